"""Routing replay (R3): did the trainer apply the rollout's expert ids, per token and MoE layer? (issue 37)

With slime's `--use-rollout-routing-replay` the trainer's routers do not choose experts: they take the ids the
engine chose (SGLang's `return_routed_experts`, handed to Megatron's router replay) and gather their own scores at
those ids for the weights. What can still differ, per layer and row (sample key, position):

* ``ids``: the set differs: ids dropped or replaced (a layer not replayed, rows shifted, a stale replay);
* ``order``: same set, another slot order. Megatron's stock router scatters the replayed ids into a dense
  [tokens, experts] map, so its output does not depend on the order; kernels that combine experts in slot order
  (SGLang's, slime's ordered top-k DeepEP path) accumulate in another order, a bf16-sized difference. Checked only
  where the trainer's ids are given in the order it used (`AppliedLayer.ordered`); the canonical point
  `moe.topk_ids` holds sorted ids, so from a trace alone the order is named not checked;
* ``weights``: same ids, other weights: the trainer's weights are recomputed from its own router scores (or with
  another score function / normalisation) where the engine's come from the engine's. Checked against the
  engine's trace (`moe.topk_weights` of the same rows): the rollout record holds ids only.

A layer with no trainer trace is *not checked*, never agreeing. numpy only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

from ..graph.canonical import EXPERT_IDS
from ..view.align import RowId

WEIGHTS_POINT = "moe.topk_weights"
#: A row's weights differ when ‖w_trainer − w_engine‖ / ‖w_engine‖ (over its k weights, matched by expert id)
#: exceeds this: fp32 runs agree to ~1e-6, bf16 to ~1e-2; a recomputed score function differs by far more.
WEIGHT_TOL = 0.05
KINDS = ("ids", "order", "weights")
#: Rows of one layer and kind described in full (RowDiff); all of them are kept as (sample, position) either way.
DETAILED = 32


@dataclass(frozen=True)
class AppliedLayer:
    """One MoE layer of a side's routing, per row: expert ids and (optionally) their weights, aligned."""
    layer: int
    rows: Sequence[RowId]
    ids: np.ndarray                  # int [n, k]
    weights: np.ndarray | None = None    # float [n, k], weights[i, j] belongs to ids[i, j]
    ordered: bool = False            # ids in the slot order the side used (False: sorted, as moe.topk_ids)

    def __post_init__(self) -> None:
        n = len(self.rows)
        if self.ids.ndim != 2 or self.ids.shape[0] != n:
            raise ValueError(f"layer {self.layer}: ids must be [rows={n}, k], got {list(self.ids.shape)}")
        if self.weights is not None and self.weights.shape != self.ids.shape:
            raise ValueError(f"layer {self.layer}: weights {list(self.weights.shape)} do not match ids "
                             f"{list(self.ids.shape)}")


@dataclass(frozen=True)
class RowDiff:
    """One row of one layer whose applied routing differs from the rollout's."""
    sample: str
    position: int
    kind: str                        # "ids" | "order" | "weights"
    rollout: tuple[int, ...]         # the engine's ids, in its slot order
    applied: tuple[int, ...]         # the trainer's ids (its slot order when known, else sorted)
    detail: str                      # "dropped [3], replaced by [1]", "weights off by 0.31 (relative)", ...


@dataclass(frozen=True)
class LayerCheck:
    """The R3 check of one MoE layer. `status`: "applied" (every checked row agrees), "differs" or
    "not_checked" (`reason` says why). `order_checked` / `weights_checked` say which parts were compared."""
    layer: int
    status: str
    rows_checked: int = 0
    rows_missing: int = 0            # rollout rows the trainer's record of this layer lacks (not checked)
    diffs: tuple[RowDiff, ...] = ()  # described in full: the first DETAILED rows of each kind
    order_checked: bool = False
    weights_checked: bool = False
    reason: str = ""
    differing: Mapping[str, frozenset] = field(default_factory=dict)   # kind -> every differing (sample, position)

    def of_kind(self, kind: str) -> tuple[RowDiff, ...]:
        """The differing rows of `kind` described in full (at most DETAILED; `rows_of` has them all)."""
        return tuple(d for d in self.diffs if d.kind == kind)

    def rows_of(self, kind: str) -> frozenset[RowId]:
        return self.differing.get(kind, frozenset())


