"""The report: one typed schema, one JSON codec. The finder builds it; the renderers only display it.

Every renderer (terminal `terminal.py`, HTML `html/`, the JSON file) reads a `Report` or its JSON document
(`Report.to_json()`), never re-derives an answer: op pairing and the first differing op are computed here,
once, when the report is made. Non-finite numbers have one encoding: `"inf"`, `"-inf"`, `"nan"` (strict
JSON); `num()` is the one decoder. See docs/report.md for the fields, causes and exit codes.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

SCHEMA_ID = "tic-trace.report/2"

# Exit codes of every command that renders a verdict (and of the CLI on failure).
EXIT_CONSISTENT, EXIT_DIVERGENT, EXIT_ERROR, EXIT_NOT_COMPARABLE = 0, 1, 2, 3
VERDICT_EXIT = {"consistent": EXIT_CONSISTENT, "divergent": EXIT_DIVERGENT, "not_comparable": EXIT_NOT_COMPARABLE}

# Cause classes of a finding (a divergent point's `cause`). New analyses add a class here and a paragraph in
# docs/report.md; renderers show any class they do not know by its name and summary.
CAUSES = {
    "operator": "an operator computes differently: the error jumps at a point whose inputs agree",
    "routing": "top-k expert sets differ between the sides",
    "nonfinite": "NaN/Inf on one side only",
    "intrinsic": "one side's op is further from the exact op on its own inputs than clean implementations are",
    "precision": "the sides compute a point's output in different precisions (fp32 on one, bf16 on the other)",
    "weights": "the parameters behind a point differ bit for bit between the sides (or from the checkpoint)",
    # the used-log-prob stage, after the canonical graph (compare/used_logprob_stage.py; docs/reconcile.md)
    "semantics": "the sides take the log-probs they use under different semantics (temperature, top-k / top-p "
                 "renormalisation, raw or processed logits)",
    "tokens": "the log-probs the sides use are of different tokens (a template or tokenisation shift)",
    "used_logprobs": "a side's used log-probs are not its own traced logits under any known semantics",
    "routing_replay": "routing replay (R3) is on, but the trainer did not apply the rollout's experts",
}
# The stage after the canonical graph where the log-probs each side used are judged (compare/used_logprob_stage.py):
# the key of its findings and, where the forward is consistent, of the first divergence.
USED_LOGPROB_STAGE = "used_logprob"
USED_LOGPROB_MEANING = ("the log-probs each side used (the engine's returned ones, the trainer's), after the "
                        "canonical graph")
NOTE_KINDS = {"accumulated_noise": "points over tolerance only because below-tolerance noise accumulated",
              "not_replayed": "points the exact replay could not judge (the A-B rule alone decides there)",
              "structure": "the two models differ in structure (another number of layers or of routed experts): "
                           "not comparable",
              "duplicate_rows": "a side names the same (sample, position) row more than once: not comparable",
              "different_tokens": "rows both sides have hold different tokens: left out of the judgement",
              "unmatched_rows": "rows of one side that match no row of the other: counted, never compared",
              "implementations": "points where the sides are reproduced by different clean implementations",
              "carried": "points whose A-B difference the replay explains (each side as exact as clean "
                         "implementations on its own inputs: the op carries its inputs' difference and two clean "
                         "roundings): not a divergence",
              "both_over_envelope": "points where both sides are over the clean envelope alike: a shared less "
                                    "exact op, or a checkpoint config that does not describe what they compute",
              "unverified_mapping": "a side's architecture is not in its adapter's table: refused, or (allowed) "
                                    "compared with every point possibly mis-mapped"}
NOTE_KINDS["passes"] = ("the same rows traced in several passes on a side: compared pass with pass, with each "
                        "pass's coverage")
NOTE_KINDS["precision_unchecked"] = ("low-precision points judged by the A-B rule alone (no --reference): a "
                                     "precision fault hides inside that dtype's clean noise")
NOTE_KINDS["incomplete_run"] = ("a side's tracer stopped recording before its run ended (a failed write, or its own "
                                "error): the trace is not the whole run, and the pair is never consistent")
# Notes about the rows and the models' structure (compare/identity_notes.py): they lead the report. `detail.blocks`
# says what one does to the verdict: "always" (not comparable whatever else is found), "unless_divergent" (not
# comparable unless a divergence is found on the rows that are comparable), absent (shown, the verdict stands).
IDENTITY_NOTES = ("structure", "duplicate_rows", "passes", "different_tokens", "unmatched_rows")
ARCHITECTURE_NOTE = "unverified_mapping"
INCOMPLETE_NOTE = "incomplete_run"


def _architecture_notes(report: Any, refused: bool) -> list[dict]:
    # renderers call this on any report they are given, malformed ones too: never raise
    notes = report.get("notes") if isinstance(report, dict) else None
    return [n for n in notes if isinstance(n, dict) and n.get("kind") == ARCHITECTURE_NOTE
            and isinstance(n.get("detail"), dict) and bool(n["detail"].get("refused")) == refused] \
        if isinstance(notes, list) else []


def architecture_refusal(report: dict) -> list[dict]:
    """The `unverified_mapping` notes of a report refused for its architecture (empty: not refused)."""
    return _architecture_notes(report, True)


def unverified_sides(report: dict) -> list[dict]:
    """The `unverified_mapping` notes of a report compared despite an unverified architecture."""
    return _architecture_notes(report, False)


# ------------------------------------------------------------------------------------------------ codec

_LEAVES = frozenset({str, int, bool, type(None)})     # exact types encoded as they are
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def encode(x: Any) -> Any:
    """A report value as strict JSON: NaN/Inf as strings, numpy scalars as Python numbers, tuples as lists.
    Exact built-in types first, without a call per leaf: a report of 100k points is ~5M values (re-judging one
    spent most of its time here)."""
    t = type(x)
    if t in _LEAVES:
        return x
    if t is float:
        return x if x - x == 0.0 else "nan" if x != x else "inf" if x > 0 else "-inf"
    if t is dict:
        return {k if type(k) is str else str(k): v if type(v) in _LEAVES else encode(v) for k, v in x.items()}
    if t is list or t is tuple:
        return [v if type(v) in _LEAVES else encode(v) for v in x]
    names = _FIELD_NAMES.get(t)
    if names is None and hasattr(x, "__dataclass_fields__") and not isinstance(x, type):
        names = _FIELD_NAMES[t] = tuple(f.name for f in fields(x))
    if names is not None:      # field by field: asdict's deep copy was most of a large rejudge
        return {n: encode(getattr(x, n)) for n in names}
    return _encode_other(x)


def _encode_other(x: Any) -> Any:
    """`encode` of subclasses of the built-in types and numpy scalars."""
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return x
    if isinstance(x, np.generic):
        return encode(x.item())
    if isinstance(x, dict):
        return {str(k): encode(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [encode(v) for v in x]
    if hasattr(x, "__dataclass_fields__"):   # field by field: asdict's deep copy was most of a large rejudge
        return {f.name: encode(getattr(x, f.name)) for f in fields(x)}
    return x


def num(x: Any) -> float | None:
    """The one decoder of a numeric report field: "inf"/"-inf"/"nan" strings become floats, None stays None,
    anything unparsable is None."""
    if x is None:
        return None
    if isinstance(x, bool):
        return 1.0 if x else 0.0
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str):
        s = x.strip().lower()
        if s in ("inf", "+inf", "infinity"):
            return math.inf
        if s in ("-inf", "-infinity"):
            return -math.inf
        try:
            return float(s)
        except ValueError:
            return None
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _field_set(cls: type) -> frozenset[str]:
    """The field names of a dataclass, computed once per class (a report of 100k points decodes 100k)."""
    if cls not in _FIELD_SETS:
        _FIELD_SETS[cls] = frozenset(f.name for f in fields(cls))
    return _FIELD_SETS[cls]


_FIELD_SETS: dict[type, frozenset[str]] = {}


def _decode_floats(d: dict, names: tuple[str, ...]) -> dict:
    return {k: (num(v) if k in names else v) for k, v in d.items()}


class _Indexable:
    """Dataclasses read like the JSON dicts they become (`first["key"]`), for scripts written against JSON."""

    def __getitem__(self, k: str):
        try:
            return getattr(self, k)
        except AttributeError:
            raise KeyError(k) from None

    def get(self, k: str, default=None):
        return getattr(self, k, default)


# ------------------------------------------------------------------------------------------------ classes

@dataclass
class Point(_Indexable):
    key: str
    point: str
    layer: int | None
    status: str = "ok"                   # ok | over | divergent | not_comparable
    error: float | None = None           # the judged error (relative L2; for ids points the share of flipped rows)
    tol: float | None = None
    input_error: float | None = None     # the error inherited from the inputs, the judge's reference (saved so
                                         # that re-judging reproduces the finder)
    inputs: list[str] = field(default_factory=list)
    growth: float | None = None
    dtype: str | None = None
    rows: int = 0
    only_a: int = 0
    only_b: int = 0
    metrics: dict | None = None
    routing: dict | None = None
    stats: dict | None = None
    reason: str | None = None
    sources: dict = field(default_factory=dict)
    error_all_rows: float | None = None  # the error over every row, when routing-flip tokens were left out
    carried_error: float | None = None   # the error this point passes downstream (over every row)
    nonfinite: int = 0                   # elements NaN/Inf on one side only
    cause: str | None = None             # for a divergent point: a class of CAUSES
    intrinsic: dict | None = None        # with a reference: {"a": side A's intrinsic error, "b": B's, and the
                                         # replay verdict "side", "kind", "reason"} (docs/report.md)
    dtypes: dict | None = None           # {"a", "b"}: each side's effective dtype, where they differ
    replay: dict | None = None           # the judged replay verdict {"side", "kind", "reason"} (judge_replay)
    worst_rows: list = field(default_factory=list)   # the rows judged on their own (docs/report.md, "The worst
                                         # rows"): {"row": "sample@position", "error", "input_error", "growth"}
                                         # (measured) and "status", "cause" (judged), largest error first
    decided_by_row: str | None = None    # the row whose own judgement is the point's status (more severe than
                                         # the all-rows one); None: the all-rows judgement decided

    _FLOATS = ("error", "tol", "input_error", "growth", "error_all_rows", "carried_error")
    _ROW_FLOATS = ("error", "input_error", "growth")

    @classmethod
    def from_json(cls, d: dict) -> "Point":
        names = _field_set(cls)
        out = cls(**_decode_floats({k: v for k, v in d.items() if k in names}, cls._FLOATS))
        out.worst_rows = decode_rows(out.worst_rows)
        return out


@dataclass
class OpsRegion(_Indexable):
    """The dispatcher ops each side ran between the first divergent point's inputs and its output, paired."""
    a: list[dict] = field(default_factory=list)
    b: list[dict] = field(default_factory=list)
    pairs: list[list[int | None]] = field(default_factory=list)   # [index in a | None, index in b | None]
    first_differing: int | None = None   # index into pairs: the first op both run with a different output

    @classmethod
    def build(cls, a: list[dict], b: list[dict]) -> "OpsRegion":
        pairs = pair_ops(a, b)
        first = next((n for n, (i, j) in enumerate(pairs)
                      if i is not None and j is not None and op_differs(a[i], b[j])), None)
        return cls(a, b, [list(p) for p in pairs], first)

    @classmethod
    def from_json(cls, d: dict | None) -> "OpsRegion":
        d = d if isinstance(d, dict) else {}
        a, b = list(d.get("a") or []), list(d.get("b") or [])
        if "pairs" not in d:             # a report of schema 1
            return cls.build(a, b)
        return cls(a, b, [list(p) for p in d.get("pairs") or []], d.get("first_differing"))


