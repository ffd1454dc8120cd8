"""SGLang's module names and layouts -> canonical points: the point table, per-architecture module lists, and the
merges and transforms that rebuild a TP=1 tensor from the ranks' shards. Read-time only: numpy, no SGLang.
The reasons behind each row are in the module docstring of :mod:`tic_trace.adapters.sglang`."""
from __future__ import annotations

import re

import numpy as np

from tic_trace.families import framework_names
from tic_trace.graph.adapter import Architecture, PointMap, TransformContext, register_merge, register_transform


#: Points whose module outputs may be per-rank partial sums at TP > 1 (see ``describe()["tp_partial"]``).
PARTIAL_POINTS = ("attn.out", "moe.experts_out", "moe.shared_out", "mlp.out")
#: Points of the base's multi-head attention: with a family's own attention (the manifest's `attention` other than
#: "mha": MLA's) only that family's rows of them apply.
MHA_POINTS = ("attn.q", "attn.k", "attn.v", "attn.q_norm", "attn.k_norm", "attn.q_rope", "attn.k_rope",
              "attn.core")


#: Rows that hold only for the classes in ``opts["archs"]``; for those the generic row of the same point does
#: not apply (``OVERRIDDEN``). The families' own rows are in their folders (tic_trace/families/<name>/names.py).
ARCH_POINTS: tuple = ()
# the families' rows, tables and verified classes (families.base.FrameworkNames): the base rows are the plain
# transformer's (families/transformer/names.py, no "archs"), every other row holds for the classes it names
_FAM = framework_names("sglang")
POINTS = tuple(pm for n in _FAM for pm in n.points if "archs" not in pm.opts)
ARCH_POINTS += tuple(pm for n in _FAM for pm in n.points if "archs" in pm.opts)
#: (point, class) pairs whose generic row is replaced by one of ARCH_POINTS.
OVERRIDDEN = frozenset((pm.point, a) for pm in ARCH_POINTS for a in pm.opts["archs"])
#: Module inputs an architecture's rows read (``tracer.record_inputs_of`` patterns).
ARCH_INPUTS = {**{k: v for n in _FAM for k, v in n.tables.get("inputs", {}).items()}}


def arch_row_applies(pm: PointMap, arch: str | None) -> bool:
    """Whether a row holds for the class `arch`: its own rows, and the generic ones it does not override."""
    only = pm.opts.get("archs")
    return arch in only if only is not None else (pm.point, arch) not in OVERRIDDEN

#: Module paths (regexes, layer index written N) each architecture must have for its table rows.
ARCH_MODULES: dict[str, tuple[str, ...]] = {
    **{k: v for n in _FAM for k, v in n.tables.get("modules", {}).items()},
}
#: SGLang class name -> entry of ARCH_MODULES.
ARCH_OF_CLASS = {
    **{k: v for n in _FAM for k, v in n.tables.get("arch_of_class", {}).items()},
}


#: SGLang classes whose table rows were verified by running SGLang's own model code against another framework
#: (a name table alone, checked on the meta device, is not a verification).
ARCHITECTURES = {a.name: a for a in (
    *(a for n in _FAM for a in n.architectures),
)}
#: Classes whose rows ran at TP=1 only (the table rows say "(TP=1)"): a trace at TP > 1 is refused by name. The
#: Qwen3 / Qwen3-MoE rows ran at TP=2 (tests/test_sglang_adapter.py), Llama / Qwen2 / Phi-3's too
#: (tests/test_sglang_tp2_archs.py), DeepSeek-V3's at TP 1 and 2 (the deepseek family's refusals.mla_refusal).
ONE_RANK = frozenset().union(*(n.tables.get("one_rank", ()) for n in _FAM))


def tp_refusal(config: dict) -> str | None:
    """Why a trace of a class verified at TP=1 only, traced at TP > 1, is not the verified setup (None: it is)."""
    tp = int(config.get("tensor_model_parallel_size") or 1)
    if config.get("architecture") in ONE_RANK and tp > 1:
        return (f"tensor parallelism {tp}: `{config['architecture']}` ran at TP=1 only in the tests (its head "
                "shards, partial sums and MoE reduction at TP > 1 are not verified)")
    return None


REFUSED = {
    **{a: why for n in framework_names("sglang") for a, why in n.refused.items()},     # the families' refusals
}


