"""The canonical op graph of a decoder-only transformer (dense or MoE), as data.

Every adapter maps its framework's records onto these points; the comparator and the finder walk them in
dataflow order. A point is either global (`embed`, `final_norm`, `logits`, `logprobs`) or per layer
(`attn.q`, ...), written `L{i}.attn.q` once a layer is attached.

`SCHEMA` is the base transformer's points (`BASE_POINTS`, here) with every registered model family's own
(`Family.points`, declared in tic_trace/families/<name>/points.py) placed in dataflow order and read by the base
points they stand before. A layer without a family's point resolves it to its own feeds (`feeds_of`), so the
base's dataflow holds wherever a family's points are absent.
"""
from __future__ import annotations

import bisect
from dataclasses import replace
from typing import Iterable

from ..families import FAMILIES
from .point_spec import FamilyPoint, PointSpec

_L = True
# The base transformer's points, in dataflow order, each with the feeds it reads where no family's point stands
# between (`FamilyPoint.read_by` rewires them) and the meaning it has in every family (`Family.remarks` add theirs).
BASE_POINTS: tuple[PointSpec, ...] = (
    PointSpec("embed", False, (), "H", meaning="token embedding output", role="embedding", op="embedding"),
    PointSpec("input", _L, ("<prev>.output",), "H", meaning="residual stream entering the layer", op="identity"),
    PointSpec("attn_norm", _L, ("input",), "H", meaning="input norm output", curve=True, op="rmsnorm"),
    PointSpec("attn.q", _L, ("attn_norm",), "heads x head_dim", per_head=True,
              meaning="q projection, before QK-norm and RoPE", op="gemm"),
    PointSpec("attn.k", _L, ("attn_norm",), "kv_heads x head_dim", per_head=True,
              meaning="k projection, before QK-norm and RoPE", op="gemm"),
    PointSpec("attn.v", _L, ("attn_norm",), "kv_heads x head_dim", per_head=True, meaning="v projection", op="gemm"),
    PointSpec("attn.q_norm", _L, ("attn.q",), "heads x head_dim", per_head=True, meaning="q after QK-norm", op="rmsnorm"),
    PointSpec("attn.k_norm", _L, ("attn.k",), "kv_heads x head_dim", per_head=True, meaning="k after QK-norm", op="rmsnorm"),
    PointSpec("attn.q_rope", _L, ("attn.q_norm",), "heads x head_dim", per_head=True,
              meaning="q after rotary embedding", op="rope"),
    PointSpec("attn.k_rope", _L, ("attn.k_norm",), "kv_heads x head_dim", per_head=True,
              meaning="k after rotary embedding", op="rope"),
    PointSpec("attn.core", _L, ("attn.q_rope", "attn.k_rope", "attn.v"), "heads*head_dim",
              meaning="attention output before the output projection", per_head=True, curve=True,
              mixes_positions=True, op="attention", unit="mixture", mixes=("attn.v",)),
    PointSpec("attn.out", _L, ("attn.core",), "H", meaning="output projection, reduced over TP", curve=True,
              op="gemm"),
    PointSpec("mid", _L, ("input", "attn.out"), "H", meaning="residual stream after attention", curve=True,
              op="residual_add"),
    PointSpec("mlp_norm", _L, ("mid",), "H", meaning="pre-MLP norm output", op="rmsnorm"),
    PointSpec("moe.router_logits", _L, ("mlp_norm",), "E", meaning="router scores before top-k",
              role="router_logits", curve=True, op="gemm"),
    PointSpec("moe.topk_ids", _L, ("moe.router_logits",), "k", kind="ids", meaning="selected experts, sorted",
              role="expert_ids", op="routing"),
    PointSpec("moe.topk_weights", _L, ("moe.router_logits",), "k", meaning="weights of the sorted selected experts",
              routed=True, op="topk_weights"),
    PointSpec("moe.experts_out", _L, ("mlp_norm", "moe.topk_ids", "moe.topk_weights"), "H",
              meaning="routed experts' combined output", routed=True, curve=True, op="experts"),
    PointSpec("moe.shared_out", _L, ("mlp_norm",), "H", meaning="shared experts' output", op="mlp"),
    PointSpec("mlp.out", _L, ("moe.experts_out", "moe.shared_out", "mlp_norm"), "H", meaning="MLP or MoE block output",
              curve=True, op="mlp"),
    PointSpec("output", _L, ("mid", "mlp.out"), "H", meaning="residual stream leaving the layer", curve=True,
              role="residual", op="residual_add"),
    PointSpec("final_norm", False, ("<last>.output",), "H", meaning="final norm output", head=0, op="rmsnorm"),
    PointSpec("logits", False, ("final_norm",), "V", meaning="logits over the true vocabulary", head=1, op="gemm"),
    PointSpec("logprobs", False, ("logits",), "1", meaning="log-prob of the next token", role="logprob", head=2,
              op="log_softmax", unit="nats"),
)


