"""SGLang's DeepSeek-V2/V3 (multi-latent attention) and GLM-4.5 (`Glm4Moe`) rows, strings only: MLA's latent
points, the routed scaling factor's place in SGLang's MoE blocks, the module lists, the classes verified and
refused. adapters/sglang*.py read them through ``families.framework_names("sglang")``; the trace-time facts
(where the routed scale is, the fused shared experts, MLA's decode backend) are read off SGLang's modules by
adapters/sglang_facts.py.

What SGLang's model code computes (0.5.23 and slime's 0.5.15.post1, `srt/models/deepseek_v2.py`,
`deepseek_common/attention_forward_methods/`, `glm4_moe.py`), and where the rows read it
(``{A}`` = ``model.layers.N.self_attn``):

* **MLA's latents.** With a q latent (``q_lora_rank``) the q and kv down-projections are one GEMM,
  ``{A}.fused_qkv_a_proj_with_mqa`` -> ``[q latent | kv latent | k_pe]``: ``attn.q_a`` is its first
  ``q_lora_rank`` columns, ``attn.kv_a`` the rest (HF's ``kv_a_proj_with_mqa`` output). ``q_a_layernorm``,
  ``q_b_proj`` (every head's ``[nope | rope]``), ``kv_a_layernorm`` (the latent only) are modules of their own.
* **Two attention paths.** A prefill with no cached prefix runs MHA (``forward_normal``): ``kv_b_proj``
  decompresses every head's ``[k_nope | v]`` (``attn.kv_b``) and ``attn_mha`` attends over
  ``q = [q_nope | RoPE(q_pe)]``, ``k = [k_nope | RoPE(k_pe)]``. Decode and extends over a cached prefix run
  the absorbed path (``forward_absorb``): ``kv_b_proj`` is never called (its weights are folded into
  ``w_kc`` / ``w_vc``), and ``attn_mqa`` attends over ``q = [q_nope . w_kc | RoPE(q_pe)]``, ``k = [normed
  latent | RoPE(k_pe)]``. So ``attn.kv_b`` exists only in MHA passes; on both paths RoPE's output is the last
  ``qk_rope_head_dim`` dims of the attention's q and k inputs (``attn.q_rope``, ``attn.k_rope``: head 0 of k,
  k_pe being one tensor for every head), and ``o_proj``'s input is every head's attention output after
  ``w_vc`` (``attn.core``, ``[T, heads * v_head_dim]``).
* **Routed scaling.** HF and Megatron fold ``routed_scaling_factor`` into the top-k weights, so their
  ``moe.topk_weights`` and ``moe.experts_out`` carry it. SGLang's top-k carries it only when
  ``TopKConfig.apply_routed_scaling_factor_on_output`` is set; its experts' output carries it when the MoE
  runner applies it (CUDA, MUSA, XPU), while on other platforms the MoE block multiplies afterwards
  (``if not _is_cuda and ...: final_hidden_states *= self.routed_scaling_factor``). The trace records which
  (adapters/sglang_facts.py); the rows multiply what lacks it. Where the trace cannot say (an AMD build with
  aiter, a module without those flags), ``moe.topk_weights`` / ``moe.experts_out`` are not mapped.
"""
from __future__ import annotations

from typing import Any, Callable

from ...graph.adapter import Architecture, PointMap
from . import transforms  # noqa: F401 - registers the transforms the rows name
from .names_hf import STANDARD_ATTN

MLA = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
ROUTED_SCALED = MLA + ("Glm4MoeForCausalLM",)
_L = r"model\.layers\.(?P<layer>\d+)"
_A = _L + r"\.self_attn"
_M = _L + r"\.mlp"


def _only(archs: tuple[str, ...], **opts: Any) -> dict:
    return {"archs": archs, **opts}


