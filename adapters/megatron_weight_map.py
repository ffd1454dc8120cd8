"""Megatron-core GPTModel parameters -> the HF checkpoint tensors they hold (`record/weight_pieces.py`).

The inverse of `megatron_weights.hf_to_megatron_state_dict`, per rank: `linear_qkv` holds per local query group
[q heads; k; v] (rows of q_proj / k_proj / v_proj), `linear_fc1` [gate; up] (rows of gate_proj / up_proj),
column-parallel layers a block of rows of their tensor and row-parallel ones (`linear_proj`, `linear_fc2`) a
block of columns, the vocabulary's padding rows belong to no tensor, experts are numbered from this rank's
first expert-parallel expert. A parameter this map does not know (a family's own attention, such as MLA's;
biases other than q/k/v's, an attention output gate) is left out: the comparison names it as not mappable.
"""
from __future__ import annotations

import re
from typing import Any

from tic_trace.adapters.megatron_features import family_attention
from tic_trace.record.weight_pieces import WeightPiece, cols, rows, whole

_TAIL = re.compile(r"(?:^|\.)((?:embedding|decoder|output_layer)\..+)$")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))")
_NORMS = {"input_layernorm.weight": "input_layernorm.weight",
          "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
          "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
          "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
          "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
          "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
          "mlp.router.weight": "mlp.gate.weight",
          "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight"}


def megatron_weight_pieces(models: list, params: dict, coords: dict, offsets: list[int],
                           vocab: int | None) -> dict[str, list[WeightPiece]]:
    """{parameter name (as ParameterHasher names it): its pieces}; names it cannot map are left out."""
    out: dict[str, list[WeightPiece]] = {}
    for i, model in enumerate(models):
        root = model
        while hasattr(root, "module") and not hasattr(root, "decoder"):
            root = root.module
        cfg = getattr(root, "config", None)
        if cfg is None:
            continue
        facts = _facts(cfg, coords, vocab or int(getattr(root, "vocab_size", 0) or 0))
        # tied: a last pipeline stage's own copy of the embedding is the embedding (and must equal it)
        facts["tied"] = bool(getattr(root, "share_embeddings_and_output_weights", False))
        off = offsets[i] if i < len(offsets) else 0
        for name, p in model.named_parameters():
            key = name if i == 0 else f"{i}:{name}"
            if key not in params:
                continue
            m = _TAIL.search(name)
            pieces = _pieces(m.group(1), p, facts, off) if m else None
            if pieces:
                out[key] = pieces
    return out


