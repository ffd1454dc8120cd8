"""Clean implementations (and known faults) of multi-latent attention's ops (`ops.py`), on a side's own
inputs, as variants.py does for the standard attention's: the latent norms, the RoPE of q's rope dims and of
the shared k_pe, and the attention over [q_nope, q_rope] . [k_nope, k_pe] with v from kv_b.

Without them these ops were judged by constants borrowed from the standard ops, which a precision fault
inside MLA's attention (a bf16 softmax) stays under: a same-input envelope is what separates it.
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch

from ...replay.attention_kernels import eager as _eager, flash as _flash, scaled_gemm as _scaled_gemm, sdpa as _sdpa
from ...replay.attention_kernels import softmax_bf16 as _softmax_bf16
from ...replay.attention_ops import each_sample
from ...replay.variants import Variant, VariantInput, _norm_variants, rotate
from .ops import absorbed_queries, heads as _heads, kv_b_present
from .spec import LATENT_NORM_EPS, latent as _latent, softmax_scale

_NORMS = {"attn.q_a_norm": ("attn.q_a", "self_attn.q_a_layernorm.weight"),
          "attn.kv_a_norm": ("attn.kv_a", "self_attn.kv_a_layernorm.weight")}


def _latent_norm_variants() -> list[Variant]:
    """The standard norm variants on the latent (kv_a's first kv_lora_rank dims: k_pe is not normalised),
    at the latent norms' own eps."""
    def latent(v: VariantInput) -> VariantInput:
        feed, _ = _NORMS[v.point]
        x = v.feeds[feed][:, :_latent(v.spec).kv_lora_rank] if v.point == "attn.kv_a_norm" else v.feeds[feed]
        return replace(v, feeds={feed: x})

    base = _norm_variants(None, lambda v: v.w(_NORMS[v.point][1]), eps=lambda v: LATENT_NORM_EPS)
    return [Variant(b.name, b.what, b.clean, (lambda fn: lambda v: fn(latent(v)))(b.fn)) for b in base]


def _rope_input(v: VariantInput) -> torch.Tensor:
    """The rope dims the point rotates, de-interleaved where the model's RoPE is over interleaved pairs (HF
    reorders them before a rotate-half RoPE; so do the engines' interleaved kernels)."""
    m = _latent(v.spec)
    if v.point == "attn.q_rope":
        x = _heads(v.feeds["attn.q"], v.spec)[..., m.qk_nope_head_dim:]
    else:
        x = v.feeds["attn.kv_a"][:, m.kv_lora_rank:][:, None, :]
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1) if m.rope_interleave else x


def _latent_rope(fp32_tables: bool):
    def run(v: VariantInput) -> torch.Tensor:     # the rope dims are the whole of what is rotated
        return rotate(v, _rope_input(v), fp32_tables, replace(v.spec, head_dim=_latent(v.spec).qk_rope_head_dim))
    return run


