"""Clean bf16 implementations real engines use, planted in the computation of one side of an HF model.

Each changes how an op is computed (how a reduction is split, which attention kernel, where RoPE's tables
round, where a norm applies its gain), never the precision of a stored result beyond what that engine does:
a trace of such a side must not be blamed by the replay (docs/replay.md, "Clean variants"). They differ from
the emulations in `tic_trace/replay/variants.py` where real kernels do (a blocked online softmax, per-shard
GEMM shapes), so the suites also test that the envelope's margin covers real kernels, not only its own copies.
"""
from __future__ import annotations

import contextlib
import math
import sys
import types
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from .precision_faults import _attention_with, _scores, _sdpa_attention, fp32_rope_tables


def _wrap(module, fn) -> None:
    module.forward = types.MethodType(fn, module)


def _row_parallel_forward(k: int):
    """A row-parallel linear over k shards of its input: each shard's partial GEMM in the activations' dtype
    (fp32 accumulation, one rounding), the partials summed in that dtype (a bf16 all-reduce)."""
    def forward(self, x):
        n = x.shape[-1] // k
        out = None
        for i in range(k):
            p = F.linear(x[..., i * n:(i + 1) * n], self.weight[:, i * n:(i + 1) * n])
            out = p if out is None else out + p
        return out + self.bias if getattr(self, "bias", None) is not None else out
    return forward


def _row_parallel_experts(k: int):
    """transformers' fused experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) as a TP=k engine runs them:
    rank i holds rows i of every expert's gate and up and columns i of its down_proj, computes HF's own
    experts loop over that slice (its bf16 index_add combine), and the ranks' outputs are summed in the
    activations' dtype (the all-reduce)."""
    def forward(self, hidden_states, top_k_index, top_k_weights):
        inter = self.down_proj.shape[-1] // k
        out = None
        for i in range(k):
            part = torch.zeros_like(hidden_states)
            for e in torch.unique(top_k_index).tolist():
                if e >= self.gate_up_proj.shape[0]:
                    continue
                tok, slot = torch.where(top_k_index == e)
                gate, up = self.gate_up_proj[e].chunk(2, dim=0)
                sl = slice(i * inter, (i + 1) * inter)
                x = hidden_states[tok]
                h = self.act_fn(F.linear(x, gate[sl])) * F.linear(x, up[sl])
                y = F.linear(h, self.down_proj[e][:, sl]) * top_k_weights[tok, slot, None]
                part.index_add_(0, tok, y.to(part.dtype))
            out = part if out is None else out + part
        return out
    return forward


def tp_row_parallel(k: int, down: bool = True, declare: bool = True) -> Callable:
    """Every o_proj (and every dense or shared-expert down_proj, and the routed experts' down_proj over the
    intermediate dimension) as a TP=k row-parallel layer. With `declare`, the model says its degree as
    transformers' own tensor parallelism does (`_tp_size`, read by `model.tp_size`), so its trace records
    TP = k as a sharded HF model's would; without, the trace says TP 1 (a model sharded by hand)."""
    def plant(model) -> None:
        if declare:
            model._tp_size = k
        fwd = _row_parallel_forward(k)
        for lay in model.model.layers:
            _wrap(lay.self_attn.o_proj, fwd)
            mlp = lay.mlp
            for m in (getattr(mlp, "down_proj", None), getattr(getattr(mlp, "shared_expert", None), "down_proj", None)):
                if down and isinstance(m, torch.nn.Linear):
                    _wrap(m, fwd)
            experts = getattr(mlp, "experts", None)
            if down and hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj"):
                _wrap(experts, _row_parallel_experts(k))
    return plant


def _flash_blocked(module, q, k, v, mask, scaling=None, block: int = 8, **kw):
    """Flash-style attention with an online softmax over key blocks: fp32 running max, sum and output,
    each block's probabilities rounded to the activations' dtype before P.V, normalised at the end."""
    s_all = _scores(module, q.float(), k.float(), scaling, mask)           # [B, H, Tq, Tk] fp32
    vv = v.repeat_interleave(module.num_key_value_groups, dim=1).float()
    m = torch.full(s_all.shape[:-1] + (1,), -math.inf)
    l_, acc = torch.zeros_like(m), torch.zeros(s_all.shape[:-1] + (v.shape[-1],))
    for lo in range(0, s_all.shape[-1], block):
        s = s_all[..., lo:lo + block]
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        alpha = torch.exp(torch.where(torch.isinf(m_new), 0.0, m - m_new))
        p = torch.exp(s - torch.where(torch.isinf(m_new), 0.0, m_new))
        acc = acc * alpha + p.to(q.dtype).float() @ vv[..., lo:lo + block, :]
        l_, m = l_ * alpha + p.sum(-1, keepdim=True), m_new
    return (acc / l_).to(q.dtype).transpose(1, 2).contiguous(), None


def _sdpa_math(module, q, k, v, mask, scaling=None, **kw):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.MATH]):
        return _sdpa_attention(module, q, k, v, mask, scaling=scaling)


