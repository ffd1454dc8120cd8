"""Megatron-core ``GPTModel`` adapter: records of a (local-spec or Transformer-Engine-spec) GPTModel ->
canonical points, rank shards -> one tensor, ``[s, b]`` / packed THD / context-parallel rows -> (sample, position).

Record names (module paths of the model given to the tracer; wrappers ``module.`` from DDP/Float16Module and
``chunk{i}.`` from a list of virtual-pipeline chunks are allowed in front of every name):

* Every Megatron activation is ``[s, b, h]`` (packed THD: ``[t, 1, h]``), so row ``r`` of a pass is
  sequence index ``r // B``, batch index ``r % B`` (s-major); :meth:`MegatronAdapter.rows_from_forward`
  builds the row table in that order.
* Residual stream: decoder-layer input (``decoder.layers.i`` is called with ``hidden_states=`` as a keyword),
  the input of ``pre_mlp_layernorm`` (``mid``; the norm is an ``IdentityOp`` for TE dense layers, whose input is
  still the residual), and ``decoder.layers.i`` output ``[0]``. The residual add is a plain function
  (``self_attn_bda`` / ``mlp_bda``) that under ``no_grad`` adds *in place* into the attention / MLP output
  tensor; the tracer copies values when the module returns, before that add, so ``attn.out`` and
  ``mlp.out`` are the pre-residual values.
* ``linear_qkv`` output ``[s, b, ng/tp * (np/ng + 2) * hn]`` is interleaved per query group
  ``[q heads of g | k_g | v_g]``; the ``megatron_qkv`` transform splits it (``[q | gate | k | v]`` with
  ``attention_output_gate``). TP shards are contiguous slices of the global layout: ``cat:-1``.
* RoPE is a function inside ``SelfAttention.forward``; its outputs are the positional inputs 0 and 1 of
  ``core_attention`` (``[s, b, heads/tp, hn]``, THD ``[t, heads/tp, hn]``).
* Router: logits are the output of the ``router.gating`` method (tapped), ``[s, b, E]``; the router module
  returns ``(probs [T, E] zero off the top-k, routing_map [T, E] bool)`` with ``T = s*B + b``.
* ``moe.experts_out``: the routed experts' combined output in token order is the output of the token
  dispatcher's ``combine_postprocess`` (tapped; every dispatcher ends with it: un-permute, reshape to
  ``[s, b, h]``), before ``MoELayer.postprocess`` adds the shared-expert output. It is what
  HF's ``mlp.experts`` output is (probabilities are applied inside Megatron's experts, so it is already the
  weighted sum). Not the ``experts`` module output, which is in dispatched (expert-major) order. With
  ``moe_shared_expert_overlap`` the alltoall dispatcher adds the shared output inside ``combine_postprocess``
  and ``shared_experts`` never fires: both MoE-output points are then not promised.
* Multi-latent attention (``MLASelfAttention``, DeepSeek-V2/V3): its rows are the deepseek family's
  (``tic_trace/families/deepseek/names_megatron.py``: the q and kv latents and their norms, the up-projections,
  the rope dims of core attention's q/k inputs); the router's sigmoid / expert-bias / group-limited path is
  inside ``router`` and ends in the same ``(probs, routing_map)``.
* Logits: ``output_layer`` output ``[0]`` ``[s, b, V_pad/tp]``: ``cat:-1``, then the padding columns are cut
  (``vocab``). Megatron only knows the padded vocabulary: pass the tokenizer's size as
  ``MegatronAdapter(vocab_size=...)`` when the model's vocabulary is padded.

Transformer Engine spec: same module names; ``input_layernorm`` is an ``IdentityOp`` (the norm is fused into
``linear_qkv``, ``TELayerNormColumnParallelLinear``, which never returns the normalised input), and so is
``pre_mlp_layernorm`` of dense layers (fused into ``mlp.linear_fc1``). Those layers' ``attn_norm`` /
``mlp_norm`` are not produced (reported "not comparable", never taken from the identity's output). The
downstream points (``attn.q`` ...) are compared as usual.

Shards: ranks with the same (pp, dp, cp) coordinates form one group, ordered by TP rank. Column-parallel
outputs are concatenated (QKV, heads, core attention, logits); row-parallel outputs are already reduced
(one rank), or reduce-scattered along the sequence with sequence parallelism (``seq`` merge: ``cat:0`` when
SP, else one rank). Expert-parallel ranks are data-parallel ranks for everything outside the experts, and
after the combine each holds its own tokens' MoE output: nothing to merge. Layers: ``layer_number - 1``
(global) = local index + the stage's offset, recorded per rank in ``rank_coords()["layer_offset"]``.

Activation recompute re-runs forwards inside backward; the tracer tags those records ``recompute`` and skips
them by default.

Verified on CPU with megatron-core 0.16.1 (``tests/test_megatron_adapter.py``): local spec, dense and MoE
(alltoall), TP=1 vs HF, TP=2, TP=2+SP, TP=4 with 2 query groups, EP=2, pipeline chunks, full recompute,
padded vocabulary, a shared expert, packed THD (with a per-segment stand-in for TE's attention kernel), and a
TE-shaped module tree (identity norms, norm inside ``linear_qkv`` / ``linear_fc1``); DeepSeek-V3-style MLA with
the sigmoid group-limited router, shared experts and a dense first layer against HF ``DeepseekV3ForCausalLM``
at TP 1 and 2 (``tests/test_megatron_mla.py``; MLA with TP > 2, SP, EP, CP, PP, the TE spec, fused or YaRN RoPE
is refused: the family's ``refusals.latent_refusal``); GPT-OSS-style (learnable sinks, windows, clamped GLU, biases, YaRN)
against HF ``GptOssForCausalLM`` on one rank (``tests/test_megatron_gptoss.py``; other ``TransformerConfig``
switches the module structure does not show are refused: ``megatron_features.feature_refusal``). Not runnable on CPU,
so checked by name / pure function only, to be verified on GPU: real Transformer Engine modules
(``TEDotProductAttention``, ``TEGroupedMLP``, fused RoPE / permute / router), context parallelism (the
zigzag row mapping is checked against megatron's own SBHD split and a re-implementation of TE's THD
partition), the flex (DeepEP) dispatcher.

The layout's pure mechanics (the ``megatron_qkv`` / ``megatron_biased`` transforms, the ``seq`` / ``heads`` /
``kv_heads`` merges, ``rows_from_sbhd`` / ``rows_from_packed`` / ``zigzag_position``) are
``adapters/megatron_layout.py``'s; this module holds the adapter: hooks and taps, ``describe``, the structure
checks, rank coordinates.
"""
from __future__ import annotations

