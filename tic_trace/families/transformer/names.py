"""The plain transformer's name tables: HF's module names (transformers 5.24), SGLang's (0.5.23's model code) and
megatron-core's GPTModel's onto the canonical points, and the architectures each framework's rows were verified
on. Strings and `graph.adapter` rows only, no framework import: adapters/hf.py, sglang*.py and megatron.py read
them through `families.framework_names` and keep the mechanics (hooks, TP merges, transforms, row identity).

These rows are the base every family's rows override: a family's row names the architectures it holds for
(`opts["archs"]`), and for those the base row of the same point does not apply. Megatron's architectures are
structures (a `GPTModel`'s module tree cannot say which family it was configured as): the families whose configs
ran through each are named in it, and the other side of a pair names the family.
"""
from __future__ import annotations

from ...graph.adapter import Architecture, PointMap
from ..base import FrameworkNames

_L = r"model\.layers\.(?P<layer>\d+)"
_A = _L + r"\.self_attn"
_M = _L + r"\.mlp"
_QK = ("attn.q_norm", "attn.k_norm")
_MOE = ("moe.router_logits", "moe.topk_ids", "moe.topk_weights", "moe.experts_out", "moe.shared_out")
_SHARED = ("moe.shared_out",)


# ---------------------------------------------------------------- HF (the model classes of transformers)

HF_POINTS = (
    PointMap("embed", r"model\.embed_tokens:out"),
    PointMap("input", _L + r":in(\[0\]|\.hidden_states)", note="decoder layer input = residual stream"),
    PointMap("attn_norm", _L + r"\.input_layernorm:out"),
    PointMap("attn.q", _A + r"\.q_proj:out", "heads", opts={"heads": "q"}),
    PointMap("attn.k", _A + r"\.k_proj:out", "heads", opts={"heads": "kv"}),
    PointMap("attn.v", _A + r"\.v_proj:out", "heads", opts={"heads": "kv"}),
    PointMap("attn.q_norm", _A + r"\.q_norm:out", "heads", opts={"heads": "q"}),
    PointMap("attn.k_norm", _A + r"\.k_norm:out", "heads", opts={"heads": "kv"}),
    PointMap("attn.q_rope", _A + r"/fn:apply_rotary_pos_emb:out\[0\]", "bhsd"),
    PointMap("attn.k_rope", _A + r"/fn:apply_rotary_pos_emb:out\[1\]", "bhsd"),
    PointMap("attn.core", _A + r"\.o_proj:in\[0\]", note="o_proj input = attention output"),
    PointMap("attn.out", _A + r"\.o_proj:out"),
    PointMap("mid", _L + r"\.post_attention_layernorm:in\[0\]", note="post-attention norm input = residual"),
    PointMap("mlp_norm", _L + r"\.post_attention_layernorm:out"),
    PointMap("moe.router_logits", _L + r"\.mlp\.gate:out\[0\]"),
    PointMap("moe.topk_ids", _L + r"\.mlp\.gate:out\[2\]", "sorted_ids"),
    PointMap("moe.topk_weights", _L + r"\.mlp\.gate:out\[1\]", "weights_by_sorted_ids",
             also={"ids": "model.layers.{layer}.mlp.gate:out[2]"}),
    PointMap("moe.experts_out", _L + r"\.mlp\.experts:out"),
    PointMap("moe.shared_out", _L + r"\.mlp\.shared_experts?:out",
             note="Qwen2-MoE's `shared_expert`, DeepSeek/GLM's `shared_experts`"),
    PointMap("mlp.out", _L + r"\.mlp:out(\[0\])?"),
    PointMap("output", _L + r":out(\[0\])?"),
    PointMap("final_norm", r"model\.norm:out"),
    PointMap("logits", r"lm_head:out", "vocab"),
)

_HF_T = "`tests/test_supported_archs.py`"

