"""Tiny configs of Gemma2, Gemma3 (text), Phi-3 and GPT-OSS (transformers 5.24), shared by
test_supported_archs.py (the generic checks of every HF table row) and test_archs_gemma_phi3_gptoss.py."""
import transformers as T

COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, intermediate_size=128, max_position_embeddings=256, rms_norm_eps=1e-6,
              tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_NO_HEAD_DIM = {k: v for k, v in COMMON.items() if k != "head_dim"}
# Sliding windows shorter than the test's 10 tokens, so that windowed layers attend to fewer keys than full ones;
# soft-caps small enough to bend the tiny model's scores and logits.
GEMMA_PHI3_GPTOSS = {
    "Gemma2ForCausalLM": lambda: T.Gemma2Config(**COMMON, sliding_window=4, query_pre_attn_scalar=16,
                                                attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "Gemma3ForCausalLM": lambda: T.Gemma3TextConfig(**COMMON, sliding_window=4, query_pre_attn_scalar=16,
                                                    layer_types=["sliding_attention", "full_attention"]),
    "Phi3ForCausalLM": lambda: T.Phi3Config(**_NO_HEAD_DIM),
    "GptOssForCausalLM": lambda: T.GptOssConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2,
                                                sliding_window=4),
}
