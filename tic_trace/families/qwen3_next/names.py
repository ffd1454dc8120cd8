"""Qwen3-Next's name tables: HF's rows (`Qwen3NextForCausalLM`, transformers 5.24) and SGLang's refusal. Strings,
`graph.adapter` rows and the numpy transforms those rows name; no framework import (adapters/hf.py taps, hooks
and describes with these tables).

HF's model: hybrid layers of Gated DeltaNet linear attention and gated softmax attention, each layer one or the
other (`config.layer_types`), a sparse MoE (softmax router, top-k, a sigmoid-gated `shared_expert`, as
Qwen2-MoE's) on every `decoder_sparse_step`-th layer.

What `modeling_qwen3_next.py` computes, and where the table reads it:
- Gated attention (`self_attn`): `q_proj` emits, per head, the query then the gate ([q | gate], 2 x head_dim
  columns a head): `attn.q` and `attn.gate` are the two halves. QK-norm per head, partial RoPE
  (`apply_rotary_pos_emb`, tapped as adapters/hf.py taps it). The attention output is multiplied by sigmoid(gate)
  before `o_proj`: `o_proj`'s input (`attn.core`) is the gated output.
- Linear attention (`linear_attn`): `in_proj_qkvz` / `in_proj_ba` (their columns grouped by key head);
  `causal_conv1d_fn` (a module-level function: the `conv1d` module itself is never called; a cached decode
  step calls `causal_conv1d_update`) returns SiLU(causal depthwise conv1d) of q | k | v as [B, channels, S];
  `torch_chunk_gated_delta_rule` (prefill) or `torch_recurrent_gated_delta_rule` (cached decode) returns the
  delta rule's output [B, S, v_heads, v_dim]; `norm` (`Qwen3NextRMSNormGated`) acts on [B*S*v_heads, v_dim]
  rows, so `out_proj`'s input ([B, S, v_heads * v_dim]) is read instead; `out_proj`'s output is `attn.out`.
- Every RMSNorm but the gated one scales by (1 + w) (the replay's concern, not the table's).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ...graph.adapter import Architecture, PointMap, TransformContext, register_transform
from ..base import FrameworkNames

_L = r"model\.layers\.(?P<layer>\d+)"
_A = _L + r"\.self_attn"
_LIN = _L + r"\.linear_attn"
QWEN3NEXT = ("Qwen3NextForCausalLM",)
_ONLY = {"archs": QWEN3NEXT}
# functions of the modeling module the table reads (tapped by HFAdapter.prepare where a module `linear_attn` is)
TAPPED = ("causal_conv1d_fn", "causal_conv1d_update", "torch_chunk_gated_delta_rule",
          "torch_recurrent_gated_delta_rule")
LINEAR_POINTS = ("attn.linear_qkvz", "attn.linear_ba", "attn.linear_conv", "attn.linear_core", "attn.linear_norm")


@register_transform("gated_q")
def _gated_q(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """q_proj's output [..rows.., heads * 2 * head_dim], each head [q | gate] -> q or gate [rows, heads, head_dim]."""
    hd = int(ctx.config["head_dim"])
    x = a.reshape(ctx.n_rows, int(ctx.config["num_attention_heads"]), 2 * hd)
    return np.ascontiguousarray(x[:, :, :hd] if ctx.opts.get("part", "q") == "q" else x[:, :, hd:])