@dataclass
class Finding(_Indexable):
    """One named cause. `divergent` findings make the verdict; the others are shown, never hidden."""
    cause: str                           # a class of CAUSES
    key: str                             # the point where it shows first
    layer: int | None
    divergent: bool                      # counts for the verdict
    computational: bool                  # the sides compute differently (vs. near-tie routing noise)
    summary: str
    remedy: str = ""
    detail: dict = field(default_factory=dict)
    share: float | None = None           # with an attribution: the share of the log-prob gap it explains


@dataclass
class Note(_Indexable):
    kind: str                            # a class of NOTE_KINDS
    summary: str
    detail: dict = field(default_factory=dict)


@dataclass
class FirstDivergence(Point):
    ops: OpsRegion = field(default_factory=OpsRegion)
    summary: str = ""                    # the finding's one line

    @classmethod
    def from_json(cls, d: dict) -> "FirstDivergence":
        names = {f.name for f in fields(cls)} - {"ops"}
        out = cls(**_decode_floats({k: v for k, v in d.items() if k in names}, Point._FLOATS))
        out.ops = OpsRegion.from_json(d.get("ops"))
        out.worst_rows = decode_rows(out.worst_rows)
        return out


def decode_rows(rows) -> list[dict]:
    """A saved point's worst rows (untrusted input): dicts with a row label, their numbers decoded."""
    if not isinstance(rows, list):
        return []
    return [_decode_floats(dict(r), Point._ROW_FLOATS) for r in rows if isinstance(r, dict) and "row" in r]


