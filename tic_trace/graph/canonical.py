"""The canonical op graph of a decoder-only transformer (dense or MoE), as data.

Every adapter maps its framework's records onto these points; the comparator and the finder walk them in
dataflow order. A point is either global (`embed`, `final_norm`, `logits`, `logprobs`) or per layer
(`attn.q`, ...), written `L{i}.attn.q` once a layer is attached.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class PointSpec:
    name: str
    layered: bool
    feeds: tuple[str, ...]      # points whose values this point is computed from (same layer unless global)
    features: str               # shape of one row, for documentation and checks
    kind: str = "float"         # "float" | "ids" (top-k expert ids: compared as sets)
    meaning: str = ""
    # How the finder and the renderers treat the point (the only place this knowledge lives):
    role: str = ""              # "embedding" | "residual" (the stream leaving a layer) | "router_logits" |
                                # "expert_ids" | "logprob" (what the model finally emits, per token)
    routed: bool = False        # computed from the layer's expert choice: judged without tokens whose
                                # top-k set flipped in that layer (those ran other experts)
    curve: bool = False         # a column of the error-growth views (terminal curve, HTML plot and heatmap)
    head: int | None = None     # position among the global points after the layers (final norm, logits, ...)
    per_head: bool = False      # a row is head-major (heads x head_dim): the replay measures per-head segments
    mixes_positions: bool = False   # a row is computed from its feeds' rows at this and earlier positions of
                                    # its sample (causal attention), not from the same row only
    op: str = ""                # the class of op that computes it ("rmsnorm", "gemm", ...): the attribution's
                                # groups ("every RMSNorm of B explains 62%"); "" = the point's own name
    # A feed only some architectures compute (Qwen3-Next's attention gate, its linear-attention block): absent
    # from a layer, it stands for nothing (not for its own feeds, which the point reads otherwise anyway);
    # present, the feeds of the reading point it `replaces` are not read (that layer computes this instead).
    optional: bool = False
    replaces: tuple[str, ...] = ()
    # The unit a row's error is judged in (compare/judge.py; docs/report.md, "Units"): "relative" — the row's
    # relative L2, ‖a_row − b_row‖ / ‖a_row‖, every element against the row's scale (a top-k weight or router
    # probability near 0 is never judged against its own value); "nats" — |a − b| itself, for a row that is one
    # log-prob, against what the logits' difference implies through the log-softmax (compare/inherited.py);
    # "mixture" — for a row that is a convex (or sub-convex) combination of its feed's rows (attention: Σ_j p_j v_j
    # with p ≥ 0, Σ p ≤ 1), ‖a_row − b_row‖ over the norm those rows bound it to (or its own, if larger): its
    # error scales with the rows it mixes, not with its own norm, which cancellation among them can make small
    # (compare/mixture.py). Judged like "relative".
    unit: str = "relative"
    # For unit "mixture": the feeds whose rows are mixed, in order of preference (the first the trace holds is
    # read); each holds, per value head, the mixed vectors in its last (point width / heads) columns.
    mixes: tuple[str, ...] = ()


_L = True
SCHEMA: tuple[PointSpec, ...] = (
    PointSpec("embed", False, (), "H", meaning="token embedding output", role="embedding", op="embedding"),
    PointSpec("input", _L, ("<prev>.output",), "H", meaning="residual stream entering the layer", op="identity"),
    PointSpec("attn_norm", _L, ("input",), "H", meaning="input norm output", curve=True, op="rmsnorm"),
    # Multi-latent attention (DeepSeek-V2/V3 MLA): q and kv pass through low-rank latents. No other architecture
    # has these points, and an absent feed resolves to its own feeds (feeds_of), so attn.q/k/v still read
    # attn_norm there.
    PointSpec("attn.q_a", _L, ("attn_norm",), "q_lora_rank", meaning="MLA: q down-projection (q_a_proj)", op="gemm"),
    PointSpec("attn.q_a_norm", _L, ("attn.q_a",), "q_lora_rank", meaning="MLA: the q latent after its RMSNorm "
              "(q_a_layernorm)", op="rmsnorm"),
    PointSpec("attn.kv_a", _L, ("attn_norm",), "kv_lora_rank + rope_dim", meaning="MLA: the kv latent, then the "
              "one k_pe every head shares, before RoPE (kv_a_proj_with_mqa)", op="gemm"),
    PointSpec("attn.kv_a_norm", _L, ("attn.kv_a",), "kv_lora_rank", meaning="MLA: the kv latent after its RMSNorm "
              "(kv_a_layernorm; k_pe is not normalised)", op="rmsnorm"),
    PointSpec("attn.kv_b", _L, ("attn.kv_a_norm",), "heads x (nope_dim + v_dim)", per_head=True,
              meaning="MLA: every head's decompressed k_nope, then its v (kv_b_proj)", op="gemm"),
    # Qwen3-Next's Gated DeltaNet linear attention (`linear_attn`), in the layers that run it instead of softmax
    # attention: its output projection is `attn.out`, read from the gated norm instead of `attn.core`.
    PointSpec("attn.linear_qkvz", _L, ("attn_norm",), "2 key_dim + 2 value_dim", meaning="linear attention: the "
              "q, k, v and z projection (in_proj_qkvz), grouped by key head", op="gemm"),
    PointSpec("attn.linear_ba", _L, ("attn_norm",), "2 v_heads", meaning="linear attention: the beta and decay "
              "inputs b, a (in_proj_ba), grouped by key head", op="gemm"),
    PointSpec("attn.linear_conv", _L, ("attn.linear_qkvz",), "2 key_dim + value_dim", mixes_positions=True,
              meaning="linear attention: q | k | v after the causal depthwise conv1d and SiLU", op="conv1d"),
    PointSpec("attn.linear_core", _L, ("attn.linear_conv", "attn.linear_ba"), "v_heads x v_head_dim",
              per_head=True, mixes_positions=True, meaning="linear attention: the gated delta rule's output "
              "(q, k L2-normalised, beta = sigmoid(b), decay g = -exp(A_log) softplus(a + dt_bias))",
              op="delta_rule"),
    PointSpec("attn.linear_norm", _L, ("attn.linear_core", "attn.linear_qkvz"), "v_heads x v_head_dim",
              per_head=True, optional=True, replaces=("attn.core",), meaning="linear attention: the RMSNorm of "
              "each head's output times SiLU(z), before out_proj", op="gated_rmsnorm"),
    PointSpec("attn.q", _L, ("attn.q_a_norm",), "heads x head_dim", per_head=True,
              meaning="q projection, before QK-norm and RoPE (MLA: q_b_proj, or q_proj without a q latent: "
              "every head's nope dims, then its rope dims before RoPE)", op="gemm"),
    PointSpec("attn.gate", _L, ("attn_norm",), "heads x head_dim", per_head=True, optional=True,
              meaning="gated attention (Qwen3-Next): each head's gate, the second half of its q_proj columns",
              op="gemm"),
    PointSpec("attn.k", _L, ("attn.kv_a",), "kv_heads x head_dim", per_head=True,
              meaning="k projection, before QK-norm and RoPE", op="gemm"),
    PointSpec("attn.v", _L, ("attn.kv_b",), "kv_heads x head_dim", per_head=True, meaning="v projection", op="gemm"),
    PointSpec("attn.q_norm", _L, ("attn.q",), "heads x head_dim", per_head=True, meaning="q after QK-norm", op="rmsnorm"),
    PointSpec("attn.k_norm", _L, ("attn.k",), "kv_heads x head_dim", per_head=True, meaning="k after QK-norm", op="rmsnorm"),
    PointSpec("attn.q_rope", _L, ("attn.q_norm",), "heads x head_dim", per_head=True,
              meaning="q after rotary embedding (MLA: every head's rope dims only)", op="rope"),
    PointSpec("attn.k_rope", _L, ("attn.k_norm",), "kv_heads x head_dim", per_head=True,
              meaning="k after rotary embedding (MLA: the shared k_pe only, one head)", op="rope"),
    PointSpec("attn.core", _L, ("attn.q_rope", "attn.k_rope", "attn.v", "attn.gate"), "heads*head_dim",
              meaning="attention output before the output projection (gated attention: times sigmoid(gate))",
              per_head=True, curve=True,
              mixes_positions=True, op="attention", unit="mixture", mixes=("attn.v", "attn.kv_b")),
    PointSpec("attn.out", _L, ("attn.core", "attn.linear_norm"), "H", meaning="output projection, reduced over TP "
              "(a linear-attention layer's: its out_proj)", curve=True, op="gemm"),
    # Gemma's sandwich norm of the attention branch, before the residual add (absent elsewhere: `mid` then reads
    # attn.out through feeds_of)
    PointSpec("attn.post_norm", _L, ("attn.out",), "H", meaning="attention branch's norm before the residual add",
              op="rmsnorm"),
    PointSpec("mid", _L, ("input", "attn.post_norm"), "H", meaning="residual stream after attention", curve=True,
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
    PointSpec("mlp.post_norm", _L, ("mlp.out",), "H", meaning="MLP branch's norm before the residual add (Gemma)",
              op="rmsnorm"),
    PointSpec("output", _L, ("mid", "mlp.post_norm"), "H", meaning="residual stream leaving the layer", curve=True,
              role="residual", op="residual_add"),
    PointSpec("final_norm", False, ("<last>.output",), "H", meaning="final norm output", head=0, op="rmsnorm"),
    PointSpec("logits", False, ("final_norm",), "V", meaning="logits over the true vocabulary", head=1, op="gemm"),
    PointSpec("logprobs", False, ("logits",), "1", meaning="log-prob of the next token", role="logprob", head=2,
              op="log_softmax", unit="nats"),
)

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
