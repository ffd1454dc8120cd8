"""The one rule that decides a point's status, and the tolerances it is applied with.

`judge()` is the only place the finder's rule is written. The finder (per point), the per-token walk
(`divergence_starts`) and `rejudge` (a saved report with new settings) all call it, so a report re-judged
with the settings it was made with reproduces itself exactly.

A float point is *divergent* when its error is over the tolerance of its dtype and grew more than `growth`
times over the error it inherits from its inputs (an operator computes differently), or when NaN/Inf
appears on one side only while its inputs were finite. That rule is applied twice (`judge_point`): over all
rows, and to each of the point's worst rows on its own, a row's error against that same row's inherited
error (the tolerance is meant per row); the more severe of the two judgements is the point's. An ids point (the top-k expert choice) is divergent
when expert sets differ for a computational reason (the router computes differently), or when near-tie
flips carry error over tolerance to the output and near ties are not accepted.

Units (`PointSpec.unit`): a point in nats (the log-probs) is judged in nats, never relative to its value. Its
inherited error is what its inputs' difference implies through the exact op plus the op's own clean rounding
(compare/inherited.py), an absolute bound rather than an estimate, so it is divergent when its error is over
the tolerance (read in nats) and over that bound: no growth factor. A point in the "mixture" unit (attention's
output: a convex combination of its value rows) has its error measured against the norm the rows it mixes bound
it to (compare/mixture.py), since a clean kernel's error scales with them and not with an output that
cancellation made small; it is then judged by the relative rule, and passes its error against its own norm on.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field

from ..graph.canonical import BY_NAME, SCHEMA, known_key
from ..store.dtypes import dtype_info, known_dtype

# Relative-L2 tolerance by dtype. One rounding to a dtype gives a relative-L2 error of about 0.3 eps, and a
# different reduction order a few times that, so one eps flags real errors while leaving ~3x headroom over
# op-order noise (errors inherited from inputs are handled by the growth rule, not by the tolerance).
# fp32 gets a floor: long reductions of different order legitimately differ by ~1e-6.
DEFAULT_TOL = {"float64": 1e-10, "float32": 1e-5, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7,
               "float8_e4m3fn": 2.0 ** -3, "float8_e4m3fnuz": 2.0 ** -3, "float8_e5m2": 2.0 ** -2,
               "float8_e5m2fnuz": 2.0 ** -2}
DEFAULT_GROWTH = 10.0

# Status values and the cause classes a divergent point can have.
OK, OVER, DIVERGENT, NOT_COMPARABLE = "ok", "over", "divergent", "not_comparable"
OPERATOR, ROUTING, NONFINITE = "operator", "routing", "nonfinite"


class SettingsError(ValueError):
    """A tolerance or growth setting that cannot be judged with (NaN, negative, an unknown key)."""


def _check_number(what: str, v, *, allow_inf: bool) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise SettingsError(f"{what}: {v!r} is not a number") from None
    if math.isnan(x) or x < 0 or (math.isinf(x) and not allow_inf):
        raise SettingsError(f"{what}: {v!r} is not allowed: give a finite number >= 0"
                            + (" (or inf to never flag)" if allow_inf else ""))
    return x


def check_point_key(key: str, what: str = "tolerance key") -> None:
    """SettingsError (with the closest names) unless `key` is a canonical point or point key."""
    if known_key(key):
        return
    names = [p.name for p in SCHEMA]
    bare = key.split(".", 1)[1] if key.startswith("L") and key[1:2].isdigit() and "." in key else key
    close = difflib.get_close_matches(bare, names + sorted(DEFAULT_TOL), n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known points: {', '.join(names)}"
    kinds = "neither a dtype nor a canonical point" if what == "tolerance key" else "not a canonical point"
    raise SettingsError(f"{what} {key!r} is {kinds} (write a point as attn.core or L3.attn.core){hint}")


def check_accept_precision(names) -> tuple[str, ...]:
    """The points whose precision difference the user accepts (`--accept-precision`), validated against the
    canonical point table (a point name, `moe.topk_weights`, or a key, `L1.moe.topk_weights`), sorted and
    without repeats; SettingsError naming an unknown one (with the closest names)."""
    if isinstance(names, str):
        names = [names]
    out = set()
    for n in names or ():
        if not isinstance(n, str):
            raise SettingsError(f"accept-precision: {n!r} is not a point name")
        check_point_key(n, "accept-precision point")
        out.add(n)
    return tuple(sorted(out))


def accepted_point(point: str, key: str, accept: tuple[str, ...]) -> str | None:
    """The accept-precision entry that covers this point (its name or its key), or None."""
    return key if key in accept else (point if point in accept else None)


@dataclass
class Tolerance:
    growth: float = DEFAULT_GROWTH                # error must grow by this factor over the inputs' error
    per_dtype: dict = field(default_factory=dict)  # overrides of DEFAULT_TOL
    per_point: dict = field(default_factory=dict)  # overrides by point name ("attn.core") or key ("L3.attn.core")

    def __post_init__(self) -> None:
        g = _check_number("growth", self.growth, allow_inf=False)
        if g < 1:
            raise SettingsError(f"growth: {self.growth!r} is below 1: a point would be flagged for an error "
                                "smaller than its inputs'; give a factor >= 1 (default 10)")
        self.growth = g
        for k in self.per_dtype:
            if not known_dtype(k):
                raise SettingsError(f"tolerance key {k!r} is not a known dtype")
        for k in self.per_point:
            check_point_key(k)
        self.per_dtype = {k: _check_number(f"tolerance {k}", v, allow_inf=True) for k, v in self.per_dtype.items()}
        self.per_point = {k: _check_number(f"tolerance {k}", v, allow_inf=True) for k, v in self.per_point.items()}

    def tol(self, dtype: str | None, point: str, key: str) -> float:
        if key in self.per_point:
            return self.per_point[key]
        if point in self.per_point:
            return self.per_point[point]
        if dtype in self.per_dtype:
            return self.per_dtype[dtype]
        if dtype in DEFAULT_TOL:
            return DEFAULT_TOL[dtype]
        if dtype and known_dtype(dtype) and dtype_info(dtype).is_float:
            return dtype_info(dtype).eps
        return 0.0

    def to_json(self) -> dict:
        return {"growth": self.growth, "per_dtype": {**DEFAULT_TOL, **self.per_dtype}, "per_point": self.per_point}

    @classmethod
    def from_json(cls, d: dict | None) -> "Tolerance":
        d = d or {}
        per_dtype = {k: v for k, v in (d.get("per_dtype") or {}).items() if DEFAULT_TOL.get(k) != v}
        return cls(growth=d.get("growth", DEFAULT_GROWTH), per_dtype=per_dtype, per_point=dict(d.get("per_point") or {}))


def coarser(d1: str, d2: str) -> str:
    """The dtype with fewer mantissa bits: errors are judged at the precision of the less precise side."""
    def bits(d):
        return dtype_info(d).mantissa_bits if known_dtype(d) and dtype_info(d).is_float else 64
    return d1 if bits(d1) <= bits(d2) else d2


@dataclass(frozen=True)
class FlipFacts:
    """What the judge needs to know about top-k flips at one ids point (or one token's flip)."""
    flipped: int = 0             # tokens whose expert set differs
    unexplained: int = 0         # flips the router-logit error cannot explain, or the router itself diverged
    near_tie_to_output: int = 0  # near-tie flips whose token carries error over tolerance to the output
    accept_near_tie: bool = False


@dataclass(frozen=True)
class Judgement:
    status: str
    cause: str | None = None     # for a divergent status: operator | nonfinite | routing


def judge(error: float | None, input_error: float, tol: float, growth: float, kind: str = "float", *,
          nonfinite: bool = False, flips: FlipFacts | None = None, unit: str = "relative") -> Judgement:
    """The status of one point (or one token at one point).

    error        the point's error in its unit (None: nothing compared)
    input_error  the largest error the point inherits from the points that feed it (same unit)
    kind         the PointSpec kind: "float" or "ids"
    unit         the PointSpec unit: "relative" or "mixture" (divergent past growth x the inherited error) or
                 "nats" (the inherited error bounds what a clean op gives: divergent past it)
    nonfinite    NaN/Inf on one side only at this point
    flips        for an ids point: the routing facts
    """
    if error is None:
        return Judgement(NOT_COMPARABLE)
    if kind == "ids":
        f = flips or FlipFacts()
        if f.unexplained:
            return Judgement(DIVERGENT, ROUTING)
        if f.near_tie_to_output and not f.accept_near_tie:
            return Judgement(DIVERGENT, ROUTING)
        return Judgement(OVER if f.flipped else OK)
    err = math.inf if math.isnan(error) else error
    inherited = math.inf if math.isnan(input_error) else input_error
    if nonfinite:
        return Judgement(OVER) if math.isinf(inherited) else Judgement(DIVERGENT, NONFINITE)
    if not err > tol:
        return Judgement(OK)
    if err > (inherited if unit == "nats" else growth * inherited):
        return Judgement(DIVERGENT, OPERATOR)
    return Judgement(OVER)


_SEVERITY = {OK: 0, OVER: 1, DIVERGENT: 2}


def judge_point(error: float, input_error: float, tol: float, growth: float, *, nonfinite: bool = False,
                rows=(), unit: str = "relative") -> tuple[Judgement, list[Judgement], int | None]:
    """A float point judged over all its rows and on each of its worst rows.

    rows   (error, input_error) of each worst row: the row's own relative error and the largest error the
           same row (through attention: the same sample's rows up to its position) has at the points that
           feed this one. A row is judged by `judge` with the point's tolerance and growth; NaN/Inf in a row
           whose inputs are finite is a nonfinite divergence of that row.

    Returns (the point's judgement, each row's, the index of the row that decided it or None when the
    all-rows judgement did): the more severe of the all-rows judgement and the worst row's, the all-rows
    one on a tie. One bad token among thousands is therefore found although its share of the all-rows error
    is tiny, and a row already bad upstream is excused only by its own upstream error."""
    whole = judge(error, input_error, tol, growth, nonfinite=nonfinite, unit=unit)
    each = [judge(e, ie, tol, growth, nonfinite=math.isinf(e), unit=unit) for e, ie in rows]
    worst = max(range(len(each)), key=lambda i: _SEVERITY[each[i].status], default=None)
    if worst is None or _SEVERITY[each[worst].status] <= _SEVERITY[whole.status]:
        return whole, each, None
    return each[worst], each, worst


def growth_of(error: float | None, input_error: float | None) -> float | None:
    """error / input_error, inf when the inputs agree exactly and the point does not."""
    if error is None:
        return None
    if input_error and input_error > 0:
        return error / input_error if not math.isinf(input_error) else (1.0 if math.isinf(error) else 0.0)
    return math.inf if error > 0 else None


def point_kind(point: str) -> str:
    ps = BY_NAME.get(point)
    return ps.kind if ps else "float"


# ------------------------------------------------------------------------------------------------ replay

INTRINSIC, PRECISION, WEIGHTS = "intrinsic", "precision", "weights"


@dataclass(frozen=True)
class ReplayJudgement:
    side: str | None = None      # "A" | "B": the side whose op is the less exact one (None: no blame)
    kind: str | None = None      # intrinsic | precision | nonfinite
    reason: str = ""


def judge_replay(intrinsic: dict | None, dtypes: dict | None, margins=None) -> ReplayJudgement:
    """The replay verdict of one point from its saved facts: both sides' intrinsic errors against the exact
    op (`intrinsic_verdict.intrinsic_verdict`, the replay's one rule), or, where the point was not replayed
    on both sides, the effective dtypes each side computed it in (the less precise dtype is blamed, kind
    `precision`). The finder and `rejudge` both call this, on the same saved numbers."""
    from ..replay.intrinsic_verdict import DEFAULT_MARGINS, intrinsic_verdict
    sides = [decode_intrinsic((intrinsic or {}).get(s)) for s in ("a", "b")]
    if all(x is not None for x in sides):
        v = intrinsic_verdict(sides[0], sides[1], margins or DEFAULT_MARGINS)
        if v.side is not None or not v.reason.startswith("not replayed"):
            return ReplayJudgement(v.side, v.kind, v.reason)
    da, db = (dtypes or {}).get("a"), (dtypes or {}).get("b")
    if not (da and db and da != db and known_dtype(da) and known_dtype(db)
            and dtype_info(da).is_float and dtype_info(db).is_float):
        return ReplayJudgement()
    side = "A" if coarser(da, db) == da else "B"
    return ReplayJudgement(side, PRECISION, f"computed in {da} on A and {db} on B (recorded values; without a "
                                            "replay the side with the coarser dtype is taken as the less exact)")


def decode_intrinsic(d: dict | None):
    """A saved side's intrinsic error (`IntrinsicError` / `NotReplayed`) from its report dict; None if absent."""
    if not isinstance(d, dict):
        return None
    from ..replay.intrinsic import IntrinsicError, NotReplayed
    if "not_replayed" in d:
        return NotReplayed(str(d.get("point")), d.get("layer"), str(d["not_replayed"]))
    from dataclasses import fields as _fields
    from ..report.schema import num
    kw = {}
    for f in _fields(IntrinsicError):       # a saved report is untrusted input: wrong types read as absent
        if f.name not in d:
            continue
        v = d[f.name]
        if f.type == "float":
            v = num(v)
        elif f.type == "int":
            v = v if isinstance(v, int) and not isinstance(v, bool) else None
        elif f.type == "str":
            v = v if isinstance(v, str) else None
        elif f.name == "layer":
            v = v if v is None or (isinstance(v, int) and not isinstance(v, bool)) else None
        if v is None and f.name != "layer":
            return None
        kw[f.name] = v
    try:
        return IntrinsicError(**kw)
    except TypeError:                       # a required field missing
        return None


def encode_intrinsic(e, margins=None) -> dict:
    """A side's intrinsic error as a report dict: every field (so the rule can be re-run on it), plus the
    derived excess and the point's limit for readers."""
    from dataclasses import asdict
    from ..replay.intrinsic import NotReplayed
    if isinstance(e, NotReplayed):
        return {"point": e.point, "layer": e.layer, "not_replayed": e.reason}
    from ..replay.intrinsic_verdict import DEFAULT_MARGINS
    m = margins or DEFAULT_MARGINS
    limit = None if e.kind == "ids" else m.limit_of(e)
    return {**asdict(e), "excess": e.excess, "limit": limit}
