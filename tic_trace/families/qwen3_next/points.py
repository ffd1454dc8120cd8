"""Qwen3-Next's canonical points: the gate of its gated softmax attention, and its Gated DeltaNet linear attention
(`linear_attn`), in the layers that run it instead of softmax attention (its output projection is `attn.out`,
read from the gated norm instead of `attn.core`). Data only (`graph.point_spec`); both optional: a layer without
them reads as the base's."""
from __future__ import annotations

from ...graph.point_spec import FamilyPoint, PointSpec

_L = True
POINTS: tuple[FamilyPoint, ...] = (
    FamilyPoint(PointSpec("attn.linear_qkvz", _L, ("attn_norm",), "2 key_dim + 2 value_dim", meaning="linear "
                          "attention: the q, k, v and z projection (in_proj_qkvz), grouped by key head", op="gemm"),
                after="attn_norm"),
    FamilyPoint(PointSpec("attn.linear_ba", _L, ("attn_norm",), "2 v_heads", meaning="linear attention: the beta and "
                          "decay inputs b, a (in_proj_ba), grouped by key head", op="gemm"), after="attn_norm"),
    FamilyPoint(PointSpec("attn.linear_conv", _L, ("attn.linear_qkvz",), "2 key_dim + value_dim", mixes_positions=True,
                          meaning="linear attention: q | k | v after the causal depthwise conv1d and SiLU",
                          op="conv1d"), after="attn_norm"),
    FamilyPoint(PointSpec("attn.linear_core", _L, ("attn.linear_conv", "attn.linear_ba"), "v_heads x v_head_dim",
                          per_head=True, mixes_positions=True, meaning="linear attention: the gated delta rule's "
                          "output (q, k L2-normalised, beta = sigmoid(b), decay g = -exp(A_log) softplus(a + dt_bias))",
                          op="delta_rule"), after="attn_norm"),
    FamilyPoint(PointSpec("attn.linear_norm", _L, ("attn.linear_core", "attn.linear_qkvz"), "v_heads x v_head_dim",
                          per_head=True, optional=True, replaces=("attn.core",), meaning="linear attention: the "
                          "RMSNorm of each head's output times SiLU(z), before out_proj", op="gated_rmsnorm"),
                after="attn_norm", read_by=(("attn.out", ""),)),
    FamilyPoint(PointSpec("attn.gate", _L, ("attn_norm",), "heads x head_dim", per_head=True, optional=True,
                          meaning="gated attention (Qwen3-Next): each head's gate, the second half of its q_proj "
                          "columns", op="gemm"), after="attn.q", read_by=(("attn.core", ""),)),
)

# What its layers compute at the base's points, added to their meanings
REMARKS: dict[str, str] = {
    "attn.core": "gated attention: times sigmoid(gate)",
    "attn.out": "a linear-attention layer's: its out_proj",
}