def _latent_attention(kernel, same_v_dim: bool = False):
    """q = [q_nope, q_rope], k = [k_nope, k_pe] (k_pe shared by every head), v from kv_b, in the side's
    dtype, through one attention kernel per sample. `same_v_dim`: the kernel needs v's head dim to be q's
    (torch's fused SDPA; otherwise it falls back to the math path, a variant of its own). A query that ran an
    absorbed path (ops.absorbed_queries) runs the absorbed attention instead (_absorbed)."""
    def run(v: VariantInput) -> torch.Tensor:
        s, m, dt = v.spec, _latent(v.spec), v.dtype
        nope = m.qk_nope_head_dim
        if same_v_dim and m.v_head_dim != nope + m.qk_rope_head_dim:
            raise NotImplementedError("the fused kernel needs v's head dim to be q's")
        q_nope, q_rope = _heads(v.feeds["attn.q"], s)[..., :nope], _heads(v.feeds["attn.q_rope"], s)
        kv_b = _heads(v.feeds["attn.kv_b"], s)
        k_pe = v.feeds["attn.k_rope"].reshape(kv_b.shape[0], 1, -1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k, vv = torch.cat([kv_b[..., :nope], k_pe.expand(-1, s.num_attention_heads, -1)], dim=-1), kv_b[..., nope:]
        absorbed = absorbed_queries(v.rows, v.feeds["__kv_rows__"], kv_b_present(v.feeds), q.device)
        out = torch.empty(q.shape[0], s.num_attention_heads * m.v_head_dim, dtype=dt, device=q.device)
        for qi_all, qpos_all, kidx, kpos in each_sample(v.rows, v.feeds["__kv_rows__"], q.device):
            which = absorbed[torch.tensor(qi_all, device=q.device)]
            for sel in (~which, which):
                if not bool(sel.any()):
                    continue
                qi, qpos = [qi_all[j] for j in sel.nonzero().flatten().tolist()], qpos_all[sel]
                hi = int(qpos.max()) + 1        # this group's keys (later ones may lack kv_b: NaN)
                mask = (kpos[None, :hi] <= qpos[:, None])[None, None]
                if sel is which:
                    out[qi] = _absorbed(v, kernel, q_nope[qi], q_rope[qi], kidx[:hi], k_pe[kidx[:hi]], mask)
                    continue
                qs = q[qi].to(dt).transpose(0, 1)[None]
                ks, vs = (t[kidx[:hi]].to(dt).transpose(0, 1)[None] for t in (k, vv))
                o = kernel(qs, ks, vs, mask, softmax_scale(s), dt)[0]
                out[qi] = o.transpose(0, 1).reshape(len(qi), -1).to(dt)
        return out
    return run


def _absorbed(v: VariantInput, kernel, q_nope, q_rope, kidx, k_pe, mask) -> torch.Tensor:
    """MLA's absorbed attention in the side's dtype (an engine's decode: the latent cache never decompressed):
    q_nope folded into the latent space by kv_b_proj's k rows (w_kc), attention over [latent | k_pe] with the
    latent as the value, the result taken out by its v rows (w_vc); each product rounded to the dtype."""
    s, dt, heads, nope = v.spec, v.dtype, v.spec.num_attention_heads, _latent(v.spec).qk_nope_head_dim
    if "attn.kv_a_norm" not in v.feeds:
        raise NotImplementedError("an absorbed path's query without the recorded kv latent")
    latent = v.feeds["attn.kv_a_norm"][kidx]
    w = v.w("self_attn.kv_b_proj.weight").reshape(heads, nope + _latent(s).v_head_dim, -1).to(dt)
    q_lat = torch.einsum("rhn,hnl->rhl", q_nope.to(dt), w[:, :nope])
    qs = torch.cat([q_lat, q_rope.to(dt)], dim=-1).transpose(0, 1)[None]
    ks = torch.cat([latent, k_pe[:, 0]], dim=-1).to(dt)[None, None].expand(1, heads, -1, -1)
    vs = latent.to(dt)[None, None].expand(1, heads, -1, -1)
    o_lat = kernel(qs, ks, vs, mask, softmax_scale(s), dt)[0].to(dt)           # [heads, rows, kv_lora]
    return torch.einsum("hrl,hvl->rhv", o_lat, w[:, nope:]).reshape(q_nope.shape[0], -1)


def _latent_variants() -> dict[str, list[Variant]]:
    from torch.nn.attention import SDPBackend
    return {
        "latent_rmsnorm": _latent_norm_variants(),
        "latent_rope": [Variant("bf16_tables", "bf16 cos/sin tables", True, _latent_rope(False)),
                        Variant("fp32_tables", "fp32 cos/sin tables", True, _latent_rope(True))],
        "latent_attention": [
            Variant("eager", "eager attention", True, _latent_attention(_eager)),
            Variant("flash", "flash-style attention", True, _latent_attention(_flash)),
            Variant("sdpa_math", "SDPA math path", True, _latent_attention(_sdpa(SDPBackend.MATH))),
            Variant("sdpa", "fused SDPA kernel", True, _latent_attention(_sdpa(SDPBackend.FLASH_ATTENTION), True)),
            Variant("scaled_gemm", "scale inside the score GEMM, fp32 softmax (megatron-core local)", True,
                    _latent_attention(_scaled_gemm)),
            # (no fp8-KV-cache fault: MLA caches the latent and k_pe, not k and v)
            Variant("softmax_bf16", "bf16 softmax", False, _latent_attention(_softmax_bf16))],
    }


@functools.cache
def latent_variants() -> dict[str, list[Variant]]:
    """MLA's ops (spec.LATENT_OP_KEYS's names) -> their clean variants and known faults, built once."""
    return _latent_variants()
