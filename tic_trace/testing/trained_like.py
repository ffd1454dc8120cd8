"""Weight shaping that gives a small random model the statistics of a trained one (issue 23).

Random-init models are gentle: every residual row has about the same norm and every norm gain is near 1.
Trained models are not, and the comparator's rules must hold on them too:

- **massive activations** (`massive_activations`): a few residual channels of a few tokens (BOS, delimiters)
  are 10^3-10^4x the median activation, and carried along the whole residual stream. Those rows then hold
  nearly all of the residual's squared norm, so any error measured over all rows at once is theirs alone.
- **wide norm gains** (`lognormal_norm_gains`): RMSNorm gains spread log-normally over orders of magnitude
  (0.002 to 40 in real checkpoints), which weighs a row's error by a few channels.
- **attention sinks** (`attention_sinks`): every query attends mostly to the rows holding those channels.
- `BOS` and `bos_first`: token ids whose rows are massive, put at position 0 of every sample (as a tokenizer
  puts BOS there).

Each helper edits an HF causal LM's parameters in place, under `torch.no_grad()`, and returns what it did;
the same edits on both sides of a pair keep them one model. Used by tests/test_row_relative.py and meant to be
reused by any suite that needs trained-like statistics (HF Qwen3 / Qwen3-MoE and any model whose embedding is
`model.model.embed_tokens` and whose norms are modules with a 1-D `weight` and "norm" in their name).
"""
from __future__ import annotations

import math

import torch

BOS = 0   # the token id `massive_activations` makes massive by default


def massive_activations(model, token_ids=(BOS,), *, channels: int | tuple[int, ...] = 2, scale: float = 3000.0,
                        seed: int = 0, positive: bool = False) -> list[int]:
    """Token ids `token_ids` embed with `channels` residual channels (a count, drawn at random, or the
    channels themselves) at `scale` x the median |embedding| (signs random unless `positive`, the same
    channels for every such token, as in trained models); returns the channels. The residual stream carries
    the embedding to every layer, so these tokens' rows hold massive activations throughout (each RMSNorm
    rescales them back to an ordinary size for the op it feeds)."""
    emb = model.model.embed_tokens.weight
    g = torch.Generator().manual_seed(seed)
    chosen = (torch.tensor(channels) if isinstance(channels, tuple)
              else torch.randperm(emb.shape[1], generator=g)[:channels])
    median = float(emb.detach().abs().float().median())
    with torch.no_grad():
        for t in token_ids:
            signs = (torch.ones(len(chosen)) if positive
                     else torch.randint(0, 2, (len(chosen),), generator=g).float() * 2 - 1)
            emb[t, chosen] = (signs * scale * median).to(emb.dtype)
    return [int(c) for c in chosen]


def attention_sinks(model, channels: tuple[int, ...] = (3, 17), const_channel: int = 0, strength: float = 8.0) -> None:
    """Every row gets a constant positive channel (the embedding), every head's first query dimension reads
    it and its first key dimension reads the massive `channels` (positive ones: `massive_activations(...,
    positive=True)` first): the rows holding them draw most of every query's attention, as sink tokens do."""
    with torch.no_grad():
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


def lognormal_norm_gains(model, *, low: float = 0.002, high: float = 40.0, include_qk: bool = False,
                         seed: int = 0, sigma: float | None = None) -> list[str]:
    """Every RMSNorm gain drawn log-normally around 1 (`sigma`, by default with [low, high] at about +-3 sigma
    of the wider side), clipped into [low, high]; the QK-norms' gains too with `include_qk` (they scale the
    attention scores, so wide gains there make every head's softmax one-hot). Returns the parameter names
    edited."""
    g = torch.Generator().manual_seed(seed)
    sigma = sigma if sigma is not None else max(abs(math.log(low)), abs(math.log(high))) / 3.0
    done = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim != 1 or "norm" not in name or (not include_qk and ("q_norm" in name or "k_norm" in name)):
                continue
            gain = torch.exp(sigma * torch.randn(p.shape, generator=g)).clamp(low, high)
            p.copy_(gain.to(p.dtype))
            done.append(name)
    return done


def bos_first(ids: torch.Tensor, token: int = BOS) -> torch.Tensor:
    """`ids` [batch, seq] with `token` at position 0 of every sample (and nowhere else)."""
    out = ids.clone()
    out[out == token] = token + 1
    out[:, 0] = token
    return out


def massive_share(hidden: torch.Tensor, rows: torch.Tensor) -> float:
    """The share of `hidden`'s squared norm [batch, seq, d] held by the rows where `rows` [batch, seq] is true:
    how much of an all-rows relative error those rows decide."""
    sq = hidden.float().pow(2).sum(-1)
    return float(sq[rows].sum() / sq.sum())


def mute_channels(model, channels, gain: float = 4e-4, norm: str = "post_attention_layernorm",
                  layers: range | None = None) -> None:
    """The `norm` gain of `channels` set to `gain` in `layers` (default: every layer but the first): a massive
    channel muted before the MLP, as trained models do (gains down to 5e-5 where the residual's massive channel
    sits)."""
    with torch.no_grad():
        for i, lay in enumerate(model.model.layers):
            if (layers is None and i > 0) or (layers is not None and i in layers):
                getattr(lay, norm).weight[list(channels)] = gain


def confident_head(model, scale: float = 8.0) -> None:
    """The lm_head scaled by `scale`: peaked next-token distributions, so that the model's own tokens have
    log-probs near 0 (a trained model's are; random-init ones sit near -log V)."""
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)


def greedy_continuation(model, prompt: torch.Tensor, length: int) -> torch.Tensor:
    """`prompt` [batch, seq] extended to `length` positions with the model's own greedy tokens (what an RL
    rollout scores: the log-probs of a confident model's own answer sit near 0)."""
    ids = prompt
    with torch.no_grad():
        while ids.shape[1] < length:
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids
