"""Megatron-core ``TransformerConfig`` switches that change what a canonical point computes, and the refusal of
a trace that turns one on outside what the tests verify.

A ``GPTModel``'s module structure (``megatron.architecture_name``) does not show these: a GPT-OSS-style model
(attention sinks, sliding windows, a clamped GLU), a Qwen3-Next-style one (gated attention, Gated DeltaNet
layers) or one with NoPE layers is built from the very same ``SelfAttention`` / ``MLP`` / ``MoELayer`` classes as
a Qwen3. Mapped by the plain rows, its ``attn.core`` would be compared against a reference that has no sinks, or
its pre-gate core output against HF's gated one: a confident wrong point. So each switch is recorded at trace
time (:func:`feature_facts`) and :func:`feature_refusal` names every one that is on, with what the table would
get wrong. An old trace that does not record them says nothing here (it cannot have been written with them
mapped either).
"""
from __future__ import annotations

from typing import Any

# field -> (the value that changes nothing, what the plain rows would get wrong with another value)
FEATURES: dict[str, tuple[Any, str]] = {
    "softmax_type": ("vanilla", "attention sinks (`softmax_offset`, GPT-OSS): the softmax's extra column is in no "
                                "row, so `attn.core` would be judged against sink-free attention"),
    "window_size": (None, "sliding-window attention (GPT-OSS, Gemma): which layers are windowed is not mapped"),
    "activation_func_clamp_value": (None, "a clamped GLU (GPT-OSS's SwiGLU limit): not mapped to the experts' points"),
    "glu_linear_offset": (0.0, "a GLU with an offset on its linear half (GPT-OSS's `up + 1`): not mapped"),
    "attention_output_gate": (False, "gated attention (Qwen3-Next): megatron's `core_attention` output is before "
                                     "the gate, HF's `attn.core` after it"),
    "experimental_attention_variant": (None, "Gated DeltaNet / DSA layers (Qwen3-Next, DeepSeek-V3.2): no row "
                                             "maps them"),
    "no_rope_freq": (None, "NoPE layers (Llama 4): the rows assume RoPE in every layer"),
    "moe_shared_expert_gate": (False, "a gated shared expert (Qwen2-MoE): `moe.shared_out` before or after the "
                                      "gate is not verified"),
    "moe_apply_probs_on_input": (False, "top-k weights applied to the experts' input (Llama 4): "
                                        "`moe.experts_out` would not be HF's weighted sum"),
    "moe_latent_size": (None, "latent MoE (experts in a down-projected space): not mapped"),
    "apply_residual_connection_post_layernorm": (False, "the residual taken after the input norm: `input` / `mid` "
                                                        "are not the residual stream the rows assume"),
    "mrope_section": (None, "multimodal RoPE (Qwen2-VL): not mapped"),
    "position_embedding_type": ("rope", "position embeddings other than RoPE (YaRN, learned absolute, none): "
                                        "`attn.q_rope` / `attn.k_rope` not verified against a reference"),
}
# Where the model keeps a switch that is not a config field (GPTModel's constructor argument).
_ON_MODEL = ("position_embedding_type",)


def feature_facts(cfg: Any, root: Any) -> dict:
    """The switches' values as manifest facts ``megatron_<field>`` (scalars: the manifest's model facts hold
    nothing else, so a window ``(left, right)`` is written as its text)."""
    out = {}
    for field in FEATURES:
        holder = root if field in _ON_MODEL and hasattr(root, field) else cfg
        value = getattr(holder, field, FEATURES[field][0])
        out[f"megatron_{field}"] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
    return out


def feature_refusal(config: dict, verified: dict[str, Any] | None = None) -> str | None:
    """Why a trace's switches are outside the verified rows (None: every recorded one is off, or is set to the
    value ``verified`` allows, e.g. MLA's own YaRN handling)."""
    verified = verified or {}
    why = []
    for field, (off, wrong) in FEATURES.items():
        key = f"megatron_{field}"
        if key not in config:
            continue
        value = config[key]
        if value == off or (field in verified and value == verified[field]):
            continue
        why.append(f"`{field}={value!r}`: {wrong}")
    return "TransformerConfig switches outside the verified rows: " + "; ".join(why) if why else None