@dataclass(frozen=True)
class R3Check:
    """The whole check: one LayerCheck per MoE layer the rollout routed, in layer order."""
    layers: tuple[LayerCheck, ...]
    samples: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())
    engine_off: Mapping[int, int] = field(default_factory=dict)   # layer -> rows its trace routed otherwise

    def differing_rows(self, kinds: Iterable[str] = KINDS) -> frozenset[RowId]:
        """The (sample, position) rows whose applied routing differs in any layer, by the given kinds: the
        routing-replay part of the log-prob reconciliation (compare/reconcile.py)."""
        return frozenset().union(*(lc.rows_of(k) for lc in self.layers for k in kinds))

    def layers_with(self, kind: str) -> list[int]:
        return [lc.layer for lc in self.layers if lc.rows_of(kind)]

    @property
    def not_checked(self) -> list[int]:
        return [lc.layer for lc in self.layers if lc.status == "not_checked"]

    @property
    def clean(self) -> bool:
        """Every layer checked and applied as the rollout routed it."""
        return bool(self.layers) and all(lc.status == "applied" for lc in self.layers)

    @property
    def summary(self) -> str:
        return summary_line(self)

    def as_dict(self) -> dict:
        """JSON-ready: the summary, then per layer its status, counts (rows differing per kind) and the rows
        described in full (bounded: DETAILED per kind)."""
        return {"summary": self.summary, "samples": list(self.samples), "notes": list(self.notes),
                "layers": [{"layer": lc.layer, "status": lc.status, "rows_checked": lc.rows_checked,
                            "rows_missing": lc.rows_missing, "order_checked": lc.order_checked,
                            "weights_checked": lc.weights_checked, "reason": lc.reason,
                            "differing": {k: len(lc.rows_of(k)) for k in KINDS},
                            "diffs": [{"sample": d.sample, "position": d.position, "kind": d.kind,
                                       "rollout": list(d.rollout), "applied": list(d.applied), "detail": d.detail}
                                      for d in lc.diffs]}
                           for lc in self.layers]}


def check_routing_replay(rollout: Mapping[str, np.ndarray], applied: Mapping[int, AppliedLayer],
                         engine: Mapping[int, AppliedLayer] | None = None, *,
                         layers: Sequence[int] | None = None, weight_tol: float = WEIGHT_TOL) -> R3Check:
    """Check, per MoE layer and row, that the trainer applied the rollout's expert ids.

    `rollout`: sample key -> int [rows, layers, topk], row i = position i, in the engine's slot order (what
    SGLang returned; `store/routed_experts.py`). `applied`: layer -> the trainer's routing of that layer (from
    its trace: :func:`applied_from_view`; or the ids it replayed, in order: :func:`applied_from_packed`).
    `engine`: layer -> the engine's routing with weights (its trace), for the weights. `layers`: the MoE layers
    to check (default: every layer of the rollout's arrays in which some sample routed a token, and every layer
    `applied` holds)."""
    if not rollout:
        raise ValueError("routing replay check: no rollout routed experts given (was R3 on, and were the traced "
                         "samples' routed experts recorded?)")
    n_layers = _layer_count(rollout)
    # by default the MoE layers: those the engine routed (slime's own test, all-zero ids: a dense layer or one
    # SGLang did not capture) and those the trainer's record holds
    todo = list(layers) if layers is not None else \
        [L for L in range(n_layers) if L in applied or _routed(rollout, L)]
    out = []
    for L in todo:
        if not 0 <= L < n_layers:
            raise ValueError(f"layer {L}: the rollout's routed experts hold layers 0..{n_layers - 1}")
        out.append(_check_layer(L, rollout, applied.get(L), (engine or {}).get(L), weight_tol))
    off = {L: n for L in todo if (n := _engine_off(L, rollout, (engine or {}).get(L)))}
    notes = [f"layer {L}: the engine's trace routed {n[0]} of {n[1]} rows otherwise than the ids it returned (the "
             f"returned record does not match the traced forward there; weights not compared at those rows)"
             for L, n in off.items()]
    return R3Check(tuple(out), tuple(sorted(rollout)), tuple(notes), {L: n[0] for L, n in off.items()})


