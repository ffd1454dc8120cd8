"""The words and numbers of each part of the reconciliation (compare/reconcile.py): its summary, its coverage,
whether it is a cause, and the report field they make (report/schema.py `Report.reconciliation`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from .reconcile_groups import SideFit

SHARE_MIN = 0.05         # a part under this share of the metric (or under the tolerance in nats) is not a cause
R3_FLAG = "--use-rollout-routing-replay"


@dataclass(frozen=True)
class R3State:
    """Why no routing-replay check was given: `on` False, R3 was off for the run (slime's flag not set: there is
    no routing-replay part to measure); True, it was on but nothing was recorded or readable (`why`)."""
    on: bool
    why: str = ""


@dataclass
class Ctx:
    rows: Any                       # reconcile._Rows
    tok: np.ndarray                 # rows whose token ids differ, or that follow one that does
    tok_own: np.ndarray             # rows whose own token ids differ
    have: np.ndarray                # rows with a logits row on both sides
    filtered: np.ndarray            # measured rows whose token a semantics filters out
    measured: np.ndarray
    q: np.ndarray                   # measured rows whose applied experts differ (R3)
    r3rows: set | None
    trainer: Any
    engine: Any
    fa: SideFit
    fb: SideFit
    common: list                    # each joined row's common semantics (None: none to align to)
    finder: Mapping | None
    total: float
    tol: float
    r3_state: R3State | None = None


@dataclass
class Part:
    """One part of the metric (nats, in slime's reduction) with its share and coverage."""
    name: str
    value: float
    share: float | None
    rows: int                        # rows it was measured on
    samples: int
    missing: str                     # what it could not measure ("": nothing)
    significant: bool
    summary: str
    state: str = ""                  # why the part is empty by the run's settings (R3 off), shown on its line

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        if not d["state"]:
            del d["state"]
        return d


def _samples(c: Ctx, sel: np.ndarray) -> int:
    return len({c.rows.keys[i][0] for i in np.nonzero(sel)[0]})


def _tokens(c: Ctx) -> tuple[np.ndarray, str, str]:
    sel, own = c.tok, c.tok_own
    if not sel.any():
        return sel, "", "every joined row holds the same token on both sides"
    i = int(np.nonzero(own)[0][0])
    s, p = c.rows.keys[i]
    later = [j for j, k in enumerate(c.rows.keys) if k[0] == s and k[1] >= p]
    shift = (" (most later tokens differ too: a shifted template?)"
             if len(later) > 1 and 2 * sum(own[j] for j in later) >= len(later) else "")
    after = int(sel.sum() - own.sum())
    return sel, "", (f"{int(own.sum())} rows in {_samples(c, own)} samples hold different token ids, from "
                     f"{s}@{p} ({c.trainer.name} {int(c.rows.tok['a'][i])}, {c.engine.name} "
                     f"{int(c.rows.tok['b'][i])}){shift}" + (f", and {after} more follow one that does (another "
                                                                f"context)" if after else "")
                     + ": their whole gap is theirs")


def _unmeasured(c: Ctx) -> tuple[np.ndarray, str, str]:
    sel = ~c.tok & ~c.measured
    za = sum(r is None for r, t in zip(c.rows.z["a"], c.tok) if not t)
    zb = sum(r is None for r, t in zip(c.rows.z["b"], c.tok) if not t)
    miss = [f"{n} rows without a traced logits row on {name}" for n, name in
            ((za, c.trainer.name), (zb, c.engine.name)) if n]
    if c.filtered.any():
        miss.append(f"{int(c.filtered.sum())} rows whose token a side's semantics or the common one filters out")
    if any(h and not t and x is None for h, t, x in zip(c.have, c.tok, c.common)):
        miss.append("no semantics to align the sides to")
    text = ("every row with the same tokens was split" if not sel.any() else
            f"{int(sel.sum())} rows not split: " + "; ".join(miss))
    return sel, "; ".join(miss), text


def _semantics(c: Ctx) -> tuple[np.ndarray, str, str]:
    if not c.fa.measured or not c.fb.measured:
        return c.measured, "a side's semantics not measured", "not measured: " + (
            c.fa.summary if not c.fa.measured else c.fb.summary)
    da, db = c.fa.describe(), c.fb.describe()
    if da == db:
        text = f"both sides' log-probs are {da}"
    else:
        text = f"{c.engine.name}'s log-probs are {db}; {c.trainer.name}'s are {da}"
    q = [f"{f.side} {f.verdict}" for f in (c.fa, c.fb) if f.verdict != "match"]
    return c.measured, "", text + (f" ({', '.join(q)}: see the fingerprints)" if q else "")


def _residual(c: Ctx) -> tuple[np.ndarray, str, str]:
    each = [f"{f.side} {fit[0]:.2g} (max {fit[1]:.2g})" for f in (c.fa, c.fb) if (fit := f.fit())]
    off = [f.side for f in (c.fa, c.fb) if f.verdict == "none"]
    text = ("each side's used log-probs against its own traced logits under its semantics, mean |Δ| nats: "
            + ", ".join(each))
    if off:
        text += f"; {' and '.join(off)} match no known semantics: the residual is not a sampling setting"
    return c.measured, "", text


def _routing(c: Ctx) -> tuple[np.ndarray, str, str]:
    if c.r3rows is None:
        st = c.r3_state
        if st is None:
            return c.q, "routing replay not checked", "not checked (R3 off, or no routing-replay check given)"
        if not st.on:
            return c.q, "", f"R3 off ({R3_FLAG} not set): no routing-replay part"
        why = f"routing replay not checked: R3 on ({R3_FLAG}) but {st.why}"
        return c.q, why, why
    outside = len(c.r3rows) - int(c.q.sum())
    text = (f"the forward's gap on {int(c.q.sum())} token rows whose logits row ran other experts than the "
            "rollout's" if c.q.any() else "no split row ran other experts than the rollout's")
    if outside:
        text += (f"; {outside} more differing rows score no split used token (prompt rows, or rows not split): "
                 "what they change in later tokens is in the forward part")
    return c.q, "", text


def _forward(c: Ctx) -> tuple[np.ndarray, str, str]:
    sel = c.measured & ~c.q
    text = "the two traced forwards' log-probs under the common semantics"
    f = c.finder if isinstance(c.finder, Mapping) else None
    if f:
        fd = f.get("first_divergence") if isinstance(f.get("first_divergence"), Mapping) else None
        att = f.get("attribution") if isinstance(f.get("attribution"), Mapping) else None
        if fd:
            text += f"; the finder's first divergence: {fd.get('key')} [{fd.get('cause') or 'operator'}]"
        else:
            text += f"; the finder: {f.get('verdict')}"
        if att and att.get("first"):
            text += f" (attribution: {att.get('first')})"
    return sel, "", text


_PARTS = {"tokens": _tokens, "unmeasured": _unmeasured, "semantics": _semantics, "residual": _residual,
          "routing_replay": _routing, "forward": _forward}


def part(c: Ctx, name: str, value: float) -> Part:
    sel, missing, text = _PARTS[name](c)
    share = value / c.total if c.total else None
    sig = bool(abs(value) > c.tol and (share is None or abs(share) >= SHARE_MIN))
    off = name == "routing_replay" and c.r3rows is None and c.r3_state is not None and not c.r3_state.on
    return Part(name, value, share, int(sel.sum()), _samples(c, sel), missing, sig, text, text if off else "")


def result(c: Ctx, parts: list[Part], reduction: Any, recorded: float | None, notes: list[str]) -> dict:
    rows = c.rows
    how = ("per-token mean (--calculate-per-token-loss)" if reduction.per_token else
           "per-rollout mean (slime's sum_of_sample_mean over the step's rollout count)")
    causes = [f"{p.name}: {p.summary}" for p in parts if p.significant]
    only = [f"{rows.only[k]} rows {name}-only" for k, name in (("a", c.trainer.name), ("b", c.engine.name))
            if rows.only[k]]
    if only:        # slime compares the same response tokens on both sides: a row one side lacks is not in it
        notes = [f"{', '.join(only)}: a used log-prob the other side lacks, left out of the metric"] + notes
    return {
        "metric": c.total, "recorded": recorded, "reduction": how,
        "rows": len(rows.keys), "samples": len({k[0] for k in rows.keys}),
        "only": {"a": rows.only["a"], "b": rows.only["b"]},
        "sides": {"a": {"name": c.trainer.name, **c.fa.to_json()}, "b": {"name": c.engine.name, **c.fb.to_json()}},
        **_commons(c.common),
        "order": [p.name for p in parts], "parts": [p.to_json() for p in parts],
        "residual": next(p.value for p in parts if p.name == "residual"),
        "causes": causes, "tol": c.tol, "notes": notes,
        "covered": ("measured over the traced samples; slime's logged value averages every sample of the step, "
                    "the same number when every sample is traced"),
    }


def _commons(common: list) -> dict:
    """The semantics the sides were moved to: one ("common"), or one per group of rows ("commons")."""
    distinct = list(dict.fromkeys(x for x in common if x is not None))
    if len(distinct) > 1:
        return {"common": None, "commons": [x.to_json() for x in distinct]}
    return {"common": distinct[0].to_json() if distinct else None}


def unavailable(reason: str, trainer: Any, engine: Any, recorded: float | None) -> dict:
    return {"unavailable": reason, "recorded": recorded,
            "sides": {"a": {"name": trainer.name, "samples": len(trainer.used)},
                      "b": {"name": engine.name, "samples": len(engine.used)}}}
