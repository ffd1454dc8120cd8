"""Tiny HF Qwen3 / Qwen3-MoE models with random weights, built locally (no hub access)."""
from __future__ import annotations

import torch


def tiny_qwen3_config(moe: bool = True, **overrides):
    """A small Qwen3 (dense) or Qwen3-MoE config: QK-norm, GQA, SwiGLU, RoPE; fp32, eager attention."""
    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False)
    if moe:
        from transformers import Qwen3MoeConfig
        common.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False)
        common.update(overrides)
        cfg = Qwen3MoeConfig(**common)
    else:
        from transformers import Qwen3Config
        common.update(overrides)
        cfg = Qwen3Config(**common)
    cfg._attn_implementation = "eager"
    return cfg


def tiny_qwen2_moe_config(**overrides):
    """A small Qwen2-MoE config: routed experts plus one shared expert scaled by a sigmoid gate, q/k/v bias,
    no QK-norm; fp32, eager attention."""
    from transformers import Qwen2MoeConfig
    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                  num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
                  mlp_only_layers=[], max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False)
    common.update(overrides)
    cfg = Qwen2MoeConfig(**common)
    cfg._attn_implementation = "eager"
    return cfg


def build_hf_model(config, seed: int = 0, dtype: torch.dtype = torch.float32):
    """The causal-LM for `config` with deterministic random weights (std 0.05; norms near 1)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    return model.to(dtype).eval()


def sample_tokens(batch: int, seq: int, vocab: int = 128, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def build_hf_model_stable(config, seed: int = 0, dtype: torch.dtype = torch.float32):
    """Like `build_hf_model`, but the weights depend only on (config, seed): they are drawn from a private
    generator after construction, always in float32. `save_pretrained` writes the model's dtype into its
    config object, after which `from_config` builds in that dtype and `build_hf_model` draws different
    weights (bf16 noise, and transformers' init consumes the global RNG differently); tests that save a
    checkpoint and then build the model again (the exact reference's tests) need this one."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.05 * noise)
    # from_pretrained(dtype=bf16) keeps RoPE's inverse frequencies in fp32 (they are computed, not loaded);
    # a plain .to(bf16) would round them too, and with them every angle — not what a real bf16 model does.
    keep = {n: b.clone() for n, b in model.named_buffers() if n.endswith("inv_freq")}
    model = model.to(dtype).eval()
    for n, b in keep.items():
        mod = model.get_submodule(n.rsplit(".", 1)[0])
        setattr(mod, n.rsplit(".", 1)[1], b)
    return model
