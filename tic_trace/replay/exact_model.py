"""The exact model: the canonical ops chained from the tokens in float64, and the gradient of an objective
over the log-probs at every canonical point.

The attribution (`attribution.py`) needs, for each canonical point p, how much a small change of p's output
moves the log-probs: g_p = d(objective)/d(output at p), evaluated on the exact trajectory. The ops are the
replay's (`reference.ExactReference.compute`), so the model run here is the one every point is judged
against, with the weights rounded as one side ran them. Routing follows a given expert choice (side A's
recorded top-k ids): the top-k weights' gradient is then per slot of that choice, and a token whose choice
differs on side B is accounted for by recomputing its layer with B's choice (`attribution.routing_terms`).
Memory: the whole autograd graph of the rows asked for is held (float64), so callers bound the tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..graph.canonical import BY_NAME, LOGPROBS, order_key
from .reference import F64, ExactReference, NotReplayable

RowId = tuple[str, int]
Key = tuple[str, "int | None"]


def feed_key(feed: str, layer: int | None, n_layers: int | None) -> Key:
    """The canonical key a point at `layer` reads for `feed` (`reference.inputs_of`'s names): `<prev>.output`
    is the previous layer's output (the embedding for layer 0), `<last>.output` the last layer's."""
    if feed == "<prev>.output":
        return ("output", layer - 1) if layer else ("embed", None)
    if feed == "<last>.output":
        return ("output", (n_layers or 1) - 1)
    return (feed, layer if BY_NAME[feed].layered else None)


@dataclass
class ExactRun:
    """The exact model's outputs at every canonical point over `rows` (float64), and after `backward` the
    gradient of the objective at each (zeros where the objective does not depend on the point)."""
    rows: list[RowId]
    values: dict[Key, torch.Tensor]
    logprob_rows: list[RowId] = field(default_factory=list)
    grads: dict[Key, torch.Tensor] = field(default_factory=dict)

    def index(self) -> dict[RowId, int]:
        return {r: i for i, r in enumerate(self.rows)}


def run_exact(ref: ExactReference, points: list[Key], rows: list[RowId], tokens: dict[RowId, int], n_layers: int,
              routing: dict[int, torch.Tensor] | None = None, has_qk_norm: bool | None = None,
              post: Callable[[Key, dict, torch.Tensor], torch.Tensor] | None = None) -> ExactRun:
    """The exact model forward over `rows` (whole samples: each one's positions run 0..n-1) at `points` (the
    canonical keys to compute, any order: run in dataflow order). `tokens`: every row's token, and the next
    token of the rows to score. `routing`: layer -> top-k ids [rows, k] to route by (None: the exact model's
    own choice). `post(key, feeds, y)`: what each float point's output becomes before the next point reads it
    (a clean implementation's output instead of the exact one: clean_noise.py); None: the exact value."""
    _check_whole(rows)
    run = ExactRun(rows, {})
    for point, layer in sorted(points, key=lambda k: order_key(*k)):
        if point == LOGPROBS:
            continue
        feeds = _feeds(ref, run, point, layer, n_layers, has_qk_norm)
        if point == "moe.topk_ids" and routing is not None and layer in routing:
            y = routing[layer].to(F64)
        elif point == "moe.topk_weights" and routing is not None and layer in routing:
            feeds = {**feeds, "moe.topk_ids": routing[layer].to(F64)}
            y = ref.compute(point, layer, feeds, rows, tokens)
        else:
            y = ref.compute(point, layer, feeds, rows, tokens)
        if post is not None and point != "moe.topk_ids":
            y = post((point, layer), feeds, y)
        if point == "embed":
            y = y.detach().clone().requires_grad_(True)      # the leaf every other point hangs from
        elif y.requires_grad:
            y.retain_grad()
        run.values[(point, layer)] = y
    if (LOGPROBS, None) in points and ("logits", None) in run.values:
        _logprobs(ref, run, tokens)
    return run


def backward(run: ExactRun, signs: dict[RowId, float]) -> None:
    """Gradients of sum_t signs[t] * logprob_t at every point (rows of `signs` not in the run are ignored)."""
    lp = run.values.get((LOGPROBS, None))
    if lp is None:
        raise NotReplayable("the exact model has no log-probs (logits or next tokens not available)")
    where = {r: i for i, r in enumerate(run.logprob_rows)}
    idx = [where[r] for r in signs if r in where]
    if not idx:
        raise NotReplayable("no log-prob row of the exact model is a row both sides scored")
    w = torch.tensor([signs[r] for r in signs if r in where], dtype=F64, device=lp.device)
    (lp.reshape(-1)[torch.tensor(idx, device=lp.device)] * w).sum().backward()
    run.grads = {k: (v.grad if v.grad is not None else torch.zeros_like(v)).detach()
                 for k, v in run.values.items() if v.is_floating_point() and k[0] != "moe.topk_ids"}


def _check_whole(rows: list[RowId]) -> None:
    by: dict[str, list[int]] = {}
    for s, p in rows:
        by.setdefault(s, []).append(p)
    for s, ps in by.items():
        if sorted(ps) != list(range(len(ps))):
            raise NotReplayable(f"sample {s!r}: the exact model runs every position from 0, the rows hold "
                                f"positions {min(ps)}..{max(ps)} with gaps")


def _feeds(ref: ExactReference, run: ExactRun, point: str, layer: int | None, n_layers: int,
           has_qk_norm: bool | None) -> dict:
    feeds = {}
    for f in ref.inputs_of(point, has_qk_norm, layer):
        k = feed_key(f, layer, n_layers)
        if k not in run.values:
            raise NotReplayable(f"the exact model computes {point} from {k[0]}, which is not among its points")
        feeds[k[0] if f[0] != "<" else f] = run.values[k]
    if point == "attn.core":      # every key/value row of each sample (the rows are whole samples)
        feeds["__kv_rows__"] = run.index()
    return feeds


def _logprobs(ref: ExactReference, run: ExactRun, tokens: dict[RowId, int]) -> None:
    """Log-probs of the rows whose next token is known (a sample's last row scores nothing)."""
    idx = [i for i, (s, p) in enumerate(run.rows) if (s, p + 1) in tokens]
    run.logprob_rows = [run.rows[i] for i in idx]
    logits = run.values[("logits", None)]
    sel = logits[torch.tensor(idx, device=logits.device)]
    y = ref.compute(LOGPROBS, None, {"logits": sel}, run.logprob_rows, tokens)
    if y.requires_grad:           # not under no_grad (a forward without the backward: clean_noise.py)
        y.retain_grad()
    run.values[(LOGPROBS, None)] = y

