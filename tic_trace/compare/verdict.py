"""Steps 2 and 3 of the finder: judge every point in dataflow order, name the causes, decide the verdict.

`assess()` works on the report's own points (`report.schema.Point`), which hold every fact the rule needs
(the error, the error inherited from the inputs, the routing facts of each MoE layer, per-token errors of
the worst tokens). The finder calls it on freshly measured points and `rejudge` on a saved report's points,
so both give the same answer for the same settings.

Verdict: `not_comparable` when the two models differ in structure (another number of layers) or a side names
a row more than once (`_identity_notes`); else `divergent` when some finding counts (an operator jump,
NaN/Inf on one side only, routers that compute differently, or near-tie flips that carry error over tolerance
to the output, unless near ties are accepted); `not_comparable` when rows of one side match no row of the
other inside the positions the other traced for the same sample (the sides number the rows differently),
when some point both sides record could not be compared on any row, or nothing was; `consistent` otherwise:
earned, never by default. Rows whose tokens differ are left out of the judgement and counted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..graph.canonical import OUTPUT_POINTS, RESIDUAL, is_ids, is_routed, unit_of
from ..graph.canonical import order_key, parse_key
from .judge import (DIVERGENT, INTRINSIC, NONFINITE, NOT_COMPARABLE, OPERATOR, OVER, PRECISION, ROUTING, WEIGHTS,
                    FlipFacts, Tolerance, accepted_point, coarser, growth_of, judge, judge_point, judge_replay,
                    point_kind, decode_intrinsic)
from ..report.schema import Finding, Note, Point, WorstToken, num
from ..store.dtypes import known_dtype
from .point_notes import implementations_note, not_replayed_note, precision_unchecked_note, shared_nonfinite_note
from .identity_notes import (ALWAYS, UNLESS_DIVERGENT, identity_notes as _identity_notes,  # noqa: F401 - public here too
                             incomplete_run_notes, layers_text, with_incomplete_runs)


NEAR_TIE_REMEDY = ("near ties: only the same router computation on both sides, bit for bit (same GEMM, dtype "
                   "and reduction order), or routing replay (training reuses the rollout's expert choice) "
                   "removes them; --accept-near-tie-routing accepts them")
ROUTER_REMEDY = ("the routers compute differently: make the router computation the same on both sides "
                 "(router weights, dtype, score function, expert bias / score correction, top-k)")


@dataclass
class Assessment:
    verdict: str
    findings: list[Finding] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)
    first: Finding | None = None


def assess(points: list[Point], tolerance: Tolerance, *, accept_near_tie: bool = False,
           worst_tokens: list[WorstToken] | None = None, token_errors: dict | None = None,
           routing: dict | None = None, contract: list[dict] | None = None, margins=None,
           rows: dict | None = None, identity: dict | None = None, structure: dict | None = None,
           accept_precision: tuple[str, ...] = ()) -> Assessment:
    """Judge `points` (in dataflow order) in place, then the worst tokens, then name causes and the verdict.

    With replay facts (a reference) or different effective dtypes at a point, `judge.judge_replay` decides
    whether one side's op is intrinsically (or by precision) the less exact one. The first divergence is the
    first counting finding in dataflow order (`canonical.order_key`), whatever its cause: an operator jump
    upstream of a precision difference leads it. A precision difference at a point in `accept_precision`
    (`judge.check_accept_precision`) is listed as accepted and counts for nothing: the A-B rule judges that
    point. `contract` (report.contract) adds a `weights` finding per point whose parameters differ. `rows`,
    `identity` and `structure` (the report's) give the notes on the rows and the models' structure, which lead
    the notes and can make the verdict not comparable (`_identity_notes`)."""
    judge_points(points, tolerance, accept_near_tie, margins, accept_precision)
    where = point_index(points)          # each token walks its own errors, not every point
    for w in worst_tokens or []:
        w.divergence_starts = divergence_start(w, (token_errors or {}).get(w.label, {}), points, tolerance,
                                               accept_near_tie, where)
    if routing is not None:
        routing["layers"] = {str(p.layer): _layer_summary(p.routing) for p in points
                             if is_ids(p.point) and p.routing is not None}
    findings = sorted((f for p in points for f in _findings(p)), key=lambda f: order_key(*parse_key(f.key)))
    findings = _with_weights(findings, contract or [])
    computational = [f for f in findings if f.divergent and f.computational]
    counted = computational or [f for f in findings if f.divergent]
    first = counted[0] if counted else None
    identity_notes = _identity_notes(rows or {}, identity or {}, structure or {})
    notes = identity_notes + [n for n in (not_replayed_note(points), _both_over_envelope(points),
                                          implementations_note(points), _carried_notes(points),
                                          _accumulated_noise(points, findings), shared_nonfinite_note(points),
                                          precision_unchecked_note(points) if first is None else None)
                              if n is not None]
    compared = [p for p in points if p.status != NOT_COMPARABLE]
    blocks = {n.detail.get("blocks") for n in identity_notes}
    if ALWAYS in blocks:
        verdict = "not_comparable"
    elif first is not None:
        verdict = "divergent"
    elif UNLESS_DIVERGENT in blocks or not compared or len(compared) < len(points):
        verdict = "not_comparable"
    else:
        verdict = "consistent"
    return Assessment(verdict, findings, notes, first)


def judge_points(points: list[Point], tolerance: Tolerance, accept_near_tie: bool, margins=None,
                 accept_precision: tuple[str, ...] = ()) -> None:
    by_key = {p.key: p for p in points}
    for p in points:
        if p.error is None:
            p.status, p.cause = NOT_COMPARABLE, None
            continue
        if point_kind(p.point) == "ids" and p.routing is not None:
            p.tol = 0.0
            facts = _flip_facts(p, by_key, tolerance, accept_near_tie)
            j = judge(p.error, 0.0, 0.0, tolerance.growth, "ids", flips=facts)
            router = by_key.get((p.routing or {}).get("router_key") or "")
            if router is not None and facts.flipped and router.status == DIVERGENT:
                router.cause = ROUTING      # the router diverges and tokens pick other experts
        else:
            p.tol = tolerance.tol(p.dtype, p.point, p.key)
            rows = [(_n(r.get("error")), _n(r.get("input_error"))) for r in p.worst_rows or []]
            j, each, by_row = judge_point(p.error, p.input_error or 0.0, p.tol, tolerance.growth,
                                          nonfinite=p.nonfinite > 0, rows=rows, unit=unit_of(p.point))
            for r, rj in zip(p.worst_rows or [], each):
                r["status"], r["cause"] = rj.status, rj.cause
            p.decided_by_row = p.worst_rows[by_row]["row"] if by_row is not None else None
        p.status, p.cause = j.status, j.cause
        p.growth = growth_of(p.error, p.input_error) if p.routing is None else None
        if p.intrinsic is not None or p.dtypes:
            r = judge_replay(p.intrinsic, p.dtypes, margins)
            p.replay = {"side": r.side, "kind": r.kind, "reason": r.reason}
            accepted = _accepted(p, r.kind, accept_precision) if r.side is not None else None
            if accepted:                    # shown, not counted: the A-B judgement of this point stands
                p.replay["accepted"] = accepted
            elif r.side is not None:        # the replay names a side: this point diverges for that reason
                p.status, p.cause = DIVERGENT, PRECISION if r.kind == PRECISION else INTRINSIC
            elif p.status == DIVERGENT and p.cause == OPERATOR and _carried(p, margins):
                p.status, p.cause = OVER, None
                p.replay["carried"] = True


def _carried(p: Point, margins=None) -> bool:
    """Whether an A-B jump at `p` is no fault of the op: the replay found each side's op as exact as clean
    implementations are on that side's own inputs. Then |A - B| <= (A's rounding) + |op(A's inputs) - op(B's
    inputs)| + (B's rounding): the jump is the exact op's response to its inputs' difference, which an
    ill-conditioned op (attention over large scores and sinks, a norm over a massive row) amplifies past any
    fixed growth factor, plus the two sides' clean roundings, which on such an op can differ by more than the
    fixed tolerance even on identical inputs (eager vs SDPA attention). The divergence, if any, starts upstream."""
    from ..replay.intrinsic import IntrinsicError
    from ..replay.intrinsic_verdict import DEFAULT_MARGINS, abnormal
    sides = [decode_intrinsic((p.intrinsic or {}).get(s)) for s in ("a", "b")]
    m = margins or DEFAULT_MARGINS
    return all(isinstance(x, IntrinsicError) and x.kind == "float" and x.numel >= m.min_numel
               and not abnormal(x, m) for x in sides)


def _accepted(p: Point, kind: str | None, accept: tuple[str, ...]) -> str | None:
    """The --accept-precision entry that accepts this point's replay finding: a precision difference, or an
    intrinsic one where the sides compute in different dtypes (the precision difference is its cause)."""
    entry = accepted_point(p.point, p.key, accept)
    return entry if entry and (kind == PRECISION or p.dtypes) else None


def _n(v) -> float:
    """A saved row number (untrusted): NaN or unreadable reads as inf, the judge's reading of NaN."""
    x = num(v)
    return math.inf if x is None or math.isnan(x) else x


def _flip_facts(p: Point, by_key: dict, tolerance: Tolerance, accept: bool) -> FlipFacts:
    r = p.routing or {}
    flipped = int(r.get("flipped") or 0)
    router = by_key.get(r.get("router_key") or "")
    router_div = router is not None and router.status == DIVERGENT
    explained = int(r.get("explained") or 0)
    unexplained = flipped if router_div else flipped - explained
    near = 0 if router_div else explained
    reach = 0
    if not router_div:
        for key, err in r.get("explained_outputs") or []:
            out, err = by_key.get(key), num(err)     # a saved report holds "inf"/"nan" strings
            if out is not None and err is not None and err > tolerance.tol(out.dtype, out.point, out.key):
                reach += 1
    r.update(router_divergent=router_div, router_status=router.status if router is not None else None,
             unexplained=unexplained, near_tie=near, near_tie_to_output=reach,
             accepted=bool(accept and near and not unexplained))
    return FlipFacts(flipped, unexplained, reach, accept)


def point_index(points: list[Point]) -> dict[str, int]:
    """{point key: the index of its first point in `points`}."""
    where: dict[str, int] = {}
    for i, p in enumerate(points):
        where.setdefault(p.key, i)
    return where


def divergence_start(w: WorstToken, errs: dict, points: list[Point], tolerance: Tolerance,
                     accept: bool, where: dict[str, int] | None = None) -> str | None:
    """The first point where this token's own error is judged divergent (same judge, per-token errors).
    `where` ({point key: its index in `points`}): the points holding this token's errors are visited alone, in
    dataflow order (a report of many worst tokens and points made every token walk every point: quadratic)."""
    if not errs:
        return None
    where = where if where is not None else point_index(points)
    prev: dict[str, float] = {}
    flipped_layers = {str(k) for k in (w.flips or {})}
    out_key = next((k for k in OUTPUT_POINTS if k in errs), None)
    out_pt = points[where[out_key]] if out_key in where else None
    out_over = (out_pt is not None and errs[out_key] is not None
                and errs[out_key] > tolerance.tol(out_pt.dtype, out_pt.point, out_pt.key))
    for p in (points[i] for i in sorted(where[k] for k in errs if k in where)):
        e = errs.get(p.key)
        if e is None or p.status == NOT_COMPARABLE:
            continue
        if is_ids(p.point):
            how = (w.flips or {}).get(str(p.layer))
            if how is None:
                continue
            unexpl = how == "unexplained" or bool((p.routing or {}).get("router_divergent"))
            facts = FlipFacts(1, int(unexpl), int(not unexpl and out_over), accept)
            j = judge(1.0, 0.0, 0.0, tolerance.growth, "ids", flips=facts)
        else:
            ie = max((prev[k] for k in p.inputs if k in prev), default=0.0)
            if p.key in (w.inherited or {}):   # measured where the op acts (a log-softmax, a norm's gain)
                ie = _n(w.inherited[p.key])
            if is_routed(p.point) and str(p.layer) in flipped_layers:
                ie = math.inf              # this token ran other experts in this layer: inherited, not born here
            j = judge(e, ie, p.tol if p.tol is not None else 0.0, tolerance.growth, nonfinite=math.isinf(e),
                      unit=unit_of(p.point))
            prev[p.key] = _n(w.carried[p.key]) if p.key in (w.carried or {}) else e   # a mixture passes its own
        if j.status == DIVERGENT:
            return p.key
    return None


def _layer_summary(r: dict) -> dict:
    keys = ("rows", "k", "k_b", "flipped", "near_tie", "unexplained", "near_tie_to_output", "router_divergent",
            "set_agreement", "dlogprob_share", "accepted")
    return {k: r.get(k) for k in keys}


def _findings(p: Point) -> list[Finding]:
    """A point's findings: an accepted replay finding (not counted) first, then the one that judges it."""
    out = [_replay_finding(p)] if (p.replay or {}).get("accepted") else []
    f = _finding(p)
    return out + [f] if f is not None else out


def _finding(p: Point) -> Finding | None:
    if p.status == DIVERGENT and p.cause in (INTRINSIC, PRECISION):
        return _replay_finding(p)
    if is_ids(p.point):
        r = p.routing or {}
        if not r.get("flipped"):
            return None
        return _routing_finding(p, r)
    rows = _rows_detail(p)
    row = next((r for r in p.worst_rows or [] if r.get("row") == p.decided_by_row), None)
    if p.status == DIVERGENT and p.cause == OPERATOR:
        rel = "relative error" + (" (against the value rows it mixes)" if unit_of(p.point) == "mixture" else "")
        if unit_of(p.point) == "nats":
            head = _nats_head(p, row, rows)
        elif row is not None:
            ie = num(row.get("input_error"))
            grew = ("its own inputs agree exactly" if ie == 0 else
                    f"{_g(num(row.get('growth')))} its own inputs' {_f(ie)}")
            head = (f"{p.key}: token {row['row']}'s {rel} {_f(num(row.get('error')))} over tolerance "
                    f"{_f(p.tol)}, {grew} ({len(rows['rows'])} divergent row(s) among the worst shown; over all "
                    f"{p.rows} rows {_f(p.error)})")
        else:
            head = (f"{p.key}: {rel} {_f(p.error)} over tolerance {_f(p.tol)}, {_g(p.growth)} its "
                    f"inputs' {_f(p.input_error)}" + _worst_text(p))
        return Finding(OPERATOR, p.key, p.layer, True, True,
                       head + ": the operator(s) between this point's inputs and its output compute differently",
                       "compare the dispatcher ops of both sides in this region (first differing op below)", rows)
    if p.status == DIVERGENT and p.cause == NONFINITE:
        if row is not None:
            head = f"{p.key}: token {row['row']} NaN/Inf on one side only, its own inputs finite"
        else:
            head = f"{p.key}: {p.nonfinite} element(s) NaN/Inf on one side only, its inputs finite" + _worst_text(p)
        return Finding(NONFINITE, p.key, p.layer, True, True, head,
                       "look for an overflow (a dtype too narrow), a division by zero or uninitialised memory "
                       "in this region", {"nonfinite": p.nonfinite, **rows})
    return None


def _rows_detail(p: Point) -> dict:
    """A finding's rows: the divergent ones among the worst rows (`rows`) and every worst row kept."""
    shown = list(p.worst_rows or [])
    return {"rows": [r for r in shown if r.get("status") == DIVERGENT], "worst_rows": shown}


def _worst_text(p: Point) -> str:
    r = (p.worst_rows or [None])[0]
    if r is None:
        return ""
    return f"; worst token {r['row']}: {_f(num(r.get('error')))} ({_g(num(r.get('growth')))} its own inputs')"


def _nats_head(p: Point, row: dict | None, rows: dict) -> str:
    """An operator finding at a point judged in nats (the log-probs; docs/report.md, "Units")."""
    e, ie = (num(row.get("error")), num(row.get("input_error"))) if row is not None else (p.error, p.input_error)
    who = f"token {row['row']}'s" if row is not None else "the rows'"
    return (f"{p.key}: {who} |Δ| {_f(e)} nats, over tolerance {_f(p.tol)} nats and over the {_f(ie)} nats that "
            "its inputs' difference implies through the exact op plus a clean implementation's rounding"
            + (f" ({len(rows['rows'])} divergent row(s) among the worst shown; over all {p.rows} rows "
               f"{_f(p.error)} nats)" if row is not None else _worst_text(p)))


def _side_numbers(e: dict | None) -> str:
    """One side's intrinsic error in a line: excess vs limit, ULPs, share correctly rounded, relative L2."""
    if not isinstance(e, dict):
        return "not replayed"
    if "not_replayed" in e:
        return f"not replayed ({e['not_replayed']})"
    dt = e.get("dtype") + (f" in a {e['recorded_dtype']} record" if e.get("recorded_dtype") else "")
    if e.get("kind") == "ids":
        return f"{dt}: top-k equals the exact choice in {100 * (num(e.get('share_rounded')) or 0):.1f}% of rows"
    limit = num(e.get("limit"))
    lim = f" (limit {limit:.2f})" if limit is not None and math.isfinite(limit) else ""
    return (f"{dt}: excess {_x(e.get('excess'))}{lim}, mean {_x(e.get('mean_ulp'), 3)} / max "
            f"{_x(e.get('max_ulp'))} ULP, {100 * (num(e.get('share_rounded')) or 0):.1f}% correctly rounded, "
            f"rel error {_f(num(e.get('rel_l2')))}"
            + (f", {e['nonfinite']} non-finite" if e.get("nonfinite") else "") + _fingerprint(e))


def _fingerprint(e: dict) -> str:
    """The implementation that reproduces this side's output (replay/variants.py), in words."""
    kind, eq = e.get("match_kind"), num(e.get("match_equal")) or 0
    if kind == "none":
        return ", matches no known implementation"
    if kind not in ("clean", "fault") or not isinstance(e.get("match_what"), str):
        return ""
    return (f", matches *{e['match_what']}*" + (" (a known precision fault)" if kind == "fault" else "")
            + f" (bit-equal {100 * eq:.0f}%)")


def _x(v, digits: int = 2) -> str:
    v = num(v)
    return "-" if v is None else ("inf" if math.isinf(v) else f"{v:.{digits}f}")


def _replay_finding(p: Point) -> Finding:
    """A point where one side's op is the less exact one (intrinsic) or runs in a coarser dtype (precision)."""
    r, i = p.replay or {}, p.intrinsic or {}
    side, accepted = r.get("side"), r.get("accepted")
    cause = PRECISION if r.get("kind") == PRECISION else INTRINSIC
    ea, eb = i.get("a"), i.get("b")
    da, db = (p.dtypes or {}).get("a") or (ea or {}).get("dtype"), (p.dtypes or {}).get("b") or (eb or {}).get("dtype")
    coarse = _coarser_side(da, db)
    if cause == PRECISION:
        head = (f"{p.key}: A computes it in {da}, B in {db}" + (f" (side {coarse} the coarser)" if coarse else "")
                + f"; side {side} is the less exact")
        remedy = ("compute this op's output in the same precision on both sides (or accept the difference "
                  "knowingly: it is a precision choice, e.g. an fp32 router or lm_head on one side only)")
    else:
        head = f"{p.key}: side {side}'s op is further from the exact op on its own inputs than clean implementations are"
        remedy = (f"side {side}'s implementation of this op rounds more (or computes something else) than a "
                  "clean one: compare its kernel with the other side's (fp32 upcast in norms and softmax, "
                  "accumulation dtype, weights); `tic-trace replay` measures one side alone")
    measured = ea is not None or eb is not None
    summary = head + ((f" — A {_side_numbers(ea)}; B {_side_numbers(eb)}" if measured
                       else " (by recorded dtype; --reference measures each side against the exact op)"))
    detail = {"side": side, "kind": r.get("kind"), "reason": r.get("reason"), "a": ea, "b": eb,
              "dtypes": p.dtypes, "coarser": coarse}
    if accepted:
        summary += (f"; accepted (--accept-precision {accepted}): shown, not counted, the A-B rule judges this "
                    f"point ({p.status})")
        detail["accepted"] = accepted
    return Finding(cause, p.key, p.layer, not accepted, True, summary, remedy, detail)


def _coarser_side(da, db) -> str | None:
    """"A" or "B": the side whose dtype has fewer mantissa bits (None: the same, or unknown)."""
    if not (isinstance(da, str) and isinstance(db, str)) or da == db or not (known_dtype(da) and known_dtype(db)):
        return None
    return "A" if coarser(da, db) == da else "B"


def _with_weights(findings: list[Finding], contract: list[dict]) -> list[Finding]:
    """Findings plus one `weights` finding per point whose parameters differ (side vs side, or a side vs the
    checkpoint), in dataflow order; at one point the measured finding comes first."""
    by_key: dict[str, dict] = {}
    for d in contract:
        if d.get("section") != "weights":
            continue
        w = by_key.setdefault(d.get("key"), {"names": set(), "sides": set()})
        w["names"].update(d.get("a") or [])
        if d.get("against") == "checkpoint" and d.get("side"):
            w["sides"].add(d["side"])
    if not by_key:
        return findings
    extra = []
    for key, w in by_key.items():
        point, layer = parse_key(key)
        who = (f"; side {' and '.join(sorted(w['sides']))} differ(s) from the checkpoint" if w["sides"] else "")
        # shown, not counted: hashes compare storage bits, and a layout the adapters do not see (a TP shard,
        # a fused or re-packed parameter) changes them without changing what is computed. The tensors and the
        # replay (which blames the side whose output is off the checkpoint's op) decide the verdict.
        extra.append(Finding(WEIGHTS, key, layer, False, True,
                             f"{key}: parameters differ bit for bit: {', '.join(sorted(w['names'])[:6])}{who}",
                             "push the trainer's weights to the engine again (a weight-sync bug) or load the same "
                             "checkpoint on both sides", {"parameters": sorted(w["names"]), "sides": sorted(w["sides"])}))
    rank = {WEIGHTS: 1}
    return sorted(findings + extra, key=lambda f: (order_key(*parse_key(f.key)), rank.get(f.cause, 0)))


def _routing_finding(p: Point, r: dict) -> Finding:
    router_div = bool(r.get("router_divergent"))
    key = r.get("router_key") if router_div and r.get("router_key") else p.key
    flipped, rows = r.get("flipped"), r.get("rows")
    near, unexpl, reach = r.get("near_tie") or 0, r.get("unexplained") or 0, r.get("near_tie_to_output") or 0
    parts = [f"layer {p.layer}: {flipped} of {rows} tokens chose other experts"]
    if r.get("k_b") not in (None, r.get("k")):
        parts.append(f"side A selects {r.get('k')} experts per token, side B {r.get('k_b')}: the top-k setting "
                     "differs, so every flip is computational")
    elif router_div:
        parts.append(f"the router logits diverge at {r.get('router_key')}, so every flip is computational")
    elif not r.get("router_key"):
        parts.append("the router logits were not compared, so no margin is known: every flip counts as "
                     "computational")
    else:
        space = r.get("margin_space") or "logits"
        what = "router-logit" if space == "logits" else f"choice-score ({space})"
        parts.append(f"{near} on near ties ({what} margin within twice the error the token's router-logit error "
                     f"makes of it), {unexpl} with a larger margin")
        if r.get("router_status") == OVER:
            parts.append(f"the router-logit error is inherited from upstream ({r.get('router_key')} is over "
                         "tolerance without a jump): these flips follow an earlier difference")
        if near:
            parts.append(f"{reach} near-tie token(s) carry error over tolerance to the output")
    share = r.get("dlogprob_share")
    if share is not None:
        parts.append(f"flipped tokens carry {100 * share:.0f}% of the final |Δ logprob|")
    if r.get("accepted"):
        parts.append("near ties accepted (--accept-near-tie-routing)")
    remedy = ROUTER_REMEDY if (router_div or unexpl) else NEAR_TIE_REMEDY
    detail = {k: r.get(k) for k in ("rows", "k", "k_b", "flipped", "near_tie", "unexplained",
                                    "near_tie_to_output", "router_divergent", "dlogprob_share", "margin_space",
                                    "flips")}
    return Finding(ROUTING, key, p.layer, p.status == DIVERGENT, bool(router_div or unexpl), "; ".join(parts),
                   remedy, detail)


def _both_over_envelope(points: list[Point], min_numel: int = 32) -> Note | None:
    """Points where both sides are over their clean envelope and the rule blames neither (they are alike):
    both compute the op less exactly than clean implementations (one precision choice shared by both), or
    the checkpoint's config does not describe what they compute (a feature the replay does not model). The
    replay cannot tell a fault there from either; said, never hidden under "consistent"."""
    out = {}
    for p in points:
        ea, eb = ((p.intrinsic or {}).get(s) for s in ("a", "b"))
        if (p.replay or {}).get("side") or not (isinstance(ea, dict) and isinstance(eb, dict)):
            continue
        over = [e for e in (ea, eb) if e.get("kind") == "float" and (num(e.get("numel")) or 0) >= min_numel
                and num(e.get("limit")) is not None and (num(e.get("excess")) or 0) > num(e.get("limit"))]
        if len(over) == 2:
            out[p.key] = {"a": num(ea.get("excess")), "b": num(eb.get("excess")), "limit": num(ea.get("limit"))}
    if not out:
        return None
    shown = "; ".join(f"{k} (A {_x(v['a'])}, B {_x(v['b'])}, limit {_x(v['limit'])})" for k, v in list(out.items())[:4])
    return Note("both_over_envelope", f"{len(out)} point(s) where both sides are over the clean envelope alike, "
                f"so the replay blames neither: {shown}" + (" …" if len(out) > 4 else "") + ". Either both run "
                "the same imprecise op, or the checkpoint's config does not describe what they compute (check "
                "it is the one both ran, and that the architecture's features are in docs/replay.md)",
                {"points": out})


def _carried_notes(points: list[Point]) -> Note | None:
    """Points whose A-B jump the replay found to be no fault of the op (`_carried`): said, never hidden."""
    out = [p for p in points if (p.replay or {}).get("carried")]
    if not out:
        return None
    shown = ", ".join(f"{p.key} ({_f(p.error)}" + (f", {_x(p.growth, 1)}x its inputs')" if p.input_error else
                                                   ", inputs identical)") for p in out[:4])
    return Note("carried", f"{len(out)} point(s) where A and B differ by more than the A-B rule allows, yet each "
                f"side computes the op as exactly as clean implementations do on its own inputs: {shown}"
                + (" …" if len(out) > 4 else "") + ". An ill-conditioned op (attention over large scores, a norm "
                "over a massive row) carries its inputs' difference and the two sides' clean roundings (eager vs "
                "fused attention); not a divergence here", {"points": [p.key for p in out]})


def _accumulated_noise(points: list[Point], findings: list[Finding]) -> Note | None:
    """Points over tolerance with no jump before them: noise that accumulated along the graph."""
    stop = next((f.key for f in findings if f.divergent and f.computational), None)
    over = []
    for p in points:
        if p.key == stop:
            break
        if p.status == OVER and not is_ids(p.point):
            over.append(p)
    if not over:
        return None
    curve = [[p.key, p.error] for p in points if p.point == RESIDUAL or p.layer is None]
    same_unit = [p for p in over if unit_of(p.point) != "nats"] or over   # not the log-probs' nats
    largest = max(same_unit, key=lambda p: p.error if p.error is not None else -1)
    text = (f"{len(over)} point(s) over tolerance without a jump anywhere before them (first {over[0].key}, "
            f"largest {largest.key} at {_f(largest.error)}): below-tolerance noise accumulated along the graph, "
            "what a clean low-precision pair looks like; not a divergence")
    order = [p.key for p in points]
    flips = [f.key for f in findings if f.cause == ROUTING]
    if flips and order.index(flips[0]) < order.index(over[-1].key):
        text += f"; points after {flips[0]} also carry the error of the tokens whose experts flipped"
    return Note("accumulated_noise", text, {"points": [p.key for p in over], "curve": curve})


def _f(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.2e}" if x else "0"


def _g(x) -> str:
    if x is None:
        return "-"
    return "∞×" if math.isinf(x) else f"{x:.1f}×"