# Verified: a clean pair of tiny random models of the class is consistent, every point the table promises
# is recorded (and none it says the class lacks), the residual identities mid = input + attn.out and
# output = mid + mlp.out hold on the recorded points, and a bf16 pair replayed against its own checkpoint
# judges every point but `replay_gaps` with no finding (tests/test_supported_archs.py).
HF_ARCHITECTURES = (
    Architecture("LlamaForCausalLM", ("Llama",), "dense, pre-norm, RoPE", "every point", _HF_T, lacks=_QK + _MOE),
    Architecture("Qwen2ForCausalLM", ("Qwen2",), "dense, q/k/v bias", "every point", _HF_T, lacks=_QK + _MOE),
    Architecture("Qwen3ForCausalLM", ("Qwen3",), "dense, per-head QK-norm", "every point",
                 _HF_T + ", `test_finder.py`, `test_replay_finder.py`", lacks=_MOE),
    Architecture("Qwen3MoeForCausalLM", ("Qwen3-MoE",), "MoE (softmax router, top-k), per-head QK-norm",
                 "every point", _HF_T + ", `test_finder.py`, `test_replay_finder.py`", lacks=_SHARED),
    Architecture("Qwen2MoeForCausalLM", ("Qwen2-MoE",), "MoE with a sigmoid-gated shared expert, q/k/v bias",
                 "every point", _HF_T + ", `test_replay.py`", lacks=_QK),
    # MixtralTopKRouter renormalises the top-k weights whatever the config says (it has no norm_topk_prob)
    Architecture("MixtralForCausalLM", ("Mixtral",), "MoE (softmax router, top-k always renormalised)",
                 "every point (the router and w1/w2/w3 experts read under the checkpoint's `block_sparse_moe`)",
                 _HF_T, lacks=_QK + _SHARED, defaults={"norm_topk_prob": True}),
    Architecture("OlmoeForCausalLM", ("OLMoE",), "MoE, QK-norm over the whole q/k projection (not per head)",
                 "every point (the QK-norms over the whole projection, as their gains are heads x head_dim wide)",
                 _HF_T, lacks=_SHARED),
)


# ---------------------------------------------------------------- SGLang (srt/models/*.py)

def _tp_reduced(point: str, record: str, note: str = "") -> PointMap:
    return PointMap(point, record, merge="sum", opts={"tp_reduce": True},
                    note=(note + " " if note else "") + "(TP ranks: bitwise-equal copies taken once, else partial sums added)")