@register_transform("bcs")
def _bcs(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """[B, channels, S] (the conv's layout) -> [B*S, channels]."""
    b, c, s = a.shape
    return np.ascontiguousarray(a.transpose(0, 2, 1)).reshape(b * s, c)


@register_transform("v_heads")
def _v_heads(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """[..rows.., v_heads * v_dim] or [..rows.., v_heads, v_dim] -> [rows, v_heads, v_dim]."""
    return a.reshape(ctx.n_rows, -1, int(ctx.config["linear_value_head_dim"]))


POINTS = (
    PointMap("attn.q", _A + r"\.q_proj:out", "gated_q", opts={"part": "q", **_ONLY}),
    PointMap("attn.gate", _A + r"\.q_proj:out", "gated_q", opts={"part": "gate", **_ONLY}),
    PointMap("attn.out", _L + r"\.(self_attn\.o_proj|linear_attn\.out_proj):out", opts=_ONLY,
             note="softmax layers' o_proj, linear layers' out_proj"),
    PointMap("attn.linear_qkvz", _LIN + r"\.in_proj_qkvz:out", opts=_ONLY),
    PointMap("attn.linear_ba", _LIN + r"\.in_proj_ba:out", opts=_ONLY),
    PointMap("attn.linear_conv", _LIN + r"/fn:causal_conv1d_(fn|update):out", "bcs", opts=_ONLY,
             note="SiLU(causal conv1d) of q | k | v, [B, channels, S] (a cached decode step's: `_update`)"),
    PointMap("attn.linear_core", _LIN + r"/fn:torch_(chunk|recurrent)_gated_delta_rule:out\[0\]", "v_heads",
             opts=_ONLY),
    PointMap("attn.linear_norm", _LIN + r"\.out_proj:in\[0\]", "v_heads", opts=_ONLY,
             note="out_proj input = the gated norm's output, per token"),
)

_LINEAR_FACTS = ("linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_conv_kernel_dim")


def linear_facts(text: Any) -> dict:
    """Qwen3-Next's linear-attention facts for the manifest (none for a model without linear layers)."""
    types = list(getattr(text, "layer_types", None) or [])
    if "linear_attention" not in types:
        return {}
    return {**{k: getattr(text, k, None) for k in _LINEAR_FACTS},
            "linear_attention_layers": [i for i, t in enumerate(types) if t == "linear_attention"]}


_SOFTMAX_POINTS = ("attn.q", "attn.gate", "attn.k", "attn.v", "attn.q_norm", "attn.k_norm", "attn.q_rope",
                   "attn.k_rope", "attn.core")


def linear_applies(pm: PointMap, config: dict) -> bool | None:
    """The linear-attention rows only where some layer runs linear attention, the softmax attention's only where
    some layer does not (None: the layer kinds do not decide it)."""
    linear = config.get("linear_attention_layers") or []
    if pm.point in LINEAR_POINTS:
        return bool(linear)
    if pm.point in _SOFTMAX_POINTS and linear and len(linear) >= int(config.get("num_layers") or 0):
        return False
    return None


_T = "`tests/test_archs_qwen3next.py`, `tests/test_supported_archs.py`"

HF_ARCHITECTURES = (
    Architecture("Qwen3NextForCausalLM", ("Qwen3-Next",),
                 "hybrid layers: gated attention (q and its gate split from `q_proj`, `attn.core` = the gated "
                 "output) or Gated DeltaNet linear attention (`attn.linear_*`: in-projections, causal conv, delta "
                 "rule, gated norm; `attn.out` = its out_proj); MoE with a sigmoid-gated shared expert",
                 "every point: (1 + w) RMSNorms, partial RoPE, the sigmoid gate, the causal conv + SiLU, the gated "
                 "delta rule (recurrent form), the gated RMSNorm", _T),
)

SGLANG_REFUSED = {
    "Qwen3NextForCausalLM": "hybrid layers: Gated DeltaNet linear attention besides gated full attention, whose "
                            "SGLang kernels are Triton only: the linear attention's gated norm "
                            "(`Qwen3GatedDeltaNet.norm` in `srt/models/qwen3_next.py`) is `FusedRMSNormGated` "
                            "(`kernels/ops/attention/fla/fused_norm_gate.py`, a Triton kernel) or `RMSNormGated` "
                            "(`layernorm_gated.py`, whose `_get_sm_count` calls `torch.cuda.get_device_properties`), "
                            "so SGLang's model code never ran against another framework's here (the HF table maps it)",
}

# The HF adapter's tables (adapters/hf.py reads each by its key):
# - overridden: (point, architecture) pairs whose generic row these rows replace;
# - taps: a module name's last part -> the functions of that module's modeling module to tap;
# - record_inputs: modules whose inputs are recorded (`attn.linear_norm` is out_proj's input);
# - token_dims: a record name's part -> the dim its tokens are in (0: stored whole, the transform reads it);
# - describe: the HF text config -> the manifest's facts; applies: (row, manifest config) -> False where the
#   row does not apply (None: no say).
HF_TABLES = {
    "overridden": frozenset((pm.point, a) for pm in POINTS for a in pm.opts["archs"]),
    "taps": {"linear_attn": TAPPED},
    "record_inputs": ("re:\\.linear_attn\\.out_proj$",),
    "token_dims": {"/fn:causal_conv1d": 0,            # [B, channels, S]: stored whole, `bcs` reads it
                   "_gated_delta_rule:out[1]": 0},    # the recurrent state [B, heads, dk, dv]: not per token
    "describe": linear_facts,
    "applies": linear_applies,
}


def names() -> dict[str, FrameworkNames]:
    """Qwen3-Next's tables by framework (Megatron: none; its gated attention and Gated DeltaNet switches are
    refused by adapters/megatron_features.py)."""
    return {"hf": FrameworkNames(points=POINTS, architectures=HF_ARCHITECTURES, tables=HF_TABLES),
            "sglang": FrameworkNames(refused=SGLANG_REFUSED)}
