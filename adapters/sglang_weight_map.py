"""SGLang model parameters -> the HF checkpoint tensors they hold (`record/weight_pieces.py`).

Read off the layers themselves, as SGLang's own weight loaders fill them: `QKVParallelLinear` stacks this
rank's rows of q_proj, k_proj and v_proj (k/v shared by `num_kv_head_replicas` ranks when there are fewer KV
heads than ranks), `MergedColumnParallelLinear` this rank's rows of each merged tensor (gate_proj, up_proj),
a column-parallel layer a block of rows, a row-parallel one a block of columns, a vocabulary-parallel
embedding or LM head the rows [org_vocab_start, org_vocab_end) followed by padding, `FusedMoE` per local
expert `w13` = [gate; up] rows and `w2` = down_proj columns of its expert-tensor-parallel block. Phi-3's
checkpoint fuses q/k/v and gate/up itself: its pieces are rows of those fused tensors. A parameter of any other
layer is the checkpoint tensor of its own name when the layer is replicated (norms, routers); anything else
(quantized, fused shared experts, biases of experts) is left out and named as not mappable.
"""
from __future__ import annotations

from typing import Any

from tic_trace.families import family_of, framework_names
from tic_trace.record.weight_pieces import WeightPiece, cols, rows, whole

# replicated layers (a family may add its own norm classes: its SGLang table `replicated`)
_REPLICATED = ("RMSNorm", "LayerNorm", "ReplicatedLinear",
               *(c for n in framework_names("sglang") for c in n.tables.get("replicated", ())))
_ROW_PARALLEL = ("RowParallelLinear",)
_COLUMN_PARALLEL = ("ColumnParallelLinear",)


def _rank_size(group: Any) -> tuple[int, int]:
    """As sglang.srt.distributed.utils.get_group_rank_size: None is an unsharded layout."""
    return (0, 1) if group is None else (int(group.rank_in_group), int(group.world_size))


def sglang_weight_pieces(models: list, params: dict) -> dict[str, list[WeightPiece]]:
    """{parameter name (as ParameterHasher names it): its pieces}; names it cannot map are left out."""
    out: dict[str, list[WeightPiece]] = {}
    for i, model in enumerate(models):
        fused_ckpt = _fused_on_disk(model)
        for mname, mod in model.named_modules():
            for pname, p in mod.named_parameters(recurse=False):
                full = f"{mname}.{pname}" if mname else pname
                key = full if i == 0 else f"{i}:{full}"
                if key not in params:
                    continue
                try:
                    pieces = _pieces(mod, mname, pname, p, fused_ckpt)
                except (AttributeError, TypeError, ValueError, ZeroDivisionError):
                    pieces = None       # a layer whose attributes are not the ones read here: not mapped
                if pieces:
                    out[key] = pieces
    return out


def _fused_on_disk(model: Any) -> bool:
    """Whether the model's checkpoint itself fuses q/k/v and gate/up (its family's SGLang table says so)."""
    own = family_of(str(getattr(getattr(model, "config", None), "model_type", ""))).names().get("sglang")
    return bool(own and own.tables.get("checkpoint_fuses_qkv"))


def _pieces(mod: Any, mname: str, pname: str, p, fused_ckpt: bool) -> list[WeightPiece] | None:
    cls = type(mod).__name__
    if cls in ("VocabParallelEmbedding", "ParallelLMHead") and pname == "weight":
        si = mod.shard_indices
        n = int(si.org_vocab_end_index) - int(si.org_vocab_start_index)
        shape = (int(mod.org_vocab_size), int(p.shape[1]))
        return [rows(f"{mname}.weight", shape, int(si.org_vocab_start_index), (slice(0, n),))] if n > 0 else None
    if pname not in ("weight", "bias") and cls != "FusedMoE":
        return whole(f"{mname}.{pname}", p) if cls in _REPLICATED else None
    if cls == "QKVParallelLinear":
        return _qkv(mod, mname, pname, p, fused_ckpt)
    if cls == "MergedColumnParallelLinear":
        return _merged(mod, mname, pname, p, fused_ckpt)
    if cls in _ROW_PARALLEL:
        if pname == "bias":
            return whole(f"{mname}.bias", p)
        rank, _ = _rank_size(getattr(mod, "tp_group", None))
        n = int(mod.input_size_per_partition)
        return [cols(f"{mname}.weight", (int(p.shape[0]), n * _rank_size(mod.tp_group)[1]), rank * n)]
    if cls in _COLUMN_PARALLEL:
        rank, size = _rank_size(getattr(mod, "tp_group", None))
        n = int(mod.output_size_per_partition)
        return [rows(f"{mname}.{pname}", (n * size, *p.shape[1:]), rank * n)]
    if cls == "FusedMoE":
        return _experts(mod, mname, pname, p)
    if cls in _REPLICATED:
        return whole(f"{mname}.{pname}", p)
    return None


