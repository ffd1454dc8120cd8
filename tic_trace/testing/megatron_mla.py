"""Build a real megatron-core 0.16.1 DeepSeek-V3-style ``GPTModel`` (local spec, multi-latent attention,
sigmoid group-limited router with an expert bias, shared experts, dense first layers) from a HF
``DeepseekV3Config``, on CPU.

TEST SUPPORT ONLY (like :mod:`tic_trace.testing.megatron_cpu`, whose shims and process-group set-up it uses);
product code never imports it. The weights come from the HF model through
``tic_trace.adapters.megatron_weights.hf_to_megatron_state_dict`` (which maps MLA and the DeepSeek router too).

Two shims, on top of megatron_cpu's:

* M1. ``MultiLatentAttention.__init__`` (transformer/multi_latent_attention.py:155-166) builds its core
  attention with ``k_channels=`` and ``v_channels=`` (the q/k head width nope + rope differs from v's), keywords
  only Transformer Engine's ``TEDotProductAttention`` takes. The local spec's ``DotProductAttention.__init__``
  (transformer/dot_product_attention.py:42-52) has no such parameters, so
  ``get_gpt_layer_local_spec(multi_latent_attention=True)`` cannot be built in 0.16.1 (``TypeError:
  DotProductAttention.__init__() got an unexpected keyword argument 'k_channels'``). The local kernel itself
  handles the different widths: its matmuls read the q/k width from the tensors, and its output view is
  ``kv_channels * heads``, so with ``kv_channels = v_head_dim`` it is MLA's output.
  :class:`LatentDotProductAttention` drops the two keywords (checking ``v_channels == kv_channels``) and is
  megatron's own ``DotProductAttention`` otherwise; the spec uses it in place of the local core attention
  (this module's model only).
* M2. transformer/multi_latent_attention.py:55-65 sets ``HAVE_TE = True`` whenever
  ``megatron.core.extensions.transformer_engine`` imports, which it does without Transformer Engine (its TE
  classes are then ``MagicMock`` placeholders); ``MultiLatentAttention.__init__`` (:183-186) then evaluates
  ``isinstance(self.linear_proj, TELinear)`` with that placeholder and raises ``TypeError: isinstance() arg 2
  must be a type``. Without TE the module's ``HAVE_TE`` is set to False (through megatron_cpu's ``_patch``, so
  ``remove_shims`` restores it); the only other reads of ``TELinear`` (:408, :453) are list-membership tests
  that are False either way.

What megatron computes, and the HF config it matches (each mismatch below raises NotImplementedError):

* RoPE: megatron's MLA (``_apply_rotary_pos_emb_bshd`` with ``multi_latent_attention=True``,
  models/common/embeddings/rope_utils.py) takes q's rope dims and k_pe as interleaved pairs, writes them
  de-interleaved and rotates half: HF's ``apply_rotary_pos_emb_interleave``, i.e. ``rope_interleave=True``
  (the default) with ``rotary_interleaved=False`` and no RoPE fusion (MLA's fused RoPE is YaRN-only and needs
  TE). HF's ``rope_interleave=False`` has no megatron equivalent. Plain RoPE only (``rope_type="rope"``,
  ``rotary_scaling_factor=1``: MLA's softmax mscale is then 1).
* Latent norms: megatron builds both with ``layernorm_epsilon``, HF with ``DeepseekV3RMSNorm``'s default
  1e-6: the config's ``rms_norm_eps`` must be 1e-6.
* Router: sigmoid scores, the expert bias (HF ``e_score_correction_bias``) for the choice only, top-k
  renormalised, x ``routed_scaling_factor``; logits in fp32 (HF's router casts to fp32:
  ``moe_router_dtype="fp32"``). A group's score is the sum of its ``topk // group_topk`` best scores in
  megatron (moe_utils.py ``group_limited_topk``), of its 2 best in HF: ``num_experts_per_tok // topk_group``
  must be 2. Megatron's sigmoid path always renormalises the top-k weights (topk > 1): ``norm_topk_prob``
  must be True.
"""
from __future__ import annotations

