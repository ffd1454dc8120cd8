"""Section 4: the worst tokens, a heatmap of each token's per-point error (inline SVG) and their table."""
from __future__ import annotations

import math

from ...graph.canonical import parse_key
from .cells import _anchor, _d, _decades, _e, _fmt_f, _key_sort, _l, _lerp_color, _num, _sci
from .context import Ctx
from .style import (DIVERGE_RED, GRID_W, GROWTH_KINDS, HEAT_INF, HEAT_MISSING, HEAT_STOPS, HEAT_ZERO,
                    MAX_HEAT_COLS)


def tokens_section(c: Ctx) -> str:
    head = ('<section id="tokens"><h2>Worst tokens: per-token error at every point</h2>'
            '<p class="sub">Rows: the tokens with the largest |Δ log-prob| '
            '(<span class="mono">sample@position</span>),'
            ' worst first. Columns: points in dataflow order. Colour: relative error of that token\'s row (log '
            'scale); the outlined cell is where that token\'s divergence starts. Hover a cell for its value.</p>')
    te = _d(c.r.get("token_errors"))
    rows = [(str(k), _d(v)) for k, v in te.items()]
    worst = {}
    for w in _l(c.r.get("worst_tokens")):
        if isinstance(w, dict):
            worst.setdefault(f"{w.get('sample')}@{w.get('position')}", w)
    body = _heatmap_svg(c, rows, worst) if rows and any(v for _, v in rows) else (
        '<p class="empty">No per-token errors in this report (no log-probs were compared, or the traces '
        'hold statistics only).</p>')
    return head + body + _worst_table(worst, _no_start_text(c)) + "</section>"


def _heatmap_svg(c: Ctx, rows, worst: dict) -> str:
    keys = sorted({k for _, v in rows for k in v}, key=_key_sort)
    n_all = len(keys)
    if n_all > MAX_HEAT_COLS:
        # a deep model: keep the plot's point kinds, the global points and every token's starting point
        keep = {str(w.get("divergence_starts")) for w in worst.values()} | {c.first_key}
        keys = [k for k in keys if k in keep or parse_key(k)[1] is None or parse_key(k)[0] in GROWTH_KINDS]
    vals = [_num(v.get(k)) for _, v in rows for k in keys]
    lo, hi = _decades([v for v in vals if v is not None], pad=1)
    n = len(keys)
    lw, rw = 74, 140
    cw = min(max(GRID_W / max(n, 1), 1.5), 30.0)
    ch = 22 if len(rows) <= 16 else 15
    label_fs = min(11.0, cw * 0.866 - 0.6)         # rotated -60°: the labels' spacing is cw·sin 60°
    label_cols = label_fs >= 7.5
    top = 28
    lab_h = 12 * label_fs if label_cols else 24
    gw = cw * n
    W = max(lw + gw + rw, 600)
    legend_y = top + ch * len(rows) + lab_h + 12
    H = legend_y + 44

    def color(v) -> str:
        x = _num(v)
        if x is None:
            return HEAT_MISSING
        if x == 0:
            return HEAT_ZERO
        if x < 0:
            return HEAT_MISSING
        if math.isinf(x):
            return HEAT_INF
        return _lerp_color(HEAT_STOPS, (math.log10(x) - lo) / (hi - lo))

    o = [f'<div class="plotwrap"><svg class="heatmap" viewBox="0 0 {W:.0f} {H:.0f}" width="{W:.0f}" '
         f'height="{H:.0f}" role="img" aria-label="per-token relative error" style="font-size:11px">']
    # layer bands over the columns
    prev, start = object(), 0
    bands = []
    for j, k in enumerate(keys):
        pt, lay = parse_key(k)
        g = lay if lay is not None else ("emb" if pt == "embed" else "head")
        if g != prev:
            if j:
                bands.append((prev, start, j))
            prev, start = g, j
    if keys:
        bands.append((prev, start, n))
    for bi, (g, s, e) in enumerate(bands):
        x0, x1 = lw + s * cw, lw + e * cw
        o.append(f'<rect x="{x0:.1f}" y="{top - 20}" width="{x1 - x0:.1f}" height="16" '
                 f'fill="{"#eef1f5" if bi % 2 == 0 else "#e1e7ee"}"/>')
    for g, s, e in bands:                       # labels after every band, so none is painted over
        x0, x1 = lw + s * cw, lw + e * cw
        lab = f"L{g}" if isinstance(g, int) else ("emb" if g == "emb" else "head")
        every = max(1, math.ceil(30 / max(x1 - x0, 1e-9)))
        step = next(k for k in (1, 2, 5, 10, 20, 50, 100, 10 ** 9) if k >= every)
        if x1 - x0 >= 26 or (isinstance(g, int) and g % step == 0):
            o.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{top - 8}" text-anchor="middle" font-weight="600" '
                     f'fill="#424a53">{_e(lab)}</text>')
    # cells
    for i, (label, v) in enumerate(rows):
        y = top + i * ch
        w = worst.get(label, {})
        o.append(f'<text x="{lw - 6}" y="{y + ch / 2 + 4:.1f}" text-anchor="end" font-family="monospace">'
                 f'{_e(label)}</text>')
        for j, k in enumerate(keys):
            x = lw + j * cw
            val = v.get(k)
            o.append(f'<rect x="{x:.2f}" y="{y}" width="{cw:.2f}" height="{ch}" fill="{color(val)}" '
                     f'stroke="#fff" stroke-width="{0.6 if cw >= 6 else 0}"><title>{_e(label)} · {_e(k)}: '
                     f'{_e(_sci(val))}</title></rect>')
        start_k = w.get("divergence_starts")
        if start_k in keys:
            j = keys.index(start_k)
            o.append(f'<rect x="{lw + j * cw + 1:.2f}" y="{y + 1}" width="{max(cw - 2, 1):.2f}" height="{ch - 2}" '
                     'fill="none" stroke="#1f2328" stroke-width="2"/>')
        if w:
            flip = " ⇄" if w.get("routing_flip") else ""
            o.append(f'<text x="{lw + gw + 8:.1f}" y="{y + ch / 2 + 4:.1f}" fill="#59636e">'
                     f'Δ log-prob {_e(_fmt_f(w.get("abs_dlogprob")))}{_e(flip)}</text>')
    gy = top + ch * len(rows)
    if c.first_key in keys:
        j = keys.index(c.first_key)
        x = lw + j * cw + cw / 2
        o.append(f'<path d="M{x - 5:.1f} {top - 3} L{x + 5:.1f} {top - 3} L{x:.1f} {top + 3} Z" '
                 f'fill="{DIVERGE_RED}"><title>first divergence: {_e(c.first_key)}</title></path>')
        o.append(f'<rect x="{lw + j * cw:.2f}" y="{top}" width="{cw:.2f}" height="{gy - top}" fill="none" '
                 f'stroke="{DIVERGE_RED}" stroke-width="1.2" stroke-dasharray="3 2"/>')
    if label_cols:
        for j, k in enumerate(keys):
            x = lw + j * cw + cw / 2 + label_fs * 0.3
            bold = ' font-weight="700" fill="#d1242f"' if k == c.first_key else ""
            o.append(f'<text x="{x:.1f}" y="{gy + 8}" text-anchor="end" font-size="{label_fs:.1f}" '
                     f'transform="rotate(-60 {x:.1f} {gy + 8})"{bold}>{_e(k)}</text>')
    # colour legend
    lx, lwid = lw, 300
    o.append('<defs><linearGradient id="heatgrad" x1="0" x2="1" y1="0" y2="0">' +
             "".join(f'<stop offset="{t:.2f}" stop-color="{col}"/>' for t, col in HEAT_STOPS) +
             "</linearGradient></defs>")
    o.append(f'<rect x="{lx}" y="{legend_y}" width="{lwid}" height="10" fill="url(#heatgrad)" stroke="#d1d9e0"/>')
    for d in range(lo, hi + 1):
        x = lx + (d - lo) / (hi - lo) * lwid
        o.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{legend_y + 10}" y2="{legend_y + 14}" stroke="#8c959f"/>'
                 f'<text class="tick" x="{x:.1f}" y="{legend_y + 26}" text-anchor="middle">1e{d}</text>')
    ex = lx + lwid + 30
    o.append(f'<rect x="{ex}" y="{legend_y}" width="14" height="10" fill="{HEAT_ZERO}" stroke="#d1d9e0"/>'
             f'<text x="{ex + 20}" y="{legend_y + 9}" fill="#59636e">0 (bit-identical)</text>')
    ex += 130
    o.append(f'<rect x="{ex}" y="{legend_y}" width="14" height="10" fill="none" stroke="#1f2328" stroke-width="2"/>'
             f'<text x="{ex + 20}" y="{legend_y + 9}" fill="#59636e">divergence starts</text>')
    ex += 130
    o.append(f'<text x="{ex}" y="{legend_y + 9}" fill="#59636e">⇄ routing flip</text>')
    o.append("</svg></div>")
    if n < n_all:
        o.append(f'<p class="note" style="font-size:12px;margin:0">Showing {n} of {n_all} points: the point '
                 "kinds of the error-growth plot, the "
                 "global points and where each token starts; the JSON report has every point.</p>")
    return "".join(o)


