"""SGLang adapter: records of SGLang's model code (``python/sglang/srt/models/*``) -> canonical points, TP
shards -> one tensor, ``ForwardBatch`` rows -> (request id, absolute position); plus the hook factory that
traces an unmodified server through ``--forward-hooks``.

Record names are module paths of the SGLang ``*ForCausalLM`` object (the root; SGLang's ModelRunner calls
``model.forward(input_ids, positions, forward_batch)`` directly, the tracer wraps that method). Facts this
mapping rests on (SGLang 0.5.23, checked on real model code in ``tests/test_sglang_adapter.py``):

* **Residual stream.** A decoder layer's output is its MLP/MoE output only. The residual travels in the
  layer boundaries and comes out of the norms: layer 0's ``input_layernorm(embed)`` returns the normed
  tensor; for N >= 1 ``input_layernorm(mlp_out_{N-1}, residual)`` returns ``(normed, residual)`` where the
  residual is the stream *leaving layer N-1* (= entering layer N); ``post_attention_layernorm(attn_out,
  residual)`` returns ``(normed, mid)``; ``model.norm(mlp_out_last, residual)`` returns ``(final_normed,
  stream leaving the last layer)``. So ``L{N}.input`` and ``L{N-1}.output`` are the same record
  (``opts={"layer_offset": -1}``), ``L0.input`` is the embedding and the last layer's ``output`` is
  ``model.norm:out[1]`` (``opts={"layer": -1}``; both opts are read by ``tic_trace.align``).
* **Attention.** ``qkv_proj`` returns ``(qkv, None)``; per TP rank ``qkv`` is ``[q_local | k_local |
  v_local]`` (``sgl_qkv`` merge rebuilds the global ``[q | k | v]``, de-duplicating KV heads replicated when
  ``num_kv_heads < tp``; the ``sgl_qkv`` transform splits it). QK-norm is the function ``apply_qk_norm``
  (tapped in each model module: ``.../self_attn/fn:apply_qk_norm:out[0|1]``, ``[T, heads*hd]``; on GPU it
  may run a fused in-place kernel and skip the ``q_norm``/``k_norm`` modules, whose own outputs are
  ``[T*heads, hd]``). RoPE is ONE shared ``rotary_emb`` module (listed under layer 0, called once per layer:
  ``rotary_emb#k``): q/k after RoPE are taken as the positional inputs 0 and 1 of each layer's
  ``RadixAttention`` (``self_attn.attn:in[0|1]``), which exist on every path (also with fused
  qk-norm-rope). ``attn`` returns ``[T, heads_local*hd]`` (core output before ``o_proj``).
* **TP partial sums.** ``o_proj`` (``reduce_results=False`` in Qwen2/Qwen3/Qwen3-MoE), the dense ``mlp``,
  ``mlp.experts`` and the MoE block outputs are per-rank partial sums at TP > 1 (the all-reduce is deferred
  into the next norm). Which ones are partial is read off the modules (``reduce_results``) by
  :meth:`SGLangAdapter.describe` into ``config["tp_partial"]`` (point -> layers), and ``keeps`` picks the
  ``sum`` or the ``same`` row of the table accordingly. Norm outputs, router, top-k and the embedding are
  replicated (rank 0 is taken).
* **MoE.** ``mlp.gate`` returns ``(router_logits, None)`` (Qwen3-MoE ``ReplicatedLinear``) or the logits
  (DeepSeek ``MoEGate``, GLM ``Glm4MoeGate``); ``mlp.topk`` returns ``StandardTopKOutput(topk_weights,
  topk_ids, router_logits)`` (ids in descending-weight order: compared sorted, weights reordered by id);
  ``mlp.experts`` returns the weighted combination ``[T, H]``.
* **Logits.** ``lm_head`` is never called as a module; ``logits_processor`` returns a
  ``LogitsProcessorOutput`` whose ``next_token_logits`` has ONE row per request: the last row of each
  request in EXTEND, every row in DECODE. :meth:`SGLangAdapter.rows_from_forward` names those rows with
  ``tracer.set_record_rows`` (a per-record subset of the pass's row table; stored with ``row_index``), so the
  logits meet the other side's row for the same (request, position). ``logprobs`` are derived by the core
  from logits and the next row's token; ``SGLangAdapter(input_logprobs=True)`` reads them from
  ``input_token_logprobs`` instead (prompt rows of passes run with ``return_logprob``; the last entry of
  each request in each pass is dropped: its target token is the scheduler's padding when the prompt ends
  there).
* **Rows.** EXTEND (prefill, chunked prefill, cached prefix, MIXED): request ``i`` owns rows
  ``[extend_start_loc[i], +extend_seq_lens_cpu[i])`` at absolute positions ``extend_prefix_lens_cpu[i] + j``;
  DECODE: row ``i`` is ``rids[i]`` at ``positions[i]``; rows past ``batch_size`` (graph padding) and IDLE
  passes have no key. Request ids are ``forward_batch.rids`` (SGLang >= 0.5.x; absent in 0.5.6: then
  ``slot{req_pool_index}``, stable only within a request's lifetime).

Name tables: Qwen2 / Qwen3 (dense), Qwen2-MoE / Qwen3-MoE, GLM-4-MoE (same attention names as Qwen; partial
RoPE, optional QK-norm, shared experts) and DeepSeek-V2/V3 (MLA: ``self_attn`` has no fused ``qkv_proj``;
in absorbed-MLA decode the q/k/v live in the latent space and do not correspond to any other framework's,
so only the block points are promised for MLA: norms, ``attn.out``, residuals, router, top-k, experts,
shared experts, MLP, head). ``ARCH_MODULES`` lists, per architecture, the module paths every table row
relies on; the tests check them on module trees built on the ``meta`` device.

Everything here imports SGLang lazily; reading traces needs numpy only.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import re
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tic_trace.adapter import (Adapter, PointMap, TransformContext, register_merge, register_transform)
from tic_trace.adapter import as_ints as _ints
from tic_trace.adapter import plain_settings

# Server arguments that change how the engine computes (kernels, backends, precisions, fusions).
NUMERICS_SERVER_ARGS = (
    "dtype", "kv_cache_dtype", "quantization", "attention_backend", "prefill_attention_backend",
    "decode_attention_backend", "sampling_backend", "moe_runner_backend", "moe_a2a_backend",
    "enable_fp32_lm_head", "enable_deterministic_inference", "rl_on_policy_target", "enable_torch_compile",
    "disable_cuda_graph", "enable_fused_qk_norm_rope", "triton_attention_reduce_in_fp32",
    "enable_dp_attention", "disable_radix_cache", "chunked_prefill_size", "tp_size", "ep_size")

log = logging.getLogger("tic_trace.sglang")

_L = r"model\.layers\.(?P<layer>\d+)"
_A = _L + r"\.self_attn"
_M = _L + r"\.mlp"

#: Points whose module outputs may be per-rank partial sums at TP > 1 (see ``describe()["tp_partial"]``).
PARTIAL_POINTS = ("attn.out", "moe.experts_out", "moe.shared_out", "mlp.out")
#: Points that exist only with the multi-head (Qwen/GLM-style) attention, not with DeepSeek's MLA.
MHA_POINTS = ("attn.q", "attn.k", "attn.v", "attn.q_norm", "attn.k_norm", "attn.q_rope", "attn.k_rope",
              "attn.core")


def _partial_pair(point: str, record: str, note: str = "") -> tuple[PointMap, PointMap]:
    return (PointMap(point, record, merge="sum", opts={"partial": True}, note=note + " (TP partial sums: added)"),
            PointMap(point, record, merge="same", opts={"partial": False}, note=note))


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
    *_partial_pair("attn.out", _A + r"\.o_proj:out\[0\]"),
    PointMap("mid", _L + r"\.post_attention_layernorm:out\[1\]",
             note="post_attention_layernorm(attn_out, residual) returns (normed, residual after attention)"),
    PointMap("mlp_norm", _L + r"\.post_attention_layernorm:out\[0\]"),
    PointMap("moe.router_logits", _M + r"\.gate:out(\[0\])?"),
    PointMap("moe.topk_ids", _M + r"\.topk:out\.topk_ids", "sorted_ids", note="descending-weight order: sorted"),
    PointMap("moe.topk_weights", _M + r"\.topk:out\.topk_weights", "weights_by_sorted_ids",
             also={"ids": "model.layers.{layer}.mlp.topk:out.topk_ids"}),
    *_partial_pair("moe.experts_out", _M + r"\.experts:out"),
    *_partial_pair("moe.shared_out", _M + r"\.shared_experts?:out(\[0\])?"),
    *_partial_pair("mlp.out", _M + r":out(\[0\])?"),
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
#: SGLang class name -> entry of ARCH_MODULES.
ARCH_OF_CLASS = {
    "Qwen2ForCausalLM": "qwen_dense", "Qwen3ForCausalLM": "qwen_dense",
    "Qwen2MoeForCausalLM": "qwen_moe", "Qwen3MoeForCausalLM": "qwen_moe",
    "Glm4MoeForCausalLM": "glm4_moe",
    "DeepseekV2ForCausalLM": "deepseek_mla", "DeepseekV3ForCausalLM": "deepseek_mla",
}


def record_module(pm: PointMap) -> str:
    """The module-path part of a table row's record regex (before ``:`` or ``/fn:``)."""
    return re.split(r"/fn:|:", pm.record, maxsplit=1)[0]


