"""The schema of a saved JSON report (`report --from-json`): every field a renderer reads, as a `TypedDict`.

Checked with `store.schema.validate` before any other code looks at the document (the type language and the
checker are `store/schema.py`'s); a trace's own documents are declared there.
"""
# No `from __future__ import annotations` here: TypedDict needs evaluated annotations to tell Required fields.

from typing import Annotated, Any, Literal, Required, TypedDict, Union

from .schema import Check, Count, ShortText

Number = Union[float, Literal["inf", "-inf", "nan"], None]


class ReportMetrics(TypedDict, total=False):
    max_abs: Number
    rel_l2: Number
    cosine: Number
    max_ulp: Number
    mean_ulp: Number
    bitwise_equal: Number
    ref_rms: Number
    nonfinite: int
    ulp_na: Count


class ReportPoint(TypedDict, total=False):
    key: Required[str]
    point: Required[str]
    layer: Required[int | None]
    status: Required[Literal["ok", "over", "divergent", "not_comparable"]]
    error: Number
    tol: Number
    input_error: Number
    growth: Number
    inputs: list[str]
    dtype: str | None
    rows: int
    only_a: int
    only_b: int
    metrics: ReportMetrics | None
    routing: dict[str, Any] | None
    stats: dict[str, Any] | None
    reason: str | None
    sources: dict[str, list[str]]
    error_all_rows: Number
    carried_error: Number
    nonfinite: int
    cause: str | None
    intrinsic: dict[str, Any] | None
    dtypes: dict[str, str] | None
    replay: dict[str, Any] | None


class ReportOps(TypedDict, total=False):
    a: list[dict[str, Any]]
    b: list[dict[str, Any]]
    pairs: list[list[int | None]]
    first_differing: int | None


class ReportFirst(ReportPoint, total=False):
    summary: str
    ops: ReportOps


class ReportFinding(TypedDict, total=False):
    cause: Required[str]
    key: Required[str]
    layer: Required[int | None]
    divergent: Required[bool]
    computational: Required[bool]
    summary: Required[str]
    remedy: str
    detail: dict[str, Any]
    share: Number | None


class ReportNote(TypedDict, total=False):
    kind: Required[str]
    summary: Required[str]
    detail: dict[str, Any]


class ReportToken(TypedDict, total=False):
    sample: Required[str]
    position: Required[int]
    abs_dlogprob: Required[Number]
    logprob_a: Required[Number]
    logprob_b: Required[Number]
    divergence_starts: str | None
    routing_flip: bool
    flips: dict[str, str]
    inherited: dict[str, Number]
    carried: dict[str, Number]


class ReportRoutingLayer(TypedDict, total=False):
    flipped: Required[int]
    rows: Required[int]
    unexplained: int
    set_agreement: Number
    near_tie: int
    near_tie_to_output: int
    router_divergent: bool
    dlogprob_share: Number


class ReportRouting(TypedDict, total=False):
    layers: dict[str, ReportRoutingLayer]
    tokens_with_flip: int
    share_tokens_with_flip: Number
    dlogprob_share: Number


class ReportNotComparable(TypedDict):
    key: str
    reason: str | None


Share = Annotated[float, Check("a finite number", lambda v: v == v and abs(v) != float("inf"))]
Gap = Annotated[float, Check("a finite number > 0 (the sum of |Δ logprob|)", lambda v: 0 < v < float("inf"))]


class ReportShare(TypedDict, total=False):
    """One contributor of a saved attribution (`replay.attribution.Share` as JSON)."""
    key: Required[str]
    point: Required[str]
    layer: Required[Annotated[int, Check("a layer from 0 to 65536", lambda v: 0 <= v <= 1 << 16)] | None]
    share: Required[Share]
    share_a: Share
    share_b: Share
    share_op: Share
    share_rounding: Share
    share_downstream: Share
    share_total: Share
    rows: Count
    finding: bool


class ReportShareKind(TypedDict, total=False):
    kind: Required[str]
    share: Required[Share]
    share_a: Share
    share_b: Share
    points: Count


class ReportNotAttributed(TypedDict):
    key: str
    reason: str


