"""Build a real megatron-core 0.16.1 GPT-OSS-style ``GPTModel`` (local spec: attention sinks, sliding windows on
alternate layers, q/k/v/o biases, a router with a bias, clamped SwiGLU experts with biases) from a HF
``GptOssConfig``, on CPU.

TEST SUPPORT ONLY (like :mod:`tic_trace.testing.megatron_cpu`, whose shims and process-group set-up it uses,
including P2b for the sliding-window mask); product code never imports it. Weights come from the HF model
through ``tic_trace.adapters.megatron_weights.hf_to_megatron_state_dict``.

What megatron computes, and the HF field it matches (a mismatch raises NotImplementedError):

* Sinks: ``softmax_type="learnable"``, ``DotProductAttention.softmax_offset`` [heads] <- ``self_attn.sinks``
  (``SoftmaxOne``: the offset as one more column of the softmax, dropped after it, as HF's eager attention).
* Windows: HF's ``sliding_window`` ``w`` lets a query see ``w`` keys, itself included: megatron's
  ``window_size=(w - 1, 0)``; ``window_attn_skip_freq`` is the per-layer list of HF's ``layer_types``.
* Experts: ``activation_func=quick_gelu`` (``x * sigmoid(1.702 x)``), ``glu_linear_offset=1``,
  ``activation_func_clamp_value=swiglu_limit``: HF's ``(clamp(up) + 1) * glu(clamp(gate))``; HF's alpha must be
  1.702 (quick_gelu's constant). fc2's bias is weighted by the top-k weight in both.
* Router: top-k over the biased logits, softmax over the k (``moe_router_pre_softmax=False``).
* RoPE: plain rotate-half, or YaRN (the released checkpoints' scaling) through GPTModel's ``yarn`` position
  embedding, its ``yarn_*`` settings from HF's ``rope_parameters`` (``truncate`` -> rounding the correction range
  to integers); any other scaling raises.
"""
from __future__ import annotations

from typing import Any

import torch

from tic_trace.testing import megatron_cpu as mc

__all__ = ["build_gpt_oss_transformer_fields", "build_gpt_oss_gpt_model"]

_QUICK_GELU_ALPHA = 1.702


def _check(hf_config: Any) -> None:
    params = getattr(hf_config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") not in ("default", "yarn", None):
        raise NotImplementedError(f"RoPE {params.get('rope_type')!r}: only plain RoPE and YaRN are mapped here")
    if abs(float(getattr(hf_config, "swiglu_alpha", _QUICK_GELU_ALPHA)) - _QUICK_GELU_ALPHA) > 1e-9:
        raise NotImplementedError("swiglu_alpha != 1.702: megatron's quick_gelu has that constant")
    if not getattr(hf_config, "attention_bias", True):
        raise NotImplementedError("GPT-OSS without attention biases: add_bias_linear covers q/k/v/o together")


def build_gpt_oss_transformer_fields(hf_config: Any) -> dict[str, Any]:
    """The ``TransformerConfig`` fields that make megatron_cpu's Qwen3 config a GPT-OSS one."""
    from megatron.core.activations import quick_gelu

    _check(hf_config)
    c = hf_config
    layer_types = list(getattr(c, "layer_types", None) or [])
    window = getattr(c, "sliding_window", None)
    fields: dict[str, Any] = dict(
        activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=float(c.swiglu_limit),
        bias_activation_fusion=False, add_bias_linear=True, add_qkv_bias=True, qk_layernorm=False,
        softmax_type="learnable",
        num_moe_experts=int(c.num_local_experts), moe_router_topk=int(c.num_experts_per_tok),
        moe_ffn_hidden_size=int(c.intermediate_size), moe_layer_freq=[1] * int(c.num_hidden_layers),
        moe_grouped_gemm=False, moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0, moe_router_score_function="softmax", moe_router_pre_softmax=False)
    if window and "sliding_attention" in layer_types:
        fields.update(window_size=(int(window) - 1, 0),
                      window_attn_skip_freq=[int(t == "sliding_attention") for t in layer_types])
    return fields


def _yarn_fields(hf_config: Any) -> dict[str, Any] | None:
    """GPTModel's YaRN settings (read from the config object by ``GPTModel.__init__``, gpt_model.py:172-190, and by
    attention's concentration factor) for a HF YaRN ``rope_parameters``; None for plain RoPE."""
    p = getattr(hf_config, "rope_parameters", None) or {}
    if p.get("rope_type", "default") in ("default", None):
        return None
    return {"yarn_rotary_scaling_factor": float(p["factor"]),
            "yarn_original_max_position_embeddings": int(p["original_max_position_embeddings"]),
            "yarn_beta_fast": float(p.get("beta_fast", 32.0)), "yarn_beta_slow": float(p.get("beta_slow", 1.0)),
            "yarn_mscale": p.get("mscale"), "yarn_mscale_all_dim": p.get("mscale_all_dim"),
            "yarn_correction_range_round_to_int": bool(p.get("truncate", True))}


def build_gpt_oss_gpt_model(hf_config: Any, dtype: torch.dtype = torch.float32, **config_overrides: Any):
    """An eval-mode megatron ``GPTModel`` shaped like the HF ``GptOssConfig`` (TP 1; uninitialised weights: load
    them with ``megatron_weights.load_into``). Needs ``megatron_cpu.init_parallel`` / ``single_rank`` first."""
    mc.apply_all()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    fields = {**build_gpt_oss_transformer_fields(hf_config), **config_overrides}
    c = hf_config
    # megatron_cpu reads the HF names of a Qwen3-MoE config: GPT-OSS's experts under their Qwen names
    base = {k: getattr(c, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                       "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps",
                                       "num_experts_per_tok", "attention_bias")}
    base.update(hidden_act="silu", num_experts=int(c.num_local_experts), moe_intermediate_size=int(c.intermediate_size))
    config = mc.build_transformer_config(base, tp=1, ep=1, sp=False, dtype=dtype, **fields)
    yarn = _yarn_fields(c)
    for k, v in (yarn or {}).items():
        setattr(config, k, v)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    theta = float((getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=int(c.vocab_size),
                     max_sequence_length=int(c.max_position_embeddings), pre_process=True, post_process=True,
                     parallel_output=True, share_embeddings_and_output_weights=bool(c.tie_word_embeddings),
                     position_embedding_type="yarn" if yarn else "rope", rotary_base=theta)
    return model.eval()