def _facts(cfg: Any, c: dict, vocab: int) -> dict:
    heads = int(cfg.num_attention_heads)
    tp, ep = int(c.get("tp_size", 1)), int(c.get("ep_size", 1))
    return {"heads": heads, "groups": int(getattr(cfg, "num_query_groups", None) or heads),
            "hd": int(getattr(cfg, "kv_channels", None) or cfg.hidden_size // heads), "hidden": int(cfg.hidden_size),
            "ffn": int(getattr(cfg, "ffn_hidden_size", 0) or 0),
            "moe_ffn": int(getattr(cfg, "moe_ffn_hidden_size", 0) or 0),
            "shared_ffn": int(getattr(cfg, "moe_shared_expert_intermediate_size", 0) or 0),
            "shared_gate": bool(getattr(cfg, "moe_shared_expert_gate", False)),
            "experts": int(getattr(cfg, "num_moe_experts", 0) or 0), "vocab": vocab,
            "glu": bool(getattr(cfg, "gated_linear_unit", False)),
            "plain_attn": not (family_attention(cfg) or getattr(cfg, "attention_output_gate", False)),
            "tp": (int(c.get("tp_rank", 0)), tp), "ep": (int(c.get("ep_rank", 0)), ep),
            "etp": (int(c.get("etp_rank", c.get("tp_rank", 0) if "etp_size" not in c else 0)),
                    int(c.get("etp_size", tp)))}


def _pieces(rel: str, p, f: dict, off: int) -> list[WeightPiece] | None:
    if rel in ("embedding.word_embeddings.weight", "output_layer.weight"):
        name = ("model.embed_tokens.weight" if rel.startswith("embedding") or f.get("tied") else "lm_head.weight")
        start = f["tp"][0] * p.shape[0]
        n = min(p.shape[0], f["vocab"] - start)
        return [rows(name, (f["vocab"], p.shape[1]), start, (slice(0, n),))] if n > 0 and p.dim() == 2 else None
    if rel == "decoder.final_layernorm.weight":
        return whole("model.norm.weight", p)
    m = _LAYER.fullmatch(rel)
    if m is None:
        return None
    base, rest = f"model.layers.{int(m.group(1)) + off}.", m.group(2)
    if rest in _NORMS:
        # a family's own attention's q/k layernorms (MLA's: its latents' norms) are not q_norm / k_norm
        own_attn = not f["plain_attn"] and rest.startswith("self_attention.") and "linear_qkv" not in rest
        return None if own_attn else whole(base + _NORMS[rest], p)
    if not f["plain_attn"] and rest.startswith("self_attention."):
        return None
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        return _qkv(base + "self_attn.", rest.rsplit(".", 1)[1], p, f)
    if rest == "self_attention.linear_proj.weight":
        return [cols(base + "self_attn.o_proj.weight", (f["hidden"], f["heads"] * f["hd"]), f["tp"][0] * p.shape[1])]
    if rest == "mlp.linear_fc1.weight":
        return _fc1(base + "mlp.", f["ffn"], f["tp"], p, f)
    if rest == "mlp.linear_fc2.weight":
        return [cols(base + "mlp.down_proj.weight", (f["hidden"], f["ffn"]), f["tp"][0] * p.shape[1])]
    if rest.startswith("mlp.shared_experts.linear_fc"):
        stem = base + ("mlp.shared_expert." if f["shared_gate"] else "mlp.shared_experts.")
        if rest.endswith("fc1.weight"):
            return _fc1(stem, f["shared_ffn"], f["tp"], p, f)
        return [cols(stem + "down_proj.weight", (f["hidden"], f["shared_ffn"]), f["tp"][0] * p.shape[1])]
    x = _EXPERT.fullmatch(rest)
    if x is not None and f["experts"]:
        local = int(x.group(1) if x.group(1) is not None else x.group(4))
        ep_rank, ep = f["ep"]
        e = ep_rank * (f["experts"] // ep) + local
        stem = f"{base}mlp.experts.{e}."
        if (x.group(2) or x.group(3)) == "linear_fc1":
            return _fc1(stem, f["moe_ffn"], f["etp"], p, f)
        return [cols(stem + "down_proj.weight", (f["hidden"], f["moe_ffn"]), f["etp"][0] * p.shape[1])]
    return None


def _qkv(stem: str, kind: str, p, f: dict) -> list[WeightPiece]:
    """Per local query group: [q heads of the group; its k; its v] rows."""
    heads, groups, hd = f["heads"], f["groups"], f["hd"]
    tp_rank, tp = f["tp"]
    nq, local = heads // groups, groups // tp
    tail = tuple(p.shape[1:])
    out = []
    for j in range(local):
        g, r0 = tp_rank * local + j, j * (nq + 2) * hd
        out += [rows(f"{stem}q_proj.{kind}", (heads * hd, *tail), g * nq * hd, (slice(r0, r0 + nq * hd),)),
                rows(f"{stem}k_proj.{kind}", (groups * hd, *tail), g * hd,
                     (slice(r0 + nq * hd, r0 + (nq + 1) * hd),)),
                rows(f"{stem}v_proj.{kind}", (groups * hd, *tail), g * hd,
                     (slice(r0 + (nq + 1) * hd, r0 + (nq + 2) * hd),))]
    return out


def _fc1(stem: str, inter: int, par: tuple[int, int], p, f: dict) -> list[WeightPiece] | None:
    """[gate; up] rows of this rank's block (a GLU); plain fc1: up_proj rows."""
    rank, _ = par
    if not f["glu"]:
        return [rows(stem + "up_proj.weight", (inter, f["hidden"]), rank * p.shape[0])]
    half = p.shape[0] // 2
    return [rows(stem + "gate_proj.weight", (inter, f["hidden"]), rank * half, (slice(0, half),)),
            rows(stem + "up_proj.weight", (inter, f["hidden"]), rank * half, (slice(half, 2 * half),))]
