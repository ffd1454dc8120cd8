"""The canonical op graph of a decoder-only transformer (dense or MoE), as data.

Every adapter maps its framework's records onto these points; the comparator and the finder walk them in
dataflow order. A point is either global (`embed`, `final_norm`, `logits`, `logprobs`) or per layer
(`attn.q`, ...), written `L{i}.attn.q` once a layer is attached.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PointSpec:
    name: str
    layered: bool
    feeds: tuple[str, ...]      # points whose values this point is computed from (same layer unless global)
    features: str               # shape of one row, for documentation and checks
    kind: str = "float"         # "float" | "ids" (top-k expert ids: compared as sets)
    meaning: str = ""


_L = True
SCHEMA: tuple[PointSpec, ...] = (
    PointSpec("embed", False, (), "H", meaning="token embedding output"),
    PointSpec("input", _L, ("<prev>.output",), "H", meaning="residual stream entering the layer"),
    PointSpec("attn_norm", _L, ("input",), "H", meaning="input norm output"),
    PointSpec("attn.q", _L, ("attn_norm",), "heads x head_dim", meaning="q projection, before QK-norm and RoPE"),
    PointSpec("attn.k", _L, ("attn_norm",), "kv_heads x head_dim", meaning="k projection, before QK-norm and RoPE"),
    PointSpec("attn.v", _L, ("attn_norm",), "kv_heads x head_dim", meaning="v projection"),
    PointSpec("attn.q_norm", _L, ("attn.q",), "heads x head_dim", meaning="q after QK-norm"),
    PointSpec("attn.k_norm", _L, ("attn.k",), "kv_heads x head_dim", meaning="k after QK-norm"),
    PointSpec("attn.q_rope", _L, ("attn.q_norm",), "heads x head_dim", meaning="q after rotary embedding"),
    PointSpec("attn.k_rope", _L, ("attn.k_norm",), "kv_heads x head_dim", meaning="k after rotary embedding"),
    PointSpec("attn.core", _L, ("attn.q_rope", "attn.k_rope", "attn.v"), "heads*head_dim",
              meaning="attention output before the output projection"),
    PointSpec("attn.out", _L, ("attn.core",), "H", meaning="output projection, reduced over TP"),
    PointSpec("mid", _L, ("input", "attn.out"), "H", meaning="residual stream after attention"),
    PointSpec("mlp_norm", _L, ("mid",), "H", meaning="pre-MLP norm output"),
    PointSpec("moe.router_logits", _L, ("mlp_norm",), "E", meaning="router scores before top-k"),
    PointSpec("moe.topk_ids", _L, ("moe.router_logits",), "k", kind="ids", meaning="selected experts, sorted"),
    PointSpec("moe.topk_weights", _L, ("moe.router_logits",), "k", meaning="weights of the sorted selected experts"),
    PointSpec("moe.experts_out", _L, ("mlp_norm", "moe.topk_ids", "moe.topk_weights"), "H",
              meaning="routed experts' combined output"),
    PointSpec("moe.shared_out", _L, ("mlp_norm",), "H", meaning="shared experts' output"),
    PointSpec("mlp.out", _L, ("moe.experts_out", "moe.shared_out", "mlp_norm"), "H", meaning="MLP or MoE block output"),
    PointSpec("output", _L, ("mid", "mlp.out"), "H", meaning="residual stream leaving the layer"),
    PointSpec("final_norm", False, ("<last>.output",), "H", meaning="final norm output"),
    PointSpec("logits", False, ("final_norm",), "V", meaning="logits over the true vocabulary"),
    PointSpec("logprobs", False, ("logits",), "1", meaning="log-prob of the next token"),
)

BY_NAME = {p.name: p for p in SCHEMA}
_LAYERED = [p for p in SCHEMA if p.layered]
_ORDER_IN_LAYER = {p.name: i for i, p in enumerate(_LAYERED)}


def spec(point: str) -> PointSpec:
    try:
        return BY_NAME[point]
    except KeyError:
        raise KeyError(f"{point!r} is not a canonical point; known: {[p.name for p in SCHEMA]}") from None


def key_name(point: str, layer: int | None) -> str:
    """('attn.q', 3) -> 'L3.attn.q'; ('embed', None) -> 'embed'."""
    return f"L{layer}.{point}" if layer is not None else point


def parse_key(key: str) -> tuple[str, int | None]:
    if key.startswith("L") and "." in key:
        head, rest = key.split(".", 1)
        if head[1:].isdigit():
            return rest, int(head[1:])
    return key, None


def order_key(point: str, layer: int | None) -> tuple:
    """Sort key for dataflow order: embed, layers 0..N-1 (points in schema order), then the head."""
    if layer is None:
        head = {"embed": (0,), "final_norm": (2, 0), "logits": (2, 1), "logprobs": (2, 2)}
        return head.get(point, (3, point))
    return (1, layer, _ORDER_IN_LAYER.get(point, 99))


def feeds_of(point: str, layer: int | None, present: set[tuple[str, int | None]],
             n_layers: int | None) -> list[tuple[str, int | None]]:
    """The points that feed (point, layer), resolved against those actually present: a missing feed is
    replaced by its own feeds, so the finder always compares a point with the nearest measured inputs."""
    # Depth-first, with an explicit stack: a chain of absent points may run back through every layer
    # (thousands), deeper than Python's recursion limit.
    out: list[tuple[str, int | None]] = []
    seen: set = set()
    stack = [iter(_raw_feeds(point, layer, n_layers))]
    while stack:
        f = next(stack[-1], None)
        if f is None:
            stack.pop()
            continue
        if f in seen:
            continue
        seen.add(f)
        if f in present:
            out.append(f)
        else:
            stack.append(iter(_raw_feeds(*f, n_layers)))
    return out


def _raw_feeds(point: str, layer: int | None, n_layers: int | None) -> list[tuple[str, int | None]]:
    ps = BY_NAME.get(point)
    if ps is None:
        return []
    out = []
    for f in ps.feeds:
        if f == "<prev>.output":
            out.append(("output", layer - 1) if layer and layer > 0 else ("embed", None))
        elif f == "<last>.output":
            if n_layers:
                out.append(("output", n_layers - 1))
        elif BY_NAME[f].layered:
            out.append((f, layer))
        else:
            out.append((f, None))
    return out
