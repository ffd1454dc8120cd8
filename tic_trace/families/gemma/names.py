"""Gemma's HF and SGLang name tables (strings and `graph.adapter` rows only): where its module names mean other
points than in the base transformer's tables, a row names the classes it holds for (`opts["archs"]`), and for
those the base row of the same point does not apply.

- HF (modeling_gemma2.py, modeling_gemma3.py): `post_attention_layernorm` normalises the attention branch before
  the residual add (`attn.post_norm`); the pre-MLP norm is `pre_feedforward_layernorm` (`mlp_norm`, its input
  `mid`); `post_feedforward_layernorm` normalises the MLP branch (`mlp.post_norm`). `logits` is what the model
  emits (`<root>:out['logits']`: after Gemma 2's final soft-capping; lm_head's output is not). Gemma 3's
  q_norm/k_norm act on [B, heads, S, d] (after the transpose), unlike Qwen3's.
- SGLang (gemma2.py, gemma3_causal.py): the embedding is scaled by sqrt(hidden) after `embed_tokens` (Gemma 2: in
  place on its output), so the scaled stream is layer 0's `input_layernorm` input;
  `post_attention_layernorm(attn_out)` is the attention branch's sandwich norm (one output);
  `pre_feedforward_layernorm(branch, residual)` returns `(mlp_norm, mid)`; `post_feedforward_layernorm`
  normalises the MLP branch. Gemma 3's QK-norm is the `q_norm` / `k_norm` modules on `[T, heads, d]` (no
  `apply_qk_norm`).
"""
from __future__ import annotations

from ...graph.adapter import Architecture, PointMap
from ..base import FrameworkNames

_L = r"model\.layers\.(?P<layer>\d+)"
_A = _L + r"\.self_attn"
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_GEMMA3 = ("Gemma3ForCausalLM",)
_QK = ("attn.q_norm", "attn.k_norm")
_MOE = ("moe.router_logits", "moe.topk_ids", "moe.topk_weights", "moe.experts_out", "moe.shared_out")

# The sandwich norms and the pre-MLP norm, both frameworks: (point, module under model.layers.N, the record HF's
# rows read, SGLang's, note). SGLang's norms called with a residual return (normed, residual): `mid` is the 2nd.
_NORMS = (
    ("attn.post_norm", "post_attention_layernorm", ":out", r":out(\[0\])?",
     "Gemma: the attention branch's norm, before the residual add"),
    ("mid", "pre_feedforward_layernorm", r":in\[0\]", r":out\[1\]",
     "pre-MLP norm input = residual stream (SGLang: pre_feedforward_layernorm(attn branch, residual) returns "
     "(normed, residual after attention))"),
    ("mlp_norm", "pre_feedforward_layernorm", ":out", r":out\[0\]", ""),
    ("mlp.post_norm", "post_feedforward_layernorm", ":out", r":out(\[0\])?",
     "Gemma: the MLP branch's norm, before the residual add"),
)


def _norm_rows(framework: str) -> tuple[PointMap, ...]:
    col = {"hf": 2, "sglang": 3}[framework]
    return tuple(PointMap(row[0], _L + r"\." + row[1] + row[col], opts={"archs": GEMMA}, note=row[4])
                 for row in _NORMS)


HF_POINTS = (
    *_norm_rows("hf"),
    PointMap("attn.q_norm", _A + r"\.q_norm:out", "bhsd", opts={"archs": _GEMMA3}),
    PointMap("attn.k_norm", _A + r"\.k_norm:out", "bhsd", opts={"archs": _GEMMA3}),
    PointMap("logits", r"<root>:out\['logits'\]", "vocab", opts={"archs": GEMMA},
             note="the model's logits, after Gemma2's final soft-capping"),
)
_HF_TESTS = "`tests/test_supported_archs.py`, `tests/test_archs_gemma_phi3_gptoss.py`"
HF_ARCHITECTURES = (
    Architecture("Gemma2ForCausalLM", ("Gemma 2",),
                 "sandwich norms (`attn.post_norm`, `mlp.post_norm`), pre-MLP norm `pre_feedforward_layernorm`, "
                 "`logits` after the final soft-cap", "every point: (1 + w) RMSNorms, the √hidden embedding scale, "
                 "soft-capped scores and logits, sliding windows, GELU-tanh MLP", _HF_TESTS, lacks=_QK + _MOE),
    Architecture("Gemma3ForCausalLM", ("Gemma 3 (text)",),
                 "sandwich norms as Gemma 2, per-head QK-norm on [B, heads, S, d]",
                 "every point: as Gemma 2, (1 + w) QK-norms, one RoPE per layer type (local / global base)",
                 _HF_TESTS, lacks=_MOE),
)

