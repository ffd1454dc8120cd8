"""The first-divergence finder: measure every canonical point, judge them in dataflow order, name the causes.

Steps (each its own function, the rule in one place):
1. MEASURE  `measure.measure_point` per canonical point both sides have (self-contained, picklable);
2. FACTS    the error each point inherits from its inputs, routed points judged without the tokens whose
            experts flipped, the routing facts of each MoE layer (margins, router-logit errors, what the
            flipped tokens carry to the output), the worst tokens' per-token errors;
3. JUDGE    `verdict.assess`: the one judge (`judge.judge`) per point and per token, the findings (causes),
            the accumulated-noise note and the verdict;
4. REPORT   the typed report (`report.schema.Report`), with the ops of the first divergence paired once.

`rejudge` re-runs step 3 on a saved report: with the settings it was made with, it reproduces it exactly.
"""
from __future__ import annotations

import math
from typing import Callable

from ..graph.canonical import (BY_NAME, LOGPROBS, OUTPUT_POINTS, ROUTER_LOGITS, feeds_of, is_ids, is_routed,
                               key_name, order_key, parse_key)
from .coverage import build as build_coverage
from ..report.schema import (ARCHITECTURE_NOTE, SCHEMA_ID, FirstDivergence, Note, OpsRegion, Point, Report,  # noqa: F401
                             WorstToken)
from ..view.align import CanonicalView, RowId, common_points
from ..view.model_facts import shown_model_facts
from ..view.rows import row_identity
from .judge import DEFAULT_TOL, SettingsError, Tolerance, check_accept_precision, coarser  # noqa: F401 - public names
from .measure import PointMeasurement, measure_point, subset_error
from .measure_workers import measure_all
from .row_errors import RowErrors, row_label as _label
from .shares import attribution_of, check_attribution_tokens, recredited
from .identity_notes import incomplete_run_notes, layers_text, with_incomplete_runs
from .used_logprob_stage import judge_used_logprobs
from .verdict import Assessment, assess

REPORT_SCHEMA = SCHEMA_ID
FLIPS_SHOWN = 64          # flips listed per layer in the report (the counts cover all of them)