class SchemaError(ValueError):
    """A family's points do not fit the base graph (a bug in tic_trace/families/<name>/points.py)."""


def _placed(base: tuple[PointSpec, ...], families: Iterable) -> tuple[list[PointSpec], dict[str, FamilyPoint]]:
    """The points in dataflow order (each family's after the base point it names, in registry order, then in
    its declaration order) and the family points by name; a point two families declare is placed once."""
    after: dict[str, list[PointSpec]] = {p.name: [] for p in base}
    declared: dict[str, FamilyPoint] = {}
    for fam in families:
        for fp in fam.points:
            name = fp.spec.name
            if name in after:
                raise SchemaError(f"family {fam.name}: {name!r} is a base point (graph/canonical.py); declare only "
                                  f"the points the base lacks in tic_trace/families/{fam.name}/points.py")
            if name in declared:
                if declared[name] != fp:
                    raise SchemaError(f"family {fam.name} declares point {name!r} otherwise than another family: "
                                      f"one point, one meaning (share the declaration, or name the point otherwise)")
                continue
            if fp.after not in after:
                raise SchemaError(f"family {fam.name}: point {name!r} follows {fp.after!r}, which is not a base point")
            declared[name] = fp
            after[fp.after].append(fp.spec)
    return [q for p in base for q in (p, *after[p.name])], declared


def _rewired(p: PointSpec, fp: FamilyPoint, feed: str) -> PointSpec:
    """`p` reading family point `fp` in place of its feed `feed` ("": as an added feed)."""
    if not feed:
        return replace(p, feeds=(*p.feeds, fp.spec.name))
    if feed not in p.feeds:
        raise SchemaError(f"point {fp.spec.name!r} is read by {p.name!r} in place of {feed!r}, which {p.name!r} does "
                          f"not read (feeds {p.feeds}; another family's point may stand there already)")
    return replace(p, feeds=tuple(fp.spec.name if f == feed else f for f in p.feeds))


def assemble(base: tuple[PointSpec, ...], families: Iterable) -> tuple[PointSpec, ...]:
    """The canonical graph: `base` with every family's points placed, the base points that read them rewired,
    their `mixes` extended, and the families' remarks added to the meanings ("meaning (remark; remark)")."""
    families = tuple(families)
    order, declared = _placed(base, families)
    by = {p.name: p for p in order}
    for fp in declared.values():
        for reader, feed in fp.read_by:
            if reader not in by:
                raise SchemaError(f"point {fp.spec.name!r} is read by {reader!r}, which is no canonical point")
            by[reader] = _rewired(by[reader], fp, feed)
        for reader in fp.mixed_by:
            if reader not in by or by[reader].unit != "mixture":
                raise SchemaError(f"point {fp.spec.name!r} is mixed by {reader!r}, which is no point of unit mixture")
            by[reader] = replace(by[reader], mixes=(*by[reader].mixes, fp.spec.name))
    remarks: dict[str, list[str]] = {}
    for fam in families:
        for point, remark in fam.remarks.items():
            if point not in by:
                raise SchemaError(f"family {fam.name} remarks on {point!r}, which is no canonical point")
            if remark not in remarks.setdefault(point, []):
                remarks[point].append(remark)
    for point, said in remarks.items():
        by[point] = replace(by[point], meaning=f"{by[point].meaning} ({'; '.join(said)})")
    return tuple(by[p.name] for p in order)


SCHEMA: tuple[PointSpec, ...] = assemble(BASE_POINTS, FAMILIES)

BY_NAME = {p.name: p for p in SCHEMA}
_LAYERED = [p for p in SCHEMA if p.layered]
_ORDER_IN_LAYER = {p.name: i for i, p in enumerate(_LAYERED)}
HEAD_POINTS: tuple[str, ...] = tuple(p.name for p in sorted((p for p in SCHEMA if p.head is not None),
                                                            key=lambda p: p.head))
