"""HF rows of Gemma2, Gemma3 (text), Phi-3 and GPT-OSS: where their module names mean other points than in the
Llama/Qwen family (hf.py's table), a row names the architectures it holds for (`opts["archs"]`), and for
those the generic row of the same point does not apply (`overridden`).

- Gemma (sandwich norms): `post_attention_layernorm` normalises the attention branch before the residual add
  (`attn.post_norm`); the pre-MLP norm is `pre_feedforward_layernorm` (`mlp_norm`, its input `mid`);
  `post_feedforward_layernorm` normalises the MLP branch (`mlp.post_norm`). `logits` is what the model emits
  (`<root>:out['logits']`: after Gemma2's final soft-capping; lm_head's output is not). Gemma3's q_norm/k_norm
  act on [B, heads, S, d] (after the transpose), unlike Qwen3's.
- Phi-3: q, k and v are the column blocks [q | k | v] of the fused `qkv_proj` output.
- GPT-OSS: the router is `mlp.router`, returning (logits, top-k weights, top-k ids) as `mlp.gate` does.
"""
from __future__ import annotations

import numpy as np

from tic_trace.graph.adapter import Architecture, PointMap, TransformContext, register_transform

_L = r"model\.layers\.(?P<layer>\d+)"
_A = _L + r"\.self_attn"
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
PHI3 = ("Phi3ForCausalLM",)
GPT_OSS = ("GptOssForCausalLM",)


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


POINTS = (
    PointMap("attn.post_norm", _L + r"\.post_attention_layernorm:out", opts={"archs": GEMMA},
             note="Gemma: the attention branch's norm, before the residual add"),
    PointMap("mid", _L + r"\.pre_feedforward_layernorm:in\[0\]", opts={"archs": GEMMA},
             note="pre-MLP norm input = residual stream"),
    PointMap("mlp_norm", _L + r"\.pre_feedforward_layernorm:out", opts={"archs": GEMMA}),
    PointMap("mlp.post_norm", _L + r"\.post_feedforward_layernorm:out", opts={"archs": GEMMA},
             note="Gemma: the MLP branch's norm, before the residual add"),
    PointMap("attn.q_norm", _A + r"\.q_norm:out", "bhsd", opts={"archs": ("Gemma3ForCausalLM",)}),
    PointMap("attn.k_norm", _A + r"\.k_norm:out", "bhsd", opts={"archs": ("Gemma3ForCausalLM",)}),
    PointMap("logits", r"<root>:out\['logits'\]", "vocab", opts={"archs": GEMMA},
             note="the model's logits, after Gemma2's final soft-capping"),
    PointMap("attn.q", _A + r"\.qkv_proj:out", "fused_qkv", opts={"part": "q", "archs": PHI3}),
    PointMap("attn.k", _A + r"\.qkv_proj:out", "fused_qkv", opts={"part": "k", "archs": PHI3}),
    PointMap("attn.v", _A + r"\.qkv_proj:out", "fused_qkv", opts={"part": "v", "archs": PHI3}),
    PointMap("moe.router_logits", _L + r"\.mlp\.router:out\[0\]", opts={"archs": GPT_OSS}),
    PointMap("moe.topk_ids", _L + r"\.mlp\.router:out\[2\]", "sorted_ids", opts={"archs": GPT_OSS}),
    PointMap("moe.topk_weights", _L + r"\.mlp\.router:out\[1\]", "weights_by_sorted_ids", opts={"archs": GPT_OSS},
             also={"ids": "model.layers.{layer}.mlp.router:out[2]"}),
)

# (point, architecture) pairs whose generic row is replaced by one above
OVERRIDDEN = frozenset((pm.point, a) for pm in POINTS for a in pm.opts["archs"])

_QK = ("attn.q_norm", "attn.k_norm")
_MOE = ("moe.router_logits", "moe.topk_ids", "moe.topk_weights", "moe.experts_out", "moe.shared_out")
_T = "`tests/test_supported_archs.py`, `tests/test_archs_gemma_phi3_gptoss.py`"

ARCHITECTURES = (
    Architecture("Gemma2ForCausalLM", ("Gemma 2",),
                 "sandwich norms (`attn.post_norm`, `mlp.post_norm`), pre-MLP norm `pre_feedforward_layernorm`, "
                 "`logits` after the final soft-cap", "every point: (1 + w) RMSNorms, the √hidden embedding scale, "
                 "soft-capped scores and logits, sliding windows, GELU-tanh MLP", _T, lacks=_QK + _MOE),
    Architecture("Gemma3ForCausalLM", ("Gemma 3 (text)",),
                 "sandwich norms as Gemma 2, per-head QK-norm on [B, heads, S, d]",
                 "every point: as Gemma 2, (1 + w) QK-norms, one RoPE per layer type (local / global base)", _T,
                 lacks=_MOE),
    Architecture("Phi3ForCausalLM", ("Phi-3",), "q, k, v split from the fused `qkv_proj`",
                 "every point (q/k/v and gate/up read as rows of the fused weights)", _T, lacks=_QK + _MOE),
    Architecture("GptOssForCausalLM", ("GPT-OSS",), "router `mlp.router` (logits, top-k weights, ids), experts, "
                 "attention with sinks", "every point: router bias, clamped SwiGLU experts with biases, attention "
                 "sinks, sliding windows, YaRN RoPE", _T, lacks=_QK + ("moe.shared_out",),
                 # the router's softmax over the top-k logits: the top-k weights renormalised, whatever the config
                 defaults={"norm_topk_prob": True}),
)
