"""HF weights (Qwen3 / Qwen3-MoE, Llama, Qwen2, Phi-3, Mixtral, Qwen2-MoE, DeepSeek-V3, GLM-4.5, GPT-OSS) ->
megatron-core ``GPTModel`` (local spec) parameter names and shards.

Pure torch; megatron is never imported. The result is the per-rank ``state_dict`` of a megatron-core
``GPTModel`` built with the local layer spec (``get_gpt_layer_local_spec`` /
``get_gpt_decoder_block_spec(..., use_transformer_engine=False)``), SwiGLU, QK-norm, no biases,
``moe_grouped_gemm=False`` (``SequentialMLP`` experts), no pipeline parallelism.

Layouts (``H`` hidden, ``NH`` query heads, ``NG`` KV heads / query groups, ``hn`` head dim, ``I`` dense
FFN size, ``F`` expert FFN size, ``E`` experts, ``V`` vocab):

* ``embedding.word_embeddings.weight`` ``[V/tp, H]``: rows ``tp_rank*V/tp ...`` of ``embed_tokens``
  (``VocabParallelEmbedding``).
* ``decoder.layers.{i}.input_layernorm.weight`` ``[H]`` <- ``input_layernorm``; replicated.
* ``decoder.layers.{i}.self_attention.linear_qkv.weight`` ``[(NH+2NG)*hn/tp, H]``: the global weight is
  interleaved per query group, ``[q heads of group 0; k_0; v_0; q heads of group 1; k_1; v_1; ...]``
  (group ``g`` owns query heads ``g*NH/NG ... (g+1)*NH/NG-1``), and TP rank ``r`` holds the contiguous
  ``r``-th 1/tp slice of those rows (whole groups when ``NG >= tp``). ``attention_bias`` models get
  ``linear_qkv.bias`` in the same order. Phi-3's fused ``qkv_proj`` (``[q | k | v]`` rows) and ``gate_up_proj``
  (``[gate | up]``) are split first (the Phi-3 family's Megatron tables ``fused_qkv`` / ``fused_gate_up``).
* ``...self_attention.q_layernorm.weight`` / ``k_layernorm.weight`` ``[hn]`` <- ``q_norm`` / ``k_norm``.
* ``...self_attention.linear_proj.weight`` ``[H, NH*hn/tp]``: column slice ``r`` of ``o_proj``
  (``RowParallelLinear``; head order is preserved).
* ``decoder.layers.{i}.pre_mlp_layernorm.weight`` ``[H]`` <- ``post_attention_layernorm``.
* Dense MLP: ``mlp.linear_fc1.weight`` ``[2I/tp, H]`` is ``[gate_r; up_r]`` where ``gate_r`` / ``up_r``
  are the ``r``-th 1/tp row slices of ``gate_proj`` / ``up_proj`` (``ColumnParallelLinear`` with
  ``stride=2``; at tp=1 simply ``[gate; up]``). ``mlp.linear_fc2.weight`` ``[H, I/tp]`` is column slice
  ``r`` of ``down_proj``.
* MoE: ``mlp.router.weight`` ``[E, H]`` <- ``mlp.gate.weight``, replicated. Expert-parallel rank
  ``ep_rank`` owns global experts ``ep_rank*E/ep ... (ep_rank+1)*E/ep - 1``; global expert ``e`` is
  stored at local index ``k = e - ep_rank*E/ep`` as ``mlp.experts.local_experts.{k}.linear_fc1.weight``
  ``[2F/etp, H]`` (``[gate_r; up_r]`` over the expert-TP rank, like dense fc1) and
  ``...linear_fc2.weight`` ``[H, F/etp]``. transformers 5.x stores experts as 3D tensors
  ``mlp.experts.gate_up_proj [E, 2F, H]`` (gate rows first, then up) and ``mlp.experts.down_proj
  [E, H, F]``; transformers 4.x per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight`` is accepted too.
  Expert-TP defaults to TP (megatron's default ``expert_tensor_parallel_size``).
* DeepSeek-V3 (a layer with ``self_attn.kv_a_proj_with_mqa``): multi-latent attention -> ``MLASelfAttention``'s
  ``linear_q_down_proj`` / ``q_layernorm`` / ``linear_q_up_proj`` (or ``linear_q_proj`` without a q latent),
  ``linear_kv_down_proj`` / ``kv_layernorm`` / ``linear_kv_up_proj``, ``linear_proj`` <- ``q_a_proj`` /
  ``q_a_layernorm`` / ``q_b_proj`` (``q_proj``), ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj``,
  ``o_proj``, unchanged (the deepseek family's ``names_megatron.MLA_WEIGHTS``; ``_named_attention``). The
  router's selection bias (the family's Megatron table ``router_bias``) -> ``mlp.router.expert_bias`` (fp32, as
  megatron keeps it), ``mlp.shared_experts.{gate,up,down}_proj`` ->
  ``mlp.shared_experts.linear_fc1`` (``[gate; up]``) / ``linear_fc2``. Qwen2-MoE's one gated shared expert
  (``mlp.shared_expert.*``) the same, its ``mlp.shared_expert_gate.weight`` -> ``mlp.shared_experts.gate_weight``.
* GPT-OSS (a layer with ``mlp.router.weight``): ``o_proj.bias`` -> ``linear_proj.bias``, ``self_attn.sinks`` ->
  ``core_attention.softmax_offset``, ``mlp.router.{weight,bias}`` -> ``mlp.router.{weight,bias}``, the experts as
  ``_interleaved_experts`` says (gate and up de-interleaved from alternate columns; the names: the GPT-OSS
  family's Megatron table ``interleaved_experts``).
* ``decoder.final_layernorm.weight`` <- ``model.norm.weight``.
* ``output_layer.weight`` ``[V/tp, H]`` <- ``lm_head.weight`` (row slice). With ``tie_word_embeddings``
  megatron shares ``embedding.word_embeddings.weight`` (``share_embeddings_and_output_weights=True``) and
  ``output_layer.weight`` is not a parameter, so it is not emitted.

With ``padded_vocab_size`` the vocabulary rows are zero-padded before slicing (megatron-LM pads the vocab
to a multiple of ``make_vocab_size_divisible_by * tp``); logits past the real vocab are then meaningless.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from tic_trace.families import framework_names

__all__ = ["hf_to_megatron_state_dict", "load_into", "WeightLoadError"]


class WeightLoadError(RuntimeError):
    """The converted state dict does not fit the model (missing / unexpected keys, wrong shapes)."""


def _cfg(hf_config: Any, name: str, default: Any = None) -> Any:
    if isinstance(hf_config, Mapping):
        return hf_config.get(name, default)
    return getattr(hf_config, name, default)


def _shard(t: torch.Tensor, rank: int, size: int, dim: int, what: str) -> torch.Tensor:
    if size == 1:
        return t
    if t.shape[dim] % size:
        raise ValueError(f"{what}: dim {dim} of shape {tuple(t.shape)} is not divisible by {size}")
    return t.chunk(size, dim=dim)[rank]


def _glu_fc1(gate: torch.Tensor, up: torch.Tensor, rank: int, size: int, what: str) -> torch.Tensor:
    """``[gate_r; up_r]``: megatron's stride-2 ColumnParallelLinear layout for SwiGLU fc1."""
    return torch.cat([_shard(gate, rank, size, 0, what + " gate"), _shard(up, rank, size, 0, what + " up")], 0)


