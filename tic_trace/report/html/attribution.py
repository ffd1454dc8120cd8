"""Section: which difference explains how much of the log-prob gap (the report's `attribution`): the answer
lines, then a bar per op kind per layer (signed: a negative share narrows the gap)."""
from __future__ import annotations

from ..attribution_lines import attribution_lines, attribution_of, kind_layer_bars
from .cells import _e
from .context import Ctx

_WIDTH = 240       # px of a full (100%) bar


def attribution_section(c: Ctx) -> str:
    att = attribution_of(c.r)
    if att is None:
        return ""
    lines = attribution_lines(c.r)
    o = ['<section id="attribution"><h2>Attribution of the log-prob gap</h2>',
         f'<p class="sub">{_e(lines[0])}</p>' if lines else "",
         "".join(f'<p class="mono">{_e(x.strip())}</p>' for x in lines[1:])]
    bars = kind_layer_bars(att) if "unavailable" not in att else {}
    if bars:
        o.append('<table><thead><tr><th>Op kind</th><th>Layer</th><th class="r">Share</th><th></th></tr></thead><tbody>')
        for kind in sorted(bars):
            for layer, share in sorted(bars[kind].items()):
                w = int(min(abs(share), 1.0) * _WIDTH)
                color = "#c0392b" if share > 0 else "#2e86c1"
                o.append(f"<tr><td>{_e(kind)}</td><td>{_e(layer)}</td><td class=\"r num\">{100 * share:.1f}%</td>"
                         f'<td><span style="display:inline-block;height:10px;width:{w}px;background:{color}"></span>'
                         "</td></tr>")
        o.append("</tbody></table>")
    o.append("</section>")
    return "".join(o)
