"""CPU stand-ins for SGLang 0.5.23 GPU kernels that its CPU path (outside the sgl-kernel CPU engine) lacks,
each computing what the GPU code computes. Test support only: product code never imports this module.

* :func:`shim_final_logit_softcap` - Gemma 2's final logit soft-cap (see its docstring).
* :func:`shim_fused_shared_expert_gate` - Qwen2-MoE's gated shared expert (see its docstring).
* :class:`SoftcapSinkAttnBackend` - attention logit soft-capping and attention sinks:

Works around ``sglang/srt/layers/attention/torch_native_backend.py`` ``TorchNativeAttnBackend``:
``_run_sdpa_forward_extend`` / ``_run_sdpa_forward_decode`` hand every request to
``torch.nn.functional.scaled_dot_product_attention``, which has no soft-cap, so ``RadixAttention.logit_cap``
(Gemma 2's ``attn_logit_softcapping``) is never applied; and ``forward_extend`` / ``forward_decode`` take no
``sinks`` argument, so GPT-OSS's ``self.attn(..., sinks=self.sinks)`` raises. (Sliding windows it does
honour: ``_make_sliding_window_mask`` with ``RadixAttention.sliding_window_size``.) On GPU,
``triton_backend.py`` passes ``logits_soft_cap=layer.logit_cap`` and ``sinks`` to its kernels and
``flashattention_backend.py`` passes ``softcap=layer.logit_cap`` and ``sinks``: scores ``s = scale * q.k``
become ``cap * tanh(s / cap)`` before the mask and softmax, and each head's sink is one more logit in the
softmax's denominator with no value row.

:class:`SoftcapSinkAttnBackend` keeps everything else of the upstream backend (KV pool writes, the
per-request loop reading K/V through ``req_to_token``, causal and window masks): only the SDPA call it makes
for a layer that has a cap or sinks is replaced, for the duration of that layer's call, by
:func:`capped_sink_attention`. Layers with neither run the upstream SDPA unchanged.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from tic_trace.testing.sglang_cpu import install_cpu_shims

install_cpu_shims()        # before SGLang's layer modules are imported (their import graph needs the stubs)
from sglang.srt.layers.attention import torch_native_backend as _tnb  # noqa: E402
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402

_UPSTREAM_SDPA = _tnb.scaled_dot_product_attention


def _softcap_in_place(logits: torch.Tensor, final_logit_softcapping: float) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` written into ``logits`` (computed in fp32, as the Triton kernel does)."""
    cap = float(final_logit_softcapping)
    return logits.copy_(cap * torch.tanh(logits.float() / cap))


def shim_final_logit_softcap() -> None:
    """Bypasses: ``sglang/srt/layers/logits_processor.py`` ``LogitsProcessor._get_logits``, which soft-caps
    the logits with the Triton kernel ``softcap_inplace_logits`` (``sglang/kernels/ops/activation/softcap.py``)
    on every platform but ``_is_cpu`` (the sgl-kernel CPU engine) and NPU; on a plain CPU Triton has no
    driver and raises. The stand-in computes the same in-place ``cap * tanh(logits / cap)`` (the formula of
    the method's own CPU/NPU branch). Idempotent."""
    from sglang.srt.layers import logits_processor
    logits_processor.fused_softcap = _softcap_in_place


def _gate_sigmoid_mul(hidden_states: torch.Tensor, gate_weight: torch.Tensor, shared_output: torch.Tensor,
                      addend: torch.Tensor | None) -> torch.Tensor:
    """What ``_fused_gate_sigmoid_mul_add_kernel`` computes per row, in fp32: ``sigmoid(h . w) * shared (+ f)``,
    rounded once onto the output's dtype."""
    gate = torch.sigmoid(hidden_states.float() @ gate_weight.float().reshape(-1))[:, None]
    out = gate * shared_output.float()
    return out if addend is None else out + addend.float()


def shim_fused_shared_expert_gate() -> None:
    """Bypasses: ``sglang/srt/models/qwen2_moe.py`` ``Qwen2MoeSparseMoeBlock.forward_normal``, which on every
    platform but the AMX / NPU ones (``use_fused_gate``) gates the shared expert and adds it to the routed
    output with ``fused_gate_sigmoid_mul_add`` (``sglang/kernels/ops/elementwise/elementwise.py``,
    ``_fused_gate_sigmoid_mul_add_kernel``, a Triton kernel: no driver on a plain CPU). The stand-ins compute
    the kernel's formula in fp32 and round once, as it stores. Idempotent."""
    from sglang.srt.models import qwen2_moe

    def fused_gate_sigmoid_mul_add(hidden_states, gate_weight, shared_output, final_hidden_states):
        final_hidden_states.copy_(_gate_sigmoid_mul(hidden_states, gate_weight, shared_output, final_hidden_states))

    def fused_gate_sigmoid_mul(hidden_states, gate_weight, shared_output):
        return _gate_sigmoid_mul(hidden_states, gate_weight, shared_output, None).to(shared_output.dtype)

    qwen2_moe.fused_gate_sigmoid_mul_add = fused_gate_sigmoid_mul_add
    qwen2_moe.fused_gate_sigmoid_mul = fused_gate_sigmoid_mul