def _engine_off(L: int, rollout: Mapping[str, np.ndarray], engine: AppliedLayer | None) -> tuple[int, int] | None:
    """(rows, of rows) the engine's own trace routed otherwise than the ids it returned: the record is not what
    the engine computed at those rows (shifted, or captured from another forward)."""
    if engine is None:
        return None
    at = {r: i for i, r in enumerate(engine.rows)}
    off = total = 0
    for key, a in rollout.items():
        idx = np.array([at.get((key, p), -1) for p in range(len(a))], dtype=np.int64)
        pos = np.nonzero(idx >= 0)[0]
        total += len(pos)
        if len(pos):
            off += int(_set_differs(a[pos, L, :].astype(np.int64), engine.ids[idx[pos]].astype(np.int64)).sum())
    return (off, total) if off else None


def _layer_count(rollout: Mapping[str, np.ndarray]) -> int:
    shapes = {(a.shape[1], a.shape[2]) for a in rollout.values() if np.ndim(a) == 3}
    if len(shapes) != 1 or any(np.ndim(a) != 3 for a in rollout.values()):
        raise ValueError(f"rollout routed experts: every sample must be [rows, layers, topk] with the same layers "
                         f"and topk, got {sorted({tuple(np.shape(a)) for a in rollout.values()})[:4]}")
    return shapes.pop()[0]


def _routed(rollout: Mapping[str, np.ndarray], layer: int) -> bool:
    # slime's own test for a layer SGLang did not capture (all-zero ids, validate_rollout_routed_experts_for_replay)
    return any(a.shape[0] and np.count_nonzero(a[:, layer, :]) for a in rollout.values())


def _check_layer(L: int, rollout: Mapping[str, np.ndarray], mine: AppliedLayer | None,
                 engine: AppliedLayer | None, weight_tol: float) -> LayerCheck:
    if mine is None or not len(mine.rows):
        return LayerCheck(L, "not_checked", reason="the trainer's trace holds no expert ids of this layer (not "
                                                   "traced, or statistics only)")
    at = {r: i for i, r in enumerate(mine.rows)}
    eng = {r: i for i, r in enumerate(engine.rows)} if engine is not None and engine.weights is not None \
        and mine.weights is not None else None
    diffs: list[RowDiff] = []
    rows: dict[str, set] = {k: set() for k in KINDS}
    checked = missing = weighed = 0
    for key in sorted(rollout):
        want_all = rollout[key][:, L, :].astype(np.int64)
        idx = np.array([at.get((key, p), -1) for p in range(len(want_all))], dtype=np.int64)
        pos = np.nonzero(idx >= 0)[0]
        missing += len(want_all) - len(pos)
        checked += len(pos)
        if not len(pos):
            continue
        want, got = want_all[pos], mine.ids[idx[pos]].astype(np.int64)
        bad = _set_differs(want, got)
        order = ~bad & (want != got).any(axis=1) if mine.ordered else np.zeros(len(pos), bool)
        for kind, mask in (("ids", bad), ("order", order)):
            hit = np.nonzero(mask)[0]
            rows[kind].update((key, int(p)) for p in pos[hit])
            room = max(DETAILED - sum(d.kind == kind for d in diffs), 0)
            diffs += [_row_diff(key, int(pos[n]), want[n], got[n]) for n in hit[:room]]
        if eng is not None:
            same = pos[~bad & ~order]
            j = np.array([eng.get((key, int(p)), -1) for p in same], dtype=np.int64)
            keep = j >= 0
            weighed += int(keep.sum())
            hit, detail = _weight_diffs(key, same[keep], want_all[same[keep]], mine, idx[same[keep]], engine,
                                        j[keep], weight_tol, max(DETAILED - len(rows["weights"]), 0))
            rows["weights"].update((key, p) for p in hit)
            diffs += detail
    if not checked:
        return LayerCheck(L, "not_checked", rows_missing=missing,
                          reason="the trainer's record of this layer holds none of the rollout's rows")
    reason = "" if mine.ordered else "slot order not checked: the trainer's ids are sorted (moe.topk_ids)"
    if not weighed:
        reason = "; ".join(filter(None, [reason, "weights not checked: no engine weights for these rows"]))
    diffs.sort(key=lambda d: (d.sample, d.position, KINDS.index(d.kind)))
    return LayerCheck(L, "differs" if any(rows.values()) else "applied", checked, missing, tuple(diffs),
                      mine.ordered, bool(weighed), reason, {k: frozenset(v) for k, v in rows.items() if v})


