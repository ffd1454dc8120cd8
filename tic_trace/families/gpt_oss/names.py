"""GPT-OSS's HF, SGLang and Megatron name tables (strings and `graph.adapter` rows only): its router is `mlp.router`
(HF: returning logits, top-k weights and top-k ids as the base's `mlp.gate` does; SGLang: `(logits, None)`), and
for its class the base rows of those points do not apply."""
from __future__ import annotations

from ...graph.adapter import Architecture, PointMap
from ..base import FrameworkNames

_L = r"model\.layers\.(?P<layer>\d+)"
_M = _L + r"\.mlp"
GPT_OSS = ("GptOssForCausalLM",)
_QK = ("attn.q_norm", "attn.k_norm")

HF_POINTS = (
    PointMap("moe.router_logits", _L + r"\.mlp\.router:out\[0\]", opts={"archs": GPT_OSS}),
    PointMap("moe.topk_ids", _L + r"\.mlp\.router:out\[2\]", "sorted_ids", opts={"archs": GPT_OSS}),
    PointMap("moe.topk_weights", _L + r"\.mlp\.router:out\[1\]", "weights_by_sorted_ids", opts={"archs": GPT_OSS},
             also={"ids": "model.layers.{layer}.mlp.router:out[2]"}),
)
HF_ARCHITECTURES = (
    Architecture("GptOssForCausalLM", ("GPT-OSS",), "router `mlp.router` (logits, top-k weights, ids), experts, "
                 "attention with sinks", "every point: router bias, clamped SwiGLU experts with biases, attention "
                 "sinks, sliding windows, YaRN RoPE", "`tests/test_supported_archs.py`, "
                 "`tests/test_archs_gemma_phi3_gptoss.py`", lacks=_QK + ("moe.shared_out",),
                 # the router's softmax over the top-k logits: the top-k weights renormalised, whatever the config
                 defaults={"norm_topk_prob": True}),
)

SGLANG_POINTS = (
    PointMap("moe.router_logits", _M + r"\.router:out(\[0\])?", opts={"archs": GPT_OSS},
             note="GPT-OSS: the router (with bias) is `mlp.router`, returning (logits, None)"),
)
_SGLANG_TESTS = ("`tests/test_sglang_archs.py` (against HF, fp32 and bf16 replayed), "
                 "`tests/test_sglang_megatron_archs.py` (against Megatron, fp32 and bf16 replayed)")
SGLANG_ARCHITECTURES = (
    Architecture("GptOssForCausalLM", ("GPT-OSS",), "router `mlp.router` (with bias), top-k, experts, attention "
                 "with sinks; prefill and decode rows (TP=1). SGLang keeps the sinks in bf16 (fp32 only with "
                 "`trtllm_mha`): an fp32 checkpoint's sinks are rounded", "every point the trace holds: router "
                 "bias, clamped SwiGLU experts with biases, sinks, sliding windows, YaRN RoPE",
                 _SGLANG_TESTS + "; attention sinks through a CPU backend shim", lacks=_QK + ("moe.shared_out",),
                 # TopK(renormalize=True) in gpt_oss.py: the top-k weights renormalised, whatever the config
                 defaults={"norm_topk_prob": True}),
)


# HF -> Megatron (adapters/megatron_weights.py): the router with its bias and the experts, fused and input-major
# with biases, gate and up in alternate columns of gate_up_proj (names under model.layers.N.mlp.)
MEGATRON_EXPERTS = {"router_weight": "router.weight", "router_bias": "router.bias",
                    "gate_up": "experts.gate_up_proj", "gate_up_bias": "experts.gate_up_proj_bias",
                    "down": "experts.down_proj", "down_bias": "experts.down_proj_bias"}


def names() -> dict[str, FrameworkNames]:
    return {
        # its structure is megatron.py's GPTModel MoE row (shared with other families); its weights' names here
        "megatron": FrameworkNames(tables={"interleaved_experts": MEGATRON_EXPERTS,
                                           # the sinks: DotProductAttention's softmax_offset (softmax_type learnable)
                                           "attention_sinks": ("sinks", "core_attention.softmax_offset")}),
        "hf": FrameworkNames(points=HF_POINTS, architectures=HF_ARCHITECTURES, tables={
            # (point, class) pairs whose base row these rows replace
            "overridden": frozenset((pm.point, a) for pm in HF_POINTS for a in pm.opts["archs"]),
            # the checkpoint holds the fused experts [E, H, 2F] as transformers does (not per expert)
            "checkpoint_fuses_experts": True,
            # its router's records: the token dim of the base's `mlp.gate` records (adapters/hf.py token_dims)
            "token_dims": {".mlp.router:": 1}}),
        "sglang": FrameworkNames(points=SGLANG_POINTS, architectures=SGLANG_ARCHITECTURES, tables={
            "modules": {"gpt_oss": ("model.embed_tokens", "model.layers.N.input_layernorm",
                                    "model.layers.N.self_attn.qkv_proj", "model.layers.N.self_attn.attn",
                                    "model.layers.N.self_attn.o_proj", "model.layers.N.post_attention_layernorm",
                                    "model.layers.N.mlp", "model.layers.N.mlp.router", "model.layers.N.mlp.topk",
                                    "model.layers.N.mlp.experts", "model.norm", "logits_processor")},
            "arch_of_class": {"GptOssForCausalLM": "gpt_oss"},
            "one_rank": GPT_OSS}),
    }
