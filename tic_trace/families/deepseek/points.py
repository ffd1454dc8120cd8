"""Multi-latent attention's canonical points (DeepSeek-V2/V3 MLA): q and kv pass through low-rank latents. Data
only (`graph.point_spec`). In a layer without them (GLM-4.5, any other model) an absent point resolves to its own
feeds (`canonical.feeds_of`), so attn.q, attn.k and attn.v read attn_norm there."""
from __future__ import annotations

from ...graph.point_spec import FamilyPoint, PointSpec

_L = True
POINTS: tuple[FamilyPoint, ...] = (
    FamilyPoint(PointSpec("attn.q_a", _L, ("attn_norm",), "q_lora_rank", meaning="MLA: q down-projection "
                          "(q_a_proj)", op="gemm"), after="attn_norm"),
    FamilyPoint(PointSpec("attn.q_a_norm", _L, ("attn.q_a",), "q_lora_rank", meaning="MLA: the q latent after its "
                          "RMSNorm (q_a_layernorm)", op="rmsnorm"), after="attn_norm",
                read_by=(("attn.q", "attn_norm"),)),
    FamilyPoint(PointSpec("attn.kv_a", _L, ("attn_norm",), "kv_lora_rank + rope_dim", meaning="MLA: the kv latent, "
                          "then the one k_pe every head shares, before RoPE (kv_a_proj_with_mqa)", op="gemm"),
                after="attn_norm", read_by=(("attn.k", "attn_norm"),)),
    FamilyPoint(PointSpec("attn.kv_a_norm", _L, ("attn.kv_a",), "kv_lora_rank", meaning="MLA: the kv latent after its "
                          "RMSNorm (kv_a_layernorm; k_pe is not normalised)", op="rmsnorm"), after="attn_norm"),
    FamilyPoint(PointSpec("attn.kv_b", _L, ("attn.kv_a_norm",), "heads x (nope_dim + v_dim)", per_head=True,
                          meaning="MLA: every head's decompressed k_nope, then its v (kv_b_proj)", op="gemm"),
                after="attn_norm", read_by=(("attn.v", "attn_norm"),), mixed_by=("attn.core",)),
)

# What MLA's layers compute at the base's points, added to their meanings
REMARKS: dict[str, str] = {
    "attn.q": "MLA: q_b_proj, or q_proj without a q latent: every head's nope dims, then its rope dims before RoPE",
    "attn.q_rope": "MLA: every head's rope dims only",
    "attn.k_rope": "MLA: the shared k_pe only, one head",
}