from typing import Any, Sequence

from tic_trace.adapters.router_facts import router_facts
from tic_trace.graph.adapter import Adapter, ArchitectureCheck, PointMap, plain_settings, register_adapter
# The layout's transforms and merges register by name on import; the rows name each micro-batch's rows.
from tic_trace.adapters.megatron_layout import rows_from_packed, rows_from_sbhd
from tic_trace.adapters.megatron_features import family_attention, feature_facts, feature_refusal
from tic_trace.families import framework_names

# TransformerConfig fields that change how the model computes (precision, kernels, fusions, routing).
NUMERICS_FIELDS = (
    "bf16", "fp16", "params_dtype", "fp32_residual_connection", "attention_softmax_in_fp32",
    "apply_query_key_layer_scaling", "attention_backend", "apply_rope_fusion", "rotary_interleaved",
    "masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion", "gated_linear_unit",
    "activation_func", "persist_layer_norm", "memory_efficient_layer_norm", "layernorm_zero_centered_gamma",
    "normalization", "layernorm_epsilon", "moe_router_dtype", "moe_router_score_function",
    "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias", "moe_router_pre_softmax",
    "moe_router_fusion", "moe_grouped_gemm", "moe_permute_fusion", "moe_token_dispatcher_type",
    "moe_router_num_groups", "moe_router_group_topk", "deterministic_mode",
    "disable_bf16_reduced_precision_matmul", "cross_entropy_fusion_impl", "fp8", "fp8_recipe")

# Wrapper prefixes: a virtual-pipeline chunk (`chunk{i}.` from the tracer) and DDP / Float16Module `module.`.
# The families' Megatron tables (tic_trace/families/<name>/names.py says what each key means): the base rows and
# structures are the plain transformer's; a family's own attention modules (MLASelfAttention's) give rows of their
# own (`attention_rows`, with the family whose `applies` decides them), put before the base `attn.core` row.
_FAM = framework_names("megatron")
_BASE = next(n for n in _FAM if "attention_prefix" in n.tables)
_A = _BASE.tables["attention_prefix"]
_FAM_ROWS = tuple((n, n.tables["attention_rows"](_A)) for n in _FAM if "attention_rows" in n.tables)
_AT = _BASE.tables["family_rows_at"]
POINTS = (*_BASE.points[:_AT], *(pm for _, rows in _FAM_ROWS for pm in rows), *_BASE.points[_AT:],
          *(pm for n in _FAM if n is not _BASE for pm in n.points))

