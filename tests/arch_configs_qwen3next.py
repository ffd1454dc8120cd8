"""A tiny Qwen3-Next config (transformers 5.24), shared by test_supported_archs.py (the generic checks of every
HF table row) and test_archs_qwen3next.py: hidden 64, layers alternating Gated DeltaNet linear attention and
gated softmax attention, MoE on every second layer (dense MLP on the others)."""
import transformers as T

COMMON = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              intermediate_size=128, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
# two value heads per key head (the grouping in_proj_qkvz / in_proj_ba columns follow), a 4-tap conv
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
           decoder_sparse_step=2, norm_topk_prob=True)


def qwen3next_config(layers: int = 4) -> T.Qwen3NextConfig:
    """`layers` layers: linear, full, linear, full, ... (layer 0 linear, every odd layer MoE)."""
    types = ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return T.Qwen3NextConfig(**COMMON, **LINEAR, **MOE, num_hidden_layers=layers, layer_types=types)