def find_divergence(a: CanonicalView | str, b: CanonicalView | str, *, tolerance: Tolerance | None = None,
                    worst_tokens: int = 8, progress: Callable[[str], None] | None = None,
                    accept_near_tie: bool = False, reference=None, margins=None, workers: int = 1,
                    backend: str = "processes", allow_unverified: bool = False,
                    accept_precision=(), attribution: bool = False, attribution_tokens: int | None = None) -> Report:
    """Compare side B against reference side A over every canonical point both have.

    A side whose architecture is not in its adapter's table (`Adapter.check_architecture`) is refused before
    any tensor is read: verdict `not_comparable` (exit 3), the architecture named in an `unverified_mapping`
    note. `allow_unverified=True` compares it anyway, with that note in the report (docs/adapters.md).

    `reference` (an HF checkpoint directory or an `ExactReference`): every point is also replayed exactly
    from each side's own inputs (docs/replay.md); a side whose op is less exact than clean implementations
    (or that computes in a coarser dtype) is named, and the first such point leads the report. The checkpoint
    is checked first (`contract.check_reference`): one that is not the traces' model or weights raises
    `checkpoint.ReferenceMismatch` (the CLI: not comparable, exit 3).
    `accept_precision` (point names or keys: `["moe.topk_weights"]`): a precision difference the user
    accepts at those points is listed as accepted and does not decide the verdict (docs/report.md); unknown
    names raise `SettingsError`.
    `attribution=True` (needs `reference`): which difference explains how much of the log-prob gap, by
    first-order propagation through the exact model (`replay.attribution`; docs/attribution.md), at most
    `attribution_tokens` tokens (worst samples first); each finding carries its `share`.
    `workers` > 1 measures the points in that many processes (`backend="ray"`: Ray tasks); the report is
    the same."""
    va = a if isinstance(a, CanonicalView) else CanonicalView(a)
    vb = b if isinstance(b, CanonicalView) else CanonicalView(b)
    tol = tolerance or Tolerance()
    accept = check_accept_precision(accept_precision)
    check_attribution_tokens(attribution_tokens)       # a bad budget is refused before any work
    checks = {"a": va.adapter.check_architecture(va.config), "b": vb.adapter.check_architecture(vb.config)}
    arch_notes = architecture_notes(checks, allow_unverified)
    if arch_notes and not allow_unverified:
        return _refused(va, vb, checks, arch_notes, tol, accept_near_tie, margins, accept)
    ref = _reference(reference)
    if attribution and ref is None:
        raise SettingsError("attribution needs the exact model: give the reference checkpoint (--reference)")
    if ref is not None:       # a checkpoint that is not the traces' model or weights: not comparable, raised
        from .contract import check_reference
        check_reference(ref.ckpt, {"A": va, "B": vb})
    contract = diff_contract_json(va, vb, ref)         # before any tensor
    both, only_a, only_b = common_points(va, vb)
    identity = row_identity(va, vb)                    # before any tensor too: the row tables only
    structure, after_layers = _structure(va, vb, both)
    both = [k for k in both if k not in after_layers]
    measured = measure_all(va, vb, both, workers=workers, backend=backend, progress=progress)
    kept = [m for m in measured if m.compared or not m.derived]
    n_layers = min(va.n_layers, vb.n_layers) if "layers" in structure else va.n_layers or vb.n_layers
    points = build_points(kept, n_layers)
    if ref is not None:
        add_replay_facts(points, va, vb, ref, margins, progress, measured=kept)
    worst, token_errors = _worst_tokens(kept, worst_tokens)
    routing = _routing_summary(kept)
    matched = set().union(*(m.rows for m in kept)) if kept else set()
    rows = {"a": va.rows_total, "b": vb.rows_total, "matched": len(matched), **identity.counts()}
    ident = identity.to_json()
    sides = {"a": _side(va, checks["a"]), "b": _side(vb, checks["b"])}
    incomplete = incomplete_run_notes(sides)
    verdict = with_incomplete_runs(assess(points, tol, accept_near_tie=accept_near_tie, worst_tokens=worst,
                                          token_errors=token_errors, routing=routing, contract=contract,
                                          margins=margins, rows=rows, identity=ident, structure=structure,
                                          accept_precision=accept),
                                   incomplete)
    first = _first_divergence(verdict, points, lambda p: _ops_in_region(va, vb, p, set(both), n_layers))
    not_comparable = [{"key": "run", "reason": n.summary} for n in incomplete]
    not_comparable += _not_comparable(va, vb, only_a, only_b, measured)
    if "layers" in structure:
        la, lb = structure["layers"]["a"], structure["layers"]["b"]
        not_comparable += [{"key": key_name(*k), "reason": f"{layers_text(la, lb)}: {key_name(*k)} follows the "
                            "last layer, another layer on each side"} for k in after_layers]
    att = attribution_of(va, vb, ref, verdict.findings, attribution_tokens, progress) if attribution else None
    return Report(
        verdict=verdict.verdict, first=first, findings=verdict.findings, notes=arch_notes + verdict.notes,
        points=points, not_comparable=not_comparable, rows=rows,
        worst_tokens=worst, routing=routing,
        settings={**_settings(tol, accept_near_tie, margins, ref, accept), "allow_unverified": bool(allow_unverified)},
        sides=sides, token_errors=token_errors,
        contract=contract, structure=structure, identity=ident, attribution=att,
        coverage=build_coverage(points, not_comparable, rows, only_a=[key_name(*k) for k in only_a],
                                only_b=[key_name(*k) for k in only_b], replayed=ref is not None, attribution=att,
                                attribution_budget=_budget(attribution_tokens) if attribution else None))


def _budget(tokens: int | None) -> int:
    from ..replay.attribution import DEFAULT_TOKENS
    return DEFAULT_TOKENS if tokens is None else tokens