def attention(kind: str) -> Callable:
    """Every layer's attention through one kernel: "flash" (blocked online softmax), "sdpa_math", "sdpa"."""
    fn = {"flash": _flash_blocked, "sdpa_math": _sdpa_math, "sdpa": _sdpa_attention}[kind]

    def plant(model) -> None:
        for i in range(len(model.model.layers)):
            _attention_with(model, i, f"tic_clean_{kind}_{id(model)}_{i}", fn)
    return plant


def _gain_before_cast(self, x):
    """RMSNorm in fp32 with the gain, rounded once (Megatron/TE, SGLang's fused add + RMSNorm)."""
    xf = x.float()
    h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return (h * self.weight.float()).to(x.dtype)


def fused_norm(model) -> None:
    """Every decoder RMSNorm (input, post-attention, final) computed as one fp32 kernel, rounded once."""
    for lay in model.model.layers:
        _wrap(lay.input_layernorm, _gain_before_cast)
        _wrap(lay.post_attention_layernorm, _gain_before_cast)
    _wrap(model.model.norm, _gain_before_cast)


def _rotate_in_fp32(orig: Callable) -> Callable:
    """`apply_rotary_pos_emb` that rotates q and k in fp32 and rounds back once when handed fp32 tables; a call
    with tables in q's dtype (another model's: HF's bf16 tables) runs HF's own `orig`."""
    def rotate(q, k, cos, sin, *a, **kw):
        if cos.dtype == q.dtype:
            return orig(q, k, cos, sin, *a, **kw)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        half = q.shape[-1] // 2

        def rot(x):
            xf = x.float()
            return (xf * cos + torch.cat([-xf[..., half:], xf[..., :half]], dim=-1) * sin).to(x.dtype)
        return rot(q), rot(k)
    return rotate


@contextlib.contextmanager
def rotated_in_fp32(model, pre_hook_of: Callable) -> Iterator[None]:
    """While open: every layer's attention gets the forward pre-hook `pre_hook_of(layer)` (it hands the layer
    fp32 position embeddings) and the modeling module rotates with them in fp32. The module's function and the
    hooks are restored after, so the other side, in the same process, keeps HF's bf16 tables."""
    ns = sys.modules[type(model.model.layers[0].self_attn).__module__]
    orig = ns.apply_rotary_pos_emb
    hooks = [lay.self_attn.register_forward_pre_hook(pre_hook_of(lay), with_kwargs=True)
             for lay in model.model.layers]
    ns.apply_rotary_pos_emb = _rotate_in_fp32(orig)
    try:
        yield
    finally:
        ns.apply_rotary_pos_emb = orig
        for h in hooks:
            h.remove()


def rope_fp32_tables(model) -> contextlib.AbstractContextManager:
    """RoPE with fp32 cos/sin tables, q and k rotated in fp32 and rounded back once (bf16 outputs), for every
    layer of `model` while the context is open. Trace inside the context."""
    pre = fp32_rope_tables(model)
    return rotated_in_fp32(model, lambda lay: pre)


def _fused_add_norm_layer(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                          position_embeddings=None, **kwargs):
    """A Qwen3 / Llama-style decoder layer with SGLang's fused residual add + RMSNorm: the add in fp32, its
    rounding kept as the residual stream, the post-attention norm applied to the fp32 sum (one kernel, gain in
    fp32, one rounding). The norm module is called on the rounded sum (what the trace records as `mid`)."""
    residual = hidden_states
    h = self.input_layernorm(hidden_states)
    h, _ = self.self_attn(hidden_states=h, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                          use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    mid32 = residual.float() + h.float()
    mid = mid32.to(residual.dtype)
    norm = self.post_attention_layernorm
    norm.tic_fp32_sum = mid32
    try:
        h = norm(mid)
    finally:
        norm.tic_fp32_sum = None
    return mid + self.mlp(h)


def _norm_of_fp32_sum(self, x):
    xf = self.tic_fp32_sum if getattr(self, "tic_fp32_sum", None) is not None else x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * self.weight.float()).to(x.dtype)


def fused_add_norm(model) -> None:
    """Every layer's residual add + post-attention RMSNorm fused in fp32 (SGLang's `RMSNorm(x, residual)`),
    without the trace saying so (`fused_add_norm_fp32` is SGLang's adapter's fact): the replay must name it,
    not blame it (docs/replay.md)."""
    for lay in model.model.layers:
        _wrap(lay, _fused_add_norm_layer)
        _wrap(lay.post_attention_layernorm, _norm_of_fp32_sum)


CLEAN_VARIANTS: dict[str, Callable] = {
    "tp2_row_parallel": tp_row_parallel(2),
    "tp4_row_parallel": tp_row_parallel(4),
    "tp2_undeclared": tp_row_parallel(2, declare=False),
    "flash_attention": attention("flash"),
    "sdpa_math": attention("sdpa_math"),
    "sdpa": attention("sdpa"),
    "fused_norm": fused_norm,
    "fused_add_norm": fused_add_norm,
}