SGLANG_POINTS = (
    PointMap("embed", r"model\.embed_tokens:out"),
    PointMap("input", r"model\.embed_tokens:out", opts={"layer": 0}, note="layer 0's input is the embedding"),
    PointMap("input", _L + r"\.input_layernorm:out\[1\]",
             note="input_layernorm(mlp_out, residual) returns (normed, residual entering this layer)"),
    PointMap("attn_norm", _L + r"\.input_layernorm:out(\[0\])?"),
    PointMap("attn.q", _A + r"\.qkv_proj:out\[0\]", "sgl_qkv", "sgl_qkv", opts={"part": "q"},
             note="per-rank [q_local | k_local | v_local]; merged per head, then split"),
    PointMap("attn.k", _A + r"\.qkv_proj:out\[0\]", "sgl_qkv", "sgl_qkv", opts={"part": "k"}),
    PointMap("attn.v", _A + r"\.qkv_proj:out\[0\]", "sgl_qkv", "sgl_qkv", opts={"part": "v"}),
    PointMap("attn.q_norm", _A + r"/fn:apply_qk_norm:out\[0\]", "heads", "sgl_heads_q", opts={"heads": "q"},
             note="tapped apply_qk_norm (also when the fused in-place kernel bypasses the q_norm module)"),
    PointMap("attn.k_norm", _A + r"/fn:apply_qk_norm:out\[1\]", "heads", "sgl_heads_kv", opts={"heads": "kv"}),
    PointMap("attn.q_rope", _A + r"\.attn:in\[0\]", "heads", "sgl_heads_q", opts={"heads": "q"},
             note="RadixAttention's q input: after RoPE (rotary_emb is one shared module)"),
    PointMap("attn.k_rope", _A + r"\.attn:in\[1\]", "heads", "sgl_heads_kv", opts={"heads": "kv"}),
    PointMap("attn.core", _A + r"\.attn:out", merge="sgl_heads_q", note="RadixAttention output, before o_proj"),
    _tp_reduced("attn.out", _A + r"\.o_proj:out\[0\]"),
    PointMap("mid", _L + r"\.post_attention_layernorm:out\[1\]",
             note="post_attention_layernorm(attn_out, residual) returns (normed, residual after attention)"),
    PointMap("mlp_norm", _L + r"\.post_attention_layernorm:out\[0\]"),
    PointMap("moe.router_logits", _M + r"\.gate:out(\[0\])?"),
    PointMap("moe.topk_ids", _M + r"\.topk:out\.topk_ids", "sorted_ids", note="descending-weight order: sorted"),
    PointMap("moe.topk_weights", _M + r"\.topk:out\.topk_weights", "weights_by_sorted_ids",
             also={"ids": "model.layers.{layer}.mlp.topk:out.topk_ids"}),
    _tp_reduced("moe.experts_out", _M + r"\.experts:out"),
    _tp_reduced("moe.shared_out", _M + r"\.shared_experts?:out(\[0\])?"),
    _tp_reduced("mlp.out", _M + r":out(\[0\])?"),
    PointMap("output", _L + r"\.input_layernorm:out\[1\]", opts={"layer_offset": -1},
             note="the residual leaving layer N-1 is the 2nd output of layer N's input_layernorm"),
    PointMap("output", r"model\.norm:out\[1\]", opts={"layer": -1},
             note="last layer: the 2nd output of the final norm"),
    PointMap("final_norm", r"model\.norm:out(\[0\])?"),
    PointMap("logits", r"logits_processor:out\.next_token_logits", "vocab",
             note="one row per request (last extend row / decode row), named by set_record_rows"),
    PointMap("logprobs", r"logits_processor:out\.input_token_logprobs", opts={"input_logprobs": True},
             note="only with SGLangAdapter(input_logprobs=True); else derived from logits"),
)

OLMOE = ("OlmoeForCausalLM",)
#: OLMoE (olmoe.py): QK-norm modules over the whole q / k projection, ``[T, heads * d]``.
SGLANG_ARCH_POINTS = (
    PointMap("attn.q_norm", _A + r"\.q_norm:out", "heads", "sgl_heads_q", opts={"heads": "q", "archs": OLMOE}),
    PointMap("attn.k_norm", _A + r"\.k_norm:out", "heads", "sgl_heads_kv", opts={"heads": "kv", "archs": OLMOE}),
)
MIXTRAL = ("MixtralForCausalLM",)
_B = _L + r"\.block_sparse_moe"
#: Mixtral (mixtral.py): the MoE block is ``block_sparse_moe`` (gate, topk, experts as Qwen3-MoE's ``mlp``).
SGLANG_ARCH_POINTS += (
    PointMap("moe.router_logits", _B + r"\.gate:out(\[0\])?", opts={"archs": MIXTRAL}),
    PointMap("moe.topk_ids", _B + r"\.topk:out\.topk_ids", "sorted_ids", opts={"archs": MIXTRAL}),
    PointMap("moe.topk_weights", _B + r"\.topk:out\.topk_weights", "weights_by_sorted_ids", opts={"archs": MIXTRAL},
             also={"ids": "model.layers.{layer}.block_sparse_moe.topk:out.topk_ids"}),
    PointMap("moe.experts_out", _B + r"\.experts:out", opts={"archs": MIXTRAL}),
    PointMap("mlp.out", _B + r":out(\[0\])?", opts={"archs": MIXTRAL}),
)

