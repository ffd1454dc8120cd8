"""bf16 precision faults and clean bf16 pairs, planted in the *computation* of one side of an HF model.

A precision fault is a legitimate-looking precision choice one side makes at one op (RMSNorm without the
fp32 upcast, a bf16 softmax, fp32 RoPE tables, an fp32 router, ...). Judged by A-B they are as large as the
op-order noise of clean pairs (SDPA vs eager attention, a split-K o_proj); judged by each side's intrinsic
error against the exact op they are not. `worse` says which side's op is the less exact one — the side the
intrinsic rule must name: "planted" when the fault drops precision, "clean" when it adds precision (then the
unmodified HF side is the less exact one, and saying so is the truth a numerics engineer needs).

Clean variants (`CLEAN`) change only op order or kernel, never the precision of a stored result.
"""
from __future__ import annotations

import copy
import sys
import types
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrecisionFault:
    name: str
    point: str                 # canonical point where it must be found
    layered: bool
    worse: str                 # "planted" | "clean": the side whose op is the less exact one
    what: str
    plant: Callable            # fn(hf_model, layer)
    moe_only: bool = False
    mla_only: bool = False                   # plants into multi-latent attention's own modules
    plant_megatron: Callable | None = None   # fn(megatron GPTModel, layer), where the fault has a planter
    plant_sglang: Callable | None = None     # fn(SGLang *ForCausalLM, layer)


def _layer(model, layer):
    return model.model.layers[layer]


def _wrap(module, fn):
    module.forward = types.MethodType(fn, module)


def _attention_with(model, layer: int, name: str, fn: Callable) -> None:
    """Run one layer's attention through `fn` (registered under `name`): the layer gets a config copy
    naming it, the model's other layers keep theirs."""
    from transformers import AttentionInterface
    AttentionInterface.register(name, fn)
    attn = _layer(model, layer).self_attn
    cfg = copy.copy(attn.config)
    cfg._attn_implementation = name
    attn.config = cfg


def _scores(module, q, k, scaling, mask):
    rep = module.num_key_value_groups
    s = torch.matmul(q, k.repeat_interleave(rep, dim=1).transpose(2, 3)) * scaling
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return s


def _finish(module, p, v):
    out = torch.matmul(p, v.repeat_interleave(module.num_key_value_groups, dim=1))
    return out.transpose(1, 2).contiguous(), None


def _softmax_bf16_attention(module, q, k, v, mask, scaling=None, **kw):
    """Softmax evaluated step by step in the activations' dtype: max-shift, exp, sum and divide each rounded."""
    s = _scores(module, q, k, scaling, mask)
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return _finish(module, e / e.sum(-1, keepdim=True), v)


def _sdpa_attention(module, q, k, v, mask, scaling=None, **kw):
    """torch's fused SDPA kernel (fp32 internals, one rounding) instead of HF's eager attention."""
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _rmsnorm_bf16(self, x):
    """RMSNorm without the fp32 upcast: every step rounded to the activations' dtype."""
    var = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))


def _plant_rmsnorm_no_upcast(model, layer):
    _wrap(_layer(model, layer).input_layernorm, _rmsnorm_bf16)