def record_module(pm: PointMap) -> str:
    """The module-path part of a table row's record regex (before ``:`` or ``/fn:``)."""
    return re.split(r"/fn:|:", pm.record, maxsplit=1)[0]


# ---------------------------------------------------------------- merges and transforms of rank shards

def _nh(config: dict) -> tuple[int, int, int]:
    return int(config["num_attention_heads"]), int(config["num_key_value_heads"]), int(config["head_dim"])


def _kv_ranks(arrays: list[np.ndarray], nkv: int) -> list[np.ndarray]:
    """With fewer KV heads than TP ranks each KV head is replicated on tp/nkv consecutive ranks: keep one."""
    tp = len(arrays)
    if nkv and tp > nkv and tp % nkv == 0:
        return arrays[:: tp // nkv]
    return arrays


def tp_copies_equal(arrays: list) -> bool:
    """Whether every rank recorded bitwise the same tensor (a replicated output, not partial sums)."""
    first = np.ascontiguousarray(arrays[0])
    return all(a.shape == first.shape and a.dtype == first.dtype
               and np.ascontiguousarray(a).tobytes() == first.tobytes() for a in arrays[1:])


@register_merge("sgl_qkv")
def _merge_sgl_qkv(arrays: list[np.ndarray], config: dict) -> np.ndarray:
    """Per-rank fused QKV ``[T, (q_local + 2*kv_local) * hd]`` = ``[q_local | k_local | v_local]`` -> the
    global ``[T, (nq + 2*nkv) * hd]`` = ``[q | k | v]`` (what TP=1 computes)."""
    nq, nkv, hd = _nh(config)
    tp = len(arrays)
    ql, kvl = nq // tp * hd, max(1, nkv // tp) * hd
    flat = [a.reshape(-1, a.shape[-1]) for a in arrays]
    for a in flat:
        if a.shape[-1] != ql + 2 * kvl:
            raise ValueError(f"qkv_proj shard of width {a.shape[-1]}, expected {ql + 2 * kvl} at tp={tp}")
    q = np.concatenate([a[:, :ql] for a in flat], -1)
    kv_src = _kv_ranks(flat, nkv)
    k = np.concatenate([a[:, ql:ql + kvl] for a in kv_src], -1)
    v = np.concatenate([a[:, ql + kvl:] for a in kv_src], -1)
    return np.concatenate([q, k, v], -1)


@register_transform("sgl_qkv")
def _sgl_qkv(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """Global ``[rows, (nq + 2*nkv) * hd]`` -> q ``[rows, nq, hd]`` or k / v ``[rows, nkv, hd]`` (opts ``part``)."""
    nq, nkv, hd = _nh(ctx.config)
    x = a.reshape(ctx.n_rows, -1)
    part = ctx.opts.get("part", "q")
    if part == "q":
        return x[:, : nq * hd].reshape(ctx.n_rows, nq, hd)
    lo = nq * hd + (0 if part == "k" else nkv * hd)
    return x[:, lo: lo + nkv * hd].reshape(ctx.n_rows, nkv, hd)


def _merge_heads(arrays: list[np.ndarray], config: dict, which: str) -> np.ndarray:
    nq, nkv, hd = _nh(config)
    tp = len(arrays)
    if which == "kv":
        arrays = _kv_ranks(arrays, nkv)
        local = max(1, nkv // tp)
    else:
        local = nq // tp
    # [T, local*hd] or [T*local, hd] (the q_norm module's view): both are token-major -> [T, local, hd]
    return np.concatenate([a.reshape(-1, local, hd) for a in arrays], axis=1)


@register_merge("sgl_heads_q")
def _merge_sgl_heads_q(arrays: list[np.ndarray], config: dict) -> np.ndarray:
    """Per-rank query heads (``[T, heads_local*hd]``) concatenated per head -> ``[T, heads, hd]``."""
    return _merge_heads(arrays, config, "q")


@register_merge("sgl_heads_kv")
def _merge_sgl_heads_kv(arrays: list[np.ndarray], config: dict) -> np.ndarray:
    """Per-rank KV heads concatenated per head (replicated KV heads kept once) -> ``[T, kv_heads, hd]``."""
    return _merge_heads(arrays, config, "kv")