def _structure(va: CanonicalView, vb: CanonicalView, both: list) -> tuple[dict, list]:
    """Structural differences between the two models ({} when none), and the points both record that they
    make incomparable. Another number of layers: the global points after the layers (final norm, logits,
    log-probs) read the last layer's output, which is a different layer on each side; judged, a final norm
    whose inputs "agree" would be blamed for the missing layer."""
    out: dict = {}
    after: list = []
    la, lb = va.n_layers, vb.n_layers
    if la and lb and la != lb:
        after = [k for k in both if k[1] is None and BY_NAME.get(k[0]) is not None and BY_NAME[k[0]].head is not None]
        out["layers"] = {"a": int(la), "b": int(lb)}
    # Another number of routed experts is another model too (the router's rows differ in width, and what the
    # experts compute is split differently). Only two stated MoE counts are compared: 0 is also what an adapter
    # says of a config field it does not read, and a dense side already lacks every moe.* point (listed).
    ea, eb = va.config.get("num_experts"), vb.config.get("num_experts")
    if isinstance(ea, int) and isinstance(eb, int) and ea > 0 and eb > 0 and ea != eb:
        out["experts"] = {"a": int(ea), "b": int(eb)}
    return out, after



# ------------------------------------------------------------------------------------------------ architectures

def architecture_notes(checks: dict, allowed: bool) -> list[Note]:
    """One `unverified_mapping` note per side whose architecture its adapter's table does not map: refused
    (`allowed` False) or compared anyway, said either way."""
    out = []
    for side, c in checks.items():
        if c.verified:
            continue
        who = f"side {side.upper()}: {c.name or 'an unnamed architecture'} ({c.adapter} adapter) — {c.why}"
        if allowed:
            summary = (f"UNVERIFIED MAPPING of {who}. Compared anyway (--allow-unverified): any point below "
                       "may be another op than its name says")
        else:
            summary = (f"{who}. Not compared (an unverified table may put a record at the wrong point); "
                       "--allow-unverified compares it anyway, marked unverified")
        out.append(Note(ARCHITECTURE_NOTE, summary, {"side": side, "adapter": c.adapter, "architecture": c.name,
                                                     "why": c.why, "refused": not allowed}))
    return out


def _refused(va: CanonicalView, vb: CanonicalView, checks: dict, notes: list[Note], tol: Tolerance,
             accept_near_tie: bool, margins, accept: tuple[str, ...] = ()) -> Report:
    """The report of a pair refused for an unverified architecture: nothing measured, the contract read from
    the manifests only (versions, config, numerics: point dtypes and weights hang on the mapping)."""
    contract = [d for d in diff_contract_json(va, vb, None) if d["section"] in ("version", "config", "numerics")]
    return Report(
        verdict="not_comparable", first=None, findings=[], notes=notes, points=[],
        not_comparable=[{"key": "architecture", "reason": f"side {n.detail['side'].upper()}: "
                         f"{n.detail['architecture'] or 'unnamed'} is not an architecture the {n.detail['adapter']} "
                         "adapter's table maps (note above)"} for n in notes],
        rows={"a": va.rows_total, "b": vb.rows_total, "matched": 0}, worst_tokens=[], routing=_routing_summary([]),
        settings={**_settings(tol, accept_near_tie, margins, None, accept), "allow_unverified": False},
        sides={"a": _side(va, checks["a"]), "b": _side(vb, checks["b"])}, contract=contract)


# ------------------------------------------------------------------------------------------------ contract, replay

def _reference(reference):
    """An ExactReference from a checkpoint directory (or None / an ExactReference as given)."""
    if reference is None:
        return None
    from ..replay.reference import ExactReference
    return reference if isinstance(reference, ExactReference) else ExactReference(str(reference))


def diff_contract_json(va: CanonicalView, vb: CanonicalView, ref) -> list[dict]:
    """The contract differences (contract.diff_contract) as report dicts; manifests and headers only."""
    from dataclasses import asdict

    from .contract import diff_contract
    return [asdict(d) for d in diff_contract(va, vb, ref.ckpt if ref is not None else None)]