def _interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_heads: int, n_groups: int,
                    head_dim: int) -> torch.Tensor:
    """``[NH*hn, ...]``, ``[NG*hn, ...]`` x2 -> per-group ``[q heads of g; k_g; v_g]`` (global layout)."""
    if n_heads % n_groups:
        raise ValueError(f"num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_groups}")
    tail = q.shape[1:]
    qg = q.reshape(n_groups, (n_heads // n_groups) * head_dim, *tail)
    kg = k.reshape(n_groups, head_dim, *tail)
    vg = v.reshape(n_groups, head_dim, *tail)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *tail)


def _pad_rows(t: torch.Tensor, rows: Optional[int]) -> torch.Tensor:
    if rows is None or rows == t.shape[0]:
        return t
    if rows < t.shape[0]:
        raise ValueError(f"padded_vocab_size={rows} is smaller than the vocab {t.shape[0]}")
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))], dim=0)


# Checkpoints that fuse q/k/v ([q | k | v] rows, under self_attn.) and gate/up ([gate | up] rows, under mlp.) on disk:
# the families' Megatron tables `fused_qkv` / `fused_gate_up` name those tensors
_FUSED_QKV = tuple(n.tables["fused_qkv"] for n in framework_names("megatron") if "fused_qkv" in n.tables)
_FUSED_GATE_UP = tuple(n.tables["fused_gate_up"] for n in framework_names("megatron") if "fused_gate_up" in n.tables)
# learned per-head sink logits (under self_attn.) -> megatron's parameter (the families' `attention_sinks` tables)
_SINKS = tuple(n.tables["attention_sinks"] for n in framework_names("megatron") if "attention_sinks" in n.tables)
# a router's selection-only bias (under mlp.): HF's name -> megatron's (the families' `router_bias` tables)
_ROUTER_BIASES = tuple(n.tables["router_bias"] for n in framework_names("megatron") if "router_bias" in n.tables)