_L0_IN = r"model\.layers\.0\.input_layernorm:in\[0\]"
SGLANG_POINTS = (
    PointMap("embed", _L0_IN, opts={"archs": GEMMA}, note="Gemma: the embedding after its sqrt(hidden) scale"),
    PointMap("input", _L0_IN, opts={"layer": 0, "archs": GEMMA}),
    PointMap("input", _L + r"\.input_layernorm:out\[1\]", opts={"archs": GEMMA}),
    *_norm_rows("sglang"),
    PointMap("attn.q_norm", _A + r"\.q_norm:out", "heads", "sgl_heads_q", opts={"heads": "q", "archs": _GEMMA3}),
    PointMap("attn.k_norm", _A + r"\.k_norm:out", "heads", "sgl_heads_kv", opts={"heads": "kv", "archs": _GEMMA3}),
)
_SGLANG_MODULES = ("model.embed_tokens", "model.layers.N.input_layernorm", "model.layers.N.self_attn.qkv_proj",
                   "model.layers.N.self_attn.attn", "model.layers.N.self_attn.o_proj",
                   "model.layers.N.post_attention_layernorm", "model.layers.N.pre_feedforward_layernorm",
                   "model.layers.N.mlp", "model.layers.N.post_feedforward_layernorm", "model.norm",
                   "logits_processor")
_SGLANG_TESTS = "`tests/test_sglang_archs.py` (against HF, fp32 and bf16 replayed)"
SGLANG_ARCHITECTURES = (
    Architecture("Gemma2ForCausalLM", ("Gemma 2",), "sandwich norms (`attn.post_norm`, `mlp.post_norm`), pre-MLP "
                 "norm `pre_feedforward_layernorm`, the scaled embedding as layer 0's norm input; prefill and decode "
                 "rows (TP=1)", "every point the trace holds: (1 + w) norms, soft-capped scores and logits, "
                 "sliding windows", _SGLANG_TESTS + "; attention soft-cap through a CPU backend shim",
                 lacks=_QK + _MOE),
    Architecture("Gemma3ForCausalLM", ("Gemma 3 (text)",), "as Gemma 2, QK-norm modules `q_norm` / `k_norm` on "
                 "[T, heads, d]; prefill and decode rows (TP=1)", "every point the trace holds: as Gemma 2, "
                 "one RoPE per layer type", _SGLANG_TESTS, lacks=_MOE),
)


def _overridden(points: tuple) -> frozenset:
    return frozenset((pm.point, a) for pm in points for a in pm.opts["archs"])


def names() -> dict[str, FrameworkNames]:
    return {
        "hf": FrameworkNames(points=HF_POINTS, architectures=HF_ARCHITECTURES, tables={
            # (point, class) pairs whose base row these rows replace; modules whose inputs are recorded (`mid`)
            "overridden": _overridden(HF_POINTS), "record_inputs": ("re:\\.pre_feedforward_layernorm$",),
            # the record holding the logits (the model's output, after Gemma 2's final soft-cap): logits_to_keep's
            "logits_records": ("<root>:out['logits']",),
            # config attributes recorded as numerics settings: its activation, which its configs name so
            "numerics": ("hidden_activation",)}),
        "sglang": FrameworkNames(points=SGLANG_POINTS, architectures=SGLANG_ARCHITECTURES, tables={
            # module paths (layer index written N) each class's rows rely on, by table name
            "modules": {"gemma2": _SGLANG_MODULES,
                        "gemma3": _SGLANG_MODULES + ("model.layers.N.self_attn.q_norm",
                                                     "model.layers.N.self_attn.k_norm")},
            "arch_of_class": {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"},
            # module inputs the rows read (tracer.record_inputs_of patterns): the scaled embedding
            "inputs": {name: (r"re:^model\.layers\.0\.input_layernorm$",) for name in GEMMA},
            "one_rank": GEMMA,
            # its norm classes hold replicated (1 + w) gains (sglang_weight_map)
            "replicated": ("GemmaRMSNorm", "Gemma3RMSNorm")}),
    }
