"""The first-divergence finder: walk the canonical graph in dataflow order, name the first real error.

A point *diverges* when its own error is over the tolerance of its dtype **and** grew by more than
`growth` times over the largest error among the points that feed it. Errors inherited from upstream do not
count: a point that merely carries its inputs' error is "over", not "divergent". The first divergent point
in dataflow order is the answer; every point's numbers are kept so a reader sees the jump.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from .align import CanonicalView, align_rows, common_points
from .canonical import BY_NAME, feeds_of, key_name, order_key, parse_key
from .compare import compare_routing, compare_stats, compare_values
from .dtypes import dtype_info, known_dtype

REPORT_SCHEMA = "tic-trace.report/1"
# Points of a layer computed from the routing decision: judged without near-tie flipped tokens.
_ROUTED_POINTS = {"moe.topk_weights", "moe.experts_out", "mlp.out", "output"}

# Relative-L2 tolerance by dtype. One rounding to a dtype gives a relative-L2 error of about 0.3 eps, and a
# different reduction order a few times that, so one eps flags real errors while leaving ~3x headroom over
# op-order noise (errors inherited from inputs are handled by the growth rule, not by the tolerance).
# fp32 gets a floor: long reductions of different order legitimately differ by ~1e-6.
DEFAULT_TOL = {"float64": 1e-10, "float32": 1e-5, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7,
               "float8_e4m3fn": 2.0 ** -3, "float8_e4m3fnuz": 2.0 ** -3, "float8_e5m2": 2.0 ** -2,
               "float8_e5m2fnuz": 2.0 ** -2}


@dataclass
class Tolerance:
    growth: float = 10.0                          # error must grow by this factor over the inputs' error
    per_dtype: dict = field(default_factory=dict)  # overrides of DEFAULT_TOL
    per_point: dict = field(default_factory=dict)  # overrides by point name ("attn.core") or key ("L3.attn.core")

    def tol(self, dtype: str, point: str, key: str) -> float:
        if key in self.per_point:
            return float(self.per_point[key])
        if point in self.per_point:
            return float(self.per_point[point])
        if dtype in self.per_dtype:
            return float(self.per_dtype[dtype])
        if dtype in DEFAULT_TOL:
            return DEFAULT_TOL[dtype]
        if known_dtype(dtype) and dtype_info(dtype).is_float:
            return dtype_info(dtype).eps
        return 0.0

    def to_json(self) -> dict:
        return {"growth": self.growth, "per_dtype": {**DEFAULT_TOL, **self.per_dtype}, "per_point": self.per_point}


def coarser(d1: str, d2: str) -> str:
    """The dtype with fewer mantissa bits: errors are judged at the precision of the less precise side."""
    def bits(d):
        return dtype_info(d).mantissa_bits if known_dtype(d) and dtype_info(d).is_float else 64
    return d1 if bits(d1) <= bits(d2) else d2


@dataclass
class PointResult:
    key: str
    point: str
    layer: int | None
    status: str                  # ok | over | divergent | not_comparable
    error: float | None = None
    tol: float | None = None
    input_error: float | None = None
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


@dataclass
class Report:
    verdict: str                                  # consistent | divergent | not_comparable
    first: dict | None
    points: list[PointResult]
    not_comparable: list[dict]
    rows: dict
    worst_tokens: list[dict]
    routing: dict
    settings: dict
    sides: dict
    token_errors: dict = field(default_factory=dict)   # row label -> {point key: per-token error}

    @property
    def exit_code(self) -> int:
        return 1 if self.verdict == "divergent" else 0

    def to_json(self) -> dict:
        return _clean({
            "schema": REPORT_SCHEMA, "verdict": self.verdict, "first_divergence": self.first,
            "points": [asdict(p) for p in self.points], "not_comparable": self.not_comparable,
            "rows": self.rows, "worst_tokens": self.worst_tokens, "routing": self.routing,
            "settings": self.settings, "sides": self.sides, "token_errors": self.token_errors,
        })


def _clean(x):
    if isinstance(x, float):
        if math.isnan(x):
            return None
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return x
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, np.generic):
        return _clean(x.item())
    return x


def _num(x) -> float | None:
    if x == "inf":
        return math.inf
    if x == "-inf":
        return -math.inf
    return x


def find_divergence(a: CanonicalView | str, b: CanonicalView | str, *, tolerance: Tolerance | None = None,
                    worst_tokens: int = 8, progress: Callable[[str], None] | None = None) -> Report:
    """Compare side B against reference side A over every canonical point both have."""
    va = a if isinstance(a, CanonicalView) else CanonicalView(a)
    vb = b if isinstance(b, CanonicalView) else CanonicalView(b)
    tol = tolerance or Tolerance()
    both, only_a, only_b = common_points(va, vb)
    present = set(both)
    n_layers = va.n_layers or vb.n_layers
    errors: dict[tuple, float] = {}
    per_token: dict[tuple, dict] = {}            # point -> {row: err}
    router_cache: dict[int | None, tuple] = {}   # layer -> (rows, logits_a, per_row_abs_err)
    results: list[PointResult] = []
    row_counts = {"a": va.rows_total, "b": vb.rows_total}
    matched_rows: set = set()
    routing_summary = {"layers": {}, "tokens_with_flip": 0, "share_tokens_with_flip": 0.0}
    flipped_tokens: set = set()
    near_tie: dict[int | None, set] = {}          # layer -> tokens whose routing flipped on a near tie
    first: PointResult | None = None

    for point, layer in both:
        key = key_name(point, layer)
        if progress:
            progress(key)
        ta, tb = va.load(point, layer), vb.load(point, layer)
        pr = PointResult(key, point, layer, "ok", sources={"a": ta.sources[:4], "b": tb.sources[:4]})
        feeds = feeds_of(point, layer, present, n_layers)
        pr.inputs = [key_name(*f) for f in feeds]
        in_errs = [errors[f] for f in feeds if f in errors and BY_NAME[f[0]].kind != "ids"]
        pr.input_error = max(in_errs) if in_errs else 0.0
        if ta.values is None or tb.values is None:
            st = compare_stats(ta.stats, tb.stats, ta.hashes, tb.hashes)
            pr.stats = st
            if not st["comparable"]:
                pr.status, pr.reason = "not_comparable", (
                    "only statistics recorded and the two sides cover different rows; "
                    "re-trace with mode 'rows' or 'full' for these points")
                results.append(pr)
                continue
            pr.dtype = coarser(ta.dtype, tb.dtype)
            pr.error = 0.0 if st["bitwise_equal"] else max(st["rel_rms"], st["rel_mean"])
            pr.reason = "statistics only: the error is a lower bound"
        else:
            pair = align_rows(ta, tb)
            pr.rows, pr.only_a, pr.only_b = len(pair.rows), pair.only_a, pair.only_b
            if not pair.rows:
                pr.status, pr.reason = "not_comparable", (
                    f"no rows in common (A has {len(ta.rows)}, B has {len(tb.rows)}): check sample keys and positions")
                results.append(pr)
                continue
            matched_rows.update(pair.rows)
            pr.dtype = coarser(ta.dtype, tb.dtype)
            if BY_NAME[point].kind == "ids":
                rc = router_cache.get(layer)
                logits_a = err = None
                if rc is not None:
                    idx = {r: i for i, r in enumerate(rc[0])}
                    sel = [idx.get(r) for r in pair.rows]
                    if all(s is not None for s in sel):
                        logits_a, err = rc[1][sel], rc[2][sel]
                rm = compare_routing(pair.a, pair.b, logits_a, err)
                pr.routing = rm.to_json()
                pr.error = rm.error
                for i in rm.flipped_index:
                    flipped_tokens.add(pair.rows[i])
                if rm.flipped_rows and not rm.unexplained_flips:
                    near_tie[layer] = {pair.rows[i] for i in rm.flipped_index}
                routing_summary["layers"][str(layer)] = {"flipped": rm.flipped_rows, "rows": rm.rows,
                                                        "unexplained": rm.unexplained_flips,
                                                        "set_agreement": rm.set_agreement}
                pr.tol = 0.0
                if rm.flipped_rows:
                    pr.status = "over"
                    if rm.unexplained_flips:
                        pr.status = "divergent"
                        pr.reason = f"{rm.unexplained_flips} routing flips with a router-logit margin larger than the logit error"
                    else:
                        pr.reason = f"{rm.flipped_rows} near-tie routing flips (margin within the router-logit error)"
                errors[(point, layer)] = pr.error
                results.append(pr)
                if pr.status == "divergent" and first is None:
                    first = pr
                continue
            m = compare_values(pair.a, pair.b, pr.dtype)
            pr.metrics = m.to_json()
            pr.error = m.error
            per_token[(point, layer)] = dict(zip(pair.rows, m.per_row_rel))
            noisy = near_tie.get(layer, set())
            if noisy and point in _ROUTED_POINTS:
                # Tokens whose experts flipped on a near tie ran different experts: judge this point on the
                # other tokens, but pass the full error downstream so the flip is not blamed on later points.
                keep = [i for i, r in enumerate(pair.rows) if r not in noisy]
                if keep:
                    judged = compare_values(pair.a[keep], pair.b[keep], pr.dtype)
                    errors[(point, layer)] = pr.error
                    pr.metrics["error_all_rows"] = pr.metrics["rel_l2"]
                    pr.error = judged.error
                    pr.reason = f"judged without {len(noisy)} near-tie routing-flip tokens"
            if point == "moe.router_logits":
                router_cache[layer] = (pair.rows, pair.a.reshape(len(pair.rows), -1),
                                       np.abs(pair.a - pair.b).reshape(len(pair.rows), -1).max(axis=1))
        pr.tol = tol.tol(pr.dtype, point, key)
        errors[(point, layer)] = max(pr.error, errors.get((point, layer), 0.0))
        pr.growth = (pr.error / pr.input_error) if pr.input_error and pr.input_error > 0 else (
            math.inf if pr.error and pr.error > 0 else None)
        if pr.error is not None and pr.error > pr.tol:
            pr.status = "over"
            if pr.error > tol.growth * pr.input_error:
                pr.status = "divergent"
        results.append(pr)
        if pr.status == "divergent" and first is None:
            first = pr

    # What could not be compared, and why.
    nc = []
    for k in only_a:
        nc.append({"key": key_name(*k), "reason": f"only side A ({va.adapter.name}) produces it"})
    for k in only_b:
        nc.append({"key": key_name(*k), "reason": f"only side B ({vb.adapter.name}) produces it"})
    for side, v in (("A", va), ("B", vb)):
        have = {p for p, _ in v.points()}
        for p in v.adapter.promised_points(v.config):
            if p not in have:
                nc.append({"key": p, "reason": f"side {side}'s adapter promises it but the trace has no record "
                                               "(module not run, filtered out, or the mapping is wrong)"})
    nc.extend({"key": p.key, "reason": p.reason} for p in results if p.status == "not_comparable")

    # Worst tokens by |Δ logprob| and where each one's divergence starts.
    worst = []
    lp = per_token.get(("logprobs", None))
    token_errors: dict = {}
    if ("logprobs", None) in present:
        ta, tb = va.load("logprobs", None), vb.load("logprobs", None)
        pair = align_rows(ta, tb)
        if pair.rows:
            d = np.abs(pair.a.reshape(-1) - pair.b.reshape(-1))
            order = np.argsort(-d, kind="stable")[:worst_tokens]
            walk = [r for r in results if (r.point, r.layer) in per_token]
            for i in order:
                row = pair.rows[int(i)]
                start, prev_errs = None, {}
                curve = {}
                for r in walk:
                    e = per_token[(r.point, r.layer)].get(row)
                    if e is None:
                        continue
                    curve[r.key] = e
                    feeds = [key_name(*f) for f in feeds_of(r.point, r.layer, present, n_layers)]
                    ie = max([prev_errs[f] for f in feeds if f in prev_errs], default=0.0)
                    prev_errs[r.key] = e
                    if start is None and r.tol is not None and e > r.tol and e > tol.growth * ie:
                        start = r.key
                label = f"{row[0]}@{row[1]}"
                token_errors[label] = curve
                worst.append({"sample": row[0], "position": row[1], "abs_dlogprob": float(d[int(i)]),
                              "logprob_a": float(pair.a.reshape(-1)[int(i)]),
                              "logprob_b": float(pair.b.reshape(-1)[int(i)]),
                              "divergence_starts": start, "routing_flip": row in flipped_tokens})
    del lp
    routing_summary["tokens_with_flip"] = len(flipped_tokens)
    routing_summary["share_tokens_with_flip"] = len(flipped_tokens) / max(len(matched_rows), 1)

    first_d = None
    if first is not None:
        first_d = asdict(first)
        first_d["cause"] = _cause(first, results, routing_summary)
        first_d["ops"] = _ops_in_region(va, vb, first, present, n_layers)
    verdict = "divergent" if first is not None else ("consistent" if any(r.status != "not_comparable" for r in results)
                                                     else "not_comparable")
    return Report(
        verdict=verdict, first=first_d, points=results, not_comparable=nc,
        rows={"a": row_counts["a"], "b": row_counts["b"], "matched": len(matched_rows)},
        worst_tokens=worst, routing=routing_summary, settings={"tolerance": tol.to_json()},
        sides={"a": _side(va), "b": _side(vb)}, token_errors=token_errors,
    )


def _side(v: CanonicalView) -> dict:
    m = v.trace.manifest
    return {"path": str(v.trace.path), "framework": v.adapter.name, "versions": m.get("versions", {}),
            "model": m.get("model", {}), "ranks": v.trace.ranks, "unmapped_module_outputs": len(v.unmapped),
            "merge_notes": dict(v.notes)}


def _cause(first: PointResult, results: list[PointResult], routing: dict) -> str:
    if first.point == "moe.topk_ids":
        return "routing: experts selected differently beyond what router-logit noise explains"
    if first.point in ("moe.experts_out", "mlp.out", "output") and first.layer is not None:
        lay = routing["layers"].get(str(first.layer))
        if lay and lay["flipped"]:
            return (f"routing flips in layer {first.layer} ({lay['flipped']} of {lay['rows']} tokens, near-tie) "
                    "precede the jump: the expert outputs differ because different experts ran")
    if first.metrics and first.metrics.get("nonfinite"):
        return "NaN/Inf on one side only"
    return "the operator(s) between this point's inputs and its output compute differently"


def _ops_in_region(va: CanonicalView, vb: CanonicalView, first: PointResult, present: set, n_layers) -> dict:
    feeds = feeds_of(first.point, first.layer, present, n_layers)
    out = {}
    for side, v in (("a", va), ("b", vb)):
        seqs = [s for s in (v.seq_of(*f) for f in feeds) if s is not None]
        ops = v.ops_between(first.point, first.layer, max(seqs) if seqs else None)
        out[side] = [{"name": r.name, "op": r.op, "dtype": r.dtype, "shape": list(r.shape),
                      "rms": math.sqrt(r.stats["sumsq"] / max(r.stats["count"], 1)) if r.stats else None,
                      "absmax": r.stats["absmax"] if r.stats else None, "hash": r.hash} for r in ops[:200]]
    return out


def rejudge(report: dict, tolerance: Tolerance) -> dict:
    """Re-apply new tolerances to a saved JSON report, without reading any tensor."""
    out = dict(report)
    pts = [dict(p) for p in report["points"]]
    by_key = {p["key"]: p for p in pts}
    first = None
    for p in pts:
        if p["status"] == "not_comparable" or p.get("error") is None:
            continue
        err = _num(p["error"])
        if p["point"] == "moe.topk_ids":
            if first is None and p["status"] == "divergent":
                first = p
            continue
        p["tol"] = tolerance.tol(p["dtype"], p["point"], p["key"])
        ins = [_num(by_key[k]["error"]) for k in p.get("inputs", []) if k in by_key
               and by_key[k].get("error") is not None and by_key[k]["point"] != "moe.topk_ids"]
        ie = max(ins, default=0.0)
        p["status"] = "ok"
        if err > p["tol"]:
            p["status"] = "divergent" if err > tolerance.growth * ie else "over"
        if p["status"] == "divergent" and first is None:
            first = p
    out["points"] = pts
    out["verdict"] = "divergent" if first is not None else "consistent"
    if first is None:
        out["first_divergence"] = None
    elif not report.get("first_divergence") or report["first_divergence"]["key"] != first["key"]:
        out["first_divergence"] = {**first, "cause": "re-judged from saved metrics", "ops": {}}
    out["settings"] = {**report.get("settings", {}), "tolerance": tolerance.to_json()}
    return out


def sort_points(keys: list[str]) -> list[str]:
    return sorted(keys, key=lambda k: order_key(*parse_key(k)))
