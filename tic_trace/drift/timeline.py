"""Read a run directory, compare each traced rollout's pair with the finder, and build the typed timeline.

Layouts (docs/drift.md): slime's `{run}/rollout_NNNNN/{megatron,sglang}/` (what `--tic-trace` writes), or any
directory of numbered entries (`step_3/`, `rollout_00012/`: the trailing digits are the rollout id) each holding
the two side directories named by `sides`. Side A is the reference (slime: Megatron), side B the side checked.

A rollout that cannot be compared (a side missing or corrupt, pruned by the disk budget, a crash in the
finder) is named with the reason and skipped: never fatal, never silently dropped."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Callable

from ..compare.diverge import find_divergence
from ..graph.canonical import is_ids, key_name, order_key
from ..report.schema import num
from ..view.align import CanonicalView
from ..view.weight_map import weight_hashes_by_point
from .listing import PRUNED_MARK, RolloutDirs, RunDirError, list_run, missing  # noqa: F401 - the run's listing
from .schema import RolloutEntry, WeightCheck, rollout_coverage

SLIME_SIDES = ("megatron", "sglang")


def discover(run_dir: str | os.PathLike, sides: tuple[str, str] = SLIME_SIDES) -> list[RolloutDirs]:
    """Every rollout of `run_dir`, by id (listing.list_run; the other entries are left out here)."""
    return list_run(run_dir, sides)[0]


def point_digests(view: CanonicalView) -> dict[str, tuple[str, list[str]]]:
    """{point key: (digest of its recorded parameter hashes, its parameter names)}: equal digests, unchanged
    parameters (one side against itself across rollouts: the names and layouts are its own)."""
    out = {}
    for (point, layer), params in weight_hashes_by_point(view).items():
        h = hashlib.sha256(repr(sorted((n, list(v)) for n, v in params.items())).encode()).hexdigest()[:16]
        out[key_name(point, layer)] = (h, sorted(params))
    return out


def compare_rollout(rd: RolloutDirs, sides: tuple[str, str], compare: Callable[..., dict],
                    root: Path | None = None) -> tuple[RolloutEntry, tuple[dict, dict] | None]:
    """One rollout's entry and both sides' parameter digests (None when it was skipped). `root`: the resolved
    run directory no side may lead out of (default: the rollout's parent)."""
    why = missing(rd, sides, root or rd.dir.parent.resolve())
    if why is not None:
        return RolloutEntry(rd.rollout_id, str(rd.dir), "skipped", reason=why), None
    try:
        va, vb = CanonicalView(str(rd.a)), CanonicalView(str(rd.b))
        digests = (point_digests(va), point_digests(vb))
        report = compare(va, vb)
    except Exception as e:        # a corrupt trace or a finder crash skips this rollout, named, never the run
        return RolloutEntry(rd.rollout_id, str(rd.dir), "skipped", reason=f"{type(e).__name__}: {e}"), None
    return entry_of_report(rd.rollout_id, str(rd.dir), report), digests


def entry_of_report(rollout_id: int, d: str, report: dict) -> RolloutEntry:
    """The timeline's facts of one rollout, read off its report (report schema, docs/report.md)."""
    errors: dict[str, dict[str, Any]] = {}
    for p in report.get("points") or []:
        if is_ids(str(p.get("point"))) or p.get("status") == "not_comparable":
            continue
        lay = "-" if p.get("layer") is None else str(p["layer"])
        errors.setdefault(str(p["point"]), {})[lay] = p.get("error")
    flips = {}
    for lay, r in ((report.get("routing") or {}).get("layers") or {}).items():
        rows, flipped = int(r.get("rows") or 0), int(r.get("flipped") or 0)
        flips[str(lay)] = {"rows": rows, "flipped": flipped, "share": flipped / rows if rows else 0.0}
    fd = report.get("first_divergence")
    first = None if not fd else {k: fd.get(k) for k in ("key", "point", "layer", "cause", "error")}
    precision = sorted({str(f.get("key")) for f in report.get("findings") or [] if f.get("cause") == "precision"}
                       | {str(c.get("key")) for c in report.get("contract") or [] if c.get("kind") == "precision"})
    dl = [num(t.get("abs_dlogprob")) for t in report.get("worst_tokens") or []]
    dl = [x for x in dl if x is not None]
    return RolloutEntry(rollout_id, d, "compared", verdict=report.get("verdict"), first_divergence=first,
                        errors=errors, flips=flips, precision=precision, weights=_contract_weights(report),
                        dlogprob=max(dl) if dl else None, rows=int((report.get("rows") or {}).get("matched") or 0))


def _contract_weights(report: dict) -> WeightCheck:
    """What the report's contract says of the parameter hashes between A and B (drift/weights.py)."""
    from .weights import contract_weights
    return contract_weights(report)


def finder(tolerance=None, workers: int = 1, backend: str = "processes",
           allow_unverified: bool = False) -> Callable[[CanonicalView, CanonicalView], dict]:
    """The comparison of one pair: `find_divergence` with the run's settings, as its report JSON."""
    def run(va: CanonicalView, vb: CanonicalView) -> dict:
        return find_divergence(va, vb, tolerance=tolerance, workers=workers, backend=backend,
                               allow_unverified=allow_unverified).to_json()
    return run


def series(entries: list[RolloutEntry]) -> dict[str, list[tuple[int, float]]]:
    """{point key: [(rollout id, error)]} over the compared rollouts, keys in dataflow order."""
    out: dict[tuple, list[tuple[int, float]]] = {}
    for e in entries:
        if e.status != "compared":
            continue
        for point, by_layer in e.errors.items():
            for lay, v in by_layer.items():
                x = num(v)
                if x is not None:
                    layer = None if lay == "-" else int(lay)
                    out.setdefault((order_key(point, layer), key_name(point, layer)), []).append((e.rollout_id, x))
    return {k[1]: v for k, v in sorted(out.items())}


def build_drift(run_dir: str | os.PathLike, sides: tuple[str, str] = SLIME_SIDES,
                compare: Callable[[CanonicalView, CanonicalView], dict] | None = None,
                factor: float | None = None, floor: float | None = None,
                progress: Callable[[str], None] | None = None) -> "Drift":
    """The `drift` object of a run: every rollout compared (or named and skipped), every other entry of the
    run directory named, the weight sync judged first, then the onset, then how long the run has been
    divergent."""
    from .onset import DEFAULT_FACTOR, DEFAULT_FLOOR, divergent_since, find_onset
    from .schema import EXIT_DRIFT, EXIT_NOTHING, EXIT_STEADY, Drift
    from .weights import mark_changes, weight_sync
    factor = DEFAULT_FACTOR if factor is None else float(factor)
    floor = DEFAULT_FLOOR if floor is None else float(floor)
    compare = compare or finder()
    rollouts, others = list_run(run_dir, sides)
    root = Path(run_dir).resolve()
    entries, digests = [], {}
    for rd in rollouts:
        if progress is not None:
            progress(f"rollout {rd.rollout_id}")
        entry, dg = compare_rollout(rd, sides, compare, root)
        entries.append(entry)
        if dg is not None:
            digests[rd.rollout_id] = dg
    mark_changes(entries, digests)
    sync = weight_sync(entries, list(sides))
    onset, note = find_onset(series(entries), entries, sync, factor, floor)
    since = divergent_since(entries)
    compared = sum(e.status == "compared" for e in entries)
    code = EXIT_NOTHING if not compared else EXIT_DRIFT if (onset or sync or since) else EXIT_STEADY
    return Drift(str(run_dir), list(sides), {"factor": factor, "floor": floor, "min_baseline": 2}, entries, sync,
                 onset, note, exit_code=code, divergent_since=since,
                 others=[{"name": o.name, "reason": o.reason} for o in others], coverage=rollout_coverage(entries))
