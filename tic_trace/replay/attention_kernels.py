"""Attention as each implementation computes it, on ``[B, H, T, d]`` tensors in the activations' dtype ``dt``: the
kernels the replay's clean attention variants (and its known faults) run on a side's own inputs
(``variants.py``, ``fact_variants.py``, the families' ``variants.py``). Each rounds where that implementation rounds."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def eager(q, k, v, mask, scale, dt):
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, -math.inf)
    return torch.softmax(s, dim=-1, dtype=torch.float32).to(dt) @ v


def flash(q, k, v, mask, scale, dt):
    """fp32 scores and softmax statistics, probabilities rounded to dt before P.V, normalised at the end."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, -math.inf)
    p = torch.exp(s - s.amax(-1, keepdim=True))
    return ((p.to(dt).float() @ v.float()) / p.sum(-1, keepdim=True)).to(dt)


def scaled_gemm(q, k, v, mask, scale, dt, cap=None, sinks=None):
    """megatron-core's local ``DotProductAttention``: the scale inside the score GEMM (``baddbmm(alpha=scale)``: one
    rounding of the scaled scores), softmax in fp32 (``attention_softmax_in_fp32``; GPT-OSS's sinks as one more
    column, ``SoftmaxOne``), probabilities rounded before P.V. (fact_variants.py reuses it with caps and sinks.)"""
    s = ((q.float() @ k.float().transpose(-1, -2)) * scale).to(dt).float()
    if cap:
        s = torch.tanh(s / cap) * cap
    s = s.masked_fill(~mask, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.float().reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)], dim=-1)
    p = torch.softmax(s, dim=-1)
    return (p[..., :-1] if sinks is not None else p).to(dt) @ v


def sdpa(backend):
    def fn(q, k, v, mask, scale, dt):
        from torch.nn.attention import sdpa_kernel
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return fn


def softmax_bf16(q, k, v, mask, scale, dt):
    s = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~mask, -math.inf)
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e / e.sum(-1, keepdim=True)) @ v


def kv_fp8(kernel):
    """The KV cache in fp8 (e4m3, unit scales: an engine's `--kv-cache-dtype fp8_e4m3` without calibrated
    scales): k and v rounded to fp8 before the kernel reads them back in the activations' dtype."""
    def fn(q, k, v, mask, scale, dt):
        f8 = torch.float8_e4m3fn
        return kernel(q, k.to(f8).to(dt), v.to(f8).to(dt), mask, scale, dt)
    return fn
