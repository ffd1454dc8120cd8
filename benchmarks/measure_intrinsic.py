"""Measure intrinsic error on clean bf16 pairs and bf16 precision faults: the data behind the intrinsic rule.

    python benchmarks/measure_intrinsic.py --out /tmp/intrinsic.json      # the tables in docs/replay.md

Tiny bf16 HF Qwen3-MoE (transformers' own modeling code), several weight seeds; side A is the unmodified
model, side B a clean variant (`tic_trace/testing/precision_faults.py: CLEAN`) or one precision fault planted
at layer 0 or 1. Both sides are traced and replayed against the exact reference from the same checkpoint.
Prints, per scenario, the point where the two sides' intrinsic errors differ most (by each statistic) and,
for faults, the numbers at the fault's own point, then at attn.core each implementation's per-head scale
error (docs/replay.md, "The per-head scale error"); writes every point's numbers as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tic_trace  # noqa: E402
from tic_trace.view.align import CanonicalView  # noqa: E402
from tic_trace.replay.intrinsic import IntrinsicError, replay_side  # noqa: E402
from tic_trace.replay.reference import ExactReference  # noqa: E402
from tic_trace.testing.hf_models import (build_hf_model_stable, sample_tokens, tiny_qwen2_moe_config,  # noqa: E402
                                         tiny_qwen3_config)
from tic_trace.testing.precision_faults import CLEAN, PRECISION_FAULTS  # noqa: E402


def trace(model, path: Path, ids: torch.Tensor) -> None:
    with tic_trace.trace(model, path, adapter="hf", points_mode="full") as t, torch.no_grad():
        model(ids)
    assert t.failed is None, t.failed


def side(path: Path, ref: ExactReference) -> dict[str, IntrinsicError]:
    return {r.key: r for r in replay_side(CanonicalView(str(path)), ref) if isinstance(r, IntrinsicError)}


def _config(args: argparse.Namespace):
    return tiny_qwen2_moe_config() if args.qwen2_moe else tiny_qwen3_config(moe=not args.dense)


def scenario(work: Path, seed: int, ids, variant, layer: int | None, cfg) -> dict:
    a = build_hf_model_stable(cfg, seed=seed, dtype=torch.bfloat16)
    ck = work / f"ck{seed}"
    if not ck.exists():
        a.save_pretrained(ck)
    b = build_hf_model_stable(cfg, seed=seed, dtype=torch.bfloat16)
    variant(b) if layer is None else variant(b, layer)
    pa, pb = work / f"a{seed}", work / f"b{seed}"
    import shutil
    shutil.rmtree(pb, ignore_errors=True)
    if not pa.exists():
        trace(a, pa, ids)
    trace(b, pb, ids)
    ref = ExactReference(str(ck))
    ea, eb = side(pa, ref), side(pb, ref)
    return {k: {"a": vars(ea[k]), "b": vars(eb[k])} for k in ea if k in eb}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default=None, help="comma-separated scenario names (default: all)")
    ap.add_argument("--dense", action="store_true", help="a dense model (gated MLP) instead of the MoE one")
    ap.add_argument("--qwen2-moe", action="store_true",
                    help="a Qwen2-MoE (sigmoid-gated shared expert, no QK-norm) instead of the Qwen3-MoE")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ids = sample_tokens(args.batch, args.seq)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for seed in range(args.seeds):
            for name, fn in CLEAN.items():
                if args.only and name not in args.only.split(","):
                    continue
                results.append({"scenario": name, "clean": True, "seed": seed, "layer": None,
                                "points": scenario(work, seed, ids, fn, None, _config(args))})
            for name, f in PRECISION_FAULTS.items():
                if args.only and name not in args.only.split(","):
                    continue
                for layer in (0, 1):
                    if not f.layered and layer == 0:
                        continue
                    results.append({"scenario": name, "clean": False, "seed": seed, "layer": layer,
                                    "point": f.point if not f.layered else f"L{layer}.{f.point}",
                                    "worse": f.worse, "points": scenario(work, seed, ids, f.plant, layer, _config(args))})
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(tables(results))
    print(head_scale_table(results))


def head_scale_table(results: list[dict]) -> str:
    """Markdown: at attn.core, per implementation and layer, the range over seeds of the excess and of the
    per-(token, head) scale error in units of its floor (`IntrinsicError.head_scale_excess`). HF eager is
    every scenario's side A; a fault's side B only at its own layer."""
    got: dict[tuple[str, str], dict] = {}
    for r in results:
        for key, v in r["points"].items():
            if not key.endswith(".attn.core"):
                continue
            layer = key.split(".")[0]
            for s in ("a", "b"):
                if s == "a":
                    name = "HF eager"
                elif r["clean"]:
                    name = "HF eager" if r["scenario"] != "sdpa_vs_eager" else "SDPA"
                elif f"{layer}.attn.core" == r["point"]:
                    name = r["scenario"]
                else:
                    continue
                e, a = IntrinsicError(**v[s]), IntrinsicError(**v["a"])
                trace = (r["seed"], "A" if s == "a" else r["scenario"])     # side A: one trace per seed
                got.setdefault((name, layer), {})[trace] = (e.excess, e.head_scale_excess,
                                                            e.head_scale_excess / a.head_scale_excess)
    out = ["| attn.core of | layer | n | excess | head-scale excess | head-scale / HF eager's (same seed) |",
           "|---|---|---|---|---|---|"]
    for (name, layer), per_trace in sorted(got.items()):
        xs = list(per_trace.values())
        ex, hs, q = ([x[i] for x in xs] for i in range(3))
        out.append(f"| {name} | {layer} | {len(xs)} | {min(ex):.3f}–{max(ex):.3f} | {min(hs):.3f}–{max(hs):.3f} | "
                   f"{min(q):.3f}–{max(q):.3f} |")
    return "\n".join(out)


def _excess(d: dict) -> float:
    return IntrinsicError(**{k: v for k, v in d.items()}).excess


def tables(results: list[dict]) -> str:
    """Markdown: per point, the largest excess of a clean implementation and the largest clean A/B ratio;
    per fault, both sides at the fault's point and what the rule says there."""
    from tic_trace.replay.intrinsic_verdict import DEFAULT_MARGINS, intrinsic_verdict
    env: dict[str, float] = {}
    ratio: dict[str, float] = {}
    for r in results:
        for key, v in r["points"].items():
            point = IntrinsicError(**v["a"]).envelope_key      # the op replayed, where it depends on the model
            sides = [v["a"], v["b"]] if r["clean"] else [v["a"]]
            for d in sides:
                if d["kind"] != "ids" and d["dtype"] == "bfloat16":
                    env[point] = max(env.get(point, 0.0), _excess(d))
            if r["clean"] and v["a"]["dtype"] == v["b"]["dtype"] == "bfloat16" and v["a"]["kind"] != "ids":
                ea, eb = _excess(v["a"]), _excess(v["b"])
                ratio[point] = max(ratio.get(point, 1.0), max(ea, eb) / min(ea, eb))
    out = ["| point (or op) | largest clean excess | largest clean A/B ratio | limit (rule) |", "|---|---|---|---|"]
    for point in env:
        out.append(f"| {point} | {env[point]:.3f} | {ratio.get(point, 1.0):.3f} | "
                   f"{DEFAULT_MARGINS.limit(point, 'bfloat16'):.2f} |")
    out += ["", "| fault | seed | point | A dtype / excess | B dtype / excess | B/A | rule |", "|---|---|---|---|---|---|---|"]
    for r in results:
        if r["clean"]:
            continue
        v = r["points"][r["point"]]
        a, b = (IntrinsicError(**v[s]) for s in ("a", "b"))
        verdict = intrinsic_verdict(a, b)
        said = f"{verdict.side} {verdict.kind}" if verdict.side else "none"
        out.append(f"| {r['scenario']} | {r['seed']} | {r['point']} | {a.dtype} {a.excess:.3f} | "
                   f"{b.dtype} {b.excess:.3f} | {b.excess / a.excess:.3f} | {said} (want "
                   f"{'B' if r['worse'] == 'planted' else 'A'}) |")
    clean_blamed = []
    for r in results:
        if r["clean"]:
            for key, v in r["points"].items():
                vd = intrinsic_verdict(IntrinsicError(**v["a"]), IntrinsicError(**v["b"]))
                if vd.side:
                    clean_blamed.append(f"{r['scenario']} seed {r['seed']} {key}: {vd.reason}")
    out += ["", f"clean pairs: {sum(r['clean'] for r in results)}, points blamed: {len(clean_blamed)}"] + clean_blamed
    return "\n".join(out)


if __name__ == "__main__":
    main()