# Points read from another record when a trace fact is on: the row with opts {"when": True} applies then, the plain
# row otherwise (add_bias_linear: linear_proj's bias comes apart; moe_shared_expert_gate: the module's output is
# after the gate).
_ROW_FACTS = {"attn.out": "linear_bias", "moe.shared_out": "megatron_moe_shared_expert_gate"}


# ---------------------------------------------------------------- model inspection (imports nothing)

def _unwrap(model: Any) -> Any:
    """GPTModel inside DDP / Float16Module wrappers (their `.module`)."""
    seen = 0
    while not hasattr(model, "decoder") and hasattr(model, "module") and seen < 8:
        model = model.module
        seen += 1
    return model


def _cls(m: Any) -> str:
    return type(m).__name__ if m is not None else "None"


def _is_identity(m: Any) -> bool:
    return m is None or _cls(m) in ("IdentityOp", "Identity")


def _moe_pattern(cfg: Any) -> list[int]:
    n = int(cfg.num_layers)
    if not getattr(cfg, "num_moe_experts", None):
        return [0] * n
    freq = getattr(cfg, "moe_layer_freq", 1)
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(n)]
    return [int(x) for x in list(freq)[:n]]


def _torch_dtype_name(dt: Any) -> str:
    return str(dt).removeprefix("torch.") if dt is not None else ""


# ---------------------------------------------------------------- architectures

def architecture_name(roots: Sequence[Any]) -> str:
    """A GPTModel cannot say which model family it was configured as; what the table relies on is its module
    structure: ``{model}/{decoder layer classes}/{self_attention classes}/{mlp classes}`` (``+`` joins the
    classes of different layers), and ``/cross_attention`` when a layer has one (not a GPT layer). Every rank
    writes the one shared manifest, so the name must not depend on the pipeline stage: the layers of all of
    this rank's chunks are read, and the MLP part of a plain dense/MoE stack comes from the config's layer
    pattern (``moe_layer_freq``), which every stage has whole."""
    layers = [lay for r in roots for lay in (getattr(getattr(r, "decoder", None), "layers", []) or [])]

    def part(get) -> str:
        return "+".join(sorted({_cls(get(lay)) for lay in layers})) or "-"
    mlp = part(lambda x: getattr(x, "mlp", None))
    cfg = getattr(roots[0], "config", None) if roots else None
    if cfg is not None and set(mlp.split("+")) <= {"MLP", "MoELayer"}:
        mlp = "+".join(sorted({"MoELayer" if x else "MLP" for x in _moe_pattern(cfg)})) or mlp
    name = (f"{_cls(roots[0]) if roots else None}/{part(lambda x: x)}/"
            f"{part(lambda x: getattr(x, 'self_attention', None))}/{mlp}")
    if any(not _is_identity(getattr(lay, "cross_attention", None)) for lay in layers):
        name += "/cross_attention"
    return name


# Structures, not families (the families' tables): the HF or SGLang side of a pair names the family.
ARCHITECTURES = {a.name: a for n in _FAM for a in n.architectures}
# Components whose presence makes the table map the wrong modules (named in the refusal).
REFUSED = {
    "MambaModel": "hybrid Mamba / attention stacks: the Mamba mixers are no canonical point",
    "cross_attention": "an encoder-decoder layer: the cross-attention is no canonical point",
}


