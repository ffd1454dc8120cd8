"""Trained-like statistics for a tiny random-init HF model: what makes trained models harsher than any random
init for the replay's envelopes (issue 23). Each function changes the weights in place, deterministically.

- `lognormal_norm_gains`: every RMSNorm gain log-normal, spread over orders of magnitude (0.002-41);
- `massive_activations`: a few residual channels ~10^3-10^4 x the median on chosen tokens' rows (BOS,
  delimiters), written by the embedding and kept by the residual stream;
- `attention_sinks`: every query attends mostly to the rows holding those massive channels.
"""
from __future__ import annotations

import torch


def _norms(model):
    for lay in model.model.layers:
        for m in (lay.input_layernorm, lay.post_attention_layernorm, getattr(lay.self_attn, "q_norm", None),
                  getattr(lay.self_attn, "k_norm", None)):
            if m is not None:
                yield m
    yield model.model.norm


@torch.no_grad()
def lognormal_norm_gains(model, sigma: float = 1.5, seed: int = 0, lo: float = 0.002, hi: float = 41.0) -> None:
    g = torch.Generator().manual_seed(seed)
    for m in _norms(model):
        w = torch.exp(torch.randn(m.weight.shape, generator=g) * sigma).clamp(lo, hi)
        m.weight.copy_(w.to(m.weight.dtype))


@torch.no_grad()
def massive_activations(model, tokens: list[int], channels: tuple[int, ...] = (3, 17), scale: float = 2000.0) -> None:
    """The embedding rows of `tokens` carry `scale` x the table's median magnitude in `channels`."""
    e = model.model.embed_tokens.weight
    med = float(e.float().abs().median())
    for t in tokens:
        for c in channels:
            e[t, c] = scale * med


@torch.no_grad()
def attention_sinks(model, channels: tuple[int, ...] = (3, 17), const_channel: int = 0, strength: float = 8.0) -> None:
    """Every row gets a constant positive channel (the embedding), every head's first query dimension reads
    it and its first key dimension reads the massive channels: the rows holding those channels draw most of
    every query's attention (call after `massive_activations`)."""
    e = model.model.embed_tokens.weight
    e[:, const_channel] = float(e.float().abs().mean()) * strength
    for lay in model.model.layers:
        a = lay.self_attn
        hd = a.head_dim
        kw, qw = a.k_proj.weight, a.q_proj.weight
        big_k, big_q = float(kw.float().abs().mean()) * strength, float(qw.float().abs().mean()) * strength * 4
        for h in range(kw.shape[0] // hd):
            for c in channels:
                kw[h * hd, c] = big_k
        for h in range(qw.shape[0] // hd):
            qw[h * hd, const_channel] = big_q
