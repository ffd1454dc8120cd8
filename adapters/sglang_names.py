"""SGLang's module names and layouts -> canonical points: the point table, per-architecture module lists, and the
merges and transforms that rebuild a TP=1 tensor from the ranks' shards. Read-time only: numpy, no SGLang.
The reasons behind each row are in the module docstring of :mod:`tic_trace.adapters.sglang`."""
from __future__ import annotations

import re

import numpy as np

from tic_trace.families import BASE, FAMILIES, framework_names
from tic_trace.graph.adapter import Architecture, PointMap, TransformContext, register_merge, register_transform

_L = r"model\.layers\.(?P<layer>\d+)"
_A = _L + r"\.self_attn"
_M = _L + r"\.mlp"

#: Points whose module outputs may be per-rank partial sums at TP > 1 (see ``describe()["tp_partial"]``).
PARTIAL_POINTS = ("attn.out", "moe.experts_out", "moe.shared_out", "mlp.out")
#: Points that exist only with the multi-head (Qwen/GLM-style) attention, not with DeepSeek's MLA.
MHA_POINTS = ("attn.q", "attn.k", "attn.v", "attn.q_norm", "attn.k_norm", "attn.q_rope", "attn.k_rope",
              "attn.core")


def _tp_reduced(point: str, record: str, note: str = "") -> PointMap:
    return PointMap(point, record, merge="sum", opts={"tp_reduce": True},
                    note=(note + " " if note else "") + "(TP ranks: bitwise-equal copies taken once, else partial sums added)")