def add_replay_facts(points: list[Point], va: CanonicalView, vb: CanonicalView, ref, margins=None,
                     progress: Callable[[str], None] | None = None,
                     measured: list[PointMeasurement] | None = None) -> None:
    """Each point's intrinsic error on each side (the side's output against the exact op on its own
    inputs), saved in the point for the judge (`judge.judge_replay`) and for `rejudge`; on the rows the judge
    needs, the same on both sides (replay_rows.py: chosen by the A-B errors of `measured`, and the rows' size)."""
    from ..replay.intrinsic import SideReplayer
    from ..replay.replay_rows import RowSampler
    from .judge import encode_intrinsic
    ra, rb = SideReplayer(va, ref), SideReplayer(vb, ref)
    sampler = RowSampler(ra, rb, measured)
    for p in points:
        if progress:
            progress(f"replay {p.key}")
        s = sampler.of(p.point, p.layer)
        p.intrinsic = {"a": encode_intrinsic(ra.replay(p.point, p.layer, s), margins),
                       "b": encode_intrinsic(rb.replay(p.point, p.layer, s), margins)}


# ------------------------------------------------------------------------------------------------ step 2

def build_points(measured: list[PointMeasurement], n_layers: int | None) -> list[Point]:
    """Report points (dataflow order) from measurements: inherited errors, routed points judged without the
    layer's flipped tokens, routing facts. Nothing here depends on the tolerance."""
    by = {(m.point, m.layer): m for m in measured}
    # A feed that was not compared (rows of another shape, no rows in common, statistics that cannot be
    # compared) is resolved to its own feeds, up to compared ones, as a feed with no record is: dropping it
    # would make the inputs look as if they agree exactly, and a difference born at or before it would be
    # blamed on this point's operator.
    compared = {k for k, m in by.items() if m.compared}
    flipped_at = {m.layer: set(m.flipped) for m in measured if is_ids(m.point) and m.flipped}
    outputs = _output_rows(measured)
    dlogprob = _dlogprob(measured)
    carried: dict[tuple, float] = {}       # error passed downstream: over every row
    judged: dict[tuple, float] = {}        # error judged: routed points without the flipped tokens
    row_errors = RowErrors()              # per-row errors passed downstream
    points = []
    for m in measured:
        p = Point(m.key, m.point, m.layer, error=m.error, dtype=m.dtype, rows=len(m.rows), only_a=m.only_a,
                  only_b=m.only_b, metrics=m.metrics, stats=m.stats, reason=m.reason, sources=m.sources,
                  nonfinite=m.nonfinite, carried_error=m.carried_error, dtypes=m.dtypes)
        feeds = feeds_of(m.point, m.layer, compared, n_layers)
        p.inputs = [key_name(*f) for f in feeds]
        ins = [(judged if is_routed(m.point) and is_routed(f[0]) and f[1] == m.layer else carried)[f]
               for f in feeds if not is_ids(f[0]) and f in carried]
        p.input_error = max(ins, default=0.0)
        flips = flipped_at.get(m.layer, set()) if m.layer is not None else set()
        if is_routed(m.point) and flips and m.compared:
            p.error_all_rows = m.error
            p.error = subset_error(m, flips)
            if p.error is None:
                p.error, p.input_error = m.error, math.inf
                p.reason = "every token chose other experts in this layer: its error is inherited from the flips"
            else:
                p.reason = f"judged without the {len(flips & set(m.rows))} token(s) whose experts flipped in this layer"
        if is_ids(m.point) and m.routing is not None:
            p.routing = _routing_facts(m, by.get((ROUTER_LOGITS, m.layer)), outputs, dlogprob)
        if m.compared and not is_ids(m.point) and row_errors.has(m):
            p.worst_rows, rows_in = row_errors.worst(m, feeds, carried, flips if is_routed(m.point) else set())
            if rows_in is not None and not math.isinf(p.input_error):
                p.input_error = rows_in     # row-relative, as the error is (docs/report.md)
            row_errors.add(m)
        if m.compared:
            carried[(m.point, m.layer)] = m.carried_error
            judged[(m.point, m.layer)] = p.error
        points.append(p)
    return points