ROWS = (
    PointMap("attn.q_a", _A + r"\.fused_qkv_a_proj_with_mqa:out\[0\]", "sgl_qkv_a", opts=_only(MLA, part="q"),
             note="MLA: the fused down-projection's first q_lora_rank columns"),
    PointMap("attn.kv_a", _A + r"\.fused_qkv_a_proj_with_mqa:out\[0\]", "sgl_qkv_a", opts=_only(MLA, part="kv"),
             note="MLA: the fused down-projection's kv latent and k_pe"),
    PointMap("attn.kv_a", _A + r"\.kv_a_proj_with_mqa:out\[0\]", opts=_only(MLA),
             note="MLA without a q latent: its own kv down-projection"),
    PointMap("attn.q_a_norm", _A + r"\.q_a_layernorm:out", opts=_only(MLA)),
    PointMap("attn.q", _A + r"\.q_(b_)?proj:out\[0\]", "latent_heads", "cat:-1", opts=_only(MLA),
             note="MLA: q_b_proj (q_proj without a q latent), every head's [nope | rope]"),
    PointMap("attn.kv_a_norm", _A + r"\.kv_a_layernorm:out", opts=_only(MLA)),
    PointMap("attn.kv_b", _A + r"\.kv_b_proj:out\[0\]", "latent_heads", "cat:-1", opts=_only(MLA),
             note="every head's [k_nope | v]: MHA passes only (the absorbed path folds kv_b_proj into w_kc/w_vc)"),
    PointMap("attn.q_rope", _A + r"\.attn_m[hq]a:in\[0\]", "sgl_mla_rope", "cat:-2", opts=_only(MLA, part="q"),
             note="the attention's q input (attn_mha or attn_mqa): its last qk_rope_head_dim dims"),
    PointMap("attn.k_rope", _A + r"\.attn_m[hq]a:in\[1\]", "sgl_mla_rope", opts=_only(MLA, part="k"),
             note="the attention's k input: the RoPE dims of head 0 (k_pe is one tensor for every head)"),
    PointMap("attn.core", _A + r"\.o_proj:in\[0\]", merge="cat:-1", opts=_only(MLA),
             note="MLA: o_proj's input, every head's attention output (after w_vc on the absorbed path)"),
    PointMap("moe.topk_weights", _M + r"\.topk:out\.topk_weights", "sgl_routed_weights",
             opts=_only(ROUTED_SCALED, routed_scale="routed_scale_in_weights"),
             also={"ids": "model.layers.{layer}.mlp.topk:out.topk_ids"},
             note="times routed_scaling_factor unless SGLang's top-k applied it (HF's and Megatron's weights carry it)"),
    PointMap("moe.experts_out", _M + r"\.experts:out", "sgl_routed_experts", "sum",
             opts=_only(ROUTED_SCALED, routed_scale="routed_scale_in_experts", tp_reduce=True),
             note="times routed_scaling_factor where SGLang's MoE block applies it after the experts "
                  "(TP ranks: bitwise-equal copies taken once, else partial sums added)"),
)
#: Module inputs MLA's rows read (``tracer.record_inputs_of`` patterns).
INPUTS = {name: (r"re:\.self_attn\.(attn_mha|attn_mqa|o_proj)$",) for name in MLA}


def row_applies(pm: PointMap, config: dict) -> bool | None:
    """Where these rows decide (None: they do not): the q latent's rows only with ``q_lora_rank``, the kv
    down-projection's own row only without it; a routed-scale row only where the trace says where the scale is."""
    if pm not in ROWS:
        return None
    fact = pm.opts.get("routed_scale")
    if fact is not None:
        return config.get(fact) is not None
    fused = bool(config.get("q_lora_rank"))
    if pm.point == "attn.kv_a":
        return fused == ("fused_qkv_a" in pm.record)
    if pm.point in ("attn.q_a", "attn.q_a_norm"):
        return fused
    return True


#: SGLang's constants the attention facts read, by key: (module, name). `rope_apart`: the attention backends whose
#: absorbed path hands MLA's RoPE dims to the kernel apart (``attn_mqa(q_nope_out, ..., q_rope=, k_rope=)``)
#: instead of inside the attention's q and k inputs, where the rows read them.
CONSTANTS = {"rope_apart": ("sglang.srt.models.deepseek_common.utils", "FORWARD_ABSORB_CORE_ATTENTION_BACKENDS")}


def attention_facts(attn: Any, server_args: Callable[[], Any], constant: Callable[[str], Any]) -> dict:
    """The manifest's attention facts where a layer's live ``self_attn`` module is MLA's (it has no fused
    ``qkv_proj``; {} otherwise): the attention backend MLA's decode ran on and whether that backend takes the RoPE
    dims apart (``refusals.setup_refusal`` reads both). None where the trace cannot tell (no server arguments, or a
    version without that list). ``server_args()`` and ``constant(key)`` (a `CONSTANTS` entry, None where SGLang
    lacks it) are the adapter's readers of the running SGLang (adapters/sglang_facts.py): this table imports no
    framework."""
    if attn is None or hasattr(attn, "qkv_proj"):
        return {}
    sa = server_args()
    backend = getattr(sa, "decode_attention_backend", None) or getattr(sa, "attention_backend", None)
    apart = constant("rope_apart")
    return {"attention": "mla", "mla_decode_backend": backend,
            "mla_rope_apart": None if backend is None or apart is None else backend in apart}