@dataclass
class WorstToken(_Indexable):
    sample: str
    position: int
    abs_dlogprob: float
    logprob_a: float
    logprob_b: float
    divergence_starts: str | None = None
    routing_flip: bool = False
    flips: dict = field(default_factory=dict)   # layer (str) -> "explained" | "unexplained" (margin vs logit error)
    # point key -> this token's inherited error where it is measured where the op acts (compare/inherited.py:
    # the log-probs in nats, a norm through its gain), for the per-token walk
    inherited: dict = field(default_factory=dict)
    # point key -> this token's error passed downstream where it is not its judged one (a point judged in the
    # "mixture" unit passes its error against its own norm), for the per-token walk
    carried: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.sample}@{self.position}"


@dataclass
class Report(_Indexable):
    verdict: str                                  # consistent | divergent | not_comparable
    first: FirstDivergence | None
    findings: list[Finding]
    notes: list[Note]
    points: list[Point]
    not_comparable: list[dict]
    rows: dict
    worst_tokens: list[WorstToken]
    routing: dict
    settings: dict
    sides: dict
    token_errors: dict = field(default_factory=dict)   # row label -> {point key: per-token error}
    contract: list = field(default_factory=list)       # contract differences (contract.ContractDiff as dicts)
    structure: dict = field(default_factory=dict)      # structural differences ({"layers"|"experts": {"a", "b"}})
    identity: dict = field(default_factory=dict)       # the rows behind rows' identity counts (align.RowIdentity)
    attribution: dict | None = None                    # which difference explains how much of the gap (attribution.py)
    coverage: dict = field(default_factory=dict)       # what the verdict covered (compare/coverage.py builds it)
    reconciliation: dict | None = None                 # slime's train_rollout_logprob_abs_diff split into parts
                                                       # (compare/reconcile.py; docs/reconcile.md)
    extra: dict = field(default_factory=dict)          # fields callers add (e.g. "slime"), kept verbatim

    @property
    def exit_code(self) -> int:
        return VERDICT_EXIT.get(self.verdict, EXIT_ERROR)

    def to_json(self) -> dict:
        doc = {
            "schema": SCHEMA_ID, "verdict": self.verdict, "exit_code": self.exit_code,
            "contract": self.contract, "first_divergence": self.first, "findings": self.findings, "notes": self.notes,
            "points": self.points, "not_comparable": self.not_comparable, "rows": self.rows,
            "worst_tokens": self.worst_tokens, "routing": self.routing, "settings": self.settings,
            "sides": self.sides, "token_errors": self.token_errors, "structure": self.structure,
            "identity": self.identity,
        }
        if self.attribution is not None:
            doc["attribution"] = self.attribution
        if self.coverage:
            doc["coverage"] = self.coverage
        if self.reconciliation is not None:
            doc["reconciliation"] = self.reconciliation
        return encode({**self.extra, **doc})

    @classmethod
    def from_json(cls, d: dict) -> "Report":
        known = {"schema", "verdict", "exit_code", "contract", "first_divergence", "findings", "notes", "points",
                 "not_comparable", "rows", "worst_tokens", "routing", "settings", "sides", "token_errors",
                 "structure", "identity", "attribution", "coverage", "reconciliation"}
        fd = d.get("first_divergence")
        wt_names = {f.name for f in fields(WorstToken)}
        return cls(
            verdict=d.get("verdict"), first=FirstDivergence.from_json(fd) if isinstance(fd, dict) else None,
            findings=[Finding(**x) for x in d.get("findings") or []],
            notes=[Note(**x) for x in d.get("notes") or []],
            points=[Point.from_json(p) for p in d.get("points") or []],
            not_comparable=list(d.get("not_comparable") or []), rows=dict(d.get("rows") or {}),
            worst_tokens=[WorstToken(**_decode_floats({k: v for k, v in w.items() if k in wt_names},
                                                      ("abs_dlogprob", "logprob_a", "logprob_b")))
                          for w in d.get("worst_tokens") or []],
            routing=dict(d.get("routing") or {}), settings=dict(d.get("settings") or {}),
            sides=dict(d.get("sides") or {}),
            token_errors={k: {kk: num(vv) for kk, vv in v.items()} for k, v in (d.get("token_errors") or {}).items()},
            contract=[dict(x) for x in d.get("contract") or [] if isinstance(x, dict)],
            structure=dict(d.get("structure") or {}) if isinstance(d.get("structure"), dict) else {},
            identity=dict(d.get("identity") or {}) if isinstance(d.get("identity"), dict) else {},
            attribution=_decode_attribution(d.get("attribution")),
            coverage=dict(d["coverage"]) if isinstance(d.get("coverage"), dict) else {},
            reconciliation=_decode_attribution(d.get("reconciliation")),
            extra={k: v for k, v in d.items() if k not in known})


