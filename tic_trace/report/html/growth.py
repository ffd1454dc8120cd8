"""Section 2: the error-growth plot, the relative error of each point kind through the layers (inline SVG,
log scale), with the tolerance, the first divergence and the global points."""
from __future__ import annotations

import math
from collections import Counter

from ...graph.canonical import HEAD_POINTS, order_key
from .cells import _e, _is_ids, _layer_of, _num, _point_of, _sci
from .context import Ctx
from .style import DIVERGE_RED, EXTRA_COLORS, GROWTH_KINDS, HEAD_COLORS, SERIES_COLORS


def growth_section(c: Ctx) -> str:
    head = ('<section id="growth"><h2>Error growth through the layers</h2>'
            '<p class="sub">Relative L2 error of each point kind, per layer (log scale). Dashed: the tolerance; '
            'the shaded band is over it. Exact zeros sit on the bottom line. A jump between layers is where error '
            'is born; a flat high line is inherited error.</p>')
    svg = _growth_svg(c)
    return head + (f'<div class="plotwrap">{svg}</div>' if svg else
                   '<p class="empty">No numeric errors to plot.</p>') + "</section>"


def _growth_svg(c: Ctx) -> str | None:
    pts = [p for p in c.points if not _is_ids(_point_of(p))]
    layered = [p for p in pts if _layer_of(p) is not None]
    layers = sorted({_layer_of(p) for p in layered})
    has_embed = any(_point_of(p) == "embed" and _layer_of(p) is None for p in pts)
    heads = [h for h in HEAD_POINTS if any(_point_of(p) == h and _layer_of(p) is None for p in pts)]
    if not layers and not has_embed and not heads:
        return None
    cols: list = (["emb"] if has_embed else []) + layers + (["head"] if heads else [])
    # x positions in layer units; embed and head sit a little apart from the layers
    gap = max(1.0, 0.04 * len(layers))
    xi: dict = {lay: float(i) for i, lay in enumerate(layers)}
    if has_embed:
        xi["emb"] = -gap
    if heads:
        xi["head"] = (len(layers) - 1 if layers else 0) + gap
    x_lo, x_hi = min(xi.values()), max(xi.values())

    present_kinds = {_point_of(p) for p in layered}
    kinds = [k for k in GROWTH_KINDS if k in present_kinds]
    fp = _point_of(c.first) if c.first else None
    if c.first and _layer_of(c.first) is not None and fp in present_kinds and fp not in kinds and not _is_ids(fp):
        kinds.append(fp)
    if not kinds:
        kinds = sorted(present_kinds, key=lambda k: order_key(k, 0))[:6]
    kinds.sort(key=lambda k: order_key(k, 0))
    colors, extra = {}, iter(EXTRA_COLORS * 4)
    for k in kinds:
        colors[k] = SERIES_COLORS.get(k) or next(extra)

    lo, hi = c.lo, c.hi
    W, H = 1160, 400
    ml, mr, mt, mb = 64, 190, 26, 46
    pw, ph = W - ml - mr, H - mt - mb
    zero_band = 22          # pixels under the lowest decade for exact zeros
    inf_band = 16           # pixels over the highest decade for infinities
    plot_top, plot_bottom = mt + inf_band, mt + ph - zero_band

    def X(col) -> float:
        if x_hi == x_lo:
            return ml + pw / 2
        return ml + 24 + (pw - 48) * (xi[col] - x_lo) / (x_hi - x_lo)

    def Y(v: float | None) -> float | None:
        if v is None or v < 0:
            return None
        if v == 0:
            return mt + ph
        if math.isinf(v):
            return mt
        lv = min(max(math.log10(v), lo), hi)
        return plot_bottom - (lv - lo) / (hi - lo) * (plot_bottom - plot_top)

    o = [f'<svg class="plot-growth" viewBox="0 0 {W} {H}" width="100%" role="img" '
         f'aria-label="relative error per layer, log scale" style="max-width:{W}px;font-size:12px">']
    # tolerance band(s)
    tols = Counter(_num(p.get("tol")) for p in pts if (_num(p.get("tol")) or 0) > 0
                   and not math.isinf(_num(p.get("tol"))))
    tol_vals = sorted(t for t, _ in tols.most_common(3))
    if tol_vals:
        ty = Y(tol_vals[0])
        o.append(f'<rect x="{ml}" y="{mt}" width="{pw}" height="{max(ty - mt, 0):.1f}" fill="#fff1f0"/>')
    # grid and y labels
    for d in range(lo, hi + 1):
        y = Y(10.0 ** d)
        o.append(f'<line class="grid" x1="{ml}" x2="{ml + pw}" y1="{y:.1f}" y2="{y:.1f}"/>')
        o.append(f'<text class="tick" x="{ml - 8}" y="{y + 4:.1f}" text-anchor="end">1e{d}</text>')
    o.append(f'<line class="grid" x1="{ml}" x2="{ml + pw}" y1="{mt + ph}" y2="{mt + ph}" '
             'stroke-dasharray="2 3"/>')
    o.append(f'<text class="tick" x="{ml - 8}" y="{mt + ph + 4}" text-anchor="end">0</text>')
    o.append(f'<text class="tick" x="{ml - 8}" y="{mt + 4}" text-anchor="end">∞</text>')
    # x axis
    step = next(s for s in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 10 ** 9) if len(layers) / s <= 25)
    for col in cols:
        x = X(col)
        if isinstance(col, str):
            lab = "embed" if col == "emb" else "head"
        elif col % step == 0:
            lab = f"{col}"
        else:
            lab = None
        if lab is not None or len(layers) <= 60:
            o.append(f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{mt}" y2="{mt + ph}" stroke-opacity=".6"/>')
        if lab is not None:
            o.append(f'<text class="tick" x="{x:.1f}" y="{mt + ph + 16}" text-anchor="middle">{_e(lab)}</text>')
    o.append(f'<line class="ax" x1="{ml}" x2="{ml + pw}" y1="{mt + ph}" y2="{mt + ph}"/>')
    o.append(f'<line class="ax" x1="{ml}" x2="{ml}" y1="{mt}" y2="{mt + ph}"/>')
    o.append(f'<text x="{ml + pw / 2:.1f}" y="{H - 6}" text-anchor="middle" fill="#59636e">layer</text>')
    o.append(f'<text x="14" y="{mt + ph / 2:.1f}" text-anchor="middle" fill="#59636e" '
             f'transform="rotate(-90 14 {mt + ph / 2:.1f})">relative error</text>')
    for t in tol_vals:
        y = Y(t)
        dts = sorted({str(p.get("dtype")) for p in pts if _num(p.get("tol")) == t})
        o.append(f'<line x1="{ml}" x2="{ml + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="{DIVERGE_RED}" '
                 'stroke-width="1.3" stroke-dasharray="6 4"/>')
        o.append(f'<text x="{ml + 6}" y="{y - 5:.1f}" font-size="11" fill="{DIVERGE_RED}" stroke="#fff" '
                 'stroke-width="3" paint-order="stroke" stroke-linejoin="round">'
                 f'tolerance {_e(_sci(t))} ({_e(", ".join(dts))})</text>')

    # first divergence: vertical marker
    fx = fy = None
    if c.first:
        fl = _layer_of(c.first)
        col = fl if fl is not None else ("emb" if fp == "embed" else "head")
        if col in xi:
            fx = X(col)
            o.append(f'<line x1="{fx:.1f}" x2="{fx:.1f}" y1="{mt}" y2="{mt + ph}" stroke="{DIVERGE_RED}" '
                     'stroke-width="1.5" stroke-opacity=".55"/>')
            if (fp in kinds and fl is not None) or (fl is None and fp in ("embed", *heads)):
                fy = Y(_num(c.first.get("error")))

    markers = len(cols) <= 48
    by_kind: dict = {}
    for p in layered:
        by_kind.setdefault(_point_of(p), {})[_layer_of(p)] = p
    for k in kinds:
        col = colors[k]
        seq = by_kind.get(k, {})
        d, pen = [], False
        for lay in layers:
            p = seq.get(lay)
            y = Y(_num(p.get("error"))) if p else None
            if y is None:
                pen = False
                continue
            d.append(f'{"L" if pen else "M"}{X(lay):.1f} {y:.1f}')
            pen = True
        w = 2.6 if k == "output" else 2
        if d:
            o.append(f'<path class="series" d="{" ".join(d)}" fill="none" stroke="{col}" stroke-width="{w}" '
                     'stroke-linejoin="round" stroke-linecap="round"/>')
        if markers:
            for lay in layers:
                p = seq.get(lay)
                y = Y(_num(p.get("error"))) if p else None
                if y is None:
                    continue
                o.append(f'<circle cx="{X(lay):.1f}" cy="{y:.1f}" r="3.2" fill="{col}" stroke="#fff" '
                         f'stroke-width="1"><title>{_e(p.get("key"))}: {_e(_sci(p.get("error")))} '
                         f'({_e(p.get("status"))})</title></circle>')
    # global points as markers
    glob = [("emb", "embed")] + [("head", h) for h in heads]
    for col, name in glob:
        if col not in xi:
            continue
        p = next((q for q in pts if _point_of(q) == name and _layer_of(q) is None), None)
        y = Y(_num(p.get("error"))) if p else None
        if y is None:
            continue
        x = X(col) + (0 if col == "emb" else (HEAD_POINTS.index(name) - 1) * 9)
        o.append(f'<rect x="{x - 4:.1f}" y="{y - 4:.1f}" width="8" height="8" fill="{HEAD_COLORS[name]}" '
                 f'stroke="#fff" stroke-width="1" transform="rotate(45 {x:.1f} {y:.1f})"><title>{_e(p.get("key"))}: '
                 f'{_e(_sci(p.get("error")))} ({_e(p.get("status"))})</title></rect>')
        if c.first and fp == name and _layer_of(c.first) is None:
            fx = x
    if fx is not None and fy is not None:
        o.append(f'<circle cx="{fx:.1f}" cy="{fy:.1f}" r="9" fill="none" stroke="{DIVERGE_RED}" stroke-width="2.5"/>')
    if fx is not None:
        lab = f"first divergence: {c.first.get('key', '?')}"
        anchor = "start" if fx < ml + pw * 0.7 else "end"
        tx = fx + 8 if anchor == "start" else fx - 8
        o.append(f'<text class="first-mark" x="{tx:.1f}" y="{mt + 12}" text-anchor="{anchor}" font-weight="700" '
                 f'fill="{DIVERGE_RED}">{_e(lab)}</text>')
    # legend
    lx, ly = ml + pw + 22, mt + 8
    o.append(f'<text x="{lx}" y="{ly}" font-weight="600" font-size="12">point kind</text>')
    ly += 18
    for k in kinds:
        o.append(f'<line x1="{lx}" x2="{lx + 22}" y1="{ly - 4}" y2="{ly - 4}" stroke="{colors[k]}" '
                 f'stroke-width="{2.6 if k == "output" else 2}"/><circle cx="{lx + 11}" cy="{ly - 4}" r="3" '
                 f'fill="{colors[k]}"/><text x="{lx + 30}" y="{ly}" font-size="12">{_e(k)}</text>')
        ly += 18
    for col, name in glob:
        if col in xi and any(_point_of(q) == name and _layer_of(q) is None for q in pts):
            o.append(f'<rect x="{lx + 7}" y="{ly - 8}" width="8" height="8" fill="{HEAD_COLORS[name]}" '
                     f'transform="rotate(45 {lx + 11} {ly - 4})"/><text x="{lx + 30}" y="{ly}" font-size="12">'
                     f'{_e(name)}</text>')
            ly += 18
    if tol_vals:
        ly += 4
        o.append(f'<line x1="{lx}" x2="{lx + 22}" y1="{ly - 4}" y2="{ly - 4}" stroke="{DIVERGE_RED}" '
                 f'stroke-width="1.3" stroke-dasharray="6 4"/><text x="{lx + 30}" y="{ly}" font-size="12">'
                 'tolerance</text>')
        ly += 18
    if fx is not None:
        o.append(f'<circle cx="{lx + 11}" cy="{ly - 4}" r="7" fill="none" stroke="{DIVERGE_RED}" stroke-width="2"/>'
                 f'<text x="{lx + 30}" y="{ly}" font-size="12">first divergence</text>')
    o.append("</svg>")
    return "".join(o)
