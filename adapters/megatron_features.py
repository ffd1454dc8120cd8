"""Megatron-core ``TransformerConfig`` switches that change what a canonical point computes, and the refusal of
a trace that turns one on outside what the tests verify.

A ``GPTModel``'s module structure (``megatron.architecture_name``) does not show these: a GPT-OSS-style model
(attention sinks, sliding windows, a clamped GLU), a Qwen3-Next-style one (gated attention, Gated DeltaNet
layers) or one with NoPE layers is built from the very same ``SelfAttention`` / ``MLP`` / ``MoELayer`` classes as
a Qwen3. Mapped by the plain rows, its ``attn.core`` would be compared against a reference that has no sinks, or
its pre-gate core output against HF's gated one: a confident wrong point. So each switch is recorded at trace
time (:func:`feature_facts`) and :func:`feature_refusal` names every one that is on and was not run against a
reference in the tests, with what the table would get wrong. GPT-OSS's switches (learnable sinks, windows, the
clamped GLU with its offset, YaRN) are: they change values, not which record a point reads, and the tests run them
against HF's GPT-OSS on one rank (the attention output's separate bias is ``megatron.py``'s
``megatron_biased``); so is Qwen2-MoE's gated shared expert (its ``moe.shared_out`` row reads the expert before
the gate). An old trace that does not record them says nothing here (it cannot have been written
with them mapped either).
"""
from __future__ import annotations

from typing import Any, NamedTuple

from tic_trace.families import framework_names


class Feature(NamedTuple):
    off: Any                    # the value that changes nothing
    wrong: str                  # what the plain rows would get wrong with it on
    verified: tuple = ()        # values run against a reference in the tests ("any": every value)


_VERIFIED_BY = "`tests/test_megatron_gptoss.py`, `tests/test_megatron_families.py`"
FEATURES: dict[str, Feature] = {
    "softmax_type": Feature("vanilla", "attention sinks other than GPT-OSS's learnable ones (`off-by-one`): not run "
                                       "against a reference", ("learnable",)),
    "window_size": Feature(None, "sliding-window attention", ("any",)),
    "activation_func_clamp_value": Feature(None, "a clamped GLU", ("any",)),
    "glu_linear_offset": Feature(0.0, "a GLU with an offset on its linear half", ("any",)),
    "attention_output_gate": Feature(False, "gated attention (Qwen3-Next): megatron's `core_attention` output is "
                                            "before the gate, HF's `attn.core` after it"),
    "experimental_attention_variant": Feature(None, "Gated DeltaNet / DSA layers (Qwen3-Next, DeepSeek-V3.2): no "
                                                    "row maps them"),
    "no_rope_freq": Feature(None, "NoPE layers (Llama 4): the rows assume RoPE in every layer"),
    "moe_shared_expert_gate": Feature(False, "a gated shared expert", (True,)),
    "moe_apply_probs_on_input": Feature(False, "top-k weights applied to the experts' input (Llama 4): "
                                               "`moe.experts_out` would not be HF's weighted sum"),
    "moe_latent_size": Feature(None, "latent MoE (experts in a down-projected space): not mapped"),
    "apply_residual_connection_post_layernorm": Feature(False, "the residual taken after the input norm: `input` / "
                                                               "`mid` are not the residual stream the rows assume"),
    "mrope_section": Feature(None, "multimodal RoPE (Qwen2-VL): not mapped"),
    "position_embedding_type": Feature("rope", "position embeddings other than RoPE and YaRN (learned absolute, "
                                               "multimodal, none): `attn.q_rope` / `attn.k_rope` not verified "
                                               "against a reference", ("yarn",)),
}
# The verified values above ran on one rank only (GPT-OSS, Qwen2-MoE): with any of them on, other layouts are
# refused.
_ONE_RANK = ("tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size",
             "expert_model_parallel_size")
# Where the model keeps a switch that is not a config field (GPTModel's constructor argument).
_ON_MODEL = ("position_embedding_type",)


# The switches under which a family's own attention module stands in for ``SelfAttention`` (the families'
# ``attention_switch`` tables: MLA's): its ``q_layernorm`` is no per-head QK-norm, its parameters no ``linear_qkv``.
_FAMILY_ATTENTION = tuple(n.tables["attention_switch"] for n in framework_names("megatron")
                          if "attention_switch" in n.tables)


def family_attention(cfg: Any) -> bool:
    """Whether a family's own attention module stands in for ``SelfAttention`` in this config."""
    return any(getattr(cfg, switch, False) for switch in _FAMILY_ATTENTION)


def feature_facts(cfg: Any, root: Any) -> dict:
    """The switches' values as manifest facts ``megatron_<field>`` (scalars: the manifest's model facts hold
    nothing else, so a window ``(left, right)`` is written as its text)."""
    out = {}
    for field in FEATURES:
        holder = root if field in _ON_MODEL and hasattr(root, field) else cfg
        value = getattr(holder, field, FEATURES[field].off)
        out[f"megatron_{field}"] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
    return out


def feature_refusal(config: dict) -> str | None:
    """Why a trace's switches are outside the verified rows (None: every recorded one is off, or on at a value and
    in a layout the tests ran against a reference)."""
    why, on = [], []
    for field, f in FEATURES.items():
        value = config.get(f"megatron_{field}", f.off)
        if value == f.off:
            continue
        if "any" in f.verified or value in f.verified:
            on.append(field)
        else:
            why.append(f"`{field}={value!r}`: {f.wrong}")
    layout = [f"`{k}` {config[k]}" for k in _ONE_RANK if int(config.get(k) or 1) > 1]
    if config.get("sequence_parallel"):
        layout.append("sequence parallelism")
    if on and layout:
        why.append(f"{', '.join(f'`{x}`' for x in on)} ({_VERIFIED_BY}) verified on one rank only, not with "
                   + ", ".join(layout))
    return "TransformerConfig switches outside the verified rows: " + "; ".join(why) if why else None