def _standard_attention(sd: Mapping[str, torch.Tensor], get, attn: str, dst: str, shape: tuple[int, int, int],
                        tp_rank: int, tp_size: int, what: str) -> dict[str, torch.Tensor]:
    """q/k/v/o (and q/k/v bias, QK-norm) -> ``linear_qkv`` (per-group interleaved), the norms, ``linear_proj``."""
    n_heads, n_groups, head_dim = shape
    out = {}
    fused = next((f for f in _FUSED_QKV if attn + f in sd), None)
    if fused is not None:                   # a family's checkpoint: [q | k | v] rows of one fused projection
        q, k, v = get(attn + fused).split([n_heads * head_dim, n_groups * head_dim, n_groups * head_dim])
        qkv = _interleave_qkv(q, k, v, n_heads, n_groups, head_dim)
    else:
        qkv = _interleave_qkv(get(attn + "q_proj.weight"), get(attn + "k_proj.weight"),
                              get(attn + "v_proj.weight"), n_heads, n_groups, head_dim)
    out[dst + "linear_qkv.weight"] = _shard(qkv, tp_rank, tp_size, 0, f"{what} qkv")
    if attn + "q_proj.bias" in sd:
        qkv_b = _interleave_qkv(get(attn + "q_proj.bias"), get(attn + "k_proj.bias"), get(attn + "v_proj.bias"),
                                n_heads, n_groups, head_dim)
        out[dst + "linear_qkv.bias"] = _shard(qkv_b, tp_rank, tp_size, 0, f"{what} qkv bias")
    if attn + "q_norm.weight" in sd:
        out[dst + "q_layernorm.weight"] = get(attn + "q_norm.weight")
        out[dst + "k_layernorm.weight"] = get(attn + "k_norm.weight")
    out[dst + "linear_proj.weight"] = _shard(get(attn + "o_proj.weight"), tp_rank, tp_size, 1, f"{what} o_proj")
    if attn + "o_proj.bias" in sd:          # added once, after the row-parallel reduce
        out[dst + "linear_proj.bias"] = get(attn + "o_proj.bias")
    for hf, mg in _SINKS:                   # a family's sink logit per query head (heads column-parallel)
        if attn + hf in sd:
            out[dst + mg] = _shard(get(attn + hf), tp_rank, tp_size, 0, f"{what} {hf}")
    return out


def _local_experts(n_experts: int, ep_rank: int, ep_size: int) -> list[tuple[int, int]]:
    """(local index, global expert) of the experts expert-parallel rank ``ep_rank`` owns (a contiguous block)."""
    if n_experts % ep_size:
        raise ValueError(f"{n_experts} experts are not divisible by ep_size={ep_size}")
    n_local = n_experts // ep_size
    return [(k, ep_rank * n_local + k) for k in range(n_local)]