def _output_rows(measured: list[PointMeasurement]) -> list[tuple[str, dict]]:
    """Per-row errors of the output points (log-probs, logits, final norm), best first."""
    by = {m.key: m for m in measured if m.compared and len(m.per_row)}
    return [(k, dict(zip(by[k].rows, by[k].per_row.tolist()))) for k in OUTPUT_POINTS if k in by]


def _dlogprob(measured: list[PointMeasurement]) -> dict:
    lp = next((m for m in measured if m.point == LOGPROBS and m.compared and len(m.per_row_abs)), None)
    return dict(zip(lp.rows, lp.per_row_abs.tolist())) if lp else {}


def flip_margins(m: PointMeasurement, router: PointMeasurement | None) -> list[tuple[RowId, float, float, bool]]:
    """Per flipped token of an ids point: (row, top-k margin of side A's choice scores, the error that token's
    router-logit error makes of a choice score, explained). The scores are those the router's top-k compares
    (compare/choice.py: the logits of a softmax router; sigmoid + selection bias, inside the kept groups, of a
    DeepSeek-style one). A flip is *explained* when its margin, or its group margin, is within twice the
    error; without router logits the margin is unknown (NaN) and the flip is not explained."""
    k = int(m.routing["k"])
    if m.routing.get("k_b") not in (None, k):       # another top-k on side B: no margin explains that
        return [(row, math.nan, math.nan, False) for row in m.flipped]
    rix = {r: i for i, r in enumerate(router.rows)} if router is not None and router.router_top else {}
    out = []
    for row in m.flipped:
        margin = err = math.nan
        i = rix.get(row)
        if i is not None and len(router.router_top[i]) > k:
            top = router.router_top[i]
            margin = top[k - 1] - top[k]
            err = float(router.router_score_error[i])
            if router.router_group_margin is not None:
                margin = min(margin, float(router.router_group_margin[i]))
        out.append((row, margin, err, bool(margin <= 2.0 * err)))
    return out


def _routing_facts(m: PointMeasurement, router: PointMeasurement | None, outputs: list, dlogprob: dict) -> dict:
    """Each flip's margin against the error its router-logit error makes of a choice score, and the error the
    flipped token carries to the output (the first output point that has its row)."""
    flips, explained_outputs = [], []
    for row, margin, logit_err, explained in flip_margins(m, router):
        out_key, out_err = next(((key, rows[row]) for key, rows in outputs if row in rows), (None, None))
        flips.append({"row": _label(row), "margin": margin, "logit_error": logit_err, "explained": explained,
                      "output": out_key, "output_error": out_err, "abs_dlogprob": dlogprob.get(row)})
        if explained:
            explained_outputs.append([out_key, out_err])
    total = sum(v for v in dlogprob.values() if math.isfinite(v))
    share = (sum(dlogprob.get(r, 0.0) for r in set(m.flipped) if math.isfinite(dlogprob.get(r, 0.0))) / total
             if total > 0 else None)
    has_router = router is not None and bool(router.router_top)
    return {**m.routing, "router_key": key_name(ROUTER_LOGITS, m.layer) if has_router else None,
            "margin_space": router.router_space if has_router else None,
            "explained": len(explained_outputs), "explained_outputs": explained_outputs,
            "flips": flips[:FLIPS_SHOWN], "dlogprob_share": share}


def _routing_summary(measured: list[PointMeasurement]) -> dict:
    flipped: set = set()
    for m in measured:
        if is_ids(m.point):
            flipped |= set(m.flipped)
    rows = set().union(*(m.rows for m in measured if is_ids(m.point))) if flipped else set()
    dl = _dlogprob(measured)
    total = sum(v for v in dl.values() if math.isfinite(v))
    carried = sum(dl.get(r, 0.0) for r in flipped if math.isfinite(dl.get(r, 0.0)))
    return {"layers": {}, "tokens_with_flip": len(flipped), "share_tokens_with_flip": len(flipped) / max(len(rows), 1),
            "dlogprob_share": carried / total if total > 0 and flipped else None}


