"""A trace's parameter hashes in the checkpoint's layout: the pieces every rank recorded
(`record/weight_pieces.py`) merged into one hash per HF checkpoint tensor. numpy-free and torch-free: the
contract reads this before any tensor.

A checkpoint tensor is *whole* when its pieces, across all ranks, tile it exactly (the same region recorded by
several ranks, as a norm replicated over tensor-parallel ranks, must agree and counts once); its hash is then
the sum of the pieces' shares, `device_hash` of the tensor itself, in each dtype every piece was hashed in.
Anything short of that is said: a tensor some ranks did not record (partly covered), ranks that hold one
region with different bits, a parameter the adapter could not map.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

_MAX_PIECES = 4096     # per checkpoint tensor (a trace is untrusted: the overlap check is quadratic)


@dataclass
class CanonicalWeights:
    """`tensors`: {checkpoint tensor: ({dtype: hash}, shape)} of the whole ones; `partial`: {checkpoint tensor:
    why it is not whole}; `unmapped`: parameters recorded with no checkpoint piece; `recorded`: whether the trace
    holds checkpoint-layout hashes at all (older traces and adapters without a map do not)."""
    tensors: dict[str, tuple[dict[str, int], tuple[int, ...]]] = field(default_factory=dict)
    partial: dict[str, str] = field(default_factory=dict)
    unmapped: list[str] = field(default_factory=list)
    recorded: bool = False


def _wrap(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= (1 << 63) else v


def _ints(x: Any, n: int | None = None) -> tuple[int, ...] | None:
    if not isinstance(x, (list, tuple)) or (n is not None and len(x) != n):
        return None
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in x):
        return None
    return tuple(x)


def _piece(e: Any) -> tuple[str, tuple, tuple, tuple, dict] | None:
    """One recorded piece [name, shape, offsets, piece shape, {dtype: hash}], checked (untrusted input)."""
    if not (isinstance(e, (list, tuple)) and len(e) == 5 and isinstance(e[0], str) and isinstance(e[4], dict)):
        return None
    shape = _ints(e[1])
    if shape is None:
        return None
    off, sub = _ints(e[2], len(shape)), _ints(e[3], len(shape))
    hashes = {k: v for k, v in e[4].items() if isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)}
    if off is None or sub is None or not hashes or any(o + n > s for o, n, s in zip(off, sub, shape)):
        return None
    return e[0], shape, off, sub, hashes


def _first_pieces(view: Any, rank: int) -> dict | None:
    for pidx in view.trace.pass_indices(rank):
        meta = view._pass(rank, pidx).meta
        if isinstance(meta.get("weights"), dict):        # the first pass that hashed: the full map
            pieces = meta.get("weight_pieces")
            return pieces if isinstance(pieces, dict) else None
    return None


def canonical_weights(view: Any) -> CanonicalWeights:
    """The trace's checkpoint-layout hashes, every rank's pieces merged."""
    return merge_rank_pieces([p for p in (_first_pieces(view, r) for r in view.trace.ranks) if p is not None])


def merge_rank_pieces(per_rank: list[dict]) -> CanonicalWeights:
    """Merge each rank's {parameter name: [piece, ...]} (record/weight_pieces.hash_pieces) into whole tensors."""
    out = CanonicalWeights(recorded=bool(per_rank))
    regions: dict[str, dict[tuple, dict[str, int]]] = {}
    shapes: dict[str, tuple] = {}
    unmapped: set[str] = set()
    for pieces in per_rank:
        for pname, entries in pieces.items():
            if not isinstance(pname, str) or not isinstance(entries, list):
                continue
            good = [p for p in map(_piece, entries) if p is not None]
            if not good:
                unmapped.add(pname)
            for name, shape, off, sub, hashes in good:
                if shapes.setdefault(name, shape) != shape:
                    out.partial[name] = f"recorded with shapes {list(shapes[name])} and {list(shape)}"
                    continue
                held = regions.setdefault(name, {})
                prev = held.get((off, sub))
                if prev is not None and any(prev[k] != v for k, v in hashes.items() if k in prev):
                    out.partial[name] = "ranks hold different bits for one region of it"
                elif len(held) < _MAX_PIECES:
                    held[(off, sub)] = hashes if prev is None else {k: v for k, v in prev.items() if k in hashes}
    for name, held in regions.items():
        if name in out.partial:
            continue
        why = _tiling_gap(shapes[name], list(held))
        if why:
            out.partial[name] = why
            continue
        dtypes = set.intersection(*(set(h) for h in held.values()))
        out.tensors[name] = ({dt: _wrap(sum(h[dt] for h in held.values())) for dt in sorted(dtypes)}, shapes[name])
    out.unmapped = sorted(unmapped)
    return out


def _tiling_gap(shape: tuple, boxes: list[tuple[tuple, tuple]]) -> str | None:
    """Why the boxes (offsets, sizes) do not tile `shape` exactly (None: they do)."""
    total = math.prod(shape)
    got = sum(math.prod(sub) for _, sub in boxes)
    for i, (oa, sa) in enumerate(boxes):
        for ob, sb in boxes[i + 1:]:
            if all(a < b + m and b < a + n for a, n, b, m in zip(oa, sa, ob, sb)):
                return "recorded as overlapping pieces that are not the same region"
    if got != total:
        return f"its pieces cover {got} of its {total} elements (ranks not traced, or a layout not mapped)"
    return None