POINTS = (
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

#: Rows that hold only for the classes in ``opts["archs"]``; for those the generic row of the same point does
#: not apply (``OVERRIDDEN``). The families' own rows are in their folders (tic_trace/families/<name>/names.py).
ARCH_POINTS: tuple = ()
OLMOE = ("OlmoeForCausalLM",)
#: OLMoE (olmoe.py): QK-norm modules over the whole q / k projection, ``[T, heads * d]``.
ARCH_POINTS += (
    PointMap("attn.q_norm", _A + r"\.q_norm:out", "heads", "sgl_heads_q", opts={"heads": "q", "archs": OLMOE}),
    PointMap("attn.k_norm", _A + r"\.k_norm:out", "heads", "sgl_heads_kv", opts={"heads": "kv", "archs": OLMOE}),
)
MIXTRAL = ("MixtralForCausalLM",)
_B = _L + r"\.block_sparse_moe"
#: Mixtral (mixtral.py): the MoE block is ``block_sparse_moe`` (gate, topk, experts as Qwen3-MoE's ``mlp``).
ARCH_POINTS += (
    PointMap("moe.router_logits", _B + r"\.gate:out(\[0\])?", opts={"archs": MIXTRAL}),
    PointMap("moe.topk_ids", _B + r"\.topk:out\.topk_ids", "sorted_ids", opts={"archs": MIXTRAL}),
    PointMap("moe.topk_weights", _B + r"\.topk:out\.topk_weights", "weights_by_sorted_ids", opts={"archs": MIXTRAL},
             also={"ids": "model.layers.{layer}.block_sparse_moe.topk:out.topk_ids"}),
    PointMap("moe.experts_out", _B + r"\.experts:out", opts={"archs": MIXTRAL}),
    PointMap("mlp.out", _B + r":out(\[0\])?", opts={"archs": MIXTRAL}),
)
# the families' rows, tables and verified classes (families.base.FrameworkNames; the base transformer's are still
# this module's own, above and below)
_FAM = tuple(n for fam in FAMILIES if fam is not BASE for n in (fam.names().get("sglang"),) if n is not None)
ARCH_POINTS += tuple(pm for n in _FAM for pm in n.points)
#: (point, class) pairs whose generic row is replaced by one of ARCH_POINTS.
OVERRIDDEN = frozenset((pm.point, a) for pm in ARCH_POINTS for a in pm.opts["archs"])
#: Module inputs an architecture's rows read (``tracer.record_inputs_of`` patterns).
ARCH_INPUTS = {**{k: v for n in _FAM for k, v in n.tables.get("inputs", {}).items()}}


def arch_row_applies(pm: PointMap, arch: str | None) -> bool:
    """Whether a row holds for the class `arch`: its own rows, and the generic ones it does not override."""
    only = pm.opts.get("archs")
    return arch in only if only is not None else (pm.point, arch) not in OVERRIDDEN

#: Module paths (regexes, layer index written N) each architecture must have for its table rows.
ARCH_MODULES: dict[str, tuple[str, ...]] = {
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
    **{k: v for n in _FAM for k, v in n.tables.get("modules", {}).items()},
}
#: SGLang class name -> entry of ARCH_MODULES.
ARCH_OF_CLASS = {
    "Qwen2ForCausalLM": "qwen_dense", "Qwen3ForCausalLM": "qwen_dense",
    "Qwen2MoeForCausalLM": "qwen_moe", "Qwen3MoeForCausalLM": "qwen_moe",
    "LlamaForCausalLM": "qwen_dense",
    "MixtralForCausalLM": "mixtral", "OlmoeForCausalLM": "olmoe",
    **{k: v for n in _FAM for k, v in n.tables.get("arch_of_class", {}).items()},
}


_QK = ("attn.q_norm", "attn.k_norm")
_MOE = ("moe.router_logits", "moe.topk_ids", "moe.topk_weights", "moe.experts_out", "moe.shared_out")
_ARCH_TESTS = "`tests/test_sglang_archs.py` (against HF, fp32 and bf16 replayed)"
_ARCH_MG_TESTS = _ARCH_TESTS + ", `tests/test_sglang_megatron_archs.py` (against Megatron, fp32 and bf16 replayed)"
_TP2_TESTS = _ARCH_MG_TESTS + ", `tests/test_sglang_tp2_archs.py` (TP=2)"
_RUN = "prefill, chunked prefill, cached prefix and decode rows; TP=2 shards"
#: SGLang classes whose table rows were verified by running SGLang's own model code against another framework
#: (a name table alone, checked on the meta device, is not a verification).
ARCHITECTURES = {a.name: a for a in (
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
    *(a for n in _FAM for a in n.architectures),
)}
#: Classes whose rows ran at TP=1 only (the table rows say "(TP=1)"): a trace at TP > 1 is refused by name. The
#: Qwen3 / Qwen3-MoE rows ran at TP=2 (tests/test_sglang_adapter.py), Llama / Qwen2 / Phi-3's too
#: (tests/test_sglang_tp2_archs.py), DeepSeek-V3's at TP 1 and 2 (the deepseek family's refusals.mla_refusal).
ONE_RANK = frozenset({"MixtralForCausalLM", "Qwen2MoeForCausalLM", "OlmoeForCausalLM"}
                     ).union(*(n.tables.get("one_rank", ()) for n in _FAM))


def tp_refusal(config: dict) -> str | None:
    """Why a trace of a class verified at TP=1 only, traced at TP > 1, is not the verified setup (None: it is)."""
    tp = int(config.get("tensor_model_parallel_size") or 1)
    if config.get("architecture") in ONE_RANK and tp > 1:
        return (f"tensor parallelism {tp}: `{config['architecture']}` ran at TP=1 only in the tests (its head "
                "shards, partial sums and MoE reduction at TP > 1 are not verified)")
    return None


REFUSED = {
    **{a: why for n in framework_names("sglang") for a, why in n.refused.items()},     # the families' refusals
}


def record_module(pm: PointMap) -> str:
    """The module-path part of a table row's record regex (before ``:`` or ``/fn:``)."""
    return re.split(r"/fn:|:", pm.record, maxsplit=1)[0]


# ---------------------------------------------------------------- merges and transforms of rank shards

def _nh(config: dict) -> tuple[int, int, int]:
    return int(config["num_attention_heads"]), int(config["num_key_value_heads"]), int(config["head_dim"])


def _kv_ranks(arrays: list[np.ndarray], nkv: int) -> list[np.ndarray]:
    """With fewer KV heads than TP ranks each KV head is replicated on tp/nkv consecutive ranks: keep one."""
    tp = len(arrays)
    if nkv and tp > nkv and tp % nkv == 0:
        return arrays[:: tp // nkv]
    return arrays


def tp_copies_equal(arrays: list) -> bool:
    """Whether every rank recorded bitwise the same tensor (a replicated output, not partial sums)."""
    first = np.ascontiguousarray(arrays[0])
    return all(a.shape == first.shape and a.dtype == first.dtype
               and np.ascontiguousarray(a).tobytes() == first.tobytes() for a in arrays[1:])


@register_merge("sgl_qkv")
def _merge_sgl_qkv(arrays: list[np.ndarray], config: dict) -> np.ndarray:
    """Per-rank fused QKV ``[T, (q_local + 2*kv_local) * hd]`` = ``[q_local | k_local | v_local]`` -> the
    global ``[T, (nq + 2*nkv) * hd]`` = ``[q | k | v]`` (what TP=1 computes)."""
    nq, nkv, hd = _nh(config)
    tp = len(arrays)
    ql, kvl = nq // tp * hd, max(1, nkv // tp) * hd
    flat = [a.reshape(-1, a.shape[-1]) for a in arrays]
    for a in flat:
        if a.shape[-1] != ql + 2 * kvl:
            raise ValueError(f"qkv_proj shard of width {a.shape[-1]}, expected {ql + 2 * kvl} at tp={tp}")
    q = np.concatenate([a[:, :ql] for a in flat], -1)
    kv_src = _kv_ranks(flat, nkv)
    k = np.concatenate([a[:, ql:ql + kvl] for a in kv_src], -1)
    v = np.concatenate([a[:, ql + kvl:] for a in kv_src], -1)
    return np.concatenate([q, k, v], -1)


@register_transform("sgl_qkv")
def _sgl_qkv(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """Global ``[rows, (nq + 2*nkv) * hd]`` -> q ``[rows, nq, hd]`` or k / v ``[rows, nkv, hd]`` (opts ``part``)."""
    nq, nkv, hd = _nh(ctx.config)
    x = a.reshape(ctx.n_rows, -1)
    part = ctx.opts.get("part", "q")
    if part == "q":
        return x[:, : nq * hd].reshape(ctx.n_rows, nq, hd)
    lo = nq * hd + (0 if part == "k" else nkv * hd)
    return x[:, lo: lo + nkv * hd].reshape(ctx.n_rows, nkv, hd)


def _merge_heads(arrays: list[np.ndarray], config: dict, which: str) -> np.ndarray:
    nq, nkv, hd = _nh(config)
    tp = len(arrays)
    if which == "kv":
        arrays = _kv_ranks(arrays, nkv)
        local = max(1, nkv // tp)
    else:
        local = nq // tp
    # [T, local*hd] or [T*local, hd] (the q_norm module's view): both are token-major -> [T, local, hd]
    return np.concatenate([a.reshape(-1, local, hd) for a in arrays], axis=1)


@register_merge("sgl_heads_q")
def _merge_sgl_heads_q(arrays: list[np.ndarray], config: dict) -> np.ndarray:
    """Per-rank query heads (``[T, heads_local*hd]``) concatenated per head -> ``[T, heads, hd]``."""
    return _merge_heads(arrays, config, "q")


@register_merge("sgl_heads_kv")
def _merge_sgl_heads_kv(arrays: list[np.ndarray], config: dict) -> np.ndarray:
    """Per-rank KV heads concatenated per head (replicated KV heads kept once) -> ``[T, kv_heads, hd]``."""
    return _merge_heads(arrays, config, "kv")