#: Module paths (regexes, layer index written N) each of its architectures' tables relies on.
SGLANG_MODULES: dict[str, tuple[str, ...]] = {
    "qwen_dense": ("model.embed_tokens", "model.layers.N.input_layernorm", "model.layers.N.self_attn.qkv_proj",
                   "model.layers.N.self_attn.attn", "model.layers.N.self_attn.o_proj",
                   "model.layers.N.post_attention_layernorm", "model.layers.N.mlp", "model.norm",
                   "logits_processor"),
    "qwen_moe": ("model.embed_tokens", "model.layers.N.input_layernorm", "model.layers.N.self_attn.qkv_proj",
                 "model.layers.N.self_attn.attn", "model.layers.N.self_attn.o_proj",
                 "model.layers.N.post_attention_layernorm", "model.layers.N.mlp", "model.layers.N.mlp.gate",
                 "model.layers.N.mlp.topk", "model.layers.N.mlp.experts", "model.norm", "logits_processor"),
    "olmoe": ("model.embed_tokens", "model.layers.N.input_layernorm", "model.layers.N.self_attn.qkv_proj",
              "model.layers.N.self_attn.q_norm", "model.layers.N.self_attn.k_norm", "model.layers.N.self_attn.attn",
              "model.layers.N.self_attn.o_proj", "model.layers.N.post_attention_layernorm", "model.layers.N.mlp",
              "model.layers.N.mlp.gate", "model.layers.N.mlp.topk", "model.layers.N.mlp.experts", "model.norm",
              "logits_processor"),
    "mixtral": ("model.embed_tokens", "model.layers.N.input_layernorm", "model.layers.N.self_attn.qkv_proj",
                "model.layers.N.self_attn.attn", "model.layers.N.self_attn.o_proj",
                "model.layers.N.post_attention_layernorm", "model.layers.N.block_sparse_moe",
                "model.layers.N.block_sparse_moe.gate", "model.layers.N.block_sparse_moe.topk",
                "model.layers.N.block_sparse_moe.experts", "model.norm", "logits_processor"),
}