def capped_sink_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                          attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                          scale: float | None = None, enable_gqa: bool = False, logit_cap: float = 0.0,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA's signature (``[B, heads, Lq, d]`` q, ``[B, kv_heads, Lk, d]`` k/v, a boolean keep-mask or a
    top-left causal mask) plus a logit soft-cap and per-head sink logits; computed in fp32 (the GPU kernels
    accumulate scores and softmax in fp32), returned in the query's dtype."""
    q, k, v = query.float(), key.float(), value.float()
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if logit_cap and logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    lq, lk = scores.shape[-2:]
    keep = attn_mask
    if is_causal:
        keep = torch.ones(lq, lk, dtype=torch.bool, device=scores.device).tril()
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :lk]
    else:
        probs = torch.softmax(scores, dim=-1)
    return (probs @ v).to(query.dtype)


class SoftcapSinkAttnBackend(TorchNativeAttnBackend):
    """``TorchNativeAttnBackend`` whose per-request attention applies ``layer.logit_cap`` and ``sinks`` (see
    the module docstring for the upstream functions this works around)."""

    @contextlib.contextmanager
    def _attention_of(self, layer, sinks: torch.Tensor | None) -> Iterator[None]:
        cap = float(getattr(layer, "logit_cap", 0.0) or 0.0)
        if cap <= 0 and sinks is None:
            yield
            return

        def sdpa(query, key, value, **kw):
            return capped_sink_attention(query, key, value, logit_cap=cap, sinks=sinks, **kw)
        _tnb.scaled_dot_product_attention = sdpa
        try:
            yield
        finally:
            _tnb.scaled_dot_product_attention = _UPSTREAM_SDPA

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, **kwargs):
        with self._attention_of(layer, sinks):
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, **kwargs):
        with self._attention_of(layer, sinks):
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)


class LatentCacheAttnBackend(TorchNativeAttnBackend):
    """``TorchNativeAttnBackend`` for multi-latent attention (``deepseek_v2.py``'s ``DeepseekV2AttentionMLA``).

    Works around ``torch_native_backend.py`` ``TorchNativeAttnBackend.forward_extend``, which always attends
    over K and V read back from the KV pool. MLA's pool (``MLATokenToKVPool``) holds each token's normed kv
    latent and k_pe, not per-head K/V. A prefill with no cached prefix runs MLA's MHA path
    (``forward_normal``, chosen by ``attention_backend_handler.handle_attention_triton``, the handler every
    backend without its own gets): it writes the latent to the pool itself, decompresses k_nope / v with
    ``kv_b_proj`` and calls ``attn_mha(q, k, v, save_kv_cache=False)``, expecting the backend to attend over
    the ``k`` / ``v`` it passes, as the GPU backends' extend kernels do (``triton_backend.forward_extend``
    reads the extend part from ``k`` / ``v``). This class does that, per request and causal, with the upstream
    SDPA; every other call (the absorbed MQA path over the latent cache, decode) runs upstream unchanged.
    """

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if save_kv_cache or k is None or v is None:
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if any(forward_batch.extend_prefix_lens_cpu):
            raise NotImplementedError("MLA's MHA path over a cached prefix (MHA_CHUNKED_KV) is not emulated")
        heads = layer.tp_q_head_num
        q_, k_ = q.view(-1, heads, layer.qk_head_dim), k.view(-1, heads, layer.qk_head_dim)
        v_ = v.view(-1, heads, layer.v_head_dim)
        out = q.new_empty((q_.shape[0], heads, layer.v_head_dim))
        start = 0
        for n in forward_batch.extend_seq_lens_cpu:
            rows = slice(start, start + int(n))
            o = _UPSTREAM_SDPA(q_[rows].transpose(0, 1), k_[rows].transpose(0, 1), v_[rows].transpose(0, 1),
                               is_causal=True, scale=layer.scaling)
            out[rows] = o.transpose(0, 1)
            start += int(n)
        return out.view(q_.shape[0], heads * layer.v_head_dim)
