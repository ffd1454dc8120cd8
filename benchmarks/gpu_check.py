"""What the tracer does on a real accelerator, checked in one run of under 5 minutes on one GPU.

    python benchmarks/gpu_check.py --out gpu_check.json          # on a CUDA machine: every check
    python benchmarks/gpu_check.py --device cpu --quick --out x.json   # the checks that run on a CPU (CI)

Uses only this repository, torch and transformers. Every check runs in its own try/except: a failure is
reported in the table and the JSON (status "fail" or "error", with the reason) and the next check runs.
Checks (status "skip" where they need CUDA and there is none):

  stats_hash_agree   device statistics and hash vs numpy from the stored bits: hash bit for bit, sums to
                     float64 rounding, 9 dtypes, multi-block and strided tensors; repeat runs bitwise equal
  no_sync_per_op     host syncs counted by torch.cuda.set_sync_debug_mode("warn") in an untraced and a traced
                     forward (the traced one may only add a constant per pass, whatever the number of ops),
                     then set_sync_debug_mode("error") around a traced forward of a model that does not sync
  overhead           wall time of one forward: untraced, tic-trace stats/full, DebugMode (with/without
                     hashes), forward hooks cloning every module output; medians, same process, interleaved
  transient_memory   device memory the statistics and hash of one 1 GiB / 2 GiB tensor allocate at once
  peak_memory        peak device memory of a forward: untraced vs stats vs full
  pinned_cap         full mode with a 256 MiB host-copy cap on a pass recording 1.5 GiB: ring within the cap,
                     every stored value hashes to its recorded hash, a value modified in place after its
                     module returned is stored as produced; whether the forward had to wait is reported
  cuda_graph         a traced model captured into a CUDA graph: capture works, the pass notes say records were
                     skipped during capture, replay output equals eager
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import tic_trace  # noqa: E402


def _map_subpackages() -> None:
    """Run from a plain checkout (nothing installed): map `tic_trace.adapters` / `tic_trace.tools` onto their
    folders, as pyproject's package-dir does for an install."""
    import importlib.util
    for sub in ("adapters", "tools"):
        name = f"tic_trace.{sub}"
        try:
            if importlib.util.find_spec(name) is not None:
                continue
        except ImportError:
            pass
        spec = importlib.util.spec_from_file_location(name, ROOT / sub / "__init__.py",
                                                      submodule_search_locations=[str(ROOT / sub)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        setattr(tic_trace, sub, mod)


_map_subpackages()
from tic_trace.record import stats as stats_mod  # noqa: E402
from tic_trace.store.dtypes import torch_dtype_name  # noqa: E402
from tic_trace.record.stats import device_hash, device_stats, numpy_hash, numpy_stats, stats_dict  # noqa: E402


class Skip(Exception):
    """The check cannot run here (e.g. it needs CUDA)."""


class Ctx:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.dev = torch.device(args.device)
        self.cuda = self.dev.type == "cuda"
        self.work = Path(tempfile.mkdtemp(prefix="tic-gpu-check-"))
        self.n = 0
        self._model = None

    def fresh_dir(self) -> Path:
        self.n += 1
        return self.work / f"t{self.n}"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def model(self):
        if self._model is None:
            from bench_tracer import build_model
            from tic_trace.testing.hf_models import sample_tokens
            a = self.args
            m, _ = build_model(a.layers, a.hidden, a.experts, a.topk, a.vocab)
            self._model = m.to(self.dev), sample_tokens(1, a.tokens, vocab=a.vocab).to(self.dev)
        return self._model

    def needs_cuda(self) -> None:
        if not self.cuda:
            raise Skip("needs CUDA")


# ------------------------------------------------------------------------------------------------ checks

def _agree_values(dtype: torch.dtype, n: int, dev: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    base = torch.randn(n, generator=g, dtype=torch.float64) * 3
    if n > 8:
        base[1], base[3], base[5] = float("nan"), float("inf"), -float("inf")
    if dtype == torch.bool:
        t = base > 0
    elif dtype.is_complex:
        t = torch.complex(base, base.flip(0)).to(dtype)
    elif not dtype.is_floating_point:
        t = (base.nan_to_num(0, 0, 0) * 1000).to(dtype)
    else:
        t = base.to(dtype)
    return t.to(dev)


def check_stats_hash_agree(ctx: Ctx) -> dict:
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.int64,
              torch.int32, torch.bool, torch.complex64]
    sizes = [0, 1, 1000, 3 * stats_mod._CHUNK + 5] if not ctx.args.quick else [0, 1, 1000, 70_001]
    bad, n_checked = [], 0
    for dtype in dtypes:
        for n in sizes:
            t = _agree_values(dtype, n, ctx.dev)
            views = [t] + ([t[: (n // 1000) * 1000].view(-1, 1000).t()] if n >= 2000 else [])
            for v in views:
                n_checked += 1
                from tic_trace.record.host_copy import as_storage
                raw = as_storage(v.cpu().contiguous())
                h = int(device_hash(v))
                got = stats_dict(device_stats(v).cpu().numpy())
                want = numpy_stats(raw, torch_dtype_name(v.dtype))
                again = int(device_hash(v)), device_stats(v).cpu().numpy()
                if h != numpy_hash(raw) or again[0] != h or not np.array_equal(again[1], device_stats(v).cpu().numpy()):
                    bad.append(f"{dtype} n={n} {tuple(v.stride())}: hash")
                scale = max(1.0, abs(want["sumsq"])) ** 0.5
                for k in want:
                    close = abs(got[k] - want[k]) <= 1e-12 * max(abs(want[k]), scale) if k in ("sum", "sumsq") \
                        else (got[k] == want[k] or (got[k] != got[k] and want[k] != want[k]))
                    if not close:
                        bad.append(f"{dtype} n={n} {tuple(v.stride())}: {k} {got[k]!r} vs {want[k]!r}")
    return {"status": "fail" if bad else "pass", "tensors_checked": n_checked, "mismatches": bad[:20]}


def _count_syncs(fn: Callable[[], Any]) -> int:
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def _traced_forward(ctx: Ctx, model, ids, layers_note: str = "", **kw) -> Callable[[], None]:
    def run():
        t = tic_trace.trace(model, ctx.fresh_dir(), **kw)
        t.start()
        try:
            holder["syncs"] = _count_syncs(lambda: model(ids))
        finally:
            t.stop()
        holder["failed"] = t.failed
    holder: dict = {}
    run.holder = holder  # type: ignore[attr-defined]
    return run


def check_no_sync_per_op(ctx: Ctx) -> dict:
    ctx.needs_cuda()
    from bench_tracer import build_model
    from tic_trace.testing.hf_models import sample_tokens
    a, out = ctx.args, {}
    ids = sample_tokens(1, 128, vocab=a.vocab).to(ctx.dev)
    with torch.no_grad():
        for layers in (2, 4):
            model = build_model(layers, a.hidden, a.experts, a.topk, a.vocab)[0].to(ctx.dev)
            model(ids)
            untraced = _count_syncs(lambda: model(ids))
            row = {"untraced": untraced}
            for label, kw in (("stats", dict(adapter="hf")), ("full", dict(adapter="hf", points_mode="full")),
                              ("stats_no_adapter", {})):
                run = _traced_forward(ctx, model, ids, **kw)
                run()
                row[label] = run.holder["syncs"]
                if run.holder["failed"] is not None:
                    row[label + "_failed"] = repr(run.holder["failed"])
            out[f"moe_{layers}_layers"] = row
        extra = {k: out["moe_4_layers"][k] - out["moe_4_layers"]["untraced"] - (
            out["moe_2_layers"][k] - out["moe_2_layers"]["untraced"]) for k in ("stats", "full", "stats_no_adapter")}
        out["extra_syncs_growth_2_to_4_layers"] = extra
        out["strict"] = _strict_sync_check(ctx, ids)
    ok = all(v == 0 for v in extra.values()) and out["strict"].get("status") == "pass"
    return {"status": "pass" if ok else "fail", **out}


def _strict_sync_check(ctx: Ctx, ids: torch.Tensor) -> dict:
    """set_sync_debug_mode("error") around a traced forward of a model that itself never syncs: a dense
    Qwen3 (no MoE routing, which syncs in HF's code), no adapter (reading the rows of the input is one
    host read per pass, by design)."""
    from tic_trace.testing.hf_models import build_hf_model, tiny_qwen3_config
    a = ctx.args
    cfg = tiny_qwen3_config(moe=False, hidden_size=a.hidden, num_hidden_layers=2, num_attention_heads=8,
                            num_key_value_heads=4, head_dim=a.hidden // 8, intermediate_size=2 * a.hidden,
                            vocab_size=a.vocab, max_position_embeddings=4096)
    model = build_hf_model(cfg).to(ctx.dev)
    model(ids)
    if _count_syncs(lambda: model(ids)):
        return {"status": "skip", "reason": "the dense model syncs by itself"}
    res = {}
    for label, kw in (("stats", {}), ("full", dict(points_mode="full")), ("full_rows", dict(points_mode="rows", sample_rows=[0, 5]))):
        t = tic_trace.trace(model, ctx.fresh_dir(), **kw)
        t.start()
        if label == "full_rows":
            t.set_rows(["s"] * ids.shape[1], list(range(ids.shape[1])))
        try:
            torch.cuda.set_sync_debug_mode("error")
            model(ids)
            res[label] = "no sync"
        except RuntimeError as e:
            res[label] = f"SYNC: {e}"[:300]
        finally:
            torch.cuda.set_sync_debug_mode(0)
            t.stop()
        if t.failed is not None:
            res[label] = f"tracer failed: {t.failed!r}"[:300]
    return {"status": "pass" if all(v == "no sync" for v in res.values()) else "fail", **res}


def check_overhead(ctx: Ctx) -> dict:
    try:
        from torch.utils._debug_mode import DebugMode
    except ImportError:                          # older torch: the other variants still run
        DebugMode = None
    model, ids = ctx.model()

    def traced(**kw):
        def run():
            with tic_trace.trace(model, ctx.fresh_dir(), adapter="hf", **kw) as t:
                model(ids)
            assert t.failed is None, t.failed
        return run

    def debug(hashes):
        def run():
            with contextlib.ExitStack() as st:
                st.enter_context(DebugMode())
                if hashes:
                    st.enter_context(DebugMode.log_tensor_hashes(hash_fn=hashes))
                model(ids)
        return run

    def hooks():
        from bench_tracer import CloneHooks   # the same naive hooks the CPU benchmark measures
        with CloneHooks(model):
            model(ids)

    variants = {"untraced": lambda: model(ids), "tic-trace stats": traced(),
                "tic-trace full (points full, ops stats)": traced(points_mode="full"),
                "DebugMode (no hashes)": debug(None), "DebugMode + log_tensor_hashes('norm')": debug("norm"),
                "forward hooks cloning every module output": hooks}
    dropped = {}
    for name in list(variants):                  # a variant this torch cannot run is dropped, with the reason
        try:
            with torch.no_grad():
                variants[name]()
        except Exception as e:  # noqa: BLE001
            dropped[name] = f"{type(e).__name__}: {e}"[:200]
            del variants[name]
    times = _interleaved(ctx, variants)
    med = {k: statistics.median(v) for k, v in times.items()}
    base, dmh = med["untraced"], med.get("DebugMode + log_tensor_hashes('norm')", float("nan"))
    table = {k: {"median_s": v, "x_untraced": v / base, "x_debugmode_hashes": v / dmh} for k, v in med.items()}
    s, f = med["tic-trace stats"], med["tic-trace full (points full, ops stats)"]
    targets = {"stats <= 2x untraced": s / base <= 2, "stats <= 0.5x DebugMode+hashes": s / dmh <= 0.5,
               "full <= 2.5x untraced": f / base <= 2.5}
    return {"status": "pass", "table": table, "targets_met": targets, "dropped_variants": dropped,
            "rounds": times}


def _interleaved(ctx: Ctx, variants: dict[str, Callable[[], None]]) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in variants}
    with torch.no_grad():
        for r in range(ctx.args.warmup + ctx.args.repeats):
            for name, fn in variants.items():
                ctx.sync()
                t0 = time.perf_counter()
                fn()
                ctx.sync()
                if r >= ctx.args.warmup:
                    times[name].append(time.perf_counter() - t0)
            shutil.rmtree(ctx.work, ignore_errors=True)
            ctx.work.mkdir(parents=True, exist_ok=True)
    return times


def _peak_above(ctx: Ctx, fn: Callable[[], Any]) -> int:
    ctx.sync()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    ctx.sync()
    return torch.cuda.max_memory_allocated() - base


def check_transient_memory(ctx: Ctx) -> dict:
    ctx.needs_cuda()
    out, worst = {}, 0
    for label, make in (("bf16 1 GiB", lambda: torch.randn(1 << 29, device=ctx.dev, dtype=torch.bfloat16)),
                        ("fp32 2 GiB", lambda: torch.randn(1 << 29, device=ctx.dev)),
                        ("fp32 2 GiB transposed", lambda: torch.randn(1 << 14, 1 << 15, device=ctx.dev).t()),
                        ("fp32 1 GiB with NaN", lambda: torch.randn(1 << 28, device=ctx.dev).index_fill_(
                            0, torch.tensor([7], device=ctx.dev), float("nan")))):
        x = make()
        peak = _peak_above(ctx, lambda x=x: (device_stats(x), device_hash(x)))
        out[label] = f"{peak / 2**20:.1f} MiB"
        worst = max(worst, peak)
        del x
        torch.cuda.empty_cache()
    bound = stats_mod.TRANSIENT_BYTES_MAX
    return {"status": "pass" if worst <= bound else "fail", "bound": f"{bound / 2**20:.0f} MiB", **out}


def check_peak_memory(ctx: Ctx) -> dict:
    ctx.needs_cuda()
    model, ids = ctx.model()
    res = {}
    with torch.no_grad():
        model(ids)
        res["untraced"] = _peak_above(ctx, lambda: model(ids))
        for label, kw in (("stats", {}), ("full", dict(points_mode="full"))):
            def run(kw=kw):
                with tic_trace.trace(model, ctx.fresh_dir(), adapter="hf", **kw):
                    model(ids)
            res[label] = _peak_above(ctx, run)
    mib = {k: f"{v / 2**20:.1f} MiB" for k, v in res.items()}
    extra = {k: f"{(res[k] - res['untraced']) / 2**20:.1f} MiB" for k in ("stats", "full")}
    return {"status": "pass", "peak_above_start": mib, "extra_over_untraced": extra}


class _Producer(torch.nn.Module):
    def forward(self, x, i):
        return x * float(i + 1)


class _Many(torch.nn.Module):
    """24 module outputs of 64 MiB each (1.5 GiB per pass); the last one modified in place after its module
    returned (its record must hold the value as produced)."""

    def __init__(self):
        super().__init__()
        self.p = torch.nn.ModuleList(_Producer() for _ in range(24))

    def forward(self, x):
        y = None
        for i, m in enumerate(self.p):
            y = m(x, i)
        y.add_(100.0)
        return y.sum()


def check_pinned_cap(ctx: Ctx) -> dict:
    cap = 256 << 20 if ctx.cuda else 16 << 20
    x = torch.randn(1 << 24 if ctx.cuda else 1 << 20, device=ctx.dev)
    model = _Many()
    stats0 = _host_stats()      # on CPU: a plain host ring, the same writer thread (host_copy.STAGE_CPU)
    with torch.no_grad(), tic_trace.trace(model, ctx.fresh_dir(), mode="stats", points_mode="full",
                                          pinned_cap_bytes=cap) as t:
        model(x)
    stats1 = _host_stats()
    p = next(tic_trace.open_trace(t.out_dir).passes())
    stored = [r for r in p.records if r.has_data]
    bad = [r.name for r in stored if numpy_hash(r.raw()) != r.hash]
    last = p.record("p.23:out")
    as_produced = np.array_equal(last.values(), (x * 24.0).cpu().numpy())
    ok = t.failed is None and not bad and as_produced and t._stager.peak_ring_bytes <= cap and len(stored) == 25
    return {"status": "pass" if ok else "fail", "cap": cap, "ring_bytes": t._stager.peak_ring_bytes,
            "recorded_bytes": sum(r.nbytes or 0 for r in stored), "records_stored": len(stored),
            "hash_mismatches": bad[:5], "in_place_after_return_stored_as_produced": as_produced,
            "forward_waited": any("waited for the disk writer" in n for n in p.meta["notes"]),
            "notes": p.meta["notes"], "tracer_failed": repr(t.failed) if t.failed else None,
            "host_allocator_before_after": [stats0, stats1]}


def _host_stats() -> dict | None:
    fn = getattr(torch.cuda, "host_memory_stats", None)
    if fn is None or not torch.cuda.is_available():
        return None
    s = fn()
    return {k: v for k, v in s.items() if "allocated_bytes" in k or "reserved_bytes" in k}


class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def check_cuda_graph(ctx: Ctx) -> dict:
    ctx.needs_cuda()
    model = _Mlp().to(ctx.dev)
    static = torch.randn(64, 256, device=ctx.dev)
    with torch.no_grad():
        eager = model(static).clone()
        with tic_trace.trace(model, ctx.fresh_dir(), points_mode="full") as t:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    model(static)                         # warm-up on a side stream, as torch requires
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = model(static)
        g.replay()
        ctx.sync()
    notes = [n for p in tic_trace.open_trace(t.out_dir).passes() for n in p.meta["notes"]]
    noted = any("CUDA graph capture" in n for n in notes)
    same = bool(torch.equal(out, eager))
    ok = noted and same and t.failed is None
    return {"status": "pass" if ok else "fail", "capture_noted": noted, "replay_equals_eager": same,
            "tracer_failed": repr(t.failed) if t.failed else None, "notes": notes}


CHECKS: list[tuple[str, Callable[[Ctx], dict]]] = [
    ("stats_hash_agree", check_stats_hash_agree), ("no_sync_per_op", check_no_sync_per_op),
    ("overhead", check_overhead), ("transient_memory", check_transient_memory),
    ("peak_memory", check_peak_memory), ("pinned_cap", check_pinned_cap), ("cuda_graph", check_cuda_graph)]


def _run_checks(ctx: Ctx, only: list[str] | None) -> dict:
    results = {}
    for name, fn in CHECKS:
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        try:
            res = fn(ctx)
        except Skip as e:
            res = {"status": "skip", "reason": str(e)}
        except Exception as e:  # noqa: BLE001 - one failing check never stops the others
            res = {"status": "error", "reason": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc(limit=6)}
        res["seconds"] = round(time.perf_counter() - t0, 2)
        results[name] = res
        print(f"[{res['status']:>5}] {name} ({res['seconds']} s)", flush=True)
    return results


def _print_summary(results: dict) -> None:
    print("\n| check | status | detail |\n|---|---|---|")
    for name, r in results.items():
        detail = {k: v for k, v in r.items() if k not in ("status", "seconds", "rounds", "table", "traceback")}
        print(f"| {name} | {r['status']} | {json.dumps(detail, default=str)[:300]} |")
    ov = results.get("overhead", {})
    if "table" in ov:
        print("\n| variant | median s | × untraced | × DebugMode+hashes |\n|---|---:|---:|---:|")
        for k, v in ov["table"].items():
            print(f"| {k} | {v['median_s']:.4f} | {v['x_untraced']:.2f} | {v['x_debugmode_hashes']:.2f} |")
        print("targets:", ", ".join(f"{k}: {'MET' if m else 'MISSED'}" for k, m in ov["targets_met"].items()))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="where to write the JSON results")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="smaller tensors and fewer rounds (CI)")
    ap.add_argument("--only", nargs="*", help="run only these checks")
    for name, default in (("layers", 4), ("hidden", 512), ("experts", 16), ("topk", 2), ("vocab", 4096),
                          ("tokens", 512), ("repeats", 5), ("warmup", 1)):
        ap.add_argument(f"--{name}", type=int, default=default)
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.experts, args.vocab, args.tokens = 2, 128, 4, 512, 64
        args.repeats, args.warmup = 2, 1
    ctx = Ctx(args)
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(ctx.dev),
           "gpu": torch.cuda.get_device_name(0) if ctx.cuda else None,
           "cuda": torch.version.cuda, "argv": sys.argv, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(json.dumps(env), flush=True)
    t0 = time.perf_counter()
    try:
        results = _run_checks(ctx, args.only)
    finally:
        shutil.rmtree(ctx.work, ignore_errors=True)
    doc = {"env": env, "total_seconds": round(time.perf_counter() - t0, 1), "checks": results}
    _print_summary(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, default=str))
    print(f"\nwrote {args.out} ({doc['total_seconds']} s)")
    return doc


if __name__ == "__main__":
    main()
