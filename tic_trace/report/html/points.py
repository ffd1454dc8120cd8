"""Section 3: every point in dataflow order, grouped by layer, with its status, error, tolerance, growth and
metrics (and the CSS-only filter "show only points that are not ok")."""
from __future__ import annotations

import math
from collections import Counter

from ..lines import ulp_text
from .cells import (_anchor, _cos, _d, _e, _gen, _growth, _int, _l, _layer_of, _log10, _meaning, _num, _pct,
                    _pill, _point_of, _sci, _str_or_none)
from .context import Ctx
from .style import STATUS_COLOR, STATUS_LABEL, STATUSES


def points_section(c: Ctx) -> str:
    counts = Counter(p.get("status") for p in c.points)
    summary = " ".join(f'{_pill(s)} <span class="num">{counts.get(s, 0)}</span>&nbsp;' for s in STATUSES)
    head = ('<section id="points"><h2>All points in dataflow order</h2>'
            '<p class="sub"><b>over</b>: above tolerance but carrying its inputs\' error; <b>divergent</b>: above '
            f'tolerance and grown more than the growth factor over its inputs. &nbsp; {summary}</p>')
    if not c.points:
        return head + '<p class="empty">The report has no points.</p></section>'
    o = [head, '<input type="checkbox" id="only-bad" class="flt"><label for="only-bad" class="fltl">'
               'show only points that are not ok</label>',
         '<div class="tablewrap"><table class="pts"><thead><tr><th>Point</th><th>Status</th><th>dtype</th>'
         '<th class="r">Error</th><th class="r">Tol</th><th class="r">Input err</th><th class="r">Growth</th>'
         '<th class="r">Rows</th><th class="r">Bit-equal</th><th class="r">Cosine</th><th class="r">Max ULP</th>'
         '<th>Note</th></tr></thead><tbody>']
    groups: dict = {}
    for p in c.points:
        groups.setdefault(_layer_of(p), []).append(p)
    seen_ids: set = set()
    cur = object()
    span = max(c.hi - c.lo, 1)
    for p in c.points:
        lay = _layer_of(p)
        grp = lay if lay is not None else ("embed" if _point_of(p) == "embed" else "head")
        if grp != cur:
            cur = grp
            members = groups.get(lay, []) if lay is not None else [
                q for q in groups.get(None, []) if (_point_of(q) == "embed") == (grp == "embed")]
            allok = all(q.get("status") == "ok" for q in members)
            label = f"Layer {lay}" if lay is not None else ("Embedding" if grp == "embed" else "Head")
            bad = Counter(q.get("status") for q in members)
            tail = ", ".join(f"{bad[s]} {STATUS_LABEL[s]}" for s in ("divergent", "over", "not_comparable") if bad[s])
            o.append(f'<tr class="grp{" grp-allok" if allok else ""}"><td colspan="12">{_e(label)}'
                     f'<span class="note" style="font-weight:400"> &nbsp;{_e(tail or "all ok")}</span></td></tr>')
        st = p.get("status")
        key = str(p.get("key"))
        aid = _anchor(key)
        id_attr = "" if aid in seen_ids else f' id="{_e(aid)}"'
        seen_ids.add(aid)
        cls = f"st-{st}" if st in STATUSES else "st-unknown"
        if c.first_key is not None and key == c.first_key:
            cls += " first"
        m = _d(p.get("metrics"))
        stt = _d(p.get("stats"))
        rt = _d(p.get("routing"))
        err = _num(p.get("error"))
        lv = _log10(err)
        if lv is not None:
            w = min(max((lv - c.lo) / span, 0.03), 1.0) * 100
        else:
            w = 100.0 if err is not None and math.isinf(err) else 0.0
        bar = (f'<span class="bar"><i style="width:{w:.0f}%;background:{STATUS_COLOR.get(st, "#6e7781")}"></i>'
               '</span>')
        if m:
            beq, cos, ulp = _pct(m.get("bitwise_equal")), _cos(m.get("cosine")), ulp_text(m, _gen)
        elif stt:
            beq = "100%" if stt.get("bitwise_equal") is True else ("0%" if stt.get("bitwise_equal") is False else "—")
            cos = ulp = "—"
        else:
            beq = cos = ulp = "—"
        note = _str_or_none(p.get("reason")) or ""
        if rt and not note:
            note = f"set agreement {_pct(rt.get('set_agreement'))}"
        if m and (_num(m.get("nonfinite")) or 0) > 0:
            note = (note + "; " if note else "") + f"{_gen(m.get('nonfinite'))} non-finite"
        extra = ""
        if _int(p.get("only_a")) or _int(p.get("only_b")):
            extra = f' <span class="note">(+{_gen(p.get("only_a"))} A-only, +{_gen(p.get("only_b"))} B-only)</span>'
        inputs = ", ".join(str(k) for k in _l(p.get("inputs")))
        o.append(
            f'<tr class="{cls}"{id_attr}><td class="key mono" title="{_e(_meaning(_point_of(p)))}">{_e(key)}</td>'
            f"<td>{_pill(st)}</td><td class=\"mono\">{_e(p.get('dtype') or '—')}</td>"
            f'<td class="r num"><span class="ebar">{_sci(err)}{bar}</span></td>'
            f'<td class="r num">{_sci(p.get("tol"))}</td>'
            f'<td class="r num" title="inputs: {_e(inputs)}">{_sci(p.get("input_error"))}</td>'
            f'<td class="r num">{_growth(p.get("growth"))}</td>'
            f'<td class="r num">{_gen(p.get("rows"))}{extra}</td>'
            f'<td class="r num">{beq}</td><td class="r num">{cos}</td><td class="r num">{ulp}</td>'
            f'<td class="note">{_e(note)}</td></tr>')
    o.append("</tbody></table></div></section>")
    return "\n".join(o)