def _set_differs(want: np.ndarray, got: np.ndarray) -> np.ndarray:
    """Per row, whether the two id rows hold different experts (as multisets)."""
    if want.shape[1] != got.shape[1]:
        return np.ones(len(want), bool)
    return (np.sort(want, axis=1) != np.sort(got, axis=1)).any(axis=1)


def _row_diff(key: str, pos: int, want: np.ndarray, got: np.ndarray) -> RowDiff:
    w, g = [int(x) for x in want], [int(x) for x in got]
    if sorted(w) != sorted(g):
        dropped = sorted(set(w) - set(g))
        added = sorted(set(g) - set(w))
        detail = f"dropped {dropped}, replaced by {added}" if dropped or added else \
            f"same experts, other multiplicities ({w} vs {g})"
        return RowDiff(key, pos, "ids", tuple(w), tuple(g), detail)
    return RowDiff(key, pos, "order", tuple(w), tuple(g), f"slot order {g} instead of {w}")


def _weight_diffs(key: str, pos: np.ndarray, want: np.ndarray, mine: AppliedLayer, i: np.ndarray,
                  engine: AppliedLayer, j: np.ndarray, tol: float, detailed: int) -> tuple[list[int], list[RowDiff]]:
    """The positions whose ids agree but whose weights (matched by expert id) differ by more than `tol`, relative
    to the engine's, and the first `detailed` of them described. A row the engine's own trace routed otherwise
    than it returned has nothing to weigh against."""
    if not len(pos):
        return [], []
    ids_a, ids_e = mine.ids[i].astype(np.int64), engine.ids[j].astype(np.int64)
    oa, oe = np.argsort(ids_a, axis=1), np.argsort(ids_e, axis=1)
    comparable = ~_set_differs(np.take_along_axis(ids_e, oe, 1), np.sort(want, axis=1))
    wa = np.take_along_axis(mine.weights[i].astype(np.float64), oa, 1)
    we = np.take_along_axis(engine.weights[j].astype(np.float64), oe, 1)
    err = np.linalg.norm(wa - we, axis=1) / np.maximum(np.linalg.norm(we, axis=1), 1e-30)
    hit = np.nonzero(comparable & (err > tol))[0]
    out = []
    for n in hit[:detailed]:
        experts = [int(x) for x in np.sort(ids_e[n])]
        out.append(RowDiff(key, int(pos[n]), "weights", tuple(int(x) for x in want[n]),
                           tuple(int(x) for x in ids_a[n]),
                           f"weights off by {err[n]:.3g} (relative, tolerance {tol:g}): trainer {_fmt(wa[n])} vs "
                           f"engine {_fmt(we[n])} for experts {experts}"))
    return [int(pos[n]) for n in hit], out


def _fmt(v: np.ndarray) -> str:
    return "[" + ", ".join(f"{x:.4g}" for x in v) + "]"


def summary_line(c: R3Check) -> str:
    """One line: "R3: ids applied in 24 of 24 layers; weights differ in layers 3, 7 (12 rows); ..." """
    done = [lc for lc in c.layers if lc.status != "not_checked"]
    ok_ids = [lc for lc in done if not lc.rows_of("ids")]
    parts = [f"R3: ids applied in {len(ok_ids)} of {len(c.layers)} layers"]
    for kind, verb in (("ids", "ids differ"), ("order", "slot order differs"), ("weights", "weights differ")):
        hit = [lc for lc in done if lc.rows_of(kind)]
        if hit:
            rows = len(frozenset().union(*(lc.rows_of(kind) for lc in hit)))
            parts.append(f"{verb} in {_layers(lc.layer for lc in hit)} ({rows} rows)")
    if c.not_checked:
        parts.append(f"not checked: {_layers(c.not_checked)} (the trainer's trace holds no expert ids there)")
    if c.engine_off:
        parts.append(f"the engine's trace disagrees with its returned ids in {_layers(c.engine_off)} "
                     f"({sum(c.engine_off.values())} rows)")
    missing = sum(lc.rows_missing for lc in done)
    if missing:
        total = missing + sum(lc.rows_checked for lc in done)
        parts.append(f"{missing} of {total} (layer, row) pairs not in the trainer's trace, not checked")
    if done and not any(lc.order_checked for lc in done):
        parts.append("slot order not checked")
    if done and not any(lc.weights_checked for lc in done):
        parts.append("weights not checked")
    return "; ".join(parts)


