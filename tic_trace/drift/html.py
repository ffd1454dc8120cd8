"""The `drift` page: self-contained HTML (no script, no external file) with an inline SVG of each point kind's
error over the rollouts (its largest error over the layers, log scale), the onset marked, and the rollout
table. Bounded: at most `MAX_ROLLOUTS` rollouts and `MAX_KINDS` series drawn, the rest counted. Only displays."""
from __future__ import annotations

import html
import math
from typing import Any

from ..report.html.style import EXTRA_COLORS, HEAD_COLORS, SERIES_COLORS
from ..report.schema import num
from .schema import coverage_text
from .terminal import others_lines, rollout_line

MAX_ROLLOUTS = 2000
MAX_KINDS = 16
W, H, PAD = 900, 320, 50


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def kind_series(rollouts: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """{point kind: [(rollout id, its largest error over the layers)]} over the compared rollouts."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in rollouts:
        if r["status"] != "compared":
            continue
        for kind, by_layer in (r.get("errors") or {}).items():
            vals = [num(v) for v in by_layer.values()]
            vals = [v for v in vals if v is not None and not math.isnan(v)]
            if vals:
                out.setdefault(kind, []).append((r["rollout_id"], max(vals)))
    return out


def _colours(kinds: list[str]) -> dict[str, str]:
    """The report's colour of each point kind; kinds it has none for get the extra colours in turn."""
    extra = iter(EXTRA_COLORS * (1 + len(kinds) // max(1, len(EXTRA_COLORS))))
    return {k: SERIES_COLORS.get(k) or HEAD_COLORS.get(k) or next(extra, "#555") for k in kinds}


def _svg(rollouts: list[dict], onset: dict | None) -> str:
    series = dict(list(kind_series(rollouts).items())[:MAX_KINDS])
    ids = [r["rollout_id"] for r in rollouts]
    vals = [v for s in series.values() for _, v in s if v > 0 and math.isfinite(v)]
    if not ids or not vals:
        return '<p class="empty">No numeric errors to plot.</p>'
    lo, hi = math.log10(min(vals)) - 0.3, math.log10(max(vals)) + 0.3
    x0, x1 = min(ids), max(ids) if max(ids) > min(ids) else min(ids) + 1

    def xy(rid: int, v: float) -> tuple[float, float]:
        x = PAD + (rid - x0) / (x1 - x0) * (W - 2 * PAD)
        y = H - PAD if v <= 0 else H - PAD - (min(math.log10(v), hi) - lo) / (hi - lo) * (H - 2 * PAD)
        return x, y

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" role="img" '
             f'aria-label="error of each point kind over rollouts">',
             f'<rect x="{PAD}" y="{PAD}" width="{W - 2 * PAD}" height="{H - 2 * PAD}" fill="none" stroke="#d0d7de"/>']
    for r in rollouts:
        x, _ = xy(r["rollout_id"], 1.0)
        parts.append(f'<text x="{x:.1f}" y="{H - PAD + 16}" font-size="10" text-anchor="middle">{r["rollout_id"]}</text>')
        if r["status"] != "compared":
            parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{PAD}" y2="{H - PAD}" stroke="#bbb" stroke-dasharray="2 3"/>')
    for e in range(math.ceil(lo), math.floor(hi) + 1):
        _, y = xy(x0, 10.0 ** e)
        parts.append(f'<text x="{PAD - 4}" y="{y + 3:.1f}" font-size="10" text-anchor="end">1e{e}</text>')
    if onset:
        x, _ = xy(onset["rollout_id"], 1.0)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{PAD}" y2="{H - PAD}" stroke="#d1242f" stroke-width="2"/>'
                     f'<text x="{x + 4:.1f}" y="{PAD + 12}" font-size="11" fill="#d1242f">onset: {_e(onset["key"])}</text>')
    colours = _colours(list(series))
    for kind, pts in series.items():
        colour = colours[kind]
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(r, v) for r, v in pts))
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{path}">'
                     f'<title>{_e(kind)}</title></polyline>')
    legend = "".join(f'<span style="color:{colours[k]}">&#9632; {_e(k)}</span> ' for k in series)
    return "".join(parts) + "</svg>" + f'<p class="legend">{legend}</p>'


def render_drift_html(doc: dict) -> str:
    rollouts = (doc.get("rollouts") or [])[:MAX_ROLLOUTS]
    more = len(doc.get("rollouts") or []) - len(rollouts)
    sync, onset, since = doc.get("weight_sync"), doc.get("onset"), doc.get("divergent_since")
    onset_class = "bad" if onset else "" if since else "ok"      # "no onset" is no good news on a divergent run
    head = [f"<h1>Drift over {_e(doc['dir'])}</h1>",
            f"<p>A = {_e(doc['sides'][0])} (reference), B = {_e(doc['sides'][1])}</p>",
            f'<p class="{"bad" if sync else "ok"}">' + _e("WEIGHT SYNC: " + sync["summary"] if sync else
                                                          "weight sync: no rollout shows engine weights other than "
                                                          "the trainer's") + "</p>",
            f'<p class="{onset_class}">' + _e("ONSET: " + onset["summary"] if onset else
                                              doc.get("onset_note") or "no onset") + "</p>"]
    if since:
        head.append('<p class="bad">' + _e("DIVERGENT: " + since["summary"]) + "</p>")
    if coverage_text(doc):
        head.append('<p class="coverage">' + _e(coverage_text(doc)) + "</p>")
    rows = "".join(f"<tr><td><pre>{_e(rollout_line(r))}</pre></td></tr>" for r in rollouts)
    tail = f"<p>… {more} more rollouts not shown (see the JSON)</p>" if more > 0 else ""
    tail += "".join(f"<p><code>{_e(line)}</code></p>" for line in others_lines(doc.get("others") or []))
    style = ("body{font-family:sans-serif;margin:2em} .bad{color:#cf222e;font-weight:bold} .ok{color:#1a7f37} "
             "pre{margin:0} .legend span{margin-right:1em}")
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>tic-trace drift</title>"
            f"<style>{style}</style></head><body>" + "".join(head) +
            "<h2>Error of each point kind over rollouts</h2>" + _svg(rollouts, onset) +
            f"<h2>Rollouts</h2><table>{rows}</table>{tail}</body></html>")
