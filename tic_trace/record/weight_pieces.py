"""Parameter hashes in the checkpoint's layout, so that two frameworks' weights can be compared bit for bit.

Megatron fuses q/k/v (interleaved per query group) and gate/up, SGLang stacks them (`qkv_proj`,
`gate_up_proj`, `w13_weight`), and both shard them over tensor- and expert-parallel ranks: a hash of a whole
parameter means nothing to the other side. The adapter says, at trace time, which slice of which checkpoint
(HF) tensor each slice of each parameter is (`WeightPiece`); each piece is hashed here *in the checkpoint
tensor's coordinates*. `device_hash` is a sum over elements of mix(bits ^ flat index * K1), so a piece's share
uses the flat index its elements have in the whole checkpoint tensor, and the shares of pieces that tile it
add up (mod 2**64) to `device_hash` of the checkpoint tensor itself: shards and fused parts merge at read time
(view/weight_map.py), on any side, with no tensor read, and compare with the checkpoint's own hash.

A piece is hashed in its own dtype, and also in each narrower float dtype that holds its values exactly (a
norm weight Megatron keeps in fp32 after loading it from a bf16 checkpoint): then it compares with a side that
holds the same weights in bf16.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .stats import _K1, _K2, _bits_view, _logical, _wrap, device_hash

#: the narrower dtypes a float piece is also hashed in when they hold its values exactly
_NARROWER = {torch.float32: (torch.bfloat16, torch.float16), torch.float64: (torch.float32, torch.bfloat16,
                                                                            torch.float16)}
_ROWS_ELEMS = 1 << 20       # elements per block of the index arithmetic


@dataclass(frozen=True)
class WeightPiece:
    """`param[index]` is the slice of checkpoint tensor `name` (full shape `shape`) that starts at `offsets`,
    in the checkpoint's orientation (same number of dimensions)."""
    name: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    index: tuple = ()

    def of(self, param: torch.Tensor) -> torch.Tensor:
        return param[self.index] if self.index else param


def whole(name: str, p: torch.Tensor) -> list[WeightPiece]:
    """A parameter that is checkpoint tensor `name` itself."""
    return [WeightPiece(name, tuple(p.shape), (0,) * p.dim())]


def rows(name: str, shape, row0: int, index=()) -> WeightPiece:
    """A block of whole rows of checkpoint tensor `name` starting at row `row0`."""
    return WeightPiece(name, tuple(int(d) for d in shape), (int(row0),) + (0,) * (len(shape) - 1), tuple(index))


def cols(name: str, shape, col0: int, index=()) -> WeightPiece:
    """A block of whole columns (dim 1) of a 2-D checkpoint tensor, starting at column `col0`."""
    return WeightPiece(name, tuple(int(d) for d in shape), (0, int(col0)), tuple(index))


def piece_hash(x: torch.Tensor, shape: tuple[int, ...], offsets: tuple[int, ...]) -> torch.Tensor:
    """x's share of `device_hash` of the whole tensor of `shape` it sits in at `offsets` (int64 scalar on x's
    device). The whole tensor itself: `device_hash`."""
    x = _logical(x)
    if x.is_complex() or x.dim() != len(shape) or any(o + n > s for o, n, s in zip(offsets, x.shape, shape)):
        raise ValueError(f"a piece of shape {tuple(x.shape)} at {offsets} does not fit in {shape}")
    if tuple(x.shape) == tuple(shape):
        return device_hash(x)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    dev = x.device
    inner = torch.zeros((), dtype=torch.int64, device=dev)
    for d in range(1, x.dim()):
        ax = (torch.arange(x.shape[d], dtype=torch.int64, device=dev) + offsets[d]) * strides[d]
        inner = inner.unsqueeze(-1) + ax       # broadcast grid of the trailing dims' flat offsets
    per_row = max(1, x[0].numel()) if x.dim() and x.shape[0] else 1
    step = max(1, _ROWS_ELEMS // per_row)
    total = torch.zeros((), dtype=torch.int64, device=dev)
    for r in range(0, x.shape[0] if x.dim() else 1, step):
        blk = x[r:r + step] if x.dim() else x
        lead = (torch.arange(blk.shape[0], dtype=torch.int64, device=dev) + offsets[0] + r) * strides[0] \
            if x.dim() else torch.zeros((), dtype=torch.int64, device=dev)
        idx = lead.view(-1, *([1] * (x.dim() - 1))) + inner if x.dim() else lead
        v = _bits_view(blk.contiguous()).to(torch.int64) ^ (idx * _K1)
        v = v * _K2
        v = v ^ torch.bitwise_right_shift(v, 31)
        total += v.sum()
    return total


def _exact_in(x: torch.Tensor) -> list[torch.dtype]:
    """The narrower float dtypes that hold every value of x exactly (NaNs compare by position)."""
    out = []
    for dt in _NARROWER.get(x.dtype, ()):
        y = x.to(dt).to(x.dtype)
        if torch.equal(y, x) or bool(((y == x) | (torch.isnan(y) & torch.isnan(x))).all()):
            out.append(dt)
    return out


def hash_pieces(param: torch.Tensor, pieces: list[WeightPiece], own: int | None = None) -> list[list[Any]]:
    """[[name, shape, offsets, piece shape, {dtype: hash}], ...] of one parameter's pieces (`own`: the
    parameter's own hash, already known, when it is its one piece whole)."""
    out = []
    with torch.no_grad():
        p = param.detach()
        for pc in pieces:
            x = pc.of(p)
            mine = own if own is not None and len(pieces) == 1 and not pc.index and tuple(p.shape) == pc.shape \
                else None
            hashes = {str(x.dtype).removeprefix("torch."): piece_hash(x, pc.shape, pc.offsets) if mine is None
                      else torch.tensor(mine)}
            if x.dtype in _NARROWER:
                for dt in _exact_in(x):
                    hashes[str(dt).removeprefix("torch.")] = piece_hash(x.to(dt), pc.shape, pc.offsets)
            out.append([pc.name, list(pc.shape), list(pc.offsets), list(x.shape), hashes])
    for e in out:
        e[4] = {k: _wrap(int(v)) for k, v in e[4].items()}
    return out
