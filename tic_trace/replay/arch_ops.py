"""The exact float64 ops of Gemma2/3, Phi-3 and GPT-OSS where they differ from the Llama/Qwen family's
(reference.py), chosen by config.json's model_type through the facts of `arch_spec` (`ModelSpec.extra`).

- Gemma: the embedding times sqrt(hidden) (rounded to the weight's dtype, as HF's `embed_scale` is), every
  RMSNorm by (1 + weight), sandwich norms (`attn.post_norm` / `mlp.post_norm` feed the residual adds),
  attention scaled by query_pre_attn_scalar^-1/2 with soft-capped scores (Gemma2) over a sliding window on
  sliding layers, a GELU-tanh gated MLP, soft-capped final logits (Gemma2: `logits` is the model's output).
- Phi-3: q/k/v and gate/up are rows of the fused `qkv_proj` / `gate_up_proj` (`derived_weight`), so every
  generic op reads them unchanged.
- GPT-OSS: a router GEMM with a bias, attention with one learned sink logit per head, experts with biases and
  the clamped SwiGLU `(clamp(up) + 1) * g * sigmoid(alpha * g)`, g = clamp(gate, max=limit), gate and up
  interleaved in `gate_up_proj` [E, H, 2F].
"""
from __future__ import annotations

import re
from typing import Callable

import torch

# attention_mask, attention_scale, each_sample, sinks_of, spans_heads: imported from here by modules not yet moved
# to tic_trace/families/ (issue 36); their home is attention_ops.py
from .attention_ops import (attention_mask, attention_scale, each_sample, offset_rms_norm,  # noqa: F401
                            sinks_of, softcap, spans_heads, windowed_attention)
from .not_replayable import NotReplayable

F64 = torch.float64


# ---------------------------------------------------------------- Gemma

def _offset_norm(weight: str, feed: str | None = None) -> Callable:
    def op(ref, layer, feeds, rows, tokens):
        x = feeds[feed] if feed else next(iter(feeds.values()))
        return offset_rms_norm(x, ref.weights(layer).get(weight), ref.spec.rms_norm_eps, ref.spec.extra["norm_offset"])
    return op


def scale_in(ref, name: str, scale: float) -> float:
    """A constant as the side holds it: HF rounds `embed_scale` to the embedding weight's dtype."""
    dt = getattr(torch, ref.weight_dtype(name) or ref.ckpt.info[name].dtype, None)
    return float(torch.tensor(scale, dtype=dt if isinstance(dt, torch.dtype) else F64).to(F64))


def _scaled_embed(embed: Callable) -> Callable:
    def op(ref, layer, feeds, rows, tokens):
        name = "model.embed_tokens.weight"
        return embed(ref, layer, feeds, rows, tokens) * scale_in(ref, name, ref.spec.extra["embed_scale"])
    return op


def _capped_logits(logits: Callable) -> Callable:
    def op(ref, layer, feeds, rows, tokens):
        return softcap(logits(ref, layer, feeds, rows, tokens), ref.spec.extra.get("final_softcap"))
    return op


_GEMMA_NORMS = {"attn_norm": "input_layernorm.weight", "attn.post_norm": "post_attention_layernorm.weight",
                "mlp_norm": "pre_feedforward_layernorm.weight", "mlp.post_norm": "post_feedforward_layernorm.weight",
                "final_norm": "model.norm.weight", "attn.q_norm": "self_attn.q_norm.weight",
                "attn.k_norm": "self_attn.k_norm.weight"}


def _gemma_ops(base: dict[str, Callable]) -> dict[str, Callable]:
    ops = {p: _offset_norm(w, "attn.q" if p == "attn.q_norm" else "attn.k" if p == "attn.k_norm" else None)
           for p, w in _GEMMA_NORMS.items()}
    ops.update({"embed": _scaled_embed(base["embed"]), "attn.core": windowed_attention,
                "logits": _capped_logits(base["logits"])})
    return ops


# ---------------------------------------------------------------- GPT-OSS

def _router(ref, layer, feeds, rows, tokens):
    w = ref.weights(layer)
    return feeds["mlp_norm"] @ w.get("mlp.router.weight").T + w.get("mlp.router.bias")


