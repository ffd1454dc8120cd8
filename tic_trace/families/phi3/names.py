"""Phi-3's HF, SGLang and Megatron name tables (strings, `graph.adapter` rows, and the numpy transform that reads
q, k and v out of the fused `qkv_proj` output; no framework import).

- HF (modeling_phi3.py): q, k and v are the column blocks [q | k | v] of the fused `qkv_proj` output.
- SGLang runs Phi-3 with its Llama model code (`llama.py`): the base transformer's module tree and rows.
"""
from __future__ import annotations

import numpy as np

from ...graph.adapter import Architecture, PointMap, TransformContext, register_transform
from ..base import FrameworkNames

_L = r"model\.layers\.(?P<layer>\d+)"
_A = _L + r"\.self_attn"
PHI3 = ("Phi3ForCausalLM",)
_QK = ("attn.q_norm", "attn.k_norm")
_MOE = ("moe.router_logits", "moe.topk_ids", "moe.topk_weights", "moe.experts_out", "moe.shared_out")


@register_transform("fused_qkv")
def _fused_qkv(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """[rows, (nq + 2 nkv) * hd] ([q | k | v], one rank) -> q [rows, nq, hd] or k / v [rows, nkv, hd]."""
    cfg = ctx.config
    nq, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    x = a.reshape(ctx.n_rows, -1)
    if x.shape[1] != (nq + 2 * nkv) * hd:
        raise ValueError(f"qkv_proj output of width {x.shape[1]}, expected ({nq} + 2 x {nkv}) x {hd}")
    part = ctx.opts.get("part", "q")
    lo, n = {"q": (0, nq), "k": (nq * hd, nkv), "v": ((nq + nkv) * hd, nkv)}[part]
    return x[:, lo:lo + n * hd].reshape(ctx.n_rows, n, hd)


HF_POINTS = (
    PointMap("attn.q", _A + r"\.qkv_proj:out", "fused_qkv", opts={"part": "q", "archs": PHI3}),
    PointMap("attn.k", _A + r"\.qkv_proj:out", "fused_qkv", opts={"part": "k", "archs": PHI3}),
    PointMap("attn.v", _A + r"\.qkv_proj:out", "fused_qkv", opts={"part": "v", "archs": PHI3}),
)
HF_ARCHITECTURES = (
    Architecture("Phi3ForCausalLM", ("Phi-3",), "q, k, v split from the fused `qkv_proj`",
                 "every point (q/k/v and gate/up read as rows of the fused weights)",
                 "`tests/test_supported_archs.py`, `tests/test_archs_gemma_phi3_gptoss.py`", lacks=_QK + _MOE),
)
_SGLANG_TESTS = ("`tests/test_sglang_archs.py` (against HF, fp32 and bf16 replayed), "
                 "`tests/test_sglang_megatron_archs.py` (against Megatron, fp32 and bf16 replayed), "
                 "`tests/test_sglang_tp2_archs.py` (TP=2)")
SGLANG_ARCHITECTURES = (
    Architecture("Phi3ForCausalLM", ("Phi-3",), "SGLang's Llama model code (`llama.py`) on a checkpoint whose "
                 "`qkv_proj` / `gate_up_proj` are fused on disk; prefill and decode rows, TP=1 and 2",
                 "every point the trace holds", _SGLANG_TESTS, lacks=_QK + _MOE),
)


def names() -> dict[str, FrameworkNames]:
    return {
        # the GPTModel dense structure is megatron.py's (shared); the fused tensors the weight conversion splits
        "megatron": FrameworkNames(tables={"fused_qkv": "qkv_proj.weight", "fused_gate_up": "gate_up_proj.weight"}),
        "hf": FrameworkNames(points=HF_POINTS, architectures=HF_ARCHITECTURES, tables={
            # (point, class) pairs whose base row these rows replace
            "overridden": frozenset((pm.point, a) for pm in HF_POINTS for a in pm.opts["archs"])}),
        # llama.py: the base transformer's dense module tree
        "sglang": FrameworkNames(architectures=SGLANG_ARCHITECTURES,
                                 tables={"arch_of_class": {"Phi3ForCausalLM": "qwen_dense"},
                                         # its checkpoint fuses q/k/v and gate/up: SGLang's shards are rows of those
                                         "checkpoint_fuses_qkv": True}),
    }
