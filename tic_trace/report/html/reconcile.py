"""Section: slime's train_rollout_logprob_abs_diff split into parts (the report's `reconciliation`): the
headline, a table of the parts with their shares and coverage, each side's semantics fingerprint."""
from __future__ import annotations

from ..reconcile_lines import _LABEL, _g, _pct, headline, parts_of, reconciliation_of, side_lines
from .cells import _e
from .context import Ctx


def reconciliation_section(c: Ctx) -> str:
    rec = reconciliation_of(c.r)
    if rec is None:
        return ""
    o = ['<section id="reconciliation"><h2>Reconciliation of slime\'s train_rollout_logprob_abs_diff</h2>',
         f'<p class="sub">{_e(headline(rec))}</p>']
    parts = parts_of(rec) if "unavailable" not in rec else []
    if parts:
        o.append('<table><thead><tr><th>Part</th><th class="r">nats</th><th class="r">Share</th>'
                 '<th class="r">Rows</th><th>What it is</th><th>Not measured</th></tr></thead><tbody>')
        for p in parts:
            style = ' style="font-weight:bold;color:#c0392b"' if p.get("significant") else ""
            o.append(f"<tr{style}><td>{_e(_LABEL.get(p['name'], p['name']))}</td>"
                     f'<td class="r num">{_e(_g(p.get("value")))}</td><td class="r num">{_e(_pct(p.get("share")))}</td>'
                     f'<td class="r num">{_e(p.get("rows"))}</td><td>{_e(p.get("summary"))}</td>'
                     f"<td>{_e(p.get('missing') or '')}</td></tr>")
        o.append("</tbody></table>")
        o += [f'<p class="mono">{_e(x.strip())}</p>' for x in side_lines(rec)]
        o += [f'<p class="sub">note: {_e(n)}</p>' for n in list(rec.get("notes") or [])[:20]]
        if rec.get("covered"):
            o.append(f'<p class="sub">{_e(rec["covered"])}</p>')
    o.append("</section>")
    return "".join(o)