# MoE blocks the families convert by name (their Megatron `interleaved_experts` tables: a router with a bias,
# experts stored fused and input-major with biases, gate and up in alternate columns)
_INTERLEAVED_EXPERTS = tuple(n.tables["interleaved_experts"] for n in framework_names("megatron")
                             if "interleaved_experts" in n.tables)


def _interleaved_experts(get, mlp: str, dst: str, names: Mapping, experts: list[tuple[int, int]],
                         etp: tuple[int, int], what: str) -> dict[str, torch.Tensor]:
    """A router (weight and bias) and experts whose ``gate_up [E, H, 2F]`` holds gate and up in alternate columns,
    ``down [E, F, H]`` (both input-major), with their biases (`names`: the family's HF names of each) -> per expert
    ``linear_fc1`` ``[gate; up]`` and ``linear_fc2`` (output-major), with biases."""
    out = {dst + "mlp.router.weight": get(mlp + names["router_weight"]),
           dst + "mlp.router.bias": get(mlp + names["router_bias"])}
    gate_up, gate_up_b = get(mlp + names["gate_up"]), get(mlp + names["gate_up_bias"])
    down, down_b = get(mlp + names["down"]), get(mlp + names["down_bias"])
    for k, e in experts:
        edst = f"{dst}mlp.experts.local_experts.{k}."
        w, b = gate_up[e].T, gate_up_b[e]
        out[edst + "linear_fc1.weight"] = _glu_fc1(w[0::2], w[1::2], *etp, f"{what} expert {e} fc1")
        out[edst + "linear_fc1.bias"] = _glu_fc1(b[0::2], b[1::2], *etp, f"{what} expert {e} fc1 bias")
        out[edst + "linear_fc2.weight"] = _shard(down[e].T, *etp, 1, f"{what} expert {e} fc2")
        out[edst + "linear_fc2.bias"] = down_b[e]
    return out


# Attention modules the families convert by name (their Megatron `attention_weights` tables: multi-latent
# attention's, HF DeepseekV3Attention -> MLASelfAttention): every tensor copied, column-parallel ones row-sliced
# per TP rank, linear_proj column-sliced.
_ATTN_WEIGHTS = tuple(n.tables["attention_weights"] for n in framework_names("megatron")
                      if "attention_weights" in n.tables)


def _named_attention(get, attn: str, dst: str, names: Mapping, tp_rank: int, tp_size: int,
                     what: str) -> dict[str, torch.Tensor]:
    """An attention converted by its family's names (MLA's projections and latent norms: ``q_a_*`` absent
    without a q latent, then ``q_proj``): a name the checkpoint lacks is skipped."""
    out = {}
    for hf, mg in names["column"]:
        try:
            w = get(attn + hf + ".weight")
        except KeyError:
            continue
        out[dst + mg + ".weight"] = _shard(w, tp_rank, tp_size, 0, f"{what} {hf}")
    for hf, mg in names["norms"]:
        try:
            out[dst + mg + ".weight"] = get(attn + hf + ".weight")
        except KeyError:
            continue
    out[dst + "linear_proj.weight"] = _shard(get(attn + "o_proj.weight"), tp_rank, tp_size, 1, f"{what} o_proj")
    return out