def offset_rmsnorm_no_upcast(norm: torch.nn.Module) -> None:
    """A Gemma RMSNorm ((1 + w) gain) computed in the input's dtype throughout (no fp32 upcast)."""
    def forward(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * (1.0 + norm.weight)
    norm.forward = forward


def _plant_gemma_input_norm_no_upcast(model, layer):
    offset_rmsnorm_no_upcast(_layer(model, layer).input_layernorm)


def _plant_gemma_attn_post_norm_no_upcast(model, layer):
    offset_rmsnorm_no_upcast(_layer(model, layer).post_attention_layernorm)


def _plant_gemma_q_norm_no_upcast(model, layer):
    offset_rmsnorm_no_upcast(_layer(model, layer).self_attn.q_norm)


def _plant_q_a_norm_no_upcast(model, layer):
    _wrap(_layer(model, layer).self_attn.q_a_layernorm, _rmsnorm_bf16)


def _plant_kv_a_norm_no_upcast(model, layer):
    _wrap(_layer(model, layer).self_attn.kv_a_layernorm, _rmsnorm_bf16)


def _plant_qk_norm_no_upcast(model, layer):
    _wrap(_layer(model, layer).self_attn.q_norm, _rmsnorm_bf16)


def _rmsnorm_bf16_torch(self, x):
    """torch.nn.RMSNorm (megatron's local spec) without the upcast: each step rounded to x's dtype."""
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
    return (x * r) * self.weight.to(x.dtype)


def _mg_plant_rmsnorm_no_upcast(model, layer):
    from .faults import _mg_layer
    lay = _mg_layer(model, layer)
    if lay is not None:
        _wrap(lay.input_layernorm, _rmsnorm_bf16_torch)


def _mg_plant_qk_norm_no_upcast(model, layer):
    from .faults import _mg_layer
    lay = _mg_layer(model, layer)
    if lay is not None:
        _wrap(lay.self_attention.q_layernorm, _rmsnorm_bf16_torch)


def _kv_fp8_attention(module, q, k, v, mask, scaling=None, **kw):
    """HF's eager attention reading its K and V from an fp8 (e4m3, unit-scale) cache."""
    f8 = torch.float8_e4m3fn
    k, v = k.to(f8).to(q.dtype), v.to(f8).to(q.dtype)
    p = torch.softmax(_scores(module, q, k, scaling, mask), dim=-1, dtype=torch.float32).to(q.dtype)
    return _finish(module, p, v)


def _plant_kv_fp8(model, layer):
    _attention_with(model, layer, f"tic_kv_fp8_{id(model)}_{layer}", _kv_fp8_attention)


def _plant_softmax_bf16(model, layer):
    _attention_with(model, layer, f"tic_softmax_bf16_{id(model)}_{layer}", _softmax_bf16_attention)


def fp32_rope_tables(model) -> Callable:
    """A forward pre-hook (with kwargs) for an HF attention module: its cos/sin tables computed in fp32 from
    the model's rotary embedding instead of the hidden states' dtype."""
    rotary = model.model.rotary_emb

    def pre(mod, args, kwargs):
        h, pos = kwargs["hidden_states"], kwargs.get("position_ids")
        if pos is None:
            pos = torch.arange(h.shape[1], device=h.device)[None]
        kwargs["position_embeddings"] = rotary(h.float(), pos)
        return args, kwargs
    return pre


def _plant_rope_fp32(model, layer):
    """cos/sin kept in fp32 (q_rope/k_rope come out fp32); attention then casts q, k back to bf16."""
    attn = _layer(model, layer).self_attn
    attn.register_forward_pre_hook(fp32_rope_tables(model), with_kwargs=True)
    eager = sys.modules[type(attn).__module__].eager_attention_forward

    def cast_qk(module, q, k, v, mask, **kw):
        return eager(module, q.to(v.dtype), k.to(v.dtype), v, mask, **kw)
    _attention_with(model, layer, f"tic_cast_qk_{id(model)}_{layer}", cast_qk)


def _plant_router_fp32(model, layer):
    """Megatron's moe_router_dtype=fp32: router GEMM, softmax and top-k in fp32; fp32 logits."""
    def forward(self, hidden_states):
        hs = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(hs.float(), self.weight.float())
        probs = torch.softmax(logits, dim=-1)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(hs.dtype), idx
    _wrap(_layer(model, layer).mlp.gate, forward)


def _plant_lm_head_fp32(model, layer):
    def forward(self, x):
        return F.linear(x.float(), self.weight.float())
    _wrap(model.lm_head, forward)


def _plant_fp32_residual(model, layer):
    """fp32_residual_connection for one layer: the residual stream (mid) is kept in fp32."""
    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, **kwargs):
        h = self.input_layernorm(hidden_states)
        h, _ = self.self_attn(hidden_states=h, attention_mask=attention_mask, position_ids=position_ids,
                              cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        mid = hidden_states.float() + h.float()
        h = self.mlp(self.post_attention_layernorm(mid).to(hidden_states.dtype))
        return (mid + h.float()).to(hidden_states.dtype)
    _wrap(_layer(model, layer), forward)


def _experts_with(model, layer, act: Callable) -> None:
    """One layer's HF experts (fused gate_up_proj layout) with `act(gate, up)` for act(gate) * up."""
    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in torch.unique(top_k_index).tolist():
            tok, slot = torch.where(top_k_index == e)
            gate, up = F.linear(hidden_states[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(act(gate, up), self.down_proj[e]) * top_k_weights[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out
    _wrap(_layer(model, layer).mlp.experts, forward)


def _plant_fused_silu_up(model, layer):
    """silu(gate) * up fused in fp32 with one rounding, where HF rounds silu(gate) and the product apart."""
    _experts_with(model, layer, lambda gate, up: (F.silu(gate.float()) * up.float()).to(gate.dtype))  # fused


def _plant_mlp_norm_no_upcast(model, layer):
    _wrap(_layer(model, layer).post_attention_layernorm, _rmsnorm_bf16)


def _plant_k_norm_no_upcast(model, layer):
    _wrap(_layer(model, layer).self_attn.k_norm, _rmsnorm_bf16)


def _plant_final_norm_no_upcast(model, layer):
    _wrap(model.model.norm, _rmsnorm_bf16)


def _plant_silu_bf16(model, layer):
    """The experts' SiLU evaluated as gate * sigmoid(gate) in bf16: one more rounding than torch's silu."""
    _experts_with(model, layer, lambda gate, up: (gate * torch.sigmoid(gate)) * up)


def _sg_plant_qk_norm_no_upcast(model, layer):
    """SGLang's RMSNorm (q_norm is called on [tokens*heads, head_dim] without a residual on CPU)."""
    from .faults import _sg_layer
    lay = _sg_layer(model, layer)
    if lay is not None:
        _wrap(lay.self_attn.q_norm, _rmsnorm_bf16)


def _plant_o_proj_bf16_partials(model, layer):
    """One layer's o_proj with its reduction split in 4 and the partial GEMMs summed in bf16 (a split-K
    kernel keeping bf16 partials) in a model that runs at TP = 1: what a TP = 4 row-parallel layer computes,
    clean only where the trace runs at TP = 4."""
    def forward(self, x):
        n = x.shape[-1] // 4
        out = None
        for i in range(4):
            p = F.linear(x[..., i * n:(i + 1) * n], self.weight[:, i * n:(i + 1) * n])
            out = p if out is None else out + p                       # the fault: bf16 partial sums
        return out
    _wrap(_layer(model, layer).self_attn.o_proj, forward)


def _mg_wrap_norm(model, layer, which: Callable) -> None:
    from .faults import _mg_layer
    lay = _mg_layer(model, layer)
    if lay is not None:
        _wrap(which(lay), _rmsnorm_bf16_torch)


def _mg_plant_mlp_norm_no_upcast(model, layer):
    _mg_wrap_norm(model, layer, lambda lay: lay.pre_mlp_layernorm)


def _mg_plant_k_norm_no_upcast(model, layer):
    _mg_wrap_norm(model, layer, lambda lay: lay.self_attention.k_layernorm)


def _mg_plant_silu_bf16(model, layer):
    """megatron-core's experts (SequentialMLP, local spec) with SiLU as gate * sigmoid(gate) in bf16: each
    expert of the layer gets a config copy whose activation is that (the config is shared by every layer)."""
    from .faults import _mg_layer
    lay = _mg_layer(model, layer)
    for expert in getattr(getattr(getattr(lay, "mlp", None), "experts", None), "local_experts", None) or []:
        cfg = copy.copy(expert.config)
        cfg.activation_func = lambda g: g * torch.sigmoid(g)       # the fault: an extra bf16 rounding
        object.__setattr__(expert, "config", cfg)


def _sg_plant_mlp_norm_no_upcast(model, layer):
    """SGLang's fused residual add + post-attention RMSNorm, the add as SGLang does it (fp32, rounded: the
    residual stream `mid` unchanged) and the norm of the rounded sum without the fp32 upcast."""
    from .faults import _sg_layer
    lay = _sg_layer(model, layer)
    if lay is None:
        return
    norm = lay.post_attention_layernorm

    def forward(self, x, residual=None, *args, **kwargs):
        if residual is None:
            return _rmsnorm_bf16(self, x)
        mid = (x.float() + residual.float()).to(x.dtype)
        return _rmsnorm_bf16(self, mid), mid
    _wrap(norm, forward)


def _sg_plant_k_norm_no_upcast(model, layer):
    from .faults import _sg_layer
    lay = _sg_layer(model, layer)
    if lay is not None:
        _wrap(lay.self_attn.k_norm, _rmsnorm_bf16)


def _sg_plant_silu_bf16(model, layer):
    """SGLang's CPU experts (`moe_forward_native`, which builds a `SiluAndMul` per call) with SiLU as
    gate * sigmoid(gate) in bf16, for this layer's experts only: the class's native forward is swapped
    while this layer's experts run."""
    from sglang.srt.layers.activation import SiluAndMul

    from .faults import _sg_layer
    lay = _sg_layer(model, layer)
    experts = getattr(getattr(lay, "mlp", None), "experts", None)
    if experts is None:
        return
    orig = experts.forward

    def silu_bf16(self, x):
        g, u = x.chunk(2, dim=-1)
        return (g * torch.sigmoid(g)) * u                            # the fault: an extra bf16 rounding

    def forward(*args, **kwargs):
        native = SiluAndMul.forward_native
        SiluAndMul.forward_native = silu_bf16
        try:
            return orig(*args, **kwargs)
        finally:
            SiluAndMul.forward_native = native
    experts.forward = forward


def _sg_plant_router_fp32(model, layer):
    """SGLang's router GEMM in fp32 (fp32 logits; the top-k reads them): an fp32 router on the rollout side."""
    from .faults import _sg_layer
    lay = _sg_layer(model, layer)
    gate = getattr(getattr(lay, "mlp", None), "gate", None)
    if gate is None:
        return

    def forward(x):
        return F.linear(x.float(), gate.weight.float()), None     # ReplicatedLinear returns (output, bias)
    gate.forward = forward


PRECISION_FAULTS: dict[str, PrecisionFault] = {f.name: f for f in [
    PrecisionFault("rmsnorm_no_upcast", "attn_norm", True, "planted",
                   "input RMSNorm computed in bf16 (no fp32 upcast)", _plant_rmsnorm_no_upcast,
                   plant_megatron=_mg_plant_rmsnorm_no_upcast),
    PrecisionFault("qk_norm_no_upcast", "attn.q_norm", True, "planted",
                   "Q-norm computed in bf16 (no fp32 upcast)", _plant_qk_norm_no_upcast,
                   plant_megatron=_mg_plant_qk_norm_no_upcast, plant_sglang=_sg_plant_qk_norm_no_upcast),
    PrecisionFault("softmax_bf16", "attn.core", True, "planted",
                   "attention softmax evaluated in bf16", _plant_softmax_bf16),
    PrecisionFault("kv_fp8", "attn.core", True, "planted",
                   "K and V read back from an fp8 (e4m3) KV cache", _plant_kv_fp8),
    PrecisionFault("rope_fp32_tables", "attn.q_rope", True, "clean",
                   "RoPE cos/sin kept in fp32 (q/k rotated in fp32)", _plant_rope_fp32),
    PrecisionFault("router_fp32", "moe.router_logits", True, "clean",
                   "router GEMM and softmax in fp32 (moe_router_dtype=fp32)", _plant_router_fp32, moe_only=True,
                   plant_sglang=_sg_plant_router_fp32),
    PrecisionFault("fp32_residual", "mid", True, "clean",
                   "residual stream kept in fp32 (fp32_residual_connection)", _plant_fp32_residual),
    PrecisionFault("lm_head_fp32", "logits", False, "clean",
                   "lm_head GEMM in fp32, fp32 logits", _plant_lm_head_fp32),
    PrecisionFault("fused_silu_up", "moe.experts_out", True, "clean",
                   "silu(gate)*up fused in fp32 (one rounding)", _plant_fused_silu_up, moe_only=True),
    PrecisionFault("mlp_norm_no_upcast", "mlp_norm", True, "planted",
                   "post-attention RMSNorm computed in bf16 (no fp32 upcast)", _plant_mlp_norm_no_upcast,
                   plant_megatron=_mg_plant_mlp_norm_no_upcast, plant_sglang=_sg_plant_mlp_norm_no_upcast),
    PrecisionFault("k_norm_no_upcast", "attn.k_norm", True, "planted",
                   "K-norm computed in bf16 (no fp32 upcast)", _plant_k_norm_no_upcast,
                   plant_megatron=_mg_plant_k_norm_no_upcast, plant_sglang=_sg_plant_k_norm_no_upcast),
    PrecisionFault("final_norm_no_upcast", "final_norm", False, "planted",
                   "final RMSNorm computed in bf16 (no fp32 upcast)", _plant_final_norm_no_upcast),
    PrecisionFault("silu_bf16", "moe.experts_out", True, "planted",
                   "experts' SiLU as gate * sigmoid(gate) in bf16 (an extra rounding)", _plant_silu_bf16,
                   moe_only=True, plant_megatron=_mg_plant_silu_bf16, plant_sglang=_sg_plant_silu_bf16),
    # multi-latent attention (DeepSeek-V3): the q and kv latents' norms
    PrecisionFault("q_a_norm_no_upcast", "attn.q_a_norm", True, "planted",
                   "MLA's q latent RMSNorm computed in bf16 (no fp32 upcast)", _plant_q_a_norm_no_upcast, mla_only=True),
    PrecisionFault("kv_a_norm_no_upcast", "attn.kv_a_norm", True, "planted",
                   "MLA's kv latent RMSNorm computed in bf16 (no fp32 upcast)", _plant_kv_a_norm_no_upcast,
                   mla_only=True),
    # Gemma 2/3: (1 + w) norms, the sandwich norm on the attention branch, Gemma3's QK-norm
    PrecisionFault("gemma_input_norm_no_upcast", "attn_norm", True, "planted",
                   "Gemma's input RMSNorm computed in bf16 (no fp32 upcast)", _plant_gemma_input_norm_no_upcast),
    PrecisionFault("gemma_attn_post_norm_no_upcast", "attn.post_norm", True, "planted",
                   "Gemma's attention-branch RMSNorm computed in bf16 (no fp32 upcast)",
                   _plant_gemma_attn_post_norm_no_upcast),
    PrecisionFault("gemma_q_norm_no_upcast", "attn.q_norm", True, "planted",
                   "Gemma3's Q-norm computed in bf16 (no fp32 upcast)", _plant_gemma_q_norm_no_upcast),
    PrecisionFault("o_proj_bf16_partials", "attn.out", True, "planted",
                   "o_proj's reduction in 4 chunks summed in bf16 (at TP = 1)", _plant_o_proj_bf16_partials),
]}
# Since the replay compares each side with clean variants on its own inputs (replay/variants.py), a fused
# silu x up is a clean implementation, named as such ("implementation difference"), not a precision fault.


# ---------------------------------------------------------------- clean bf16 variants

def _clean_sdpa(model):
    for i in range(len(model.model.layers)):
        _attention_with(model, i, f"tic_sdpa_{id(model)}_{i}", _sdpa_attention)


def _clean_split_k(model):
    """Every o_proj as two half-K GEMMs with fp32 partial sums, rounded once (a split-K kernel)."""
    def forward(self, x):
        k = x.shape[-1] // 2
        y = F.linear(x[..., :k].float(), self.weight[:, :k].float()) + F.linear(x[..., k:].float(),
                                                                             self.weight[:, k:].float())
        return y.to(x.dtype)
    for lay in model.model.layers:
        _wrap(lay.self_attn.o_proj, forward)


CLEAN: dict[str, Callable] = {
    "identical": lambda model: None,
    "sdpa_vs_eager": _clean_sdpa,
    "split_k_o_proj": _clean_split_k,
}