# ---------------------------------------------------------------- transforms and merges

def _nh(config: dict) -> tuple[int, int, int]:
    return int(config["num_attention_heads"]), int(config["num_key_value_heads"]), int(config["head_dim"])


def _kv_ranks(arrays: list[np.ndarray], nkv: int) -> list[np.ndarray]:
    """With fewer KV heads than TP ranks each KV head is replicated on tp/nkv consecutive ranks: keep one."""
    tp = len(arrays)
    if nkv and tp > nkv and tp % nkv == 0:
        return arrays[:: tp // nkv]
    return arrays


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


# ---------------------------------------------------------------- rows

def _rids(fb: Any) -> list[str]:
    rids = getattr(fb, "rids", None)
    bs = int(getattr(fb, "batch_size", 0) or 0)
    if rids is not None:
        rids = list(rids)
        return [None if r is None else str(r) for r in (rids[:bs] if bs else rids)]
    # SGLang without ForwardBatch.rids (0.5.6): the request-pool slot, stable while the request lives
    return [f"slot{i}" for i in _ints(getattr(fb, "req_pool_indices", None))[:bs]]


def _mode(fb: Any) -> str:
    m = getattr(fb, "forward_mode", None)
    if m is None:
        return "unknown"
    if m.is_idle():
        return "idle"
    if m.is_decode():
        return "decode"
    target = getattr(m, "is_target_verify", lambda: False)()
    draft = getattr(m, "is_draft_extend", lambda *a: False)()
    if m.is_extend() and not target and not draft:
        return "extend"
    return "other"


def _extend_layout(fb: Any) -> tuple[list[int], list[int], list[int]]:
    """(start row, rows, cached prefix) per request of an EXTEND batch, from the CPU-side fields."""
    lens = _ints(getattr(fb, "extend_seq_lens_cpu", None)) or _ints(getattr(fb, "extend_seq_lens", None))
    prefix = _ints(getattr(fb, "extend_prefix_lens_cpu", None)) or _ints(getattr(fb, "extend_prefix_lens", None))
    starts = []
    s = 0
    for n in lens:
        starts.append(s)
        s += n
    if not prefix:
        prefix = [0] * len(lens)
    return starts, lens, prefix


def row_rids(fb: Any, n_rows: int | None = None) -> list[str | None]:
    """The request id of every row of a ForwardBatch's token axis (None: padding / no request), from CPU-side
    fields only (no device sync): what the hook session uses to choose passes and rows."""
    mode = _mode(fb)
    rids = _rids(fb)
    if n_rows is None:
        ids = getattr(fb, "input_ids", None)
        n_rows = int(ids.shape[0]) if ids is not None and hasattr(ids, "shape") else 0
    out: list[str | None] = [None] * n_rows
    if mode == "decode":
        for i, rid in enumerate(rids[:n_rows]):
            out[i] = rid
    elif mode == "extend":
        starts, lens, _ = _extend_layout(fb)
        for rid, s, n in zip(rids, starts, lens):
            for r in range(s, min(s + n, n_rows)):
                out[r] = rid
    return out


def forward_batch_rows(fb: Any, input_ids: Any = None) -> dict:
    """Row identity of one SGLang forward.

    Returns ``{"keys", "positions", "tokens", "logits_rows", "input_logprob_rows"}``: per row of the token
    axis the request id (None for padding), the absolute position and the token id; the rows of
    ``next_token_logits`` (one per request: the last row of each request in EXTEND, row i in DECODE); the
    rows of ``input_token_logprobs`` when the pass computes them (-1: an entry that is not joined, see the
    module docstring)."""
    ids = input_ids if input_ids is not None else getattr(fb, "input_ids", None)
    tokens = _ints(ids)
    n = len(tokens)
    keys: list[str | None] = [None] * n
    pos = [0] * n
    mode = _mode(fb)
    rids = _rids(fb)
    logits_rows: list[int] = []
    lp_rows: list[int] | None = None
    if mode == "decode":
        seq = getattr(fb, "seq_lens_cpu", None)
        p = [v - 1 for v in _ints(seq)] if seq is not None else _ints(getattr(fb, "positions", None))
        for i, rid in enumerate(rids[:n]):
            keys[i] = rid
            pos[i] = int(p[i])
        logits_rows = list(range(min(len(rids), n)))
    elif mode == "extend":
        starts, lens, prefix = _extend_layout(fb)
        for rid, s, k, pre in zip(rids, starts, lens, prefix):
            for j in range(k):
                if s + j < n:
                    keys[s + j] = rid
                    pos[s + j] = pre + j
            logits_rows.append(s + k - 1)
        if getattr(fb, "return_logprob", False):
            lp_start = _ints(getattr(fb, "extend_logprob_start_lens_cpu", None)) or [0] * len(lens)
            lp_rows = []
            for s, k, st in zip(starts, lens, lp_start):
                entries = list(range(s + st, s + k))
                if entries:
                    entries[-1] = -1
                lp_rows.extend(entries)
    return {"keys": keys, "positions": pos, "tokens": tokens, "logits_rows": logits_rows,
            "input_logprob_rows": lp_rows, "mode": mode}


_RID_RE = re.compile(r"^(\d+)-(\d+)$")


def parse_sample_rid(rid: str | None) -> tuple[int, int] | None:
    """``"{rollout_id}-{sample_index}"`` (the rid slime's integration gives traced samples) -> the two ints."""
    if rid is None:
        return None
    m = _RID_RE.match(str(rid))
    return (int(m.group(1)), int(m.group(2))) if m else None


# ---------------------------------------------------------------- the adapter

def _cls(m: Any) -> str:
    return type(m).__name__ if m is not None else "None"


def _reduces(mod: Any) -> bool | None:
    """A row-parallel module's ``reduce_results`` (None: not such a module)."""
    v = getattr(mod, "reduce_results", None)
    return None if v is None else bool(v)


def _par(name: str) -> int | None:
    """A parallel coordinate of this SGLang process (``tp_rank``, ``tp_size``, ``pp_rank``, ...): SGLang's
    ``get_parallel()`` (0.5.2x), else the older ``parallel_state`` getters; None when not initialised."""
    try:
        from sglang.srt.runtime_context import get_parallel
        v = getattr(get_parallel(), name)
        if v is not None:
            return int(v)
    except Exception:  # noqa: BLE001 - older SGLang, or not published
        pass
    old = {"tp": "tensor_model_parallel", "pp": "pipeline_model_parallel", "attn_tp": "attn_tensor_model_parallel",
           "moe_ep": "moe_expert_parallel", "moe_tp": "moe_tensor_parallel"}
    kind, what = name.rsplit("_", 1)
    try:
        import warnings

        from sglang.srt.distributed import parallel_state as ps
        fn = getattr(ps, f"get_{old[kind]}_{'rank' if what == 'rank' else 'world_size'}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return int(fn())
    except Exception:  # noqa: BLE001
        return None


def _tp() -> tuple[int, int]:
    return _par("tp_size") or 1, _par("tp_rank") or 0


class SGLangAdapter(Adapter):
    """``adapter="sglang"``. ``input_logprobs=True``: the ``logprobs`` point from SGLang's
    ``input_token_logprobs`` instead of derived from the logits. ``rid_filter(rid) -> bool``: rows of other
    requests get no key (not joined, not compared); the hook session uses it to trace chosen samples."""
    name = "sglang"
    points = POINTS

    def __init__(self, input_logprobs: bool = False, rid_filter: Callable[[str], bool] | None = None):
        self.input_logprobs = input_logprobs
        self.rid_filter = rid_filter

    # ------------------------------------------------------------ trace time
    def prepare(self, tracer: Any, models: list) -> None:
        tapped = set()
        for model in models:
            for name, mod in model.named_modules():
                if not name.endswith("self_attn"):
                    continue
                ns = sys.modules.get(type(mod).__module__)
                if ns is not None and callable(getattr(ns, "apply_qk_norm", None)) and ns.__name__ not in tapped:
                    tracer.tap_function(ns, "apply_qk_norm")
                    tapped.add(ns.__name__)
        tracer.record_inputs_of([r"re:\.self_attn\.attn$"])

    def describe(self, models: list) -> dict:
        model = models[0]
        cfg = getattr(model, "config", None)
        if cfg is None:
            return {}
        text = getattr(cfg, "get_text_config", lambda: cfg)()
        heads = int(text.num_attention_heads)
        layers = list(getattr(getattr(model, "model", None), "layers", []) or [])
        real = [lay for lay in layers if hasattr(lay, "self_attn")]
        attn0 = getattr(real[0], "self_attn", None) if real else None
        mla = attn0 is not None and not hasattr(attn0, "qkv_proj")
        tp, _ = _tp()
        partial: dict[str, list[int]] = {p: [] for p in PARTIAL_POINTS}
        shared = False
        n_exp = int(getattr(text, "num_experts", None) or getattr(text, "n_routed_experts", None) or 0)
        for i, lay in enumerate(layers):
            idx = int(getattr(lay, "layer_id", i) if getattr(lay, "layer_id", None) is not None else i)
            att, mlp = getattr(lay, "self_attn", None), getattr(lay, "mlp", None)
            if att is None or mlp is None:
                continue                     # a pipeline stage's missing layer
            moe = hasattr(mlp, "experts")
            sh = getattr(mlp, "shared_experts", None) or getattr(mlp, "shared_expert", None)
            shared = shared or sh is not None
            if tp <= 1:
                continue
            if _reduces(getattr(att, "o_proj", None)) is False:
                partial["attn.out"].append(idx)
            if moe:
                exp_partial = _reduces(mlp.experts) is not True
                if exp_partial:
                    partial["moe.experts_out"].append(idx)
                    partial["mlp.out"].append(idx)     # the MoE block returns the unreduced combination
                if sh is not None and _reduces(getattr(sh, "down_proj", None)) is False:
                    partial["moe.shared_out"].append(idx)
            elif _reduces(getattr(mlp, "down_proj", None)) is False:
                partial["mlp.out"].append(idx)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        try:
            dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        except StopIteration:
            dtype = ""
        theta = getattr(text, "rope_theta", None)
        if theta is None:
            params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
            theta = params.get("rope_theta") if isinstance(params, dict) else None
        return {
            "model_type": getattr(text, "model_type", None),
            "architecture": _cls(model),
            "arch_table": ARCH_OF_CLASS.get(_cls(model)),
            "attention": "mla" if mla else "mha",
            "num_layers": int(text.num_hidden_layers),
            "hidden_size": int(text.hidden_size),
            "num_attention_heads": heads,
            "num_key_value_heads": int(getattr(text, "num_key_value_heads", None) or heads),
            "head_dim": int(head_dim),
            "qk_norm": attn0 is not None and getattr(attn0, "q_norm", None) is not None,
            "vocab_size": int(text.vocab_size),
            "num_experts": n_exp,
            "num_experts_per_tok": int(getattr(text, "num_experts_per_tok", 0) or 0) if n_exp else 0,
            "shared_experts": bool(shared),
            "rms_norm_eps": getattr(text, "rms_norm_eps", None),
            "rope_theta": theta,
            "dtype": dtype,
            "tensor_model_parallel_size": tp,
            "tp_partial": partial,
        }

    def rank_coords(self) -> dict:
        out: dict[str, Any] = {}
        for k in ("tp", "pp", "attn_tp", "moe_ep", "moe_tp"):
            r, n = _par(f"{k}_rank"), _par(f"{k}_size")
            if r is not None and n is not None:
                out[f"{k}_rank"], out[f"{k}_size"] = r, n
        return out

    def numerics(self, models: list) -> dict:
        """The running server's arguments that change numerics ({} when no server context exists, e.g. a
        model built directly in a test)."""
        try:
            from sglang.srt.runtime_context import get_server_args
            sa = get_server_args()
        except Exception:  # noqa: BLE001 - outside a server there are no server args to read
            return {}
        return plain_settings(sa, NUMERICS_SERVER_ARGS) if sa is not None else {}

    def parallel_layout(self) -> dict:
        c = self.rank_coords()
        return {k: c[k] for k in ("tp_size", "pp_size", "attn_tp_size", "moe_ep_size", "moe_tp_size") if k in c}

    def rows_from_forward(self, tracer: Any, args: tuple, kwargs: dict):
        fb = kwargs.get("forward_batch", args[2] if len(args) > 2 else None)
        ids = kwargs.get("input_ids", args[0] if args else None)
        if fb is None or getattr(fb, "forward_mode", None) is None:
            return None
        rows = forward_batch_rows(fb, ids)
        keys = rows["keys"]
        if self.rid_filter is not None:
            keys = [k if k is not None and self.rid_filter(k) else None for k in keys]
        if rows["logits_rows"]:
            tracer.set_record_rows(r"logits_processor:out\.next_token_logits", rows["logits_rows"])
        if rows["input_logprob_rows"] is not None:
            tracer.set_record_rows(r"logits_processor:out\.input_token_logprobs", rows["input_logprob_rows"])
        return keys, rows["positions"], rows["tokens"]

    def token_dims(self, record_name: str) -> int | None:
        return 1               # every SGLang activation is [T, ...] (q_norm/k_norm modules: [T*heads, hd])

    # ------------------------------------------------------------ read time
    def rank_groups(self, ranks: list[int], rank_infos: dict[int, dict]) -> list[list[int]]:
        groups: dict[tuple, list[int]] = {}
        for r in sorted(ranks):
            c = (rank_infos.get(r) or {}).get("coords") or {}
            key = (c.get("pp_rank", 0),) if "tp_rank" in c else ("rank", r)
            groups.setdefault(key, []).append(r)
        return [sorted(g, key=lambda r: ((rank_infos.get(r) or {}).get("coords") or {}).get("tp_rank", 0))
                for _, g in sorted(groups.items(), key=lambda kv: str(kv[0]))]

    def keeps(self, pm: PointMap, layer: int | None, config: dict) -> bool:
        if "partial" in pm.opts:
            partial_layers = set((config.get("tp_partial") or {}).get(pm.point) or [])
            return (layer in partial_layers) == bool(pm.opts["partial"])
        return True

    def applies(self, pm: PointMap, config: dict) -> bool:
        if pm.opts.get("input_logprobs") and not self.input_logprobs:
            return False
        if pm.point in MHA_POINTS and config.get("attention") == "mla":
            return False
        if pm.point in ("attn.q_norm", "attn.k_norm") and not config.get("qk_norm", True):
            return False
        return super().applies(pm, config)


ADAPTER = SGLangAdapter


@contextlib.contextmanager
def trace_forwards(model: Any, out_dir: Any, **kwargs: Any):
    """Trace an SGLang model's forwards in-process: every ``model.forward(...)`` call (what SGLang's runners
    call) is one pass, and nothing between them (the engine's KV bookkeeping) is recorded: the tracer is
    resumed for each forward and paused after it. Keyword arguments go to ``tic_trace.trace`` (adapter
    ``"sglang"`` unless given). Yields the tracer::

        with trace_forwards(model, "traces/sglang", points_mode="full") as t:
            engine.generate(...)
    """
    from tic_trace.tracer import Tracer
    kwargs.setdefault("adapter", "sglang")
    kwargs["auto_step"] = True
    t = Tracer(model, out_dir, **kwargs).start()
    t.pause()
    inner = model.forward          # the tracer's wrapper of the root forward

    @functools.wraps(inner)
    def forward(*args, **kw):
        t.resume()
        try:
            return inner(*args, **kw)
        finally:
            t.pause()

    model.forward = forward
    try:
        yield t
    finally:
        t.stop()                   # also restores the model's own forward


# ================================================================== inside an unmodified server

HOOK_FACTORY = "tic_trace.adapters.sglang:forward_hook_factory"
#: Modules the hook is registered on (SGLang wants at least one); the hook itself only finds the model
#: when the factory could not, and notices torch.compile. The tracer works through the model's forward.
HOOK_TARGETS = ["model.embed_tokens", "*.embed_tokens"]
MODES = ("stats", "full", "rows")

TRACING_SERVER_ARGS = (
    "--cuda-graph-backend-decode=disabled --cuda-graph-backend-prefill=disabled (or the deprecated "
    "--disable-cuda-graph, the only spelling in older SGLang), no --enable-torch-compile, "
    "--disable-radix-cache, --disable-overlap-schedule (see docs/sglang.md)"
)


def forward_hooks_spec(out_dir: str, rollout_ids: list[int] | None = None, max_samples: int = 4,
                       mode: str = "rows", filters: list[str] | None = None) -> list[dict]:
    """The JSON-able value of SGLang's ``--forward-hooks`` (slime: ``--sglang-forward-hooks``) that traces
    the server's forwards with this adapter.

    ``rollout_ids`` given: only rows whose request id is ``"{rollout_id}-{sample_index}"`` with
    ``rollout_id in rollout_ids`` and ``sample_index < max_samples`` are traced, each rollout into
    ``{out_dir}/rollout_{id:05d}/sglang/`` (a forward without such rows writes nothing; other requests' rows
    of a traced forward have no key, and in ``rows`` mode their values are not stored). ``rollout_ids``
    None: every forward, every row, into ``{out_dir}``. ``mode``: how canonical-point records are kept
    (``rows`` = the traced rows' values, ``full``, ``stats``); dispatcher ops are statistics. ``filters``:
    module-path globs to record (``re:`` for a regex).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    config = {
        "out_dir": str(out_dir),
        "rollout_ids": None if rollout_ids is None else sorted({int(i) for i in rollout_ids}),
        "max_samples": int(max_samples),
        "mode": mode,
        "filters": None if not filters else [str(f) for f in filters],
    }
    return [{"name": "tic_trace", "target_modules": list(HOOK_TARGETS), "hook_factory": HOOK_FACTORY,
             "config": config}]


def _graph_backend(sa: Any, phase: str) -> str:
    cfg = getattr(sa, "cuda_graph_config", None)
    b = None
    if isinstance(cfg, dict):
        b = (cfg.get(phase) or {}).get("backend")
    elif cfg is not None:
        b = getattr(getattr(cfg, phase, None), "backend", None)
    if b:
        return str(b)
    if getattr(sa, "disable_cuda_graph", False) or getattr(sa, f"disable_{phase}_cuda_graph", False):
        return "disabled"
    b = getattr(sa, f"cuda_graph_backend_{phase}", None)
    return str(b) if b else "default"


def tracing_problems(server_args: Any = None) -> list[str]:
    """What in the server's arguments hides operators from the tracer, each with the flag to set. Reads the
    running server's arguments when none are given; [] when they are not available."""
    sa = server_args
    if sa is None:
        try:
            from sglang.srt.runtime_context import get_server_args
            sa = get_server_args()
        except Exception:  # noqa: BLE001
            return []
    if sa is None:
        return []
    problems = []
    device = str(getattr(sa, "device", None) or "cuda")
    if device != "cpu":
        for phase in ("decode", "prefill"):
            backend = _graph_backend(sa, phase)
            if backend != "disabled":
                problems.append(
                    f"{phase} CUDA graphs are on (backend {backend!r}): a graph replay runs recorded kernels "
                    f"without calling the model's modules, so no hook fires and {phase} forwards are missing "
                    f"from the trace. Start the server with --cuda-graph-backend-{phase}=disabled "
                    "(or --disable-cuda-graph for both phases).")
    if getattr(sa, "enable_torch_compile", False):
        problems.append("--enable-torch-compile is set: compiled forwards inline module calls (hooks and the "
                        "dispatch mode see nothing or a different graph). Remove --enable-torch-compile.")
    if getattr(sa, "enable_fused_qk_norm_rope", False):
        problems.append("--enable-fused-qk-norm-rope is set: QK-norm and RoPE run in one fused kernel, so "
                        "attn.q_norm / attn.k_norm are not recorded. Remove it to trace them.")
    return problems


class _HookSession:
    """One per server process (TP rank): lazily started tracers, one per traced rollout (or one for all)."""

    def __init__(self, config: dict):
        self.config = dict(config or {})
        mode = self.config.get("mode") or "rows"
        if mode not in MODES:
            raise ValueError(f"tic-trace hook: mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        ids = self.config.get("rollout_ids")
        self.rollout_ids = None if ids is None else {int(i) for i in ids}
        self.max_samples = int(self.config.get("max_samples", 4) if self.config.get("max_samples") is not None else 4)
        self.out_dir = Path(self.config.get("out_dir") or "tic-trace")
        self.root: Any = None
        self.tracers: dict[int | None, Any] = {}
        self.passes_seen = 0
        self.passes_traced = 0
        self._plain: Any = None
        self._had_forward = False
        self._top: Any = None
        self._wrapper: Any = None
        self._hook: Any = None
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- plumbing
    def _warn(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def attach(self, root: Any) -> None:
        """Wrap ``root.forward`` (what SGLang's ModelRunner calls). Tracers start at the next forward."""
        with self._lock:
            if self.root is not None:
                return
            self.root = root
            self._had_forward = "forward" in vars(root)
            self._plain = root.forward
            self._top = self._plain
            session = self

            @functools.wraps(self._plain)
            def forward(*args, **kwargs):
                return session._forward(args, kwargs)

            self._wrapper = forward
            root.forward = forward
        for p in tracing_problems():
            self._warn(p[:40], "tic-trace: %s Recipe for tracing runs: %s", p, TRACING_SERVER_ARGS)

    def _rank(self) -> int:
        tp, r = _tp()
        if _par("tp_size") is not None:
            return (_par("pp_rank") or 0) * tp + r
        import torch
        d = torch.distributed
        return d.get_rank() if d.is_available() and d.is_initialized() else 0

    def _select(self, rollout: int | None) -> Callable[[str], bool] | None:
        if rollout is None:
            return None

        def want(rid: str) -> bool:
            p = parse_sample_rid(rid)
            return p is not None and p[0] == rollout and p[1] < self.max_samples
        return want

    def _tracer_for(self, rollout: int | None):
        t = self.tracers.get(rollout)
        if t is not None:
            return t
        from tic_trace.filters import Filters
        from tic_trace.tracer import Tracer
        out = self.out_dir if rollout is None else self.out_dir / f"rollout_{rollout:05d}" / "sglang"
        filters = Filters(modules=self.config["filters"]) if self.config.get("filters") else None
        root = self.root
        root.forward = self._top          # the new tracer wraps the chain of earlier tracers, not this session
        try:
            t = Tracer(root, out, adapter=SGLangAdapter(rid_filter=self._select(rollout)), mode="stats",
                       points_mode=self.mode, filters=filters, rank=self._rank(), auto_step=True,
                       sample_rows=[] if self.mode == "rows" else None,
                       manifest={"sglang_hook": {k: v for k, v in self.config.items() if k != "out_dir"}})
            t.start()
            self._top = root.forward
        finally:
            root.forward = self._wrapper
        t.pause()
        self.tracers[rollout] = t
        log.info("tic-trace: tracing SGLang forwards (rank %d) into %s", t.rank, out)
        return t

    def _plan(self, args: tuple, kwargs: dict) -> list:
        """The tracers to run for this forward (resumed, with their rows chosen)."""
        import torch
        if getattr(torch.compiler, "is_compiling", lambda: False)():
            self._warn("compile", "tic-trace: the model's forward runs under torch.compile: not traced. "
                                  "Remove --enable-torch-compile. Recipe: %s", TRACING_SERVER_ARGS)
            return []
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            self._warn("graph", "tic-trace: a CUDA graph is being captured: this forward is not traced, and its "
                                "replays will not be either. Recipe: %s", TRACING_SERVER_ARGS)
            return []
        fb = kwargs.get("forward_batch", args[2] if len(args) > 2 else None)
        if fb is None or getattr(fb, "forward_mode", None) is None:
            self._warn("nofb", "tic-trace: a forward without a ForwardBatch: not traced")
            return []
        if _mode(fb) not in ("extend", "decode"):
            return []
        ids = kwargs.get("input_ids", args[0] if args else None)
        n = int(ids.shape[0]) if ids is not None and hasattr(ids, "shape") and ids.dim() else None
        rids = row_rids(fb, n)
        if self.rollout_ids is None:
            picked = {None: [i for i, r in enumerate(rids) if r is not None]}
        else:
            picked: dict[int | None, list[int]] = {}
            for i, rid in enumerate(rids):
                p = parse_sample_rid(rid)
                if p is not None and p[0] in self.rollout_ids and p[1] < self.max_samples:
                    picked.setdefault(p[0], []).append(i)
        out = []
        for rollout in sorted(picked, key=lambda x: -1 if x is None else x):
            if not picked[rollout]:
                continue
            t = self._tracer_for(rollout)
            if self.mode == "rows":
                t.sample_rows = picked[rollout]
            out.append(t)
        return out

    def _forward(self, args: tuple, kwargs: dict):
        self.passes_seen += 1
        try:
            active = self._plan(args, kwargs)
        except Exception as e:  # noqa: BLE001 - tracing never breaks a forward
            self._warn("plan", "tic-trace: not tracing this forward: %s: %s", type(e).__name__, e)
            active = []
        for t in active:
            t.resume()
        if active:
            self.passes_traced += 1
        try:
            return self._top(*args, **kwargs)
        finally:
            for t in reversed(active):
                t.pause()

    def on_hook(self, module: Any) -> None:
        import torch
        if getattr(torch.compiler, "is_compiling", lambda: False)():
            return
        if self.root is None:
            root = _root_in_stack(module)
            if root is not None:
                self.attach(root)

    def close(self) -> None:
        """Stop every tracer, restore the model's forward and remove the hook (tests, shutdown)."""
        for t in reversed(list(self.tracers.values())):
            try:
                t.stop()
            except Exception:  # noqa: BLE001
                pass
        self.tracers.clear()
        if self.root is not None:
            if self._had_forward:
                self.root.forward = self._plain
            else:
                try:
                    del self.root.forward
                except AttributeError:
                    pass
            for mod in self.root.modules():
                for hid, h in list(getattr(mod, "_forward_hooks", {}).items()):
                    if h is self._hook:
                        del mod._forward_hooks[hid]
        self.root = None
        if self in _SESSIONS:
            _SESSIONS.remove(self)


_SESSIONS: list[_HookSession] = []


def _root_in_stack(module: Any = None) -> Any:
    """The SGLang model whose forward is running: the nearest caller frame's ``self`` that is an nn.Module
    with a ``logits_processor`` (and contains ``module``)."""
    try:
        import torch
        f = sys._getframe(1)
    except Exception:  # noqa: BLE001
        return None
    while f is not None:
        obj = f.f_locals.get("self")
        if isinstance(obj, torch.nn.Module) and hasattr(obj, "logits_processor"):
            if module is None or any(m is module for m in obj.modules()):
                return obj
        f = f.f_back
    return None


def _model_in_callers() -> Any:
    """The model SGLang's ``register_forward_hooks(model, specs)`` is registering on (its caller frames)."""
    try:
        import torch
        f = sys._getframe(2)
    except Exception:  # noqa: BLE001
        return None
    depth = 0
    while f is not None and depth < 12:
        for name in ("model", "self"):
            obj = f.f_locals.get(name)
            if isinstance(obj, torch.nn.Module) and hasattr(obj, "logits_processor"):
                return obj
        mr = f.f_locals.get("model_runner")
        if mr is not None and hasattr(getattr(mr, "model", None), "logits_processor"):
            return mr.model
        f = f.f_back
        depth += 1
    return None


def forward_hook_factory(config: dict) -> Callable:
    """The ``hook_factory`` of :func:`forward_hooks_spec` (SGLang calls it once per process with the spec's
    ``config`` from ``register_forward_hooks``, after CUDA-graph capture). Finds the model being registered
    on and wraps its ``forward``: the first forward with rows to trace starts a tracer in this process (rank =
    TP rank), and every forward is one pass (``auto_step``). Returns the forward hook SGLang registers on
    ``HOOK_TARGETS``; it returns None (a hook's return value would replace the module output), finds the
    model if the factory could not (tracing starts at the next forward) and notices torch.compile."""
    try:
        session = _HookSession(config)
        _SESSIONS.append(session)
        root = _model_in_callers()
        if root is not None:
            session.attach(root)
    except Exception as e:  # noqa: BLE001 - a bad tracing config must not take the server down
        log.error("tic-trace: not tracing this SGLang server (hook config %r): %s: %s", config, type(e).__name__, e)
        return None          # SGLang then registers nothing and says so

    def hook(module, inputs, output):
        try:
            session.on_hook(module)
        except Exception as e:  # noqa: BLE001 - never into the model's forward
            session._warn("hook", "tic-trace hook: %s: %s", type(e).__name__, e)
        return None

    session._hook = hook
    hook.tic_trace_session = session
    return hook


def close_sessions() -> None:
    """Stop the tracers of every hook session of this process (tests; a server's shutdown)."""
    for s in list(_SESSIONS):
        s.close()
