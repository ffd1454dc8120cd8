"""The `drift` object (`tic-trace.drift/1`): typed dataclasses, the one JSON codec, and the check every
document read back passes before anything renders it (docs/drift.md, "Fields").

Non-finite errors are encoded as the report's are (`"inf"`, `"nan"`: report.schema.encode / num)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ..report.schema import encode, num

SCHEMA = "tic-trace.drift/1"
#: exit codes of `tic-trace drift`: nothing departs, the weights agree and the last compared rollout is not
#: divergent / an onset, a weight-sync finding or a run divergent since some rollout / no answer (bad input) /
#: nothing compared (every rollout skipped).
EXIT_STEADY, EXIT_DRIFT, EXIT_ERROR, EXIT_NOTHING = 0, 1, 2, 3


class DriftSchemaError(ValueError):
    """A `drift` document that does not have the schema's shape; the message names the field."""


@dataclass
class WeightCheck:
    """Weight-hash agreement between the sides at one rollout.

    `agree`: True / False when the sides' hashes were compared (same names, dtypes, shapes: the report's
    contract), None when they could not be (other frameworks name and lay out their parameters differently).
    `parameters`: for `one_sided` points, the parameter names of the side that changed. `differing`: the contract's parameters whose bits differ. `changed_a` / `changed_b`: the canonical points
    whose parameter hashes changed on each side since the previous compared rollout; `one_sided`: the points
    changed on one side only (the engine kept old weights, or got weights the trainer does not hold)."""
    agree: bool | None = None
    points_hashed: int = 0                        # canonical points whose parameters both sides hash
    differing: list[str] = field(default_factory=list)
    changed_a: list[str] = field(default_factory=list)
    changed_b: list[str] = field(default_factory=list)
    one_sided: list[str] = field(default_factory=list)
    parameters: list[str] = field(default_factory=list)
    note: str = ""


@dataclass
class RolloutEntry:
    """One traced rollout: compared (`status` "compared") or named and skipped (`status` "skipped", `reason`)."""
    rollout_id: int
    dir: str
    status: str                                   # "compared" | "skipped"
    reason: str = ""
    verdict: str | None = None
    first_divergence: dict | None = None          # {key, point, layer, cause, error}
    errors: dict[str, dict[str, Any]] = field(default_factory=dict)   # point kind -> {layer | "-": error}
    flips: dict[str, dict[str, Any]] = field(default_factory=dict)    # layer -> {rows, flipped, share}
    precision: list[str] = field(default_factory=list)                # keys of precision findings / contract
    weights: WeightCheck = field(default_factory=WeightCheck)
    dlogprob: Any = None                          # max |Δ logprob| over the report's worst tokens
    rows: int = 0                                 # (sample, position) rows compared


@dataclass
class WeightSync:
    """The run's weight-sync finding, named before any numerics: from which rollout on, at which points, the
    engine's weights are not the trainer's (None: no rollout showed it)."""
    from_rollout: int
    points: list[str]
    parameters: list[str]
    how: str                                      # "hashes differ" | "changed on one side only"
    summary: str


@dataclass
class Onset:
    """The first rollout after which a point's error leaves its own earlier range (onset.RULE)."""
    rollout_id: int
    key: str
    point: str
    layer: int | None
    error: Any
    baseline: Any                                 # max of the point's error over the earlier rollouts
    threshold: Any
    confirmed_by: int                             # following compared rollouts that stay above the threshold
    also: list[str]                               # other points departing at the same rollout (dataflow order)
    changes: list[dict]                           # what changed there: {kind, summary}
    summary: str


@dataclass
class Drift:
    dir: str
    sides: list[str]
    settings: dict
    rollouts: list[RolloutEntry]
    weight_sync: WeightSync | None
    onset: Onset | None
    onset_note: str
    exit_code: int = EXIT_STEADY
    schema: str = SCHEMA
    divergent_since: dict | None = None           # {rollout_id, rollouts, summary}: onset.divergent_since
    others: list[dict] = field(default_factory=list)  # the run directory's entries that are no rollout: {name, reason}
    coverage: dict = field(default_factory=dict)  # {"rollouts": {compared, total, skipped: {count, first}}}

    def to_json(self) -> dict:
        return _encode(asdict(self))