def _no_start_text(c: Ctx) -> str:
    """What a token whose own errors start no divergence shows, in words that agree with the verdict: beside a
    divergent report, "no divergence in this token" would deny the answer (a replay finding, or one judged over
    all rows, is not a per-token A-B jump)."""
    if c.r.get("verdict") != "divergent":
        return "none on this token"
    first = c.first if isinstance(c.first, dict) else {}
    key, cause = first.get("key"), first.get("cause")
    if cause in ("intrinsic", "precision"):
        return (f"no A−B jump on this token alone; the divergence at {key} is the replay's ({cause}), measured "
                "over all rows")
    return ("no A−B jump on this token alone" + (f"; the divergence at {key} is judged over the rows" if key else ""))


def _worst_table(worst: dict, no_start: str = "none on this token") -> str:
    if not worst:
        return ""
    o = ['<table style="margin-top:10px"><thead><tr><th>Token</th><th class="r">|Δ log-prob|</th>'
         '<th class="r">log-prob A</th><th class="r">log-prob B</th><th>Divergence starts</th>'
         '<th>Routing flip</th></tr></thead><tbody>']
    for label, w in worst.items():
        ds = w.get("divergence_starts")
        dst = (f'<a class="k mono" href="#{_e(_anchor(ds))}">{_e(ds)}</a>' if ds else
               f'<span class="note">{_e(no_start)}</span>')
        o.append(f'<tr><td class="mono">{_e(label)}</td><td class="r num">{_fmt_f(w.get("abs_dlogprob"))}</td>'
                 f'<td class="r num">{_fmt_f(w.get("logprob_a"))}</td><td class="r num">{_fmt_f(w.get("logprob_b"))}'
                 f'</td><td>{dst}</td><td>{"yes" if w.get("routing_flip") else "no"}</td></tr>')
    o.append("</tbody></table>")
    return "".join(o)