def _worst_tokens(measured: list[PointMeasurement], n: int) -> tuple[list[WorstToken], dict]:
    """The tokens with the largest |Δ logprob|, and their per-token error at every point."""
    lp = next((m for m in measured if m.point == LOGPROBS and m.compared and m.values_a is not None), None)
    if lp is None or n <= 0:
        return [], {}
    d = [abs(x - y) if not (math.isnan(x) and math.isnan(y)) else 0.0 for x, y in zip(lp.values_a, lp.values_b)]
    order = sorted(range(len(d)), key=lambda i: (-d[i] if not math.isnan(d[i]) else -math.inf, i))[:n]
    rows = [lp.rows[i] for i in order]
    want = set(rows)
    errs: dict[RowId, dict] = {r: {} for r in rows}
    flips: dict[RowId, dict] = {r: {} for r in rows}
    inherited: dict[RowId, dict] = {r: {} for r in rows}
    carried: dict[RowId, dict] = {r: {} for r in rows}
    where: dict[tuple, dict] = {}      # the wanted rows' positions, per distinct row list (most points share one)
    for m in measured:
        if not m.compared or not m.rows:
            continue
        key = tuple(m.rows)
        pos = where.get(key)
        if pos is None:
            pos = where[key] = {r: i for i, r in enumerate(m.rows) if r in want}
        if is_ids(m.point):
            fl = set(m.flipped)
            for r in pos:
                errs[r][m.key] = 1.0 if r in fl else 0.0
            continue
        for r, i in pos.items():
            errs[r][m.key] = float(m.per_row[i])
            if m.row_inherited is not None:
                inherited[r][m.key] = float(m.row_inherited[i])
            if m.per_row_carried is not None:
                carried[r][m.key] = float(m.per_row_carried[i])
    routers = {m.layer: m for m in measured if m.point == ROUTER_LOGITS}
    for m in measured:
        if is_ids(m.point) and m.flipped:
            for row, _, _, explained in flip_margins(m, routers.get(m.layer)):
                if row in want:
                    flips[row][str(m.layer)] = "explained" if explained else "unexplained"
    out = [WorstToken(r[0], int(r[1]), d[i], lp.values_a[i], lp.values_b[i], None, bool(flips[r]), flips[r],
                      inherited[r], carried[r]) for i, r in zip(order, rows)]
    return out, {_label(r): errs[r] for r in rows}


# ------------------------------------------------------------------------------------------------ step 4

def _first_divergence(v: Assessment, points: list[Point], ops_of: Callable[[Point], OpsRegion] | None,
                      old: FirstDivergence | None = None) -> FirstDivergence | None:
    if v.first is None:
        return None
    p = next(p for p in points if p.key == v.first.key)
    fd = FirstDivergence(**{k: getattr(p, k) for k in Point.__dataclass_fields__})
    fd.cause, fd.summary = v.first.cause, v.first.summary
    if ops_of is not None:
        fd.ops = ops_of(p)
    elif old is not None and old.key == p.key:
        fd.ops = old.ops
    return fd


def _ops_in_region(va: CanonicalView, vb: CanonicalView, first: Point, present: set, n_layers) -> OpsRegion:
    feeds = [parse_key(k) for k in first.inputs] if first.inputs else feeds_of(first.point, first.layer, present, n_layers)
    out = {}
    for side, v in (("a", va), ("b", vb)):
        seqs = [s for s in (v.seq_of(*f) for f in feeds) if s is not None]
        ops = v.ops_between(first.point, first.layer, max(seqs) if seqs else None)
        out[side] = [{"name": r.name, "op": r.op, "dtype": r.dtype, "shape": list(r.shape),
                      "rms": math.sqrt(r.stats["sumsq"] / max(r.stats["count"], 1)) if r.stats else None,
                      "absmax": r.stats["absmax"] if r.stats else None, "hash": r.hash} for r in ops[:200]]
    return OpsRegion.build(out["a"], out["b"])


