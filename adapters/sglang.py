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
  ``model.norm:out[1]`` (``opts={"layer": -1}``; both opts are read by ``tic_trace.view.align``).
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
  :meth:`SGLangAdapter.describe` into ``config["tp_partial"]`` (point -> layers). The merge itself does not
  trust that declaration (it changes between SGLang versions: 0.5.15.post1's MoE blocks all-reduce their
  output, 0.5.23's do not): rank copies that are bitwise equal are taken once, otherwise added, and a
  disagreement with the declaration becomes a report note (:meth:`SGLangAdapter.merge_shards`). Norm
  outputs, router, top-k and the embedding are replicated (rank 0 is taken).
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
RoPE, optional QK-norm, shared experts) and DeepSeek-V2/V3 (MLA: ``self_attn`` has no fused ``qkv_proj``; its
latent points, the two attention paths and the routed scale's place are the deepseek family's,
``tic_trace/families/deepseek/names_sglang.py``; the facts they read, :mod:`.sglang_facts`).
``ARCH_MODULES`` lists, per architecture, the module paths every table row relies on; the tests check them on
module trees built on the ``meta`` device. Gemma 2 / Gemma 3 (text) have rows of their own (``ARCH_POINTS``:
sandwich norms, the scaled embedding read as layer 0's norm input, Gemma 3's QK-norm modules). Verified
(``ARCHITECTURES`` in :mod:`.sglang_names`: run against another framework) are Qwen2, Qwen3, Qwen3-MoE, Llama,
Phi-3, Gemma 2, Gemma 3 (text), GPT-OSS, GLM-4.5 and DeepSeek-V3 (MLA at TP 1, on a backend that passes the
RoPE dims inside q and k: the family's ``refusals.mla_refusal``); a trace of any other class is marked
unverified and refused at compare time, the name-table-only ones with the reason in ``REFUSED``
(docs/adapters.md).

* **Norms with a residual** (SGLang's ``RMSNorm``) add the two in fp32 and normalise that sum, storing the
  residual rounded: ``describe()["fused_add_norm_fp32"]`` says so, and the replay normalises the exact sum of
  the two recorded addends (docs/replay.md).

Split by job: the point table and shard merges in :mod:`.sglang_names`, ForwardBatch rows and parallel
coordinates in :mod:`.sglang_rows`, tracing inside a server in :mod:`.sglang_server`; this module is the
adapter itself. Everything imports SGLang lazily; reading traces needs numpy only.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Callable

from tic_trace.adapters.router_facts import selection_facts
from tic_trace.adapters.sglang_facts import attention_facts, fused_shared_facts, routed_scale_facts
from tic_trace.families import framework_names
from tic_trace.graph.adapter import Adapter, ArchitectureCheck, PointMap, merge, plain_settings, register_adapter
from tic_trace.replay.grid import round_to
from tic_trace.adapters.sglang_names import (ARCH_INPUTS, ARCH_OF_CLASS, ARCH_POINTS, ARCHITECTURES, MHA_POINTS,
                                            PARTIAL_POINTS, POINTS, REFUSED, arch_row_applies, tp_copies_equal)
from tic_trace.adapters.sglang_names import ARCH_MODULES, record_module  # noqa: F401 - part of this adapter's API
from tic_trace.adapters.sglang_names import tp_refusal
from tic_trace.adapters.sglang_rows import _par, _tp, forward_batch_rows
from tic_trace.adapters.sglang_rows import parse_sample_rid, row_rids  # noqa: F401 - part of this adapter's API

# The families' SGLang tables (tic_trace/families/<name>/names.py says what each key means).
_FAM = framework_names("sglang")

# Server arguments that change how the engine computes (kernels, backends, precisions, fusions).
NUMERICS_SERVER_ARGS = (
    "dtype", "kv_cache_dtype", "quantization", "attention_backend", "prefill_attention_backend",
    "decode_attention_backend", "sampling_backend", "moe_runner_backend", "moe_a2a_backend",
    "enable_fp32_lm_head", "enable_deterministic_inference", "rl_on_policy_target", "enable_torch_compile",
    "disable_cuda_graph", "enable_fused_qk_norm_rope", "triton_attention_reduce_in_fp32",
    "enable_dp_attention", "disable_radix_cache", "chunked_prefill_size", "tp_size", "ep_size",
    "enable_flashinfer_allreduce_fusion", "enforce_disable_flashinfer_allreduce_fusion")

log = logging.getLogger("tic_trace.sglang")

def _cls(m: Any) -> str:
    return type(m).__name__ if m is not None else "None"


def _adds_in_fp32(norm: Any) -> bool:
    """Whether the model's norms, called with a residual, normalise the fp32 sum of the two and store the
    residual rounded (SGLang's ``RMSNorm``: ``forward_native`` adds in fp32, as the CUDA fused_add_rmsnorm
    kernel does; ``GemmaRMSNorm`` adds in the activations' dtype): the replay then normalises the exact sum of
    the addends, not the rounded residual (replay/intrinsic.py, ``_unrounded_sum``)."""
    cls = type(norm)
    return cls.__name__ == "RMSNorm" and cls.__module__.startswith("sglang.") and not getattr(norm, "fp32_residual", False)


def _all_reduced(arrays: list, config: dict):
    """TP partial sums added as the engine's all-reduce returns them: in the activations' dtype, so the sum is
    rounded onto its grid (the residual add and the next norm read that rounded tensor, not the float sum)."""
    total = merge("sum", arrays, config)
    dtype = str(config.get("dtype") or "")
    return round_to(total, dtype) if dtype in ("bfloat16", "float16", "float32") else total


def _reduces(mod: Any) -> bool | None:
    """A row-parallel module's ``reduce_results`` (None: not such a module)."""
    v = getattr(mod, "reduce_results", None)
    return None if v is None else bool(v)


class SGLangAdapter(Adapter):
    """``adapter="sglang"``. ``input_logprobs=True``: the ``logprobs`` point from SGLang's
    ``input_token_logprobs`` instead of derived from the logits. ``rid_filter(rid) -> bool``: rows of other
    requests get no key (not joined, not compared); the hook session uses it to trace chosen samples."""
    name = "sglang"
    points = ARCH_POINTS + POINTS
    architectures = ARCHITECTURES
    refused = REFUSED

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
        extra = [p for m in models for p in ARCH_INPUTS.get(_cls(m), ())]
        tracer.record_inputs_of([r"re:\.self_attn\.attn$", *extra])

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
        own_attention = attention_facts(attn0)      # a family's own attention (MLA's); {}: the base's
        tp, _ = _tp()
        partial: dict[str, list[int]] = {p: [] for p in PARTIAL_POINTS}
        shared = False
        # One fact under three config names (Qwen `num_experts`, Mixtral `num_local_experts`, DeepSeek/GLM
        # `n_routed_experts`), as the HF adapter reads it.
        n_exp = int(getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
                    or getattr(text, "n_routed_experts", None) or 0)
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
        out = {
            **self.architecture_facts(models),
            "model_type": getattr(text, "model_type", None),
            "arch_table": ARCH_OF_CLASS.get(_cls(model)),
            "attention": own_attention.get("attention", "mha"),
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
            "fused_add_norm_fp32": _adds_in_fp32(getattr(real[0], "input_layernorm", None) if real else None),
            **({**_family_facts(text), **own_attention} if own_attention else {}),
            **(selection_facts(model, text, "sglang") if n_exp else {}),
            **({**routed_scale_facts(model, text), **fused_shared_facts(model)} if n_exp else {}),
        }
        arch = self.architecture(out)
        return self.settle_verified({**out, **arch.defaults} if arch is not None else out)

    def architecture_of(self, models: list) -> str | None:
        return _cls(models[0])      # the *ForCausalLM class SGLang's ModelRunner built

    def check_architecture(self, config: dict) -> ArchitectureCheck:
        """As the base, and a DeepSeek-V3 / GLM-4.5 trace only in the setup its rows were verified in
        (its family's `refusal` table), a class verified at TP=1 only at that degree (sglang_names.tp_refusal)."""
        c = super().check_architecture(config)
        said = (*(n.tables["refusal"](config) for n in _FAM if "refusal" in n.tables), tp_refusal(config))
        why = "; ".join(w for w in said if w) if c.verified else None
        return ArchitectureCheck(c.adapter, c.name, False, why) if why else c

    def rank_coords(self) -> dict:
        out: dict[str, Any] = {}
        for k in ("tp", "pp", "attn_tp", "moe_ep", "moe_tp"):
            r, n = _par(f"{k}_rank"), _par(f"{k}_size")
            if r is not None and n is not None:
                out[f"{k}_rank"], out[f"{k}_size"] = r, n
        return out

    def weight_pieces(self, models: list, params: dict) -> dict:
        from tic_trace.adapters.sglang_weight_map import sglang_weight_pieces
        return sglang_weight_pieces(models, params)

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

    def merge_shards(self, pm: PointMap, layer: int | None, arrays: list, config: dict):
        """TP-reduced points: whether a module's output is a per-rank partial sum depends on the SGLang
        version (0.5.15.post1's MoE blocks all-reduce their own output, 0.5.23's return it unreduced) and on
        runtime switches (FlashInfer all-reduce fusion), so the records decide: rank copies that are bitwise
        equal are one replicated tensor, otherwise partial sums, added. The module's declaration
        (``describe()["tp_partial"]``) is checked against that, with a note when they disagree."""
        if not pm.opts.get("tp_reduce"):
            return super().merge_shards(pm, layer, arrays, config)
        if len(arrays) == 1:
            return arrays[0], None
        replicated = tp_copies_equal(arrays)
        declared = layer in set((config.get("tp_partial") or {}).get(pm.point) or [])
        note = None
        if declared and replicated:
            note = (f"{pm.point}: the module declares a TP partial sum (reduce_results=False) but every rank "
                    "recorded the same tensor: taken once as already reduced (an SGLang version whose block "
                    "all-reduces its own output, e.g. 0.5.15's MoE blocks)")
        elif not declared and not replicated:
            note = (f"{pm.point}: the module declares a reduced output but the ranks recorded different "
                    "tensors: added as TP partial sums")
        return (arrays[0] if replicated else _all_reduced(arrays, config)), note

    def applies(self, pm: PointMap, config: dict) -> bool:
        if pm.opts.get("input_logprobs") and not self.input_logprobs:
            return False
        if not arch_row_applies(pm, config.get("architecture")):
            return False
        if pm.point in MHA_POINTS and config.get("attention", "mha") != "mha" and "archs" not in pm.opts:
            return False
        if any(n.tables["applies"](pm, config) is False for n in _FAM if "applies" in n.tables):
            return False                # a family's row its model's setup lacks (MLA without a q latent...)
        if pm.point in ("attn.q_norm", "attn.k_norm") and not config.get("qk_norm", True):
            return False
        return super().applies(pm, config)


ADAPTER = SGLangAdapter


def _family_facts(text: Any) -> dict:
    """The families' config facts for the manifest (MLA's ranks and per-head splits)."""
    return {k: v for n in _FAM if "describe" in n.tables for k, v in n.tables["describe"](text).items()}
register_adapter(SGLangAdapter)



# Tracing inside a server (docs/sglang.md) lives in sglang_server; its entry points are reachable from here too.
from tic_trace.adapters.sglang_server import (  # noqa: E402,F401
    HOOK_FACTORY, TRACING_SERVER_ARGS, close_sessions, forward_hook_factory, forward_hooks_spec, trace_forwards,
    tracing_problems,
)
