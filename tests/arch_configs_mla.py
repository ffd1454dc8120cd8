"""The tiny DeepSeek-V3 (MLA, MoE) and GLM-4.5 (MoE) configs the MLA suites share (tests/test_megatron_mla.py,
tests/test_sglang_mla.py): 8 experts in 2 groups (1 kept), top-2, routed scaling 2.5, one shared expert, layer
0 dense. DeepSeek-V3: q latent 24, kv latent 32, nope 16 + rope 8, v 16, interleaved RoPE. GLM-4.5: 2 KV heads
of 16, q/k/v bias, QK-norm, RoPE on half the head (its default)."""
from __future__ import annotations

import torch
import transformers as T

from tic_trace.testing.hf_models import build_hf_model_stable

COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128,
              max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0,
              bos_token_id=1, eos_token_id=2, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
              norm_topk_prob=True)
#: Keys DeepSeek-V3's released config.json carries that transformers' DeepseekV3Config does not declare (kept
#: as attributes and saved with the checkpoint); SGLang's deepseek_v2.py reads them.
DEEPSEEK_HUB_KEYS = dict(moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid")


def mla_config(name: str, **changes):
    """The HF config of `name` ("deepseek" or "glm"), eager attention."""
    if name == "deepseek":
        cfg = T.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 24,
                                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, **changes})
        for k, v in DEEPSEEK_HUB_KEYS.items():
            setattr(cfg, k, v)
    else:
        cfg = T.Glm4MoeConfig(**{**COMMON, "num_key_value_heads": 2, "head_dim": 16, "attention_bias": True,
                                 "use_qk_norm": True, **changes})
    cfg._attn_implementation = "eager"
    return cfg


def mla_hf_model(cfg, dtype: torch.dtype, seed: int = 0):
    """The HF model, with a non-zero score-correction bias (zero would leave the bias path untested)."""
    model = build_hf_model_stable(cfg, seed=seed, dtype=dtype)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in model.model.layers[cfg.first_k_dense_replace:]:
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(0.1 * torch.randn(bias.shape, generator=g))
    return model