def _encode(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _encode(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_encode(v) for v in x]
    if isinstance(x, float):
        return encode(x)
    return x


# ================================================================== the check on a document read back

_ROLLOUT = {"rollout_id": int, "dir": str, "status": str, "reason": str, "errors": dict, "flips": dict,
            "precision": list, "weights": dict, "rows": int}
_TOP = {"schema": str, "dir": str, "sides": list, "settings": dict, "rollouts": list, "onset_note": str,
        "exit_code": int}
_ONSET = {"rollout_id": int, "key": str, "point": str, "changes": list, "also": list, "summary": str,
          "confirmed_by": int}


def _need(doc: Any, spec: dict, where: str) -> None:
    if not isinstance(doc, dict):
        raise DriftSchemaError(f"{where}: expected an object, got {type(doc).__name__}")
    for name, typ in spec.items():
        v = doc.get(name)
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            raise DriftSchemaError(f"{where}.{name}: expected {typ.__name__}, got {type(v).__name__}")


def _number(v: Any, where: str) -> None:
    if v is None or isinstance(v, str) and v in ("inf", "-inf", "nan"):
        return
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(float(v)):
        raise DriftSchemaError(f"{where}: expected a number, null or 'inf'/'nan', got {v!r}")


def validate(doc: Any) -> dict:
    """`doc` when it is a `drift` object of this schema; else DriftSchemaError naming the first bad field."""
    _need(doc, _TOP, "drift")
    if doc["schema"] != SCHEMA:
        raise DriftSchemaError(f"drift.schema: expected {SCHEMA!r}, got {doc['schema']!r}")
    for i, r in enumerate(doc["rollouts"]):
        where = f"drift.rollouts[{i}]"
        _need(r, _ROLLOUT, where)
        if r["status"] not in ("compared", "skipped"):
            raise DriftSchemaError(f"{where}.status: expected 'compared' or 'skipped', got {r['status']!r}")
        for kind, by_layer in r["errors"].items():
            if not isinstance(by_layer, dict):
                raise DriftSchemaError(f"{where}.errors.{kind}: expected an object")
            for lay, e in by_layer.items():
                _number(e, f"{where}.errors.{kind}.{lay}")
        _number(r.get("dlogprob"), f"{where}.dlogprob")
    if doc.get("onset") is not None:
        _need(doc["onset"], _ONSET, "drift.onset")
        for name in ("error", "baseline", "threshold"):
            _number(doc["onset"].get(name), f"drift.onset.{name}")
    if doc.get("divergent_since") is not None:
        _need(doc["divergent_since"], {"rollout_id": int, "rollouts": int, "summary": str}, "drift.divergent_since")
    _coverage(doc.get("coverage"))
    if not isinstance(doc.get("others", []), list):
        raise DriftSchemaError("drift.others: expected list")
    for i, o in enumerate(doc.get("others") or []):
        _need(o, {"name": str, "reason": str}, f"drift.others[{i}]")
    if doc.get("weight_sync") is not None:
        _need(doc["weight_sync"], {"from_rollout": int, "points": list, "parameters": list, "summary": str},
              "drift.weight_sync")
    return doc


def rollout_coverage(rollouts: list[RolloutEntry]) -> dict:
    """The verdict's coverage: rollouts compared N of M, the skipped ones named (at most `SKIPPED_NAMED`)."""
    skipped = [{"rollout_id": e.rollout_id, "reason": e.reason[:500]} for e in rollouts if e.status != "compared"]
    return {"rollouts": {"compared": len(rollouts) - len(skipped), "total": len(rollouts),
                         "skipped": {"count": len(skipped), "first": skipped[:SKIPPED_NAMED]}}}


SKIPPED_NAMED = 16


def _coverage(cov: Any) -> None:
    """A saved `coverage` (absent in documents written before it): counts and at most 64 named rollouts."""
    if cov is None:
        return
    _need(cov, {"rollouts": dict}, "drift.coverage")
    r = cov["rollouts"]
    _need(r, {"compared": int, "total": int, "skipped": dict}, "drift.coverage.rollouts")
    _need(r["skipped"], {"count": int, "first": list}, "drift.coverage.rollouts.skipped")
    if not 0 <= r["compared"] <= r["total"] or len(r["skipped"]["first"]) > 64:
        raise DriftSchemaError("drift.coverage.rollouts: expected 0 <= compared <= total and at most 64 named")
    for i, x in enumerate(r["skipped"]["first"]):
        _need(x, {"rollout_id": int, "reason": str}, f"drift.coverage.rollouts.skipped.first[{i}]")


def coverage_text(doc: dict) -> str | None:
    """"rollouts compared N of M (K skipped: 3 (why), ...)" for the drift verdict line; None without coverage.
    Renderers read documents `validate` passed; still, a junk value prints as "?" rather than raising."""
    cov = doc.get("coverage") if isinstance(doc, dict) else None
    r = cov.get("rollouts") if isinstance(cov, dict) else None
    if not isinstance(r, dict):
        return None

    def n(v: Any) -> str:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else "?"
    sk = r.get("skipped") if isinstance(r.get("skipped"), dict) else {}
    first = sk.get("first") if isinstance(sk.get("first"), list) else []
    named = [f"{n(x.get('rollout_id'))} ({str(x.get('reason'))[:300]})" for x in first[:5] if isinstance(x, dict)]
    count = sk.get("count") if isinstance(sk.get("count"), int) else 0
    more = count - len(named)
    tail = f" ({count} skipped: {'; '.join(named)}{f' and {more} more' if more > 0 else ''})" if count > 0 else ""
    return f"covered: rollouts compared {n(r.get('compared'))} of {n(r.get('total'))}{tail}"


def error_value(v: Any) -> float | None:
    """A saved error as a float (None when absent)."""
    return None if v is None else num(v)