#: Module paths (regexes, layer index written N) each of its architectures' tables relies on.
SGLANG_MODULES: dict[str, tuple[str, ...]] = {
    "glm4_moe": ("model.embed_tokens", "model.layers.N.input_layernorm", "model.layers.N.self_attn.qkv_proj",
                 "model.layers.N.self_attn.attn", "model.layers.N.self_attn.o_proj",
                 "model.layers.N.post_attention_layernorm", "model.layers.N.mlp", "model.layers.N.mlp.gate",
                 "model.layers.N.mlp.topk", "model.layers.N.mlp.experts", "model.layers.N.mlp.shared_experts",
                 "model.norm", "logits_processor"),
    "deepseek_mla": ("model.embed_tokens", "model.layers.N.input_layernorm", "model.layers.N.self_attn.o_proj",
                     "model.layers.N.post_attention_layernorm", "model.layers.N.mlp", "model.layers.N.mlp.gate",
                     "model.layers.N.mlp.topk", "model.layers.N.mlp.experts", "model.layers.N.mlp.shared_experts",
                     "model.norm", "logits_processor"),
}
#: SGLang class name -> entry of the module lists.
SGLANG_ARCH_OF_CLASS = {"Glm4MoeForCausalLM": "glm4_moe", "DeepseekV2ForCausalLM": "deepseek_mla",
                        "DeepseekV3ForCausalLM": "deepseek_mla"}
_SIGMOID_TESTS = "`tests/test_sglang_mla.py` (against HF and Megatron, fp32 and bf16 replayed)"
_SIGMOID = {"router_scoring": "sigmoid"}       # in the router's code, not in the config
#: SGLang classes whose rows were verified by running SGLang's own model code against another framework.
SGLANG_ARCHITECTURES = (
    Architecture("Glm4MoeForCausalLM", ("GLM-4.5 (MoE)",), "MoE: sigmoid router (`mlp.gate`) with a "
                 "score-correction bias, group-limited top-k, routed scaling (multiplied into `moe.topk_weights` "
                 "and `moe.experts_out` where SGLang applies it later), `shared_experts`, dense first layers; "
                 "partial RoPE, q/k/v bias, QK-norm (tapped `apply_qk_norm`); prefill and decode rows (TP=1); the "
                 "shared expert fused into the routed ones refused (`--disable-shared-experts-fusion`)",
                 "every point the trace holds", _SIGMOID_TESTS, defaults=_SIGMOID),
    Architecture("DeepseekV3ForCausalLM", ("DeepSeek-V3 (MLA, MoE)",), "multi-latent attention: q and kv latents "
                 "split from `fused_qkv_a_proj_with_mqa`, their norms, `kv_b_proj` (MHA passes only: the absorbed "
                 "decode path folds it into `w_kc`/`w_vc`), RoPE dims of `attn_mha` / `attn_mqa` inputs, `o_proj`'s "
                 "input as `attn.core`; MoE as GLM-4.5's; prefill and decode rows, TP=1 and 2 (TP > 2 and decode "
                 "backends that take the RoPE dims apart, such as fa3 and flashinfer, refused)",
                 "every point the trace holds: the absorbed decode path's `attn.core` over the exact up-projection "
                 "of its recorded latent; at TP 2 the MoE block's output (a sum of per-rank partials) is said as "
                 "not replayed", _SIGMOID_TESTS + "; MLA prefill through a CPU backend shim",
                 lacks=STANDARD_ATTN, defaults=_SIGMOID),
)
#: Its classes whose rows ran at TP=1 only (refused at TP > 1); DeepSeek-V3's ran at TP 1 and 2
#: (refusals.mla_refusal says above).
SGLANG_ONE_RANK = frozenset({"Glm4MoeForCausalLM"})
#: Classes refused by name, and why.
SGLANG_REFUSED = {
    "DeepseekV2ForCausalLM": "DeepSeek-V2's class (`deepseek_v2.py`, DeepSeek-V3's code) with V2's routing "
                             "(softmax scores, `topk_method` greedy / group_limited_greedy, no correction bias): "
                             "never run against another framework (the DeepSeek-V3 class is)",
}