from typing import Any

import torch

from tic_trace.testing import megatron_cpu as mc

__all__ = ["LatentDotProductAttention", "apply_latent_shims", "build_mla_transformer_config", "build_mla_gpt_model",
           "build_glm4_moe_gpt_model", "sigmoid_router_fields", "moe_pattern"]

_HF_LATENT_NORM_EPS = 1e-6


def _latent_core_attention_class():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LatentDotProductAttention(DotProductAttention):
        """Shim M1 (module docstring): megatron's local ``DotProductAttention``, accepting MLA's
        ``k_channels`` / ``v_channels``."""

        def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                     **kwargs: Any):
            config = kwargs.get("config", args[0] if args else None)
            if v_channels is not None and v_channels != config.kv_channels:
                raise ValueError(f"v_channels {v_channels} != kv_channels {config.kv_channels}: the local kernel's "
                                 "output width is kv_channels * heads")
            super().__init__(*args, **kwargs)
    return LatentDotProductAttention


def __getattr__(name: str):       # the class needs megatron: built on first use
    if name == "LatentDotProductAttention":
        return _latent_core_attention_class()
    raise AttributeError(name)


def moe_pattern(hf_config: Any) -> list[int]:
    """Per layer 1 (MoE) or 0 (dense): HF DeepSeek-V3's rule, layers from ``first_k_dense_replace`` on."""
    first = int(getattr(hf_config, "first_k_dense_replace", 0) or 0)
    return [int(i >= first) for i in range(int(hf_config.num_hidden_layers))]


def _check_router(hf_config: Any) -> None:
    """What the module docstring says megatron's router cannot reproduce."""
    if getattr(hf_config, "hidden_act", "silu") != "silu" or not getattr(hf_config, "norm_topk_prob", True):
        raise NotImplementedError("only SwiGLU experts with renormalised top-k weights are mapped")
    topk, groups = int(hf_config.num_experts_per_tok), int(getattr(hf_config, "topk_group", 1) or 1)
    if int(getattr(hf_config, "n_group", 1) or 1) > 1 and topk // groups != 2:
        raise NotImplementedError("group score: megatron sums a group's top topk/topk_group, HF its top 2")