#: SGLang class name -> entry of the module lists (the families' `modules` tables).
SGLANG_ARCH_OF_CLASS = {
    "Qwen2ForCausalLM": "qwen_dense", "Qwen3ForCausalLM": "qwen_dense",
    "Qwen2MoeForCausalLM": "qwen_moe", "Qwen3MoeForCausalLM": "qwen_moe",
    "LlamaForCausalLM": "qwen_dense", "MixtralForCausalLM": "mixtral", "OlmoeForCausalLM": "olmoe",
}
_ARCH_TESTS = "`tests/test_sglang_archs.py` (against HF, fp32 and bf16 replayed)"
_ARCH_MG_TESTS = _ARCH_TESTS + ", `tests/test_sglang_megatron_archs.py` (against Megatron, fp32 and bf16 replayed)"
_TP2_TESTS = _ARCH_MG_TESTS + ", `tests/test_sglang_tp2_archs.py` (TP=2)"
_RUN = "prefill, chunked prefill, cached prefix and decode rows; TP=2 shards"
#: SGLang classes whose rows were verified by running SGLang's own model code against another framework.
SGLANG_ARCHITECTURES = (
    Architecture("Qwen3ForCausalLM", ("Qwen3",), f"dense, QK-norm (tapped `apply_qk_norm`); {_RUN}",
                 "every point the trace holds",
                 "`tests/test_sglang_adapter.py`, `test_replay_finder_mgsg.py`",
                 lacks=_MOE),
    Architecture("Qwen3MoeForCausalLM", ("Qwen3-MoE",), f"MoE: router, top-k, experts; {_RUN}",
                 "every point the trace holds", "`tests/test_sglang_adapter.py`, `test_replay_sglang.py`",
                 lacks=("moe.shared_out",)),
    Architecture("Qwen2ForCausalLM", ("Qwen2",), "dense, q/k/v bias; prefill and decode rows, TP=1 and 2",
                 "every point the trace holds", "`tests/test_supported_archs.py` (against HF), "
                 "`tests/test_sglang_megatron_archs.py` (against Megatron, fp32 and bf16 replayed), "
                 "`tests/test_sglang_tp2_archs.py` (TP=2)",
                 lacks=_QK + _MOE),
    Architecture("LlamaForCausalLM", ("Llama",), "dense, fused `qkv_proj` / `gate_up_proj`; prefill and decode "
                 "rows, TP=1 and 2", "every point the trace holds", _TP2_TESTS, lacks=_QK + _MOE),
    Architecture("Qwen2MoeForCausalLM", ("Qwen2-MoE",), "MoE with a sigmoid-gated shared expert "
                 "(`moe.shared_out` is `shared_expert`'s output, before the gate that the block's fused kernel "
                 "applies with the add), q/k/v bias; prefill and decode rows (TP=1)", "every point the trace holds",
                 "`tests/test_sglang_moe_families.py` (against HF and Megatron, fp32 and bf16 replayed); the fused "
                 "gate-and-add through a CPU stand-in of its Triton kernel", lacks=_QK),
    Architecture("OlmoeForCausalLM", ("OLMoE",), "MoE (softmax router, top-k never renormalised: olmoe.py fixes "
                 "`renormalize=False`), QK-norm modules over the whole q/k projection (olmoe.py fixes their eps at "
                 "1e-5 and their width at hidden_size: no GQA); prefill and decode rows (TP=1)",
                 "every point the trace holds", "`tests/test_sglang_moe_families.py` (against HF, fp32 and bf16 "
                 "replayed; megatron-core has no whole-projection QK-norm)", lacks=("moe.shared_out",),
                 defaults={"norm_topk_prob": False}),
    Architecture("MixtralForCausalLM", ("Mixtral",), "MoE block `block_sparse_moe` (router `gate`, `topk`, "
                 "`experts`: the MoE points read there); prefill and decode rows (TP=1)",
                 "every point the trace holds", "`tests/test_sglang_moe_families.py` (against HF and Megatron, "
                 "fp32 and bf16 replayed)", lacks=_QK + ("moe.shared_out",),
                 # TopK(renormalize=True) in mixtral.py: the top-k weights renormalised, whatever the config
                 defaults={"norm_topk_prob": True}),
)

#: Its classes whose rows ran at TP=1 only (refused at TP > 1).
SGLANG_ONE_RANK = frozenset({"MixtralForCausalLM", "Qwen2MoeForCausalLM", "OlmoeForCausalLM"})


# ---------------------------------------------------------------- Megatron (megatron-core's GPTModel)