def _decode_attribution(d: Any) -> dict | None:
    """A saved attribution (or reconciliation) with its numbers decoded (NaN/Inf were written as strings); None
    if absent."""
    if not isinstance(d, dict):
        return None

    def dec(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: dec(v) for k, v in x.items()}
        if isinstance(x, list):
            return [dec(v) for v in x]
        return num(x) if isinstance(x, str) and x in ("nan", "inf", "-inf") else x
    return dec(d)


# ------------------------------------------------------------------------------------------------ op pairing

def pair_ops(a: list[dict], b: list[dict]) -> list[tuple[int | None, int | None]]:
    """Pairs of op indices (A, B), aligned on the op names (longest common subsequence): an op one side runs
    and the other does not (a cast, a fused kernel split in two) gets a row of its own instead of shifting
    every pair after it; replaced runs are paired in order, the rest stands alone."""
    na, nb = [str(x.get("op")) for x in a], [str(x.get("op")) for x in b]
    out: list[tuple[int | None, int | None]] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, na, nb, autojunk=False).get_opcodes():
        if tag == "equal":
            out.extend(zip(range(i1, i2), range(j1, j2)))
        else:
            ia, jb = list(range(i1, i2)), list(range(j1, j2))
            out.extend((ia[k] if k < len(ia) else None, jb[k] if k < len(jb) else None)
                       for k in range(max(len(ia), len(jb))))
    return out


def op_differs(oa: dict, ob: dict) -> bool:
    """The same op on both sides with a different output: by hash when both have one, else by RMS."""
    if oa.get("op") != ob.get("op"):
        return False
    ha, hb = oa.get("hash"), ob.get("hash")
    if ha is not None and hb is not None:
        return ha != hb
    ra, rb = num(oa.get("rms")), num(ob.get("rms"))
    if ra is None or rb is None or math.isnan(ra) or math.isnan(rb):
        return False
    return abs(ra - rb) > 1e-6 * max(abs(ra), abs(rb), 1e-30)
