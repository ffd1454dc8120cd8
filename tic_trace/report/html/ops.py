"""Section 6: the dispatcher ops both sides ran in the first-divergence region, paired as the report pairs
them, the first differing op marked."""
from __future__ import annotations

from ..schema import op_differs
from .cells import _d, _e, _fmt_hash, _fmt_shape, _sci
from .context import Ctx, _region


def _n_ops(n: int) -> str:
    return f"{n} op" if n == 1 else f"{n} ops"


def ops_section(c: Ctx) -> str:
    sides = _d(c.r.get("sides"))
    fa, fb = _d(sides.get("a")).get("framework", "A"), _d(sides.get("b")).get("framework", "B")
    head = ('<section id="ops"><h2>Dispatcher ops in the first-divergence region</h2>'
            '<p class="sub">The aten ops each side ran between the first divergent point\'s inputs and its output, '
            'aligned on the op names. Red: the same op on both sides with a different output (hash or RMS); '
            'amber: an op only one side runs.</p>')
    if not c.first:
        return head + '<p class="empty">No first divergence, so no region to show.</p></section>'
    region = _region(_d(c.first.get("ops")))
    a, b = region.a, region.b
    if not a and not b:
        return head + ('<p class="empty">No dispatcher ops recorded in this region (the traces did not capture '
                       'ops, or the report was re-judged from saved metrics).</p></section>')
    o = [head, '<div class="plotwrap"><table class="ops"><thead>'
               f'<tr><th colspan="6">Side A · {_e(fa)} ({_n_ops(len(a))})</th>'
               f'<th colspan="6" class="sep">Side B · {_e(fb)} ({_n_ops(len(b))})</th></tr><tr>'
               + ('<th class="r{}">#</th><th>op / record</th><th>dtype · shape</th><th class="r">RMS</th>'
                  '<th class="r">abs max</th><th>hash</th>').format("")
               + ('<th class="r{}">#</th><th>op / record</th><th>dtype · shape</th><th class="r">RMS</th>'
                  '<th class="r">abs max</th><th>hash</th>').format(" sep")
               + "</tr></thead><tbody>"]
    fd = (c.first_op[0], c.first_op[2]) if c.first_op else None

    def cells(i: int | None, x: dict | None, sep: bool, badge: str = "") -> str:
        s = " sep" if sep else ""
        if x is None:
            return f'<td class="r num{s}"></td><td class="opn"><span class="note">—</span></td>' + "<td></td>" * 4
        return (f'<td class="r num{s}">{i}</td><td class="opn"><b>{_e(x.get("op"))}</b>{badge}'
                f'<small>{_e(x.get("name"))}</small></td>'
                f'<td class="mono ds">{_e(x.get("dtype") or "—")}<br>{_fmt_shape(x.get("shape"))}</td>'
                f'<td class="r num">{_sci(x.get("rms"))}</td><td class="r num">{_sci(x.get("absmax"))}</td>'
                f'<td class="mono">{_fmt_hash(x.get("hash"))}</td>')

    for i, j in region.pairs:
        oa = a[i] if i is not None else None
        ob = b[j] if j is not None else None
        cls, badge = "", ""
        if oa is None or ob is None or oa.get("op") != ob.get("op"):
            cls = "only"
        elif op_differs(oa, ob):
            cls = "differs"
        if fd == (i, j):
            cls += " firstdiff"
            badge = '<span class="badge">first difference</span>'
        o.append(f'<tr class="{cls.strip()}">{cells(i, oa, False, badge)}{cells(j, ob, True, badge)}</tr>')
    o.append("</tbody></table></div></section>")
    return "\n".join(o)
