"""The scale of a point that mixes rows (`PointSpec.unit == "mixture"`; docs/report.md, "Units").

Attention's output row is, per head, a convex combination of its sample's value rows: `o_t = Σ_{j≤t} p_j v_j`,
p ≥ 0, Σ p = 1 (sub-convex with sinks, a gate σ(g) ≤ 1 or a sliding window: Σ p ≤ 1 over the prefix). A clean
kernel's error is a rounding of the weights or of the sum, `δo = Σ_j δp_j v_j`: it scales with the rows it mixes
(at most `u Σ p_j ‖v_j‖`), not with ‖o‖, which cancellation among the v_j can make small. Eager attention rounds
p to bf16, fused kernels keep it in fp32: on a real checkpoint that is 1.2e-2 of ‖o‖ on identical inputs.

What the trace holds bounds that scale without the weights p: `‖o_t,h‖ ≤ Σ p_j ‖v_j,g(h)‖ ≤ max_{j≤t} ‖v_j,g(h)‖`
(g(h) the value head query head h reads). A row's scale is that bound over its heads,
`S_t = sqrt(Σ_h max_{j≤t} ‖v_j,g(h)‖²)`, side A's, and its error `‖a_t − b_t‖ / max(‖a_t‖, S_t)`. A wrong
mask, scale, cap, sink or value changes o by a share of the rows it mixes, and stays far over one eps of S;
the first position (o = v_0) is judged against its own norm.
"""
from __future__ import annotations

import math

import numpy as np

from ..graph.canonical import BY_NAME
from ..view.align import CanonicalView, RowId

BLOCK_ELEMS = 1 << 18     # float64 values widened at once


def mixture_scale(va: CanonicalView, point: str, layer: int | None, rows: list[RowId], width: int) -> np.ndarray | None:
    """Per row of `point` (`rows`, each `width` values): the norm the mixed rows bound it to, `S_t` above, from
    side A's first recorded feed in `PointSpec.mixes`; NaN for a row whose sample's value rows at positions
    0..t are not all held. None where the point mixes nothing, no such feed is recorded, or its layout does not
    fit the point's (heads x a value width dividing `width`)."""
    ps = BY_NAME.get(point)
    if ps is None or ps.unit != "mixture":
        return None
    feed = next((f for f in ps.mixes if (f, layer) in va.entries), None)
    if feed is None:
        return None
    t = va.load(feed, layer)
    heads = _value_heads(t.values, va.config, feed, width)
    if heads is None:
        return None
    groups, w, copies = heads
    norms = _head_norms(t.values, groups, w)                       # [value rows, groups]
    bound = _causal_max(t.rows, norms)                             # NaN where a prefix is not all held
    index = {r: i for i, r in enumerate(t.rows)}
    at = np.array([index.get(r, -1) for r in rows], dtype=np.int64)
    out = np.full(len(rows), math.nan)
    ok = at >= 0
    with np.errstate(invalid="ignore"):
        out[ok] = np.sqrt(copies * np.sum(bound[at[ok]] ** 2, axis=1))
    return out


def _value_heads(values, config: dict, feed: str, width: int) -> tuple[int, int, int] | None:
    """(value heads G, value width w, query heads per value head) of a feed recorded [rows, G, ≥ w] (or
    [rows, G·w] with G the config's KV heads) for a point of `width` = heads x w values per row."""
    if values is None or values.ndim not in (2, 3) or width <= 0:
        return None
    if values.ndim == 3:
        groups, full = int(values.shape[1]), int(values.shape[2])
    else:
        groups = int(config.get("num_key_value_heads") or 0) if feed == "attn.v" else 0
        if groups <= 0 or values.shape[1] % groups:
            return None
        full = int(values.shape[1]) // groups
    n_heads = int(config.get("num_attention_heads") or 0)
    if n_heads <= 0 or width % n_heads:          # no head count: the feed's whole per-head width is the value's
        n_heads = width // full if full and width % full == 0 else 0
    if n_heads <= 0 or groups <= 0 or n_heads % groups:
        return None
    w = width // n_heads
    if not 0 < w <= full:
        return None
    return groups, w, n_heads // groups


def _head_norms(values: np.ndarray, groups: int, w: int) -> np.ndarray:
    """‖v_j,g‖ over each value head's last `w` columns, a block of rows at a time (NaN/Inf kept: unknown)."""
    n = values.shape[0]
    out = np.empty((n, groups))
    step = max(1, BLOCK_ELEMS // max(values[0].size if n else 1, 1))
    for s in range(0, n, step):
        x = np.asarray(values[s:s + step]).reshape(min(step, n - s), groups, -1)[..., -w:].astype(np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            out[s:s + step] = np.sqrt(np.einsum("rgw,rgw->rg", x, x))
    return out


def _causal_max(rows: list[RowId], norms: np.ndarray) -> np.ndarray:
    """Per row, the largest of its sample's norms at positions 0..its own; NaN (unknown) where one of those
    positions is missing or not finite."""
    out = np.full_like(norms, math.nan)
    by: dict = {}
    for i, (sample, position) in enumerate(rows):
        by.setdefault(sample, []).append((position, i))
    for lst in by.values():
        lst.sort()
        order = np.array([i for _, i in lst], dtype=np.int64)
        run = np.maximum.accumulate(np.where(np.isfinite(norms[order]), norms[order], np.inf), axis=0)
        complete = np.array([p == k for k, (p, _) in enumerate(lst)], dtype=bool)
        out[order] = np.where(complete[:, None] & np.isfinite(run), run, math.nan)
    return out