# A record's name under (virtual-pipeline chunks and wrappers of) megatron-core's GPTModel: the module tree of
# its local and Transformer Engine specs.
MG_PREFIX = r"(?P<prefix>(?:chunk(?P<chunk>\d+)\.)?(?:module\.)*)"
_MG_L = MG_PREFIX + r"decoder\.layers\.(?P<layer>\d+)"
MG_ATTENTION = _MG_L + r"\.self_attention"
_MG_M = _MG_L + r"\.mlp"
# The base rows; a family's own attention rows (`attention_rows`, MLASelfAttention's) go between the two halves.
MEGATRON_ROWS_BEFORE_CORE = (
    PointMap("embed", MG_PREFIX + r"embedding:out", merge="seq"),
    PointMap("input", _MG_L + r":in(\[0\]|\.hidden_states)", merge="seq",
             note="decoder layer input (called with hidden_states=...) = residual stream"),
    PointMap("attn_norm", _MG_L + r"\.input_layernorm:out", merge="seq",
             note="TE spec: IdentityOp (norm fused into linear_qkv) -> not produced"),
    PointMap("attn.q", MG_ATTENTION + r"\.linear_qkv:out\[0\]", "megatron_qkv", "cat:-1", opts={"part": "q"},
             note="per-query-group interleaved [q_g | k_g | v_g] split; TP slices concatenated"),
    PointMap("attn.k", MG_ATTENTION + r"\.linear_qkv:out\[0\]", "megatron_qkv", "cat:-1", opts={"part": "k"}),
    PointMap("attn.v", MG_ATTENTION + r"\.linear_qkv:out\[0\]", "megatron_qkv", "cat:-1", opts={"part": "v"}),
    PointMap("attn.q_norm", MG_ATTENTION + r"\.q_layernorm:out", "heads", "heads", opts={"heads": "q"}),
    PointMap("attn.k_norm", MG_ATTENTION + r"\.k_layernorm:out", "heads", "kv_heads", opts={"heads": "kv"}),
    PointMap("attn.q_rope", MG_ATTENTION + r"\.core_attention:in\[0\]", "heads", "heads", opts={"heads": "q"},
             note="core_attention's query input: post-RoPE"),
    PointMap("attn.k_rope", MG_ATTENTION + r"\.core_attention:in\[1\]", "heads", "kv_heads", opts={"heads": "kv"},
             note="core_attention's key input: post-RoPE, before any GQA expansion"),
)
MEGATRON_ROWS_FROM_CORE = (
    PointMap("attn.core", MG_ATTENTION + r"\.core_attention:out", merge="cat:-1"),
    PointMap("attn.out", MG_ATTENTION + r"\.linear_proj:out\[0\]", merge="seq",
             note="row-parallel: already all-reduced (SP: reduce-scattered along s)"),
    PointMap("attn.out", MG_ATTENTION + r"\.linear_proj:out\[0\]", "megatron_biased", "seq", opts={"when": True},
             also={"bias": "{prefix}decoder.layers.{layer}.self_attention.linear_proj:out[1]"},
             note="add_bias_linear: linear_proj returns its bias apart (out[1]); bias-dropout-add adds it"),
    PointMap("mid", _MG_L + r"\.pre_mlp_layernorm:in\[0\]", merge="seq", note="pre-MLP norm input = residual"),
    PointMap("mlp_norm", _MG_L + r"\.pre_mlp_layernorm:out", merge="seq",
             note="TE spec dense layers: IdentityOp (norm fused into linear_fc1) -> not produced"),
    PointMap("moe.router_logits", _MG_M + r"\.router/fn:gating:out", merge="seq", note="tapped router.gating"),
    PointMap("moe.topk_ids", _MG_M + r"\.router:out\[1\]", "dense_topk_ids", "seq", note="routing_map [T, E]"),
    PointMap("moe.topk_weights", _MG_M + r"\.router:out\[0\]", "dense_topk_weights", "seq",
             also={"map": "{prefix}decoder.layers.{layer}.mlp.router:out[1]"}, note="probs [T, E] at the map"),
    PointMap("moe.experts_out", _MG_M + r"/fn:combine_postprocess:out", merge="seq",
             note="tapped token_dispatcher.combine_postprocess: routed experts combined, token order"),
    PointMap("moe.shared_out", _MG_M + r"\.shared_experts:out", merge="seq"),
    PointMap("moe.shared_out", _MG_M + r"\.shared_experts\.linear_fc2:out\[0\]", merge="seq", opts={"when": True},
             note="moe_shared_expert_gate: the shared expert's output before its sigmoid gate (the module's output is "
                  "after it; HF's shared_expert, the canonical point, before)"),
    PointMap("mlp.out", _MG_M + r":out\[0\]", merge="seq"),
    PointMap("output", _MG_L + r":out\[0\]", merge="seq"),
    PointMap("final_norm", MG_PREFIX + r"decoder\.final_(?:layernorm|norm):out", merge="seq"),
    PointMap("logits", MG_PREFIX + r"output_layer:out\[0\]", "vocab", "cat:-1", note="vocab shards; padding cut"),)