def _stem(mname: str) -> str:
    return mname.rsplit(".", 1)[0] + "." if "." in mname else ""


def _qkv(mod: Any, mname: str, pname: str, p, fused_ckpt: bool) -> list[WeightPiece]:
    rank, _ = _rank_size(getattr(mod, "tp_group", None))
    kv_rank, _ = _rank_size(getattr(mod, "kv_tp_group", None))
    hd, vhd = int(mod.head_size), int(mod.v_head_size)
    nq, nkv, rep = int(mod.num_heads), int(mod.num_kv_heads), int(mod.num_kv_head_replicas)
    tq, tkv = int(mod.total_num_heads), int(mod.total_num_kv_heads)
    tail = tuple(p.shape[1:])
    q0, kv_shard = rank * nq * hd, kv_rank // rep
    local = [(0, nq * hd), (nq * hd, nkv * hd), (nq * hd + nkv * hd, nkv * vhd)]
    if fused_ckpt:        # the checkpoint's own qkv_proj: [q | k | v] rows
        name, shape = f"{mname}.{pname}", (tq * hd + tkv * hd + tkv * vhd, *tail)
        starts = [q0, tq * hd + kv_shard * nkv * hd, tq * hd + tkv * hd + kv_shard * nkv * vhd]
        return [rows(name, shape, s, (slice(a, a + n),)) for s, (a, n) in zip(starts, local)]
    stem = _stem(mname)
    names = [f"{stem}{x}_proj.{pname}" for x in "qkv"]
    shapes = [(tq * hd, *tail), (tkv * hd, *tail), (tkv * vhd, *tail)]
    starts = [q0, kv_shard * nkv * hd, kv_shard * nkv * vhd]
    return [rows(n, s, st, (slice(a, a + k),)) for n, s, st, (a, k) in zip(names, shapes, starts, local)]


def _merged(mod: Any, mname: str, pname: str, p, fused_ckpt: bool) -> list[WeightPiece] | None:
    rank, size = _rank_size(getattr(mod, "tp_group", None))
    sizes = [int(s) for s in mod.output_sizes]
    if len(sizes) != 2 or not mname.endswith("gate_up_proj"):
        return None
    tail = tuple(p.shape[1:])
    local = [s // size for s in sizes]
    if fused_ckpt:
        name, shape = f"{mname}.{pname}", (sum(sizes), *tail)
        return [rows(name, shape, rank * local[0], (slice(0, local[0]),)),
                rows(name, shape, sizes[0] + rank * local[1], (slice(local[0], local[0] + local[1]),))]
    stem = _stem(mname)
    return [rows(f"{stem}gate_proj.{pname}", (sizes[0], *tail), rank * local[0], (slice(0, local[0]),)),
            rows(f"{stem}up_proj.{pname}", (sizes[1], *tail), rank * local[1], (slice(local[0], sum(local)),))]


def _experts(mod: Any, mname: str, pname: str, p) -> list[WeightPiece] | None:
    """w13_weight [E_local, 2F/etp, H] and w2_weight [E_local, H, F/etp] of routed experts only."""
    if int(getattr(mod, "num_fused_shared_experts", 0) or 0) or pname not in ("w13_weight", "w2_weight"):
        return None
    n_local = int(getattr(mod, "_num_local_routed", mod.num_local_experts))
    first = int(getattr(mod, "_expert_storage_rank", mod.moe_ep_rank)) * n_local
    tp_rank = int(mod.moe_tp_rank)
    f_local = int(mod.intermediate_size_per_partition)
    f_total = f_local * int(mod.moe_tp_size)
    hidden = int(p.shape[2] if pname == "w13_weight" else p.shape[1])
    if p.shape[0] != n_local or (pname == "w13_weight" and p.shape[1] != 2 * f_local):
        return None      # padded or repacked expert weights (a kernel's layout): not the checkpoint's
    out = []
    for k in range(n_local):
        stem = f"{_stem(mname)}experts.{first + k}."
        if pname == "w13_weight":
            out += [rows(stem + "gate_proj.weight", (f_total, hidden), tp_rank * f_local, (k, slice(0, f_local))),
                    rows(stem + "up_proj.weight", (f_total, hidden), tp_rank * f_local,
                         (k, slice(f_local, 2 * f_local)))]
        else:
            out.append(cols(stem + "down_proj.weight", (hidden, f_total), tp_rank * f_local, (k,)))
    return out