def _layers(ls: Iterable[int]) -> str:
    ls = list(ls)
    shown = ", ".join(str(x) for x in ls[:8]) + (f" and {len(ls) - 8} more" if len(ls) > 8 else "")
    return f"layer{'s' if len(ls) != 1 else ''} {shown}"


# ---------------------------------------------------------------- building the inputs

def applied_from_view(view, layers: Iterable[int] | None = None) -> dict[int, AppliedLayer]:
    """A side's routing per MoE layer from its trace (a CanonicalView): `moe.topk_ids` (sorted ids) and, where
    traced, `moe.topk_weights` (the weights of the sorted ids). Layers without values are left out (not
    checked)."""
    want = None if layers is None else set(layers)
    out: dict[int, AppliedLayer] = {}
    for point, layer in view.points():
        if point != EXPERT_IDS or layer is None or (want is not None and layer not in want):
            continue
        ids = view.load(EXPERT_IDS, layer)
        if ids.values is None or not ids.rows:
            continue
        wts = None
        w = view.load(WEIGHTS_POINT, layer) if (WEIGHTS_POINT, layer) in view.entries else None
        if w is not None and w.values is not None:
            at = {r: i for i, r in enumerate(w.rows)}
            if all(r in at for r in ids.rows):
                wts = np.asarray(w.values, dtype=np.float64)[[at[r] for r in ids.rows]]
        out[layer] = AppliedLayer(layer, list(ids.rows), np.asarray(ids.values).astype(np.int64), wts, ordered=False)
    return out


def applied_from_packed(layer: int, ids: np.ndarray, segments: Sequence[tuple[str | None, int]],
                        weights: np.ndarray | None = None) -> AppliedLayer:
    """The ids a trainer replayed for one layer of a packed micro-batch (Megatron THD, no context or sequence
    parallelism), in its slot order: `ids` [packed tokens, k]; `segments` the packed samples in order as
    (sample key or None for padding, padded length). Rows past the segments (the batch's padding) are dropped."""
    rows: list[RowId] = []
    keep: list[int] = []
    start = 0
    for key, length in segments:
        if key is not None:
            rows.extend((key, p) for p in range(length))
            keep.extend(range(start, start + length))
        start += length
    if start > len(ids):
        raise ValueError(f"layer {layer}: segments span {start} tokens, the replayed ids hold {len(ids)}")
    a = np.asarray(ids)[keep].astype(np.int64)
    w = None if weights is None else np.asarray(weights, dtype=np.float64)[keep]
    return AppliedLayer(layer, rows, a, w, ordered=True)


def check_rollout(rollout_dir, trainer=None, engine=None, *, weight_tol: float = WEIGHT_TOL) -> R3Check | None:
    """The R3 check of one traced slime rollout directory: the routed experts recorded in `routing_replay/`
    (integrations/slime/routing_replay.py) against the trainer's trace `megatron/` and, for the weights, the
    engine's trace `sglang/` (either may be given as an open CanonicalView). None when no routed experts were
    recorded (R3 off, or no traced sample)."""
    from pathlib import Path

    from ..store.routed_experts import merge_routed_experts, read_routed_experts_dir
    from ..view.align import CanonicalView
    d = Path(rollout_dir)
    rollout = merge_routed_experts(read_routed_experts_dir(d / "routing_replay"))
    if not rollout:
        return None
    trainer = trainer if trainer is not None else CanonicalView(str(d / "megatron"))
    if engine is None and (d / "sglang").is_dir():
        engine = CanonicalView(str(d / "sglang"))
    return check_routing_replay(rollout, applied_from_view(trainer),
                                applied_from_view(engine) if engine is not None else None, weight_tol=weight_tol)