def _check_latent(hf_config: Any) -> None:
    """What the module docstring says megatron's MLA cannot reproduce."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") not in ("default", None):
        raise NotImplementedError(f"RoPE {params.get('rope_type')!r}: only plain RoPE is mapped here")
    if getattr(hf_config, "rope_interleave", True) is False:
        raise NotImplementedError("rope_interleave=False: megatron's MLA RoPE always reads interleaved pairs")
    if float(hf_config.rms_norm_eps) != _HF_LATENT_NORM_EPS:
        raise NotImplementedError("rms_norm_eps != 1e-6: HF's latent norms use 1e-6, megatron's the config's eps")


def sigmoid_router_fields(hf_config: Any) -> dict[str, Any]:
    """The ``TransformerConfig`` fields of a DeepSeek-V3 / GLM-4.5 MoE: experts from ``first_k_dense_replace``
    on, the sigmoid group-limited router with an expert bias and routed scaling (fp32 logits, as HF's router),
    the ungated shared experts."""
    _check_router(hf_config)
    c = hf_config
    return dict(
        num_moe_experts=int(c.n_routed_experts), moe_router_topk=int(c.num_experts_per_tok),
        moe_ffn_hidden_size=int(c.moe_intermediate_size), moe_layer_freq=moe_pattern(c), moe_grouped_gemm=False,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_num_groups=int(getattr(c, "n_group", 1) or 1),
        moe_router_group_topk=int(getattr(c, "topk_group", 1) or 1),
        moe_router_topk_scaling_factor=float(c.routed_scaling_factor), moe_router_dtype="fp32",
        moe_shared_expert_intermediate_size=(int(c.n_shared_experts) * int(c.moe_intermediate_size)
                                             if getattr(c, "n_shared_experts", 0) else None))


def build_mla_transformer_config(hf_config: Any, dtype: torch.dtype = torch.float32, **overrides: Any):
    """The megatron ``MLATransformerConfig`` equivalent to a HF ``DeepseekV3Config`` (TP 1; pass
    ``tensor_model_parallel_size=`` for more, after ``init_parallel`` with that TP)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    _check_latent(hf_config)
    c = hf_config
    theta = float((getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", 1e4)))
    kwargs: dict[str, Any] = dict(
        num_layers=int(c.num_hidden_layers), hidden_size=int(c.hidden_size),
        num_attention_heads=int(c.num_attention_heads), num_query_groups=int(c.num_attention_heads),
        ffn_hidden_size=int(c.intermediate_size), normalization="RMSNorm", layernorm_epsilon=float(c.rms_norm_eps),
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        qk_layernorm=True,            # the local MLA spec builds the latent norms only with qk_layernorm
        attention_dropout=0.0, hidden_dropout=0.0,
        q_lora_rank=c.q_lora_rank, kv_lora_rank=int(c.kv_lora_rank), qk_head_dim=int(c.qk_nope_head_dim),
        qk_pos_emb_head_dim=int(c.qk_rope_head_dim), v_head_dim=int(c.v_head_dim), kv_channels=int(c.v_head_dim),
        rope_type="rope", rotary_base=theta, rotary_scaling_factor=1.0, rotary_interleaved=False,
        apply_rope_fusion=False,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, use_cpu_initialization=True,
        perform_initialization=False, **sigmoid_router_fields(c))
    kwargs.update(overrides)
    return MLATransformerConfig(**kwargs)


def apply_latent_shims() -> None:
    """Shim M2 (module docstring), when Transformer Engine is not installed. Idempotent."""
    import importlib.util

    import megatron.core.transformer.multi_latent_attention as mla

    if importlib.util.find_spec("transformer_engine") is None:
        mc._patch(mla, "HAVE_TE", False)


def _with_latent_core_attention(block_spec):
    """The block spec with every MLA layer's core attention replaced by the shim M1 class."""
    cls = _latent_core_attention_class()
    for layer in block_spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = cls
    return block_spec


def build_mla_gpt_model(hf_config: Any, dtype: torch.dtype = torch.float32, **config_overrides: Any):
    """An eval-mode megatron ``GPTModel`` (local spec, MLA, MoE from ``first_k_dense_replace``) shaped like
    the HF DeepSeek-V3 config; uninitialised weights (load them with ``megatron_weights.load_into``). Needs
    :func:`megatron_cpu.init_parallel` (or ``single_rank``) first. Forward:
    ``model(input_ids[b,s], position_ids[b,s], attention_mask=None)`` -> logits ``[b, s, V]``."""
    mc.apply_all()
    apply_latent_shims()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    config = build_mla_transformer_config(hf_config, dtype=dtype, **config_overrides)
    spec = _with_latent_core_attention(
        get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm"))
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=int(hf_config.vocab_size),
                     max_sequence_length=int(hf_config.max_position_embeddings), pre_process=True,
                     post_process=True, parallel_output=True,
                     share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
                     position_embedding_type="rope")     # MLA builds its own RoPE, inside each attention
    return model.eval()


def build_glm4_moe_gpt_model(hf_config: Any, dtype: torch.dtype = torch.float32, **config_overrides: Any):
    """An eval-mode megatron ``GPTModel`` (local spec, standard attention: q/k/v bias, QK-norm, partial
    rotate-half RoPE; the DeepSeek-style MoE of :func:`sigmoid_router_fields`) shaped like a HF
    ``Glm4MoeConfig``: megatron_cpu's Qwen3 model with GLM's MoE fields. Needs ``init_parallel`` first."""
    fields = {**sigmoid_router_fields(hf_config), "qk_layernorm": bool(getattr(hf_config, "use_qk_norm", False)),
              **config_overrides}
    return mc.build_gpt_model(hf_config, tp=1, ep=1, sp=False, dtype=dtype, **fields)