class MegatronAdapter(Adapter):
    """``adapter="megatron"``, or ``MegatronAdapter(vocab_size=V)`` when the model's vocabulary is padded."""
    name = "megatron"
    points = POINTS
    architectures = ARCHITECTURES
    refused = REFUSED

    def __init__(self, vocab_size: int | None = None):
        self.true_vocab_size = vocab_size
        self._layer_offsets: list[int] = []
        self._sp = False

    # ------------------------------------------------------------ trace time
    def prepare(self, tracer: Any, models: list) -> None:
        self._layer_offsets = []
        for model in models:
            root = _unwrap(model)
            self._sp = bool(getattr(getattr(root, "config", None), "sequence_parallel", False))
            layers = getattr(getattr(root, "decoder", None), "layers", None)
            off = 0
            if layers is not None and len(layers):
                off = int(getattr(layers[0], "layer_number", 1)) - 1
            self._layer_offsets.append(off)
            for name, mod in root.named_modules():
                if name.endswith(".mlp.router") and hasattr(mod, "gating"):
                    tracer.tap_method(mod, "gating")
                disp = getattr(mod, "token_dispatcher", None)
                if disp is not None and hasattr(disp, "combine_postprocess"):
                    tracer.tap_method(disp, "combine_postprocess")
        tracer.record_inputs_of([r"re:(^|\.)decoder\.layers\.\d+$", r"re:\.self_attention\.core_attention$",
                                 r"re:\.pre_mlp_layernorm$"])

    def describe(self, models: list) -> dict:
        root = _unwrap(models[0])
        cfg = getattr(root, "config", None)
        if cfg is None:
            return {}
        layers = list(getattr(getattr(root, "decoder", None), "layers", []) or [])
        heads = int(cfg.num_attention_heads)
        te = any(_cls(m).startswith("TE") for m in root.modules())
        fused_input = bool(layers) and _is_identity(getattr(layers[0], "input_layernorm", None))
        dense = [lay for lay in layers if not hasattr(getattr(lay, "mlp", None), "router")]
        if dense:
            fused_dense_mlp_norm = _is_identity(getattr(dense[0], "pre_mlp_layernorm", None))
        else:   # this stage has no dense layer: the TE spec fuses dense layers' pre-MLP norm into fc1
            fused_dense_mlp_norm = te
        pattern = _moe_pattern(cfg)
        padded = int(getattr(root, "vocab_size", 0) or 0)
        attn0 = getattr(layers[0], "self_attention", None) if layers else None
        qk = bool(getattr(cfg, "qk_layernorm", False)) and not _is_identity(getattr(attn0, "q_layernorm", None))
        qk = qk and not family_attention(cfg)     # a family's own attention: MLA's q_layernorm is the q latent's
        rope = getattr(root, "rotary_pos_emb", None) or getattr(attn0, "rotary_pos_emb", None)   # MLA: per layer
        theta = None
        if rope is not None and getattr(rope, "inv_freq", None) is not None and rope.inv_freq.numel() > 1:
            inv = rope.inv_freq.detach().double().cpu()
            dim = 2 * inv.numel()
            theta = float(f"{(1.0 / float(inv[1])) ** (dim / 2.0):.6g}")
        n_exp = int(getattr(cfg, "num_moe_experts", 0) or 0)
        shared = getattr(cfg, "moe_shared_expert_intermediate_size", None) is not None
        return self.settle_verified({
            **self.architecture_facts(models),
            "model_type": "megatron-gpt",
            "spec": "te" if te else "local",
            "num_layers": int(cfg.num_layers),
            "hidden_size": int(cfg.hidden_size),
            "num_attention_heads": heads,
            "num_key_value_heads": int(getattr(cfg, "num_query_groups", None) or heads),
            "head_dim": int(getattr(cfg, "kv_channels", None) or cfg.hidden_size // heads),
            "attention_output_gate": bool(getattr(cfg, "attention_output_gate", False)),
            "linear_bias": bool(getattr(cfg, "add_bias_linear", False)),
            "qk_layernorm": qk,
            "vocab_size": int(self.true_vocab_size or padded),
            "padded_vocab_size": padded,
            "num_experts": n_exp,
            "num_experts_per_tok": int(getattr(cfg, "moe_router_topk", 0) or 0) if n_exp else 0,
            "shared_experts": shared,
            "moe_shared_expert_overlap": bool(getattr(cfg, "moe_shared_expert_overlap", False)),
            "moe_layers": [i for i, x in enumerate(pattern) if x],
            "moe_token_dispatcher_type": getattr(cfg, "moe_token_dispatcher_type", None) if n_exp else None,
            "fused_input_norm": fused_input,
            "fused_dense_mlp_norm": bool(fused_dense_mlp_norm),
            "rms_norm_eps": float(getattr(cfg, "layernorm_epsilon", 0.0)),
            "normalization": getattr(cfg, "normalization", None),
            "rope_theta": theta,
            "sequence_parallel": bool(getattr(cfg, "sequence_parallel", False)),
            "tensor_model_parallel_size": int(getattr(cfg, "tensor_model_parallel_size", 1) or 1),
            "expert_model_parallel_size": int(getattr(cfg, "expert_model_parallel_size", 1) or 1),
            "context_parallel_size": int(getattr(cfg, "context_parallel_size", 1) or 1),
            "pipeline_model_parallel_size": int(getattr(cfg, "pipeline_model_parallel_size", 1) or 1),
            "dtype": _torch_dtype_name(getattr(cfg, "params_dtype", None)),
            "router_scoring": getattr(cfg, "moe_router_score_function", None) if n_exp else None,
            **(_router_facts(cfg, layers) if n_exp else {}),
            **{k: v for n in _FAM if "describe" in n.tables for k, v in n.tables["describe"](cfg).items()},
            **feature_facts(cfg, root),
        })

    def architecture_of(self, models: list) -> str | None:
        return architecture_name([_unwrap(m) for m in models])

    def check_architecture(self, config: dict) -> ArchitectureCheck:
        """As the base, naming the components known to be mapped wrongly when the structure has any."""
        c = super().check_architecture(config)
        refusal = (_family_refusal(config) or feature_refusal(config)) if c.verified else None
        if refusal:
            return ArchitectureCheck(c.adapter, c.name, False, refusal)
        if c.verified or not c.name:
            return c
        bad = [f"`{p}`: {REFUSED[p]}" for p in c.name.replace("+", "/").split("/") if p in REFUSED]
        if not bad:
            return c
        return ArchitectureCheck(c.adapter, c.name, False, "known to be mapped wrongly by the megatron table: "
                                 + "; ".join(bad))

    def numerics(self, models: list) -> dict:
        cfg = getattr(_unwrap(models[0]), "config", None)
        return plain_settings(cfg, NUMERICS_FIELDS) if cfg is not None else {}

    def weight_pieces(self, models: list, params: dict) -> dict:
        from tic_trace.adapters.megatron_weight_map import megatron_weight_pieces
        return megatron_weight_pieces(models, params, self.rank_coords(), self._layer_offsets, self.true_vocab_size)

    def parallel_layout(self) -> dict:
        c = self.rank_coords()
        return {k: c[k] for k in ("tp_size", "pp_size", "ep_size", "etp_size", "cp_size", "dp_size", "sp")
                if k in c}

    def rank_coords(self) -> dict:
        out: dict[str, Any] = {"sp": self._sp, "layer_offset": self._layer_offsets[0] if self._layer_offsets else 0,
                               "layer_offsets": list(self._layer_offsets)}
        try:
            from megatron.core import parallel_state as ps
        except ImportError:
            return out
        if not ps.model_parallel_is_initialized():
            return out
        getters = {
            "tp": ("get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size"),
            "pp": ("get_pipeline_model_parallel_rank", "get_pipeline_model_parallel_world_size"),
            "ep": ("get_expert_model_parallel_rank", "get_expert_model_parallel_world_size"),
            "etp": ("get_expert_tensor_parallel_rank", "get_expert_tensor_parallel_world_size"),
            "cp": ("get_context_parallel_rank", "get_context_parallel_world_size"),
            "dp": ("get_data_parallel_rank", "get_data_parallel_world_size"),
        }
        for k, (r, s) in getters.items():
            try:
                out[f"{k}_rank"] = int(getattr(ps, r)())
                out[f"{k}_size"] = int(getattr(ps, s)())
            except Exception:  # noqa: BLE001 - a group that this setup does not have
                pass
        return out

    def _cp(self) -> tuple[int, int]:
        try:
            from megatron.core import parallel_state as ps
            if ps.model_parallel_is_initialized():
                return int(ps.get_context_parallel_world_size()), int(ps.get_context_parallel_rank())
        except Exception:  # noqa: BLE001
            pass
        return 1, 0

    _FORWARD_ARGS = ("input_ids", "position_ids", "attention_mask", "decoder_input", "labels",
                     "inference_context", "packed_seq_params")

    def rows_from_forward(self, tracer: Any, args: tuple, kwargs: dict):
        bound = dict(zip(self._FORWARD_ARGS, args))
        bound.update(kwargs)
        ids = bound.get("input_ids")
        if ids is None or not hasattr(ids, "dim") or ids.dim() != 2:
            return None    # e.g. a middle pipeline stage: the caller names the rows with tracer.set_rows
        cp_size, cp_rank = self._cp()
        psp = bound.get("packed_seq_params")
        if psp is not None and getattr(psp, "qkv_format", None) == "thd":
            keys, pos = rows_from_packed(psp, tracer.sample_keys, cp_size, cp_rank, n_rows=int(ids.shape[1]))
            return keys, pos, ids[0].tolist()
        b, s = (int(x) for x in ids.shape)
        keys, pos = rows_from_sbhd(b, s, tracer.sample_keys, cp_size, cp_rank)
        tokens = ids.t().reshape(-1).tolist()      # s-major, like the rows
        return keys, pos, tokens

    def token_dims(self, record_name: str) -> int | None:
        if record_name.endswith(":in[3]") or "rotary_pos_emb:" in record_name:
            return 0        # attention mask, rotary table
        return None         # [s, b, ...], [t, 1, ...], [t, heads, hn] and [T, E]: the tracer's row-count guess

    # ------------------------------------------------------------ read time
    def rank_groups(self, ranks: list[int], rank_infos: dict[int, dict]) -> list[list[int]]:
        groups: dict[tuple, list[int]] = {}
        for r in sorted(ranks):
            c = (rank_infos.get(r) or {}).get("coords") or {}
            key = (c.get("pp_rank", 0), c.get("dp_rank", r if "tp_rank" not in c else 0), c.get("cp_rank", 0))
            groups.setdefault(key, []).append(r)
        out = []
        for key in sorted(groups):
            g = groups[key]
            out.append(sorted(g, key=lambda r: ((rank_infos.get(r) or {}).get("coords") or {}).get("tp_rank", 0)))
        return out

    def global_layer(self, local: int, rank_info: dict, config: dict) -> int:
        """``layer_number - 1``: the local index plus this stage's offset (of virtual-pipeline chunk
        ``rank_info["chunk"]`` when the record name says which chunk)."""
        coords = rank_info.get("coords") or {}
        chunk = rank_info.get("chunk")
        offsets = coords.get("layer_offsets") or []
        if chunk is not None and chunk < len(offsets):
            return local + int(offsets[chunk])
        return local + int(coords.get("layer_offset", 0) or 0)

    def keeps(self, pm: PointMap, layer: int | None, config: dict) -> bool:
        if pm.point == "attn_norm":
            return not config.get("fused_input_norm")
        if pm.point == "mlp_norm" and config.get("fused_dense_mlp_norm"):
            return layer in set(config.get("moe_layers") or [])
        return True

    def applies(self, pm: PointMap, config: dict) -> bool:
        if any(n.tables["applies"](pm, rows, config) is False for n, rows in _FAM_ROWS if "applies" in n.tables):
            return False                    # a family's row its model lacks, or a standard row it never reads
        if pm.point == "attn_norm" and config.get("fused_input_norm"):
            return False
        if pm.point == "mlp_norm" and config.get("fused_dense_mlp_norm") and not config.get("moe_layers"):
            return False
        if pm.point in ("attn.q_norm", "attn.k_norm") and not config.get("qk_layernorm", True):
            return False
        fact = _ROW_FACTS.get(pm.point)
        if fact and bool(pm.opts.get("when")) != bool(config.get(fact)):
            return False
        if pm.point in ("moe.experts_out", "moe.shared_out") and config.get("moe_shared_expert_overlap"):
            return False
        return super().applies(pm, config)


ADAPTER = MegatronAdapter
register_adapter(MegatronAdapter)


def _family_refusal(config: dict) -> str | None:
    """Why a family says this trace's setup is not one its tests ran (None: none says so)."""
    return next((w for n in _FAM if "refusal" in n.tables for w in (n.tables["refusal"](config),) if w), None)


def _router_facts(cfg: Any, layers: list) -> dict:
    """The router's selection bias per MoE layer (`expert_bias`, global layer numbers) and its group limit:
    Megatron scores a group by the sum of its best topk // group_topk scores (moe_utils.group_limited_topk)."""
    groups = int(getattr(cfg, "moe_router_num_groups", None) or 1)
    topk_group = int(getattr(cfg, "moe_router_group_topk", None) or groups)
    topk = int(getattr(cfg, "moe_router_topk", 0) or 0)
    biases = [(int(getattr(lay, "layer_number", i + 1)) - 1, getattr(lay.mlp.router, "expert_bias", None))
              for i, lay in enumerate(layers) if hasattr(getattr(lay, "mlp", None), "router")]
    return router_facts(biases, n_group=groups, topk_group=topk_group,
                        group_top=topk // topk_group if groups > 1 and topk_group else None)