_MG_SPEC = ("local spec run on CPU (TP, SP, EP, pipeline chunks, packed THD); Transformer Engine spec by module "
         "names on a TE-shaped tree, its fused norms not produced")
# Structures, not families: the HF or SGLang side of a pair names the family. The families listed are those
# whose configs ran through each structure in the tests.
MEGATRON_ARCHITECTURES = (
    Architecture("GPTModel/TransformerLayer/SelfAttention/MLP", ("Qwen3", "Llama", "Qwen2", "Phi-3"),
                 f"dense (QK-norm or none, q/k/v bias or none); {_MG_SPEC}", "every point the trace holds",
                 "`tests/test_megatron_adapter.py`, `test_replay_finder_mgsg.py`, `tests/test_megatron_families.py`",
                 lacks=_MOE),
    Architecture("GPTModel/TransformerLayer/SelfAttention/MoELayer", ("Qwen3-MoE", "Mixtral", "Qwen2-MoE", "GPT-OSS"),
                 f"MoE: router, top-k, routed experts (the dispatcher's combine) and shared experts; {_MG_SPEC}; "
                 "GPT-OSS's switches on one rank: learnable sinks, sliding windows, the clamped GLU with its offset, "
                 "biases (`linear_proj`'s added as bias-dropout-add does), YaRN; Qwen2-MoE's sigmoid-gated shared "
                 "expert (`moe.shared_out` before the gate) on one rank; other switches the structure does not show "
                 "refused by name (`megatron_features.py`)",
                 "every point the trace holds (GPT-OSS: sinks, windows, YaRN, router bias, clamped experts)",
                 "`tests/test_megatron_adapter.py`, `test_replay_megatron.py`, `test_replay_finder_mgsg.py`, "
                 "`tests/test_megatron_families.py` (Mixtral, Qwen2-MoE), `tests/test_megatron_gptoss.py`, "
                 "`tests/test_megatron_features.py`"),
    Architecture("GPTModel/TransformerLayer/SelfAttention/MLP+MoELayer", ("Qwen3-MoE", "GLM-4.5 (MoE)"),
                 "MoE with dense layers (`moe_layer_freq`), the rows of the two above; GLM-4.5's sigmoid router with "
                 "an expert bias, group-limited top-k, routed scaling, ungated shared experts, q/k/v bias, partial "
                 "RoPE", "every point (GLM-4.5, one rank)",
                 "`tests/test_megatron_adapter.py`, `tests/test_megatron_mla.py`"),
)


def names() -> dict[str, FrameworkNames]:
    """The plain transformer's tables by framework. SGLang's named tables: `modules` (module lists by key),
    `arch_of_class` (class -> key), `one_rank` (classes verified at TP=1 only). Megatron's: `attention_prefix`
    (a self-attention module's record prefix, handed to a family's `attention_rows`), `family_rows_at` (where
    in the base rows a family's attention rows go: before `attn.core`, as the first matching row wins)."""
    return {"hf": FrameworkNames(points=HF_POINTS, architectures=HF_ARCHITECTURES),
            "sglang": FrameworkNames(points=SGLANG_POINTS + SGLANG_ARCH_POINTS, architectures=SGLANG_ARCHITECTURES,
                                     tables={"modules": SGLANG_MODULES, "arch_of_class": SGLANG_ARCH_OF_CLASS,
                                             "one_rank": SGLANG_ONE_RANK}),
            "megatron": FrameworkNames(points=MEGATRON_ROWS_BEFORE_CORE + MEGATRON_ROWS_FROM_CORE,
                                       architectures=MEGATRON_ARCHITECTURES,
                                       tables={"attention_prefix": MG_ATTENTION,
                                               "family_rows_at": len(MEGATRON_ROWS_BEFORE_CORE)})}