CURVE_POINTS: tuple[str, ...] = tuple(p.name for p in SCHEMA if p.curve)
ROUTED_POINTS: frozenset[str] = frozenset(p.name for p in SCHEMA if p.routed)
EMBEDDING = next(p.name for p in SCHEMA if p.role == "embedding")
RESIDUAL = next(p.name for p in SCHEMA if p.role == "residual")
LOGPROBS = next(p.name for p in SCHEMA if p.role == "logprob")
ROUTER_LOGITS = next(p.name for p in SCHEMA if p.role == "router_logits")
EXPERT_IDS = next(p.name for p in SCHEMA if p.role == "expert_ids")
# The points whose per-token error says what reaches the user, best first: the log-prob of the sampled token,
# else the logits.
OUTPUT_POINTS: tuple[str, ...] = tuple(dict.fromkeys([LOGPROBS, *reversed(HEAD_POINTS)]))


def is_ids(point: str) -> bool:
    """Whether a point holds ids (compared as sets, never as numbers)."""
    ps = BY_NAME.get(point)
    return bool(ps and ps.kind == "ids")


def unit_of(point: str) -> str:
    """The unit a point's row errors are judged in: "relative", "nats" or "mixture" (PointSpec.unit)."""
    ps = BY_NAME.get(point)
    return ps.unit if ps else "relative"


def is_routed(point: str) -> bool:
    return point in ROUTED_POINTS


def mixes_positions(point: str) -> bool:
    ps = BY_NAME.get(point)
    return bool(ps and ps.mixes_positions)


def known_key(key: str) -> bool:
    """Whether `key` names a canonical point, bare ("attn.core") or with a layer ("L3.attn.core")."""
    point, layer = parse_key(key)
    ps = BY_NAME.get(point)
    return ps is not None and (layer is None or ps.layered)


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
        ps = BY_NAME.get(point)
        if ps is not None and ps.head is not None:
            return (2, ps.head)
        return (0,) if ps is not None and not ps.feeds else (3, point)
    return (1, layer, _ORDER_IN_LAYER.get(point, 99))


def feeds_of(point: str, layer: int | None, present: set[tuple[str, int | None]],
             n_layers: int | None) -> list[tuple[str, int | None]]:
    """The points that feed (point, layer), resolved against those actually present: a missing feed is
    replaced by its own feeds, so the finder always compares a point with the nearest measured inputs."""
    # Depth-first, with an explicit stack: a chain of absent points may run back through every layer
    # (thousands), deeper than Python's recursion limit.
    out: list[tuple[str, int | None]] = []
    seen: set = set()
    held: list[int] | None = None          # the layers holding any present point, sorted (read when first needed)
    stack = [iter(_raw_feeds(point, layer, n_layers, present))]
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
        elif f[0] == "output" and f[1] is not None:
            # Every path out of a layer that holds no present point leads to the previous layer's output only:
            # jump over such a span at once (a trace's claimed layer count may be huge and its layers few).
            if held is None:
                held = sorted({lay for _, lay in present if lay is not None})
            below = bisect.bisect_right(held, f[1]) - 1
            if below >= 0 and held[below] == f[1]:
                stack.append(iter(_raw_feeds(*f, n_layers, present)))
            else:
                stack.append(iter([("output", held[below]) if below >= 0 else ("embed", None)]))
        else:
            stack.append(iter(_raw_feeds(*f, n_layers, present)))
    return out


def _chosen_feeds(feeds: tuple[str, ...], layer: int | None, present: set) -> list[str]:
    """`feeds` without the optional ones absent from this layer, nor those a present one replaces."""
    out = [f for f in feeds if f not in BY_NAME or not BY_NAME[f].optional or (f, layer) in present]
    gone = {r for f in out if f in BY_NAME for r in BY_NAME[f].replaces}
    return [f for f in out if f not in gone]


def _raw_feeds(point: str, layer: int | None, n_layers: int | None,
               present: set) -> list[tuple[str, int | None]]:
    ps = BY_NAME.get(point)
    if ps is None:
        return []
    out = []
    for f in _chosen_feeds(ps.feeds, layer, present):
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
