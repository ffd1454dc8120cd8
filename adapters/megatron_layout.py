"""Megatron's activation layout -> canonical tensors: the transforms that split a fused output (``linear_qkv``'s
per-query-group interleave, a row-parallel output returned without its bias), the merges of TP / SP rank shards
(``seq``, ``heads``, ``kv_heads``), and the row identity of a micro-batch (``[s, b]`` s-major, packed THD,
context-parallel zigzag). Pure functions over numpy arrays and megatron's ``PackedSeqParams`` fields: nothing
here imports megatron; ``adapters/megatron.py`` (the adapter: hooks, describe, architecture checks) uses them and
importing it registers the transforms and merges by name.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from tic_trace.graph.adapter import TransformContext, register_merge, register_transform
from tic_trace.graph.adapter import as_ints as _ints
from tic_trace.graph.adapter import transform
from tic_trace.replay.grid import round_to


# ---------------------------------------------------------------- transforms and merges

@register_transform("megatron_biased")
def _megatron_biased(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """A row-parallel output returned without its bias, plus the bias as megatron's bias-dropout-add adds it: in the
    activations' dtype (one more rounding than a GEMM that adds its bias inside, HF's)."""
    x = transform("tokens")(a, ctx)
    total = x.astype(np.float64) + np.asarray(ctx.extra["bias"], np.float64).reshape(-1)
    return round_to(total, str(ctx.config.get("dtype") or "float32")).astype(x.dtype)


@register_transform("megatron_qkv")
def _megatron_qkv(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """Fused QKV ``[..rows.., ng * (np/ng + 2) * hn]`` (per query group ``[q heads | k | v]``, or
    ``[q heads | gate heads | k | v]`` with ``attention_output_gate``) -> q ``[rows, np, hn]`` or
    k / v ``[rows, ng, hn]`` (opts ``part``)."""
    cfg = ctx.config
    nq, ng, hd = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"]), int(cfg["head_dim"])
    qpg = nq // ng
    x = a.reshape(ctx.n_rows, ng, -1, hd)
    kv = qpg * (2 if cfg.get("attention_output_gate") else 1)
    if x.shape[2] != kv + 2:
        raise ValueError(f"linear_qkv output: {x.shape[2]} head slots per group, expected {kv + 2}")
    part = ctx.opts.get("part", "q")
    if part == "q":
        return np.ascontiguousarray(x[:, :, :qpg]).reshape(ctx.n_rows, nq, hd)
    j = kv if part == "k" else kv + 1
    return np.ascontiguousarray(x[:, :, j])


@register_merge("seq")
def _merge_seq(arrays: list[np.ndarray], config: dict) -> np.ndarray:
    """Sequence-parallel pieces ``[s/tp, b, ...]`` (or ``[t/tp, ...]``) in TP-rank order: ``cat:0`` when the
    model runs with sequence parallelism, else every rank holds the whole tensor (take the first)."""
    if config.get("sequence_parallel"):
        return np.concatenate(arrays, axis=0)
    return arrays[0]


@register_merge("heads")
def _merge_heads(arrays: list[np.ndarray], config: dict) -> np.ndarray:
    """Per-rank heads ``[..., heads/tp, hn]`` concatenated along the head axis (SBHD or squeezed THD)."""
    return np.concatenate(arrays, axis=-2)


@register_merge("kv_heads")
def _merge_kv_heads(arrays: list[np.ndarray], config: dict) -> np.ndarray:
    """KV heads: like ``heads``, but with fewer query groups than TP ranks each group's head is replicated
    on ``tp/ng`` consecutive ranks: keep one rank per group."""
    ng = int(config.get("num_key_value_heads") or 0)
    tp = len(arrays)
    if ng and tp > ng and tp % ng == 0:
        arrays = arrays[:: tp // ng]
    return np.concatenate(arrays, axis=-2)


# ---------------------------------------------------------------- rows

def zigzag_position(p: int, length: int, cp_size: int, cp_rank: int) -> int:
    """Global position of local offset ``p`` on context-parallel rank ``cp_rank`` for a sequence of (padded)
    ``length``: the sequence is cut into ``2*cp_size`` pieces and rank ``r`` holds pieces ``r`` and
    ``2*cp_size-1-r`` (Megatron's load-balanced causal split, SBHD and THD alike)."""
    if cp_size == 1:
        return p
    seg = length // (2 * cp_size)
    return cp_rank * seg + p if p < seg else length - (cp_rank + 1) * seg + (p - seg)


def rows_from_packed(packed_seq_params: Any, sample_keys: Sequence[str | None] | None = None, cp_size: int = 1,
                     cp_rank: int = 0, *, n_rows: int | None = None,
                     position_offsets: Sequence[int] | None = None) -> tuple[list[str | None], list[int]]:
    """Row identity of a packed THD micro-batch on one context-parallel rank.

    ``packed_seq_params``: a megatron ``PackedSeqParams`` (``cu_seqlens_q`` = real lengths, optional
    ``cu_seqlens_q_padded`` = the layout of the packed tensor; both global, i.e. before the CP split).
    Segment ``i`` gets sample key ``sample_keys[i]`` (default ``s{i}``; ``None`` marks a padding segment).
    With ``cp_size > 1`` this rank holds, of every segment of padded length ``L``, the pieces ``cp_rank`` and
    ``2*cp_size-1-cp_rank`` of length ``L/(2*cp_size)`` (``thd_get_partitioned_indices``), concatenated
    segment after segment. Returns ``(keys, positions)`` with one entry per local row; rows past a
    segment's real length (padding) and past the last segment (``n_rows`` beyond the packed total) get key
    ``None``. ``position_offsets[i]`` is added to segment ``i``'s positions (a continued sample).
    """
    cu_real = _ints(getattr(packed_seq_params, "cu_seqlens_q", None))
    cu_pad = _ints(getattr(packed_seq_params, "cu_seqlens_q_padded", None)) or cu_real
    if len(cu_real) < 2 or len(cu_pad) != len(cu_real):
        raise ValueError(f"packed_seq_params: need cu_seqlens_q (and cu_seqlens_q_padded) of equal length >= 2, "
                         f"got {cu_real} / {cu_pad}")
    n_seg = len(cu_real) - 1
    if sample_keys is not None and len(sample_keys) < n_seg:
        raise ValueError(f"{n_seg} packed segments but {len(sample_keys)} sample keys")
    keys: list[str | None] = []
    pos: list[int] = []
    for i in range(n_seg):
        length = cu_pad[i + 1] - cu_pad[i]
        real = cu_real[i + 1] - cu_real[i]
        if real > length:
            raise ValueError(f"segment {i}: real length {real} exceeds its padded length {length}")
        if length % (2 * cp_size if cp_size > 1 else 1):
            raise ValueError(f"segment {i}: padded length {length} is not a multiple of 2*cp_size={2 * cp_size}")
        key = f"s{i}" if sample_keys is None else sample_keys[i]
        off = int(position_offsets[i]) if position_offsets is not None else 0
        for p in range(length // cp_size):
            g = zigzag_position(p, length, cp_size, cp_rank)
            keys.append(None if key is None or g >= real else str(key))
            pos.append(g + off)
    if n_rows is not None:
        if n_rows < len(keys):
            raise ValueError(f"packed_seq_params describe {len(keys)} rows on this rank, the batch has {n_rows}")
        keys.extend([None] * (n_rows - len(keys)))
        pos.extend([0] * (n_rows - len(pos)))
    return keys, pos


def rows_from_sbhd(batch: int, seq: int, sample_keys: Sequence[str | None] | None = None, cp_size: int = 1,
                   cp_rank: int = 0) -> tuple[list[str | None], list[int]]:
    """Rows of a ``[s, b]`` micro-batch (s-major: row ``r`` = ``s*B + b``): sample ``sample_keys[b]``
    (default ``s{b}``), position ``s`` (with context parallelism: the zigzag global position of local index
    ``s`` on ``cp_rank``, the local sequence being ``seq = S/cp_size``). RoPE in GPTModel uses exactly these
    positions (``position_ids`` are ignored for RoPE)."""
    if sample_keys is not None and len(sample_keys) < batch:
        raise ValueError(f"batch of {batch} but {len(sample_keys)} sample keys")
    total = seq * cp_size
    keys, pos = [], []
    for s in range(seq):
        g = zigzag_position(s, total, cp_size, cp_rank)
        for b in range(batch):
            k = f"s{b}" if sample_keys is None else sample_keys[b]
            keys.append(None if k is None else str(k))
            pos.append(g)
    return keys, pos