def clamped_swiglu(gu: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate, up = gu[..., ::2].clamp(max=limit), gu[..., 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def oss_expert(w, e: int) -> tuple[torch.Tensor, ...]:
    """(gate_up [H, 2F], its bias, down [F, H], its bias) of expert e."""
    return (w.get("mlp.experts.gate_up_proj")[e], w.get("mlp.experts.gate_up_proj_bias")[e],
            w.get("mlp.experts.down_proj")[e], w.get("mlp.experts.down_proj_bias")[e])


def _oss_experts(ref, layer, feeds, rows, tokens):
    x, ids, wts = feeds["mlp_norm"], feeds["moe.topk_ids"].long(), feeds["moe.topk_weights"]
    w, spec = ref.weights(layer), ref.spec
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        if not 0 <= e < spec.num_experts:
            raise NotReplayable(f"expert id {e} outside 0..{spec.num_experts - 1}")
        r, slot = torch.nonzero(ids == e, as_tuple=True)
        gu, gub, dn, dnb = oss_expert(w, e)
        h = clamped_swiglu(x[r] @ gu + gub, spec.extra["swiglu_alpha"], spec.extra["swiglu_limit"])
        out.index_add_(0, r, wts[r, slot, None] * (h @ dn + dnb))
    return out


# ---------------------------------------------------------------- the hooks reference.py calls

def arch_ops(spec, base: dict[str, Callable]) -> dict[str, Callable]:
    """The ops of `spec`'s architecture that replace `base`'s (reference._OPS; {} for the Llama/Qwen family)."""
    ops: dict[str, Callable] = {}
    if spec.extra.get("norm_offset"):
        ops.update(_gemma_ops(base))
    if spec.model_type == "gpt_oss":
        ops.update({"attn.core": windowed_attention, "moe.router_logits": _router, "moe.experts_out": _oss_experts})
    return ops


def arch_inputs_of(point: str, spec) -> tuple[str, ...] | None:
    """The sandwich norms' residual adds read the norms (None: the generic feeds)."""
    if spec.extra.get("sandwich") and point in ("mid", "output"):
        return ("input", "attn.post_norm") if point == "mid" else ("mid", "mlp.post_norm")
    return None


def arch_op_of(point: str, spec) -> str:
    """The op replayed at `point` where the architecture makes it another (its variants: arch_variants.py)."""
    if spec.extra.get("norm_offset") and point in _GEMMA_NORMS:
        return "offset_rmsnorm"
    if point == "attn.core" and (spec.extra.get("sinks") or spec.extra.get("attn_softcap")
                                 or spec.extra.get("attn_scale") or spec.extra.get("sliding_window")):
        return "attention_ext"
    if point == "mlp.out" and not spec.num_experts and spec.hidden_act not in ("silu", "swish"):
        return "gated_mlp_act"
    if point == "logits" and spec.extra.get("final_softcap"):
        return "softcapped_logits"
    if spec.model_type == "gpt_oss" and point in ("moe.router_logits", "moe.experts_out"):
        return {"moe.router_logits": "router_bias_gemm", "moe.experts_out": "clamped_swiglu_experts"}[point]
    return ""


_PHI3_QKV = re.compile(r"self_attn\.([qkv])_proj\.weight")
_PHI3_GATE_UP = re.compile(r"mlp\.(gate|up)_proj\.weight")


def derived_weight(w, name: str) -> torch.Tensor | None:
    """A weight the checkpoint stores as part of another (`w`: reference._LayerWeights of one layer): Phi-3's
    q/k/v rows of `qkv_proj` ([q | k | v]) and gate/up halves of `gate_up_proj` ([gate | up])."""
    spec = w.ref.spec
    if spec.model_type != "phi3":
        return None
    m = _PHI3_QKV.fullmatch(name)
    if m is not None:
        qkv = w.get("self_attn.qkv_proj.weight", optional=True)
        if qkv is None:
            return None
        nq, nkv = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
        lo, n = {"q": (0, nq), "k": (nq, nkv), "v": (nq + nkv, nkv)}[m.group(1)]
        return qkv[lo:lo + n]
    m = _PHI3_GATE_UP.fullmatch(name)
    if m is not None:
        gu = w.get("mlp.gate_up_proj.weight", optional=True)
        if gu is None:
            return None
        half = gu.shape[0] // 2
        return gu[:half] if m.group(1) == "gate" else gu[half:]
    return None
