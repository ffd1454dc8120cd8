"""Reconcile slime's `train_rollout_logprob_abs_diff` with the traced forward (issue 37; docs/reconcile.md).

slime's metric is a weighted mean of |trainer's used log-prob - engine's returned log-prob| over the response
tokens, reduced by its own `sum_of_sample_mean` (slime/backends/megatron_utils/cp_utils.py, divided by the
step's rollout count in observability/train_metric_utils.py). It is linear in each row's |Δ|, so a telescoping
sequence of per-row differences splits it into parts that add up exactly:

  D0 = u_A - u_B                        the metric (u: the log-prob each side used)
  tokens          rows whose token ids differ (a template shift moves every later token): their whole gap
  unmeasured      rows without a traced logits row on a side (or whose token a semantics filters out): not split
  semantics       D0 -> D2 = (u_A - l_A(s_A) + l_A(c)) - (u_B - l_B(s_B) + l_B(c)): each side's used log-prob
                  moved from its own semantics s to a common one c, recomputed from its own traced logits (s:
                  the fingerprint of the row's group of samples stating the same parameters, reconcile_groups.py)
  residual        D2 -> D3 = l_A(c) - l_B(c): each side's used log-prob off its own traced logits under any
                  known semantics (its deviation from the closest candidate)
  routing_replay  the forward's gap D3 on rows whose applied experts differ (R3, compare/routing_replay.py)
  forward         D3 on the other rows: the canonical graph's part (the finder's first divergence)

Each part carries its coverage; a part that could not be measured says why, never a silent zero.
numpy only (tests/test_architecture.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ..store.used_logprobs import UsedLogprobs
from .logprob_semantics import MATCH_TOL, Semantics, recompute_many
from .reconcile_groups import SideFit, fit_side
from .reconcile_parts import Ctx, R3State, part, result, unavailable

ORDER = ("tokens", "unmeasured", "semantics", "residual", "routing_replay", "forward")
LogitsRows = tuple[np.ndarray, np.ndarray]     # (row positions int [m], logits float [m, V]) of one sample


@dataclass(frozen=True)
class Side:
    """One side's numbers: the log-probs it used and its traced logits rows (the row at position p - 1 gives
    the token at p). `logits` None: not traced (every row of this side is unmeasured)."""
    name: str
    used: Sequence[UsedLogprobs]
    logits: Mapping[str, LogitsRows] | None = None


@dataclass(frozen=True)
class SlimeReduction:
    """slime's reduction of the metric: `--calculate-per-token-loss` (Σ m|Δ| / Σ_samples max(Σ m, 1)), else the
    per-rollout mean (each sample's Σ m|Δ| over its rollout group's mask total, summed, over the group count).
    `groups`: sample -> its rollout group (slime's `rollout_ids`; default: each sample its own). `loss_mask`:
    (sample, position) -> mask (default 1)."""
    per_token: bool = False
    groups: Mapping[str, Any] | None = None
    loss_mask: Mapping[tuple[str, int], float] | None = None


@dataclass
class _Rows:
    keys: list[tuple[str, int]]
    u: dict[str, np.ndarray]              # side letter -> used log-probs
    tok: dict[str, np.ndarray]
    z: dict[str, list]                    # side letter -> logits row per joined row (None: absent)
    w: np.ndarray
    only: dict[str, int]


def _index(side: Side) -> dict[tuple[str, int], tuple[int, float]]:
    out = {}
    for u in side.used:
        for p, t, lp in zip(np.asarray(u.positions).tolist(), np.asarray(u.tokens).tolist(),
                            np.asarray(u.logprobs, dtype=np.float64).tolist()):
            out[(u.sample, int(p))] = (int(t), float(lp))
    return out


def _logits_row(side: Side, key: tuple[str, int]) -> np.ndarray | None:
    rows = (side.logits or {}).get(key[0])
    if rows is None:
        return None
    pos, vals = rows
    hit = np.nonzero(np.asarray(pos) == key[1] - 1)[0]
    return np.asarray(vals[hit[0]]) if len(hit) else None


def slime_weights(keys: Sequence[tuple[str, int]], red: SlimeReduction) -> np.ndarray:
    """Each row's weight in slime's metric, so that metric = Σ w·|Δ| (get_sum_of_sample_mean, then
    reduce_train_step_metrics' division by the step's rollout count or token count)."""
    m = np.array([float((red.loss_mask or {}).get(k, 1.0)) for k in keys])
    samples = [k[0] for k in keys]
    group = {s: (red.groups or {}).get(s, s) for s in set(samples)}
    per_sample: dict[str, float] = {}
    for s, mi in zip(samples, m):
        per_sample[s] = per_sample.get(s, 0.0) + mi
    if red.per_token:
        total = sum(max(v, 1.0) for v in per_sample.values())
        return m / total
    per_group: dict[Any, float] = {}
    for s, v in per_sample.items():
        per_group[group[s]] = per_group.get(group[s], 0.0) + v
    n_groups = len(per_group)
    return np.array([mi / max(per_group[group[s]], 1.0) / n_groups for s, mi in zip(samples, m)])


def join(a: Side, b: Side, red: SlimeReduction) -> _Rows:
    """The rows both sides used a log-prob for, keyed (sample, position), in order."""
    ia, ib = _index(a), _index(b)
    keys = sorted(set(ia) & set(ib))
    return _Rows(keys, {"a": np.array([ia[k][1] for k in keys]), "b": np.array([ib[k][1] for k in keys])},
                 {"a": np.array([ia[k][0] for k in keys], dtype=np.int64),
                  "b": np.array([ib[k][0] for k in keys], dtype=np.int64)},
                 {"a": [_logits_row(a, k) for k in keys], "b": [_logits_row(b, k) for k in keys]},
                 slime_weights(keys, red), {"a": len(set(ia) - set(ib)), "b": len(set(ib) - set(ia))})


def _lps(rows: _Rows, s: str, idx: np.ndarray, sems: Sequence[Semantics]) -> list[np.ndarray]:
    if not len(idx):
        return [np.zeros(0) for _ in sems]
    return recompute_many(np.stack([rows.z[s][i] for i in idx]), rows.tok[s][idx], sems)


def _after_first(keys: Sequence[tuple[str, int]], differs: np.ndarray) -> np.ndarray:
    """Rows whose token differs or that follow, in their sample, a row whose token differs: their context is
    not the other side's, so neither their forward nor their semantics can be compared."""
    first: dict[str, int] = {}
    for (s, p), d in zip(keys, differs):
        if d:
            first[s] = min(first.get(s, p), p)
    return np.array([s in first and p >= first[s] for s, p in keys], dtype=bool)


def _r3_token_rows(r3: Any) -> tuple[set[tuple[str, int]] | None, list[str]]:
    """The token rows (sample, position) whose logits row ran other experts: R3's forward rows q give the
    token at q + 1. `r3`: an R3Check (compare/routing_replay.py), a collection of forward rows, or None."""
    if r3 is None:
        return None, []         # the routing-replay part says it was not checked
    notes = []
    if hasattr(r3, "differing_rows"):
        if getattr(r3, "not_checked", None):
            notes.append(f"routing replay: layers {r3.not_checked} not checked")
        r3 = r3.differing_rows()
    return {(str(s), int(p) + 1) for s, p in r3}, notes


def _common(fa: SideFit, fb: SideFit, n: int) -> list[Semantics | None]:
    """The semantics each row's two sides are moved to: the trainer's (what the loss uses), else the engine's,
    each from the row's own group."""
    sa, sb, va, vb = fa.per_row(n), fb.per_row(n), fa.verdict_of(n), fb.verdict_of(n)
    return [a if x == "match" else b if y == "match" else (a or b) for a, b, x, y in zip(sa, sb, va, vb)]


def _stages(rows: _Rows, measured: np.ndarray, sems: dict, common: list) -> tuple[dict, np.ndarray]:
    """D2 and D3 over every joined row (0 off `measured`), and the measured rows whose token a semantics
    filters out (-inf: they cannot be split). `sems`: side letter -> each row's semantics (its group's)."""
    d = {k: np.zeros(len(rows.keys)) for k in ("d2", "d3")}
    filtered = np.zeros(len(rows.keys), bool)
    cells: dict[tuple, list[int]] = {}
    for i in np.nonzero(measured)[0]:         # rows sharing both sides' semantics and the common one
        cells.setdefault((sems["a"][i], sems["b"][i], common[i]), []).append(int(i))
    for (sa, sb, c), ix in cells.items():
        idx = np.array(ix, dtype=np.int64)
        own, com = {}, {}
        for s, sem in (("a", sa), ("b", sb)):
            own[s], com[s] = _lps(rows, s, idx, [sem, c])
        ok = np.all([np.isfinite(x) for x in (*own.values(), *com.values())], axis=0)
        aligned = {s: rows.u[s][idx] - own[s] + com[s] for s in "ab"}
        with np.errstate(invalid="ignore"):
            d["d2"][idx] = np.where(ok, aligned["a"] - aligned["b"], 0.0)
            d["d3"][idx] = np.where(ok, com["a"] - com["b"], 0.0)
        filtered[idx[~ok]] = True
    return d, filtered


def reconcile(trainer: Side, engine: Side, *, r3: Any = None, finder: Mapping | None = None,
              reduction: SlimeReduction = SlimeReduction(), common: Semantics | None = None,
              tol: float = MATCH_TOL, recorded: float | None = None, r3_state: R3State | None = None) -> dict:
    """The reconciliation of slime's metric between `trainer` (side A, the reference) and `engine` (side B):
    the report's `reconciliation` field (report/schema.py). `r3`: the routing-replay check (an R3Check or the
    forward rows whose applied experts differ; None: not checked, and `r3_state` says why: R3 off for the run,
    or on with nothing recorded or readable). `finder`: the finder's report (JSON dict), cited in the forward
    part. `recorded`: slime's own logged value, shown beside ours."""
    for s in (trainer, engine):
        if not s.used:
            return unavailable(f"{s.name} recorded no used log-probs: slime's metric needs both sides' (was the "
                                "recording on for this rollout?)", trainer, engine, recorded)
    rows = join(trainer, engine, reduction)
    if not rows.keys:
        return unavailable(f"no (sample, position) row holds a used log-prob on both sides ({rows.only['a']} "
                            f"{trainer.name}-only, {rows.only['b']} {engine.name}-only): check the sample keys",
                            trainer, engine, recorded)
    tok_own = rows.tok["a"] != rows.tok["b"]
    tok = _after_first(rows.keys, tok_own)
    have = np.array([za is not None and zb is not None for za, zb in zip(rows.z["a"], rows.z["b"])])
    fa = fit_side(trainer.name, trainer, engine, rows, "a", ~tok & have, tol)
    fb = fit_side(engine.name, engine, trainer, rows, "b", ~tok & have, tol)
    n = len(rows.keys)
    sems = {"a": fa.per_row(n), "b": fb.per_row(n)}
    c = [common] * n if common is not None else _common(fa, fb, n)
    measured = ~tok & have & np.array([None not in x for x in zip(sems["a"], sems["b"], c)], dtype=bool)
    d, filtered = (_stages(rows, measured, sems, c) if measured.any()
                   else ({"d2": np.zeros(len(rows.keys)), "d3": np.zeros(len(rows.keys))}, np.zeros(len(rows.keys), bool)))
    measured &= ~filtered
    r3rows, notes = _r3_token_rows(r3)
    q = np.array([k in r3rows for k in rows.keys]) & measured if r3rows is not None else np.zeros(len(rows.keys), bool)
    w, d0 = rows.w, rows.u["a"] - rows.u["b"]

    def m(dd: np.ndarray, sel: np.ndarray) -> float:
        return float(np.sum(w[sel] * np.abs(dd[sel]))) if sel.any() else 0.0
    total = m(d0, np.ones(len(w), bool))
    levels = [total, m(d0, ~tok), m(d0, measured), m(d["d2"], measured), m(d["d3"], measured),
              m(d["d3"], measured & ~q), 0.0]
    values = dict(zip(ORDER, [levels[i] - levels[i + 1] for i in range(len(ORDER))]))
    ctx = Ctx(rows, tok, tok_own, have, filtered, measured, q, r3rows, trainer, engine, fa, fb, c, finder, total, tol,
              r3_state)
    parts = [part(ctx, name, values[name]) for name in ORDER]
    return result(ctx, parts, reduction, recorded, notes + list(dict.fromkeys(fa.notes + fb.notes)))