class ReportAttribution(TypedDict, total=False):
    """A saved `attribution` (docs/attribution.md): `{unavailable}`, or the measured shares. Its numbers are
    summed and credited again on reading (`attribution.recredit`): each one is checked here, so that a null,
    a text or a negative gap is refused by name instead of failing (or counting letters) later."""
    unavailable: ShortText
    gap: Gap
    tokens: Count
    tokens_total: Count
    explained: Number
    residual: Number
    noise: Number
    threshold: Annotated[float, Check("a number in (0, 1]", lambda v: 0 < v <= 1)]
    first: str | None
    top: list[str]
    by_point: list[ReportShare]
    by_kind: list[ReportShareKind]
    routing: list[ReportShare]
    not_attributed: list[ReportNotAttributed]
    notes: list[str]
    withheld: ShortText | None
    credit: ShortText
    clean_noise: dict[str, Any] | None


class ReportCountPair(TypedDict):
    a: Count
    b: Count


class ReportStructure(TypedDict, total=False):
    """How the two models differ in structure (`diverge._structure`): read again by the re-judgement."""
    layers: ReportCountPair
    experts: ReportCountPair


class ReportUnmatched(TypedDict, total=False):
    count: Count
    other_samples: Count
    outside: Count
    inside: Count
    first: list[Any]


class ReportIdentity(TypedDict, total=False):
    """What the row identity check found (`view/rows.py`): read again by the re-judgement's notes."""
    unmatched: dict[str, ReportUnmatched]
    different_tokens: list[Any]
    duplicates: dict[str, list[Any]]


Tol = Annotated[float, Check("a finite number >= 0", lambda v: 0 <= v < float("inf"))]


class ReportTolerance(TypedDict, total=False):
    growth: Tol
    per_dtype: dict[str, Tol]
    per_point: dict[str, Tol]


class ReportSettings(TypedDict, total=False):
    """The settings a report was judged with: `report --from-json` judges its points again with them."""
    tolerance: ReportTolerance
    accept_near_tie_routing: bool
    accept_precision: list[str]
    margins: dict[str, Any]
    allow_unverified: bool


class CoverageKey(TypedDict, total=False):
    key: Required[ShortText]
    reason: ShortText


Named = Annotated[list[CoverageKey], Check("a list of at most 64 names", lambda v: len(v) <= 64)]


class CoverageNamed(TypedDict):
    count: Count
    first: Named


class CoveragePoints(TypedDict):
    compared: Count
    total: Count
    only_a: CoverageNamed
    only_b: CoverageNamed
    not_comparable: CoverageNamed


class CoverageRows(TypedDict):
    compared: Count
    total: Count
    only_a: Count
    only_b: Count
    different_tokens: Count


class CoverageReplayRows(TypedDict):
    replayed: Count
    total: Count
    points_sampled: Count


class CoverageReplayColumns(TypedDict):
    replayed: Count
    total: Count


class CoverageReplay(TypedDict, total=False):
    replayed: Required[Count]
    total: Required[Count]
    derived: Required[Count]
    not_replayed: Required[CoverageNamed]
    rows: CoverageReplayRows            # absent in reports saved before the finder replayed a sample of rows
    columns: CoverageReplayColumns


class CoverageAttribution(TypedDict, total=False):
    tokens: Required[Count]
    total: Required[Count | None]
    budget: Required[Count | None]
    unavailable: ShortText


class ReportCoverage(TypedDict, total=False):
    """What the verdict covered (`report/coverage.py`): every renderer prints it, so each count is checked."""
    points: Required[CoveragePoints]
    rows: Required[CoverageRows]
    replay: CoverageReplay
    attribution: CoverageAttribution


class ReportDoc(TypedDict, total=False):
    """A saved JSON report (`report.schema.Report.to_json()`), as `report --from-json` reads it back."""
    schema: Literal["tic-trace.report/1", "tic-trace.report/2"]
    verdict: Required[Literal["consistent", "divergent", "not_comparable"]]
    exit_code: int
    contract: list[dict[str, Any]]
    first_divergence: ReportFirst | None
    findings: list[ReportFinding]
    notes: list[ReportNote]
    points: Required[list[ReportPoint]]
    not_comparable: list[ReportNotComparable]
    rows: dict[str, Count | None]
    worst_tokens: list[ReportToken]
    routing: ReportRouting
    settings: ReportSettings
    sides: dict[str, dict[str, Any]]
    token_errors: dict[str, dict[str, Number]]
    attribution: ReportAttribution
    identity: ReportIdentity
    structure: ReportStructure
    coverage: ReportCoverage
