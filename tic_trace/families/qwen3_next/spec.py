"""Qwen3-Next's config facts (`ModelSpec.extra`), its tensors' shapes, and which recorded points each of its ops
reads and under which op name (the ops themselves: ops.py). No torch: the checkpoint's shape check reads this
without the replay's ops.

The keys of `extra` it states: `gated_attention` (q_proj gives each head's query and gate), `linear_layers` (the
layers running Gated DeltaNet linear attention; `ModelSpec.at_layer` marks them `at_linear_layer`),
`linear_heads` (key heads, value heads), `linear_dims` (key, value head dims), `linear_conv` (the conv's taps).
Its `layer_types` name linear-attention layers, not sliding windows: it has none.
"""
from __future__ import annotations

from typing import Any

# the (1 + w) RMSNorms: point -> (weight, the feed it normalises where the point has several)
NORMS = {"attn_norm": ("input_layernorm.weight", None), "mlp_norm": ("post_attention_layernorm.weight", None),
         "final_norm": ("model.norm.weight", None), "attn.q_norm": ("self_attn.q_norm.weight", "attn.q"),
         "attn.k_norm": ("self_attn.k_norm.weight", "attn.k")}

# The ops that read every earlier row of a sample (not the query's rows alone, as attention's KV feeds are
# gathered apart): their variants run on every row (intrinsic.py).
WHOLE_SAMPLE_OPS = frozenset({"attn.linear_conv", "attn.linear_core"})


# ---------------------------------------------------------------- config facts

def facts(c: Any, model_type: str, hidden: int) -> dict:
    """`extra` of a Qwen3-Next config (`c`: model_spec._Config): the layers of each kind and the linear
    attention's sizes."""
    n = c.int("num_hidden_layers", 1, 1 << 16)
    types = c.raw("layer_types") if c.has("layer_types") else None
    if types is None:       # older configs state the pattern: every `full_attention_interval`-th layer is full
        every = c.int("full_attention_interval", 1, 1 << 16, default=4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or not all(t in ("linear_attention", "full_attention")
                                                                  for t in types):
        raise c.error("layer_types", f"a list of {n} 'linear_attention' / 'full_attention' entries", types)
    hk, hv = c.int("linear_num_key_heads", 1, 1 << 16), c.int("linear_num_value_heads", 1, 1 << 16)
    if hv % hk:
        raise c.error("linear_num_value_heads", f"a multiple of linear_num_key_heads ({hk})", hv)
    return {"gated_attention": True,
            "linear_layers": [i for i, t in enumerate(types) if t == "linear_attention"],
            "linear_heads": (hk, hv), "linear_dims": (c.int("linear_key_head_dim", 1, 1 << 16),
                                                      c.int("linear_value_head_dim", 1, 1 << 16)),
            "linear_conv": c.int("linear_conv_kernel_dim", 1, 1 << 10)}


def shapes(rest: str, spec: Any) -> list | None:
    """The shape config.json gives a Qwen3-Next layer tensor that the base transformer's table gives otherwise,
    or that only it has (None: not one of them)."""
    H, hd, nq = spec.hidden_size, spec.head_dim, spec.num_attention_heads
    (hk, hv), (dk, dv) = spec.extra["linear_heads"], spec.extra["linear_dims"]
    conv = 2 * hk * dk + hv * dv
    return {"self_attn.q_proj.weight": [2 * nq * hd, H], "self_attn.q_proj.bias": [2 * nq * hd],
            "linear_attn.in_proj_qkvz.weight": [2 * hk * dk + 2 * hv * dv, H],
            "linear_attn.in_proj_ba.weight": [2 * hv, H],
            "linear_attn.conv1d.weight": [conv, 1, spec.extra["linear_conv"]],
            "linear_attn.dt_bias": [hv], "linear_attn.A_log": [hv], "linear_attn.norm.weight": [dv],
            "linear_attn.out_proj.weight": [H, hv * dv]}.get(rest)


def linear_layer(spec: Any, layer: int | None) -> bool:
    return layer is not None and layer in spec.extra.get("linear_layers", ())


def _at_linear_layer(spec: Any) -> bool:
    return bool(spec.extra.get("at_linear_layer"))


# ---------------------------------------------------------------- which feeds each op reads, and its op name

def inputs_of(point: str, spec: Any) -> tuple[str, ...] | None:
    """The recorded points the op producing `point` reads (None: the base's); `spec` is one layer's."""
    if point == "attn.core":
        return ("attn.q_rope", "attn.k_rope", "attn.v", "attn.gate")
    if point == "attn.out" and _at_linear_layer(spec):
        return ("attn.linear_norm",)
    return {"attn.gate": ("attn_norm",), "attn.linear_qkvz": ("attn_norm",), "attn.linear_ba": ("attn_norm",),
            "attn.linear_conv": ("attn.linear_qkvz",), "attn.linear_core": ("attn.linear_conv", "attn.linear_ba"),
            "attn.linear_norm": ("attn.linear_core", "attn.linear_qkvz")}.get(point)


def op_of(point: str, spec: Any) -> str:
    """The op's name (the clean envelopes of replay/variants.py are keyed by it: none of these has one there, so
    the base transformer's q/o GEMM and attention variants, which would read other tensors, never judge them);
    `spec` is one layer's."""
    if point in NORMS:
        return "unit_offset_rmsnorm"
    if point in ("attn.q", "attn.gate"):
        return "gated_q_gemm"
    if point == "attn.core":
        return "gated_attention"
    if point == "attn.out" and _at_linear_layer(spec):
        return "linear_out_gemm"
    return ""