def hf_to_megatron_state_dict(
    hf_state_dict: Mapping[str, torch.Tensor],
    hf_config: Any,
    tp_rank: int = 0,
    tp_size: int = 1,
    ep_rank: int = 0,
    ep_size: int = 1,
    *,
    etp_rank: Optional[int] = None,
    etp_size: Optional[int] = None,
    padded_vocab_size: Optional[int] = None,
) -> dict[str, torch.Tensor]:
    """Convert a HF Qwen3 / Qwen3-MoE ``state_dict`` to one rank's megatron GPTModel ``state_dict``.

    ``hf_state_dict`` may come from ``Qwen3(Moe)ForCausalLM`` (keys ``model.*`` and ``lm_head.weight``)
    or from the bare ``Qwen3(Moe)Model`` (keys without the ``model.`` prefix; then there is no
    ``lm_head`` and the embeddings must be tied). ``hf_config`` is the HF config object or a dict.
    ``etp_rank``/``etp_size`` (expert tensor parallel) default to ``tp_rank``/``tp_size``.
    Layer kinds are taken from the weights: a layer with ``mlp.gate.weight`` is MoE, else dense.
    The returned tensors are fresh contiguous copies (the HF tensors are not aliased).
    See the module docstring for the layouts.
    """
    etp_rank = tp_rank if etp_rank is None else etp_rank
    etp_size = tp_size if etp_size is None else etp_size
    for name, r, s in (("tp", tp_rank, tp_size), ("ep", ep_rank, ep_size), ("etp", etp_rank, etp_size)):
        if not (s >= 1 and 0 <= r < s):
            raise ValueError(f"bad {name} rank/size: {r}/{s}")

    sd = {}
    for key, value in hf_state_dict.items():
        sd[key[len("model."):] if key.startswith("model.") else key] = value

    def get(key: str) -> torch.Tensor:
        try:
            return sd[key]
        except KeyError:
            raise KeyError(f"HF state dict has no {key!r} (nor 'model.{key}')") from None

    hidden = int(_cfg(hf_config, "hidden_size"))
    n_heads = int(_cfg(hf_config, "num_attention_heads"))
    n_groups = int(_cfg(hf_config, "num_key_value_heads") or n_heads)
    head_dim = int(_cfg(hf_config, "head_dim") or hidden // n_heads)
    n_layers = int(_cfg(hf_config, "num_hidden_layers"))
    tied = bool(_cfg(hf_config, "tie_word_embeddings", False))

    out: dict[str, torch.Tensor] = {}
    embed = _pad_rows(get("embed_tokens.weight"), padded_vocab_size)
    out["embedding.word_embeddings.weight"] = _shard(embed, tp_rank, tp_size, 0, "embed_tokens")

    for i in range(n_layers):
        src, dst = f"layers.{i}.", f"decoder.layers.{i}."
        out[dst + "input_layernorm.weight"] = get(src + "input_layernorm.weight")
        attn = src + "self_attn."
        named = next((w for w in _ATTN_WEIGHTS if attn + w["marker"] in sd), None)
        if named is not None:       # multi-latent attention (a family's names)
            out.update(_named_attention(get, attn, dst + "self_attention.", named, tp_rank, tp_size, f"layer {i}"))
        else:
            out.update(_standard_attention(sd, get, attn, dst + "self_attention.", (n_heads, n_groups, head_dim),
                                           tp_rank, tp_size, f"layer {i}"))
        out[dst + "pre_mlp_layernorm.weight"] = get(src + "post_attention_layernorm.weight")

        mlp = src + "mlp."
        moe = next((n for n in _INTERLEAVED_EXPERTS if mlp + n["router_weight"] in sd), None)
        if moe is not None:                 # a family's biased router and interleaved experts (its names)
            experts = _local_experts(int(get(mlp + moe["router_weight"]).shape[0]), ep_rank, ep_size)
            out.update(_interleaved_experts(get, mlp, dst, moe, experts, (etp_rank, etp_size), f"layer {i}"))
        elif mlp + "gate.weight" in sd:  # MoE layer
            out[dst + "mlp.router.weight"] = get(mlp + "gate.weight")
            fused = mlp + "experts.gate_up_proj" in sd
            for k, e in _local_experts(int(get(mlp + "gate.weight").shape[0]), ep_rank, ep_size):
                if fused:
                    gate, up = get(mlp + "experts.gate_up_proj")[e].chunk(2, dim=0)
                    down = get(mlp + "experts.down_proj")[e]
                else:
                    gate = get(f"{mlp}experts.{e}.gate_proj.weight")
                    up = get(f"{mlp}experts.{e}.up_proj.weight")
                    down = get(f"{mlp}experts.{e}.down_proj.weight")
                edst = f"{dst}mlp.experts.local_experts.{k}."
                out[edst + "linear_fc1.weight"] = _glu_fc1(gate, up, etp_rank, etp_size, f"layer {i} expert {e} fc1")
                out[edst + "linear_fc2.weight"] = _shard(down, etp_rank, etp_size, 1, f"layer {i} expert {e} fc2")
            for hf_bias, mg_bias in _ROUTER_BIASES:          # a family's choice-only bias, in fp32 as megatron's
                if mlp + hf_bias in sd:
                    out[dst + "mlp." + mg_bias] = get(mlp + hf_bias).float()
            # DeepSeek-V3 / GLM-4.5: ungated, plural; Qwen2-MoE: one, sigmoid-gated
            shared = next((mlp + n for n in ("shared_experts.", "shared_expert.")
                           if mlp + n + "gate_proj.weight" in sd), None)
            if shared is not None:
                sh, shdst = shared, dst + "mlp.shared_experts."
                if mlp + "shared_expert_gate.weight" in sd:     # [1, H]: megatron's gate_weight, replicated
                    out[shdst + "gate_weight"] = get(mlp + "shared_expert_gate.weight")
                out[shdst + "linear_fc1.weight"] = _glu_fc1(get(sh + "gate_proj.weight"), get(sh + "up_proj.weight"),
                                                            tp_rank, tp_size, f"layer {i} shared fc1")
                out[shdst + "linear_fc2.weight"] = _shard(get(sh + "down_proj.weight"), tp_rank, tp_size, 1,
                                                          f"layer {i} shared fc2")
        else:  # dense layer (a family's checkpoint may hold gate and up as the two halves of one fused tensor)
            fused = next((f for f in _FUSED_GATE_UP if mlp + f in sd), None)
            gate, up = (get(mlp + fused).chunk(2, dim=0) if fused is not None
                        else (get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight")))
            out[dst + "mlp.linear_fc1.weight"] = _glu_fc1(gate, up, tp_rank, tp_size, f"layer {i} fc1")
            out[dst + "mlp.linear_fc2.weight"] = _shard(
                get(mlp + "down_proj.weight"), tp_rank, tp_size, 1, f"layer {i} down_proj")

    out["decoder.final_layernorm.weight"] = get("norm.weight")
    if not tied:
        head = _pad_rows(get("lm_head.weight"), padded_vocab_size)
        out["output_layer.weight"] = _shard(head, tp_rank, tp_size, 0, "lm_head")

    return {k: v.detach().clone().contiguous() for k, v in out.items()}


_IGNORED_SUFFIXES = ("._extra_state",)


def load_into(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load ``state_dict`` into ``model`` strictly, with a readable error.

    Raises :class:`WeightLoadError` listing missing keys, unexpected keys and shape mismatches (all of
    them, not just the first). ``*._extra_state`` entries (Transformer Engine / FP8 metadata) are not
    required. Values are copied into the existing parameters (dtype converted to the parameter's).
    """
    expected = model.state_dict()
    wanted = {k for k in expected if not k.endswith(_IGNORED_SUFFIXES)}
    given = set(state_dict)
    missing = sorted(wanted - given)
    unexpected = sorted(given - set(expected))
    mismatched = sorted(
        f"{k}: model {tuple(expected[k].shape)} vs given {tuple(state_dict[k].shape)}"
        for k in wanted & given
        if tuple(expected[k].shape) != tuple(state_dict[k].shape)
    )
    if missing or unexpected or mismatched:
        lines = [f"state dict does not fit {type(model).__name__}:"]
        for title, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", mismatched)):
            if items:
                lines.append(f"  {title} ({len(items)}):")
                lines.extend(f"    {item}" for item in items)
        raise WeightLoadError("\n".join(lines))
    with torch.no_grad():
        result = model.load_state_dict(dict(state_dict), strict=False)
    leftover = [k for k in result.missing_keys if not k.endswith(_IGNORED_SUFFIXES)]
    if leftover or result.unexpected_keys:  # pragma: no cover - caught above
        raise WeightLoadError(f"missing {leftover}, unexpected {result.unexpected_keys}")