def _not_comparable(va, vb, only_a, only_b, measured: list[PointMeasurement]) -> list[dict]:
    nc = [{"key": key_name(*k), "reason": f"only side A ({va.adapter.name}) produces it"} for k in only_a]
    nc += [{"key": key_name(*k), "reason": f"only side B ({vb.adapter.name}) produces it"} for k in only_b]
    for side, v in (("A", va), ("B", vb)):
        have = {p for p, _ in v.points()}
        for p in v.adapter.promised_points(v.config):
            if p not in have:
                nc.append({"key": p, "reason": f"side {side}'s adapter promises it but the trace has no record "
                                               "(module not run, filtered out, or the mapping is wrong)"})
    nc += [{"key": m.key, "reason": m.reason} for m in measured if not m.compared]
    return nc


def _settings(tol: Tolerance, accept_near_tie: bool, margins=None, ref=None, accept: tuple[str, ...] = ()) -> dict:
    from ..replay.intrinsic_verdict import DEFAULT_MARGINS
    out = {"tolerance": tol.to_json(), "accept_near_tie_routing": bool(accept_near_tie),
           "accept_precision": list(accept), "margins": (margins or DEFAULT_MARGINS).to_json()}
    if ref is not None:
        out["reference"] = {"path": str(ref.ckpt.path), "device": str(ref.device)}
    return out


def _side(v: CanonicalView, check=None) -> dict:
    m = v.trace.manifest
    check = check or v.adapter.check_architecture(v.config)
    return {"path": str(v.trace.path), "framework": v.adapter.name, "versions": m.get("versions", {}),
            "architecture": {"name": check.name, "verified": check.verified, "why": check.why},
            "model": shown_model_facts(m.get("model", {})), "ranks": v.trace.ranks,
            "unmapped_module_outputs": len(v.unmapped),
            "skipped_passes": v.skipped, "ignored_entries": v.trace.ignored, "merge_notes": dict(v.notes),
            "repeated_calls": v.repeated_calls, "run_incomplete": v.trace.incomplete_runs(),
            "tracer_notes": v.tracer_notes}


# ------------------------------------------------------------------------------------------------ rejudge

def rejudge(report: dict, tolerance: Tolerance | None = None, *, accept_near_tie: bool | None = None,
            margins=None, accept_precision=None) -> dict:
    """Re-judge a saved JSON report with new settings, without reading any tensor. With the settings it was
    made with (the default for each one not given), the result equals the report."""
    from ..replay.intrinsic_verdict import Margins
    rep = Report.from_json(report)
    saved = rep.settings or {}
    tol = tolerance if tolerance is not None else Tolerance.from_json(saved.get("tolerance"))
    accept = bool(saved.get("accept_near_tie_routing")) if accept_near_tie is None else accept_near_tie
    marg = margins if margins is not None else Margins.from_json(saved.get("margins"))
    precision = check_accept_precision(saved.get("accept_precision") or () if accept_precision is None
                                       else accept_precision)
    v = with_incomplete_runs(assess(rep.points, tol, accept_near_tie=accept, worst_tokens=rep.worst_tokens,
                                    token_errors=rep.token_errors, routing=rep.routing, contract=rep.contract,
                                    margins=marg, rows=rep.rows, identity=rep.identity, structure=rep.structure,
                                    accept_precision=precision),
                             incomplete_run_notes(rep.sides))
    rep.first = _first_divergence(v, rep.points, None, rep.first)
    kept = [n for n in rep.notes if n.kind == ARCHITECTURE_NOTE]     # a fact of the traces, not of the judge
    rep.verdict, rep.findings, rep.notes = v.verdict, v.findings, kept + v.notes
    if isinstance(rep.attribution, dict) and "unavailable" not in rep.attribution:
        rep.attribution = recredited(rep.attribution, rep.findings)
    judge_used_logprobs(rep)        # the stage after the graph: its findings come from the saved reconciliation
    new = _settings(tol, accept, marg, None, precision)
    rep.settings = {**saved, **new}
    return rep.to_json()


def sort_points(keys: list[str]) -> list[str]:
    return sorted(keys, key=lambda k: order_key(*parse_key(k)))
