"""The SGLang adapter's DeepSeek-V2/V3 (multi-latent attention) and GLM-4.5 (`Glm4Moe`) rows: MLA's latent
points, and the routed scaling factor's place in SGLang's MoE blocks. Read-time transforms need numpy only;
the trace-time facts read SGLang's modules (never imported here).

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
  (:func:`routed_scale_facts`); the rows multiply what lacks it. Where the trace cannot say (an AMD build with
  aiter, a module without those flags), ``moe.topk_weights`` / ``moe.experts_out`` are not mapped.
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np

from tic_trace.adapters import hf_deepseek  # noqa: F401 - registers the `latent_heads` transform the rows use
from tic_trace.graph.adapter import PointMap, TransformContext, register_transform, transform
from tic_trace.replay.grid import round_to

MLA = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
ROUTED_SCALED = MLA + ("Glm4MoeForCausalLM",)
_L = r"model\.layers\.(?P<layer>\d+)"
_A = _L + r"\.self_attn"
_M = _L + r"\.mlp"


@register_transform("sgl_qkv_a")
def _qkv_a(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """``[rows, q_lora + kv_lora + rope]`` -> the q latent (opts ``part`` "q") or ``[kv latent | k_pe]``."""
    x = a.reshape(ctx.n_rows, -1)
    q_lora = int(ctx.config["q_lora_rank"])
    return np.ascontiguousarray(x[:, :q_lora] if ctx.opts.get("part") == "q" else x[:, q_lora:])


@register_transform("sgl_mla_rope")
def _mla_rope(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """An MLA attention input ``[T, heads, d]`` (MHA: ``d = nope + rope``; absorbed: ``kv_lora + rope``) -> its
    RoPE dims, the last ``qk_rope_head_dim``: q ``[rows, heads, rope]``, k ``[rows, 1, rope]`` (head 0), in the
    de-interleaved layout the other adapters read when the pairs are interleaved (``rope_interleave``)."""
    rope = int(ctx.config["qk_rope_head_dim"])
    x = a.reshape(ctx.n_rows, a.shape[-2], a.shape[-1])[..., -rope:]
    x = x if ctx.opts.get("part") == "q" else x[:, :1]
    if ctx.config.get("rope_interleave", True):
        # SGLang rotates interleaved pairs in place (is_neox_style False); HF's
        # apply_rotary_pos_emb_interleave (and Megatron's MLA RoPE) write them de-interleaved: evens, then odds
        x = np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return np.ascontiguousarray(x)


def _times_missing_scale(a: np.ndarray, ctx: TransformContext, fact: str, onto: str | None) -> np.ndarray:
    """`a` times the routed scale unless the trace says it carries it; the product rounded onto the dtype
    `onto` where SGLang materialises it in that dtype (None: kept exact)."""
    if ctx.config.get(fact):
        return a
    scaled = a.astype(np.float64) * float(ctx.config["routed_scaling_factor"])
    return (round_to(scaled, onto) if onto else scaled).astype(a.dtype)


@register_transform("sgl_routed_weights")
def _routed_weights(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """The top-k weights by sorted id (as every router's), times the routed scale where SGLang's lack it (they
    then never meet the scale in SGLang: the exact product)."""
    return _times_missing_scale(transform("weights_by_sorted_ids")(a, ctx), ctx, "routed_scale_in_weights", None)


@register_transform("sgl_routed_experts")
def _routed_experts(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """The routed experts' combination, times the routed scale where SGLang's block applies it afterwards: as
    the block's in-place ``*=`` computes it, rounded onto the activations' dtype (a second rounding of the
    routed output that a scale inside the experts, HF's and Megatron's, does not have)."""
    return _times_missing_scale(transform("tokens")(a, ctx), ctx, "routed_scale_in_experts",
                                str(ctx.config.get("dtype") or "float32"))


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


def _routed_scale_in_experts(mlp: Any, in_weights: bool | None) -> bool | None:
    """Whether the experts' output already carries the routed scale, by the flags the block's forward reads
    (None where they do not settle it: aiter on AMD, or a module without them)."""
    ns = sys.modules.get(type(mlp).__module__)
    if in_weights is None or ns is None or not hasattr(ns, "_is_cuda") or getattr(ns, "_use_aiter", False):
        return None
    if in_weights:
        return True
    runner_scales = any(bool(getattr(ns, flag, False)) for flag in ("_is_cuda", "_is_musa", "_is_xpu"))
    kt_wrapper = type(getattr(getattr(mlp, "experts", None), "quant_method", None)).__name__ == "KTEPWrapperMethod"
    return runner_scales and not kt_wrapper


def _first_moe_block(model: Any) -> Any:
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    return next((lay.mlp for lay in layers if hasattr(getattr(lay, "mlp", None), "experts")), None)


def fused_shared_facts(model: Any) -> dict:
    """How many shared experts SGLang fused into the routed experts (``num_fused_shared_experts``, the default
    on GPU for DeepSeek-V3 / GLM-4.5 unless ``--disable-shared-experts-fusion``): the experts' output and the
    top-k then hold the shared expert too, and there is no ``shared_experts`` module."""
    mlp = _first_moe_block(model)
    n = getattr(mlp, "num_fused_shared_experts", None) if mlp is not None else None
    return {} if n is None else {"fused_shared_experts": int(n)}


def routed_scale_facts(model: Any, text: Any) -> dict:
    """The routed scale and where SGLang's first MoE block applies it (every block of a model is built alike)."""
    factor = getattr(text, "routed_scaling_factor", None)
    mlp = _first_moe_block(model)
    if factor is None or mlp is None:
        return {}
    cfg = getattr(getattr(mlp, "topk", None), "topk_config", None)
    in_weights = None if cfg is None else bool(getattr(cfg, "apply_routed_scaling_factor_on_output", False))
    return {"routed_scaling_factor": float(factor), "routed_scale_in_weights": in_weights,
            "routed_scale_in_experts": _routed_scale_in_experts(mlp, in_weights)}


def mla_path_facts() -> dict:
    """The attention backend MLA ran on and whether its absorbed path hands the RoPE dims to the kernel apart
    (``attn_mqa(q_nope_out, ..., q_rope=, k_rope=)``, the backends in ``deepseek_common/utils.py``'s
    ``FORWARD_ABSORB_CORE_ATTENTION_BACKENDS``) instead of inside the attention's q and k inputs, where the
    rows read them. None where the trace cannot tell (no server arguments, or a version without that list)."""
    try:
        from sglang.srt.runtime_context import get_server_args
        sa = get_server_args()
    except Exception:  # noqa: BLE001 - outside a server (a model built directly) there are none
        sa = None
    backend = getattr(sa, "decode_attention_backend", None) or getattr(sa, "attention_backend", None)
    try:
        from sglang.srt.models.deepseek_common.utils import FORWARD_ABSORB_CORE_ATTENTION_BACKENDS as apart
    except Exception:  # noqa: BLE001 - another SGLang layout: unknown
        apart = None
    return {"mla_decode_backend": backend,
            "mla_rope_apart": None if backend is None or apart is None else backend in apart}


def setup_refusal(config: dict) -> str | None:
    """Why a DeepSeek-V3 / GLM-4.5 trace's setup is not the one the tests verify (None: it is, or the model is
    neither): shared experts fused into the routed ones, and MLA's (mla_refusal)."""
    if config.get("architecture") not in ROUTED_SCALED:
        return None
    why = []
    if config.get("fused_shared_experts"):
        why.append(f"{config['fused_shared_experts']} shared expert(s) fused into the routed experts: "
                   "`moe.experts_out` and the top-k hold the shared expert too and `moe.shared_out` is not "
                   "produced; start the server with --disable-shared-experts-fusion")
    mla = mla_refusal(config)
    return "; ".join(why + ([mla] if mla else [])) or None


def mla_refusal(config: dict) -> str | None:
    """Why an MLA trace's setup is not the one the tests verify (None: it is, or the model is not MLA)."""
    if config.get("attention") != "mla" or config.get("architecture") not in MLA:
        return None
    why = []
    if int(config.get("tensor_model_parallel_size") or 1) > 2:
        why.append(f"tensor parallelism {config.get('tensor_model_parallel_size')}: MLA's sharded heads are run "
                   "at TP 1 and 2 only in the tests")
    apart = config.get("mla_rope_apart")
    if apart is None:
        why.append("the trace does not say which attention backend ran the absorbed path (where its RoPE dims are)")
    elif apart:
        why.append(f"decode attention backend `{config.get('mla_decode_backend')}` takes the RoPE dims apart "
                   "(`q_rope=` / `k_rope=`): the rows read them inside the attention's q and k inputs, as "
                   "torch_native, triton and flashmla pass them; not run in the tests")
    return "MLA: " + "; ".join(why) if why else None
