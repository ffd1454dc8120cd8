"""A canonical point's description (`PointSpec`), and a point only some model families compute (`FamilyPoint`):
where it sits in the base transformer's dataflow and which base points read it. Data only, no imports: the
families' `points.py` declare theirs with these, and `canonical` assembles the graph from the base's points and
every registered family's.
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
    # A feed only some architectures compute (a gated attention's gate, a linear-attention block): absent
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


@dataclass(frozen=True)
class FamilyPoint:
    """A point one family (or a few) computes and the base transformer does not, declared in the family's folder
    (`tic_trace/families/<name>/points.py`, `Family.points`). `canonical` places it and rewires the base points
    that read it; where a layer lacks it, `feeds_of` resolves it to its own feeds, so the base's dataflow holds
    there unchanged. Two families may declare the same point only with an equal `FamilyPoint`."""
    spec: PointSpec
    # the base point it follows in dataflow order; the family points after one base point keep the registry's
    # family order, then their declaration order
    after: str
    # (reader, feed): the point `reader` reads this one in place of its feed `feed` (the feed it stands between),
    # or, with feed "", as a feed added after the reader's own
    read_by: tuple[tuple[str, str], ...] = ()
    # the points of unit "mixture" whose `mixes` gain this one, after their own (the mixed rows it holds)
    mixed_by: tuple[str, ...] = ()
