"""Comparator throughput and memory: `find_divergence` on two full traces of the same HF Qwen3-MoE (side B
with one planted 0.1% scale on a mid-layer norm, so the walk finds a divergence and still visits every point),
against a bare numpy pass that memory-maps the same blob files and computes a max-abs-diff in chunks.

    python benchmarks/bench_compare.py                       # the table in benchmarks/README.md
    python benchmarks/bench_compare.py --sizes 2x128         # quick look

Each measurement runs in a fresh child process, so `ru_maxrss` is that measurement's own. Timings are with
a warm page cache (the traces were just written). Peak memory is reported three ways: the tracemalloc peak
(Python + numpy heap allocations, in a separate run since tracing allocations slows Python down), ru_maxrss
growth during the call (includes file pages of the memory maps that were touched), and the peak of RssAnon
(anonymous memory only: heap, not page cache) sampled every 2 ms.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _children_cpu() -> float:
    """CPU seconds of this process's finished children (the finder's worker processes, once reaped)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _rss_anon_kib() -> int:
    return _status_kib("RssAnon")


class _AnonPeak:
    def __init__(self):
        self.peak, self._stop = 0, threading.Event()

    def __enter__(self):
        self.base = _rss_anon_kib()
        self.peak = self.base
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_anon_kib())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss_anon_kib())


class _NoPeak:
    peak = base = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def bare_pass(a: Path, b: Path, chunk: int = 1 << 20) -> dict:
    """Max |a - b| over the blob files, read as float32 through np.memmap, chunk by chunk."""
    import numpy as np
    total, worst = 0, 0.0
    for fa in sorted(a.rglob("pass*.bin")):
        fb = b / fa.relative_to(a)
        ma = np.memmap(fa, dtype=np.uint8, mode="r")
        mb = np.memmap(fb, dtype=np.uint8, mode="r")
        n = min(ma.size, mb.size) // 4
        va, vb = ma[:n * 4].view(np.float32), mb[:n * 4].view(np.float32)
        for off in range(0, n, chunk):
            d = np.abs(va[off:off + chunk] - vb[off:off + chunk])
            worst = max(worst, float(np.fmax.reduce(d)) if d.size else 0.0)
        total += ma.size + mb.size
        del ma, mb, va, vb
    return {"bytes": total, "max_abs": worst}


def value_items(a: Path, b: Path) -> list[tuple]:
    """(blob A, offset A, blob B, offset B, shape, storage dtype, dtype) for every record stored on both sides."""
    import tic_trace
    from tic_trace.store.dtypes import dtype_info
    items = []
    for pa, pb in zip(tic_trace.open_trace(a).passes(), tic_trace.open_trace(b).passes()):
        for ra in pa.records:
            rb = pb.get(ra.name)
            if ra.has_data and rb is not None and rb.has_data and ra.stored_shape == rb.stored_shape:
                items.append((str(pa.blob_path), ra.offset, str(pb.blob_path), rb.offset, ra.stored_shape,
                              dtype_info(ra.dtype).storage, ra.dtype))
    return items


def compare_item(item: tuple) -> tuple[int, float]:
    """compare_values on one record pair, both sides memory-mapped from their blobs (a worker's unit)."""
    import numpy as np
    from tic_trace.compare.metrics import compare_values
    from tic_trace.store.dtypes import to_float
    blob_a, off_a, blob_b, off_b, shape, storage, dtype = item
    va, vb = (to_float(np.memmap(blob, dtype=storage, mode="r", offset=off, shape=tuple(shape)), dtype)
              for blob, off in ((blob_a, off_a), (blob_b, off_b)))
    m = compare_values(va, vb, dtype)
    return 2 * va.nbytes, m.rel_l2


def values_pass(a: Path, b: Path, workers: int) -> dict:
    from tic_trace.compare.parallel import fork_is_safe, map_ordered
    items = value_items(a, b)
    t0 = time.perf_counter()
    out = map_ordered(compare_item, items, workers=workers, start_method="fork" if fork_is_safe() else "spawn")
    return {"bytes": sum(n for n, _ in out), "points": len(out), "map_seconds": time.perf_counter() - t0}


def child(kind: str, a: str, b: str, trace_mem: bool) -> None:
    """One measurement in this (fresh) process; prints a JSON line."""
    import tracemalloc

    import numpy as np  # noqa: F401  (imported before the baseline)
    from tic_trace import find_divergence
    if trace_mem:
        tracemalloc.start()
    rss0 = _status_kib("VmRSS")
    try:   # reset the kernel's peak-RSS counter (VmHWM, what ru_maxrss reads) to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        hwm_reset = True
    except OSError:
        hwm_reset = False
    # The RssAnon sampler is a thread; the finder forks its workers only from a process without other
    # threads (parallel.fork_is_safe), as the CLI is: the worker-count runs go without it.
    with (_AnonPeak() if ":" not in kind or kind.endswith(":1") else _NoPeak()) as anon:
        c0, t0 = time.process_time(), time.perf_counter()
        if kind.startswith("finder"):
            workers = int(kind.split(":")[1]) if ":" in kind else 1
            ch0 = _children_cpu()
            rep = find_divergence(a, b, workers=workers)
            doc = json.dumps(rep.to_json(), sort_keys=True).encode()
            extra = {"verdict": rep.verdict, "first": rep.first["key"] if rep.first else None,
                     "points": len(rep.points), "workers": workers, "report_sha": hashlib.sha256(doc).hexdigest(),
                     "workers_cpu_seconds": _children_cpu() - ch0}
        elif kind.startswith("values"):
            extra = values_pass(Path(a), Path(b), int(kind.split(":")[1]))
        else:
            extra = bare_pass(Path(a), Path(b))
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    # ru_maxrss = max(peak RSS of this process, peak inherited at exec from the parent that forked us); the
    # parent holds the model, so the raw value says nothing about this call. VmHWM is the same kernel counter
    # without the inherited part, reset just before the call: its excess over the RSS before is the call's
    # peak growth (file pages of touched memory maps count in RSS too).
    peak = _status_kib("VmHWM") if hwm_reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"seconds": dt, "cpu_seconds": cpu, "loadavg": os.getloadavg()[0], "peak_rss_growth_kib": max(0, peak - rss0), "hwm_reset": hwm_reset,
           "ru_maxrss_raw_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "rss_before_kib": rss0,
           "anon_peak_growth_kib": anon.peak - anon.base, **extra}
    if trace_mem:
        out["tracemalloc_peak"] = tracemalloc.get_traced_memory()[1]
    print(json.dumps(out))


def _run_child(kind: str, a: Path, b: Path, trace_mem: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, str(HERE), "--child", kind, str(a), str(b)] + (["--trace-mem"] if trace_mem else []),
                       capture_output=True, text=True, env=env, check=False)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def make_traces(work: Path, layers: int, tokens: int, vocab: int) -> tuple[Path, Path, dict]:
    import torch

    import tic_trace
    from bench_tracer import build_model
    from tic_trace.testing.hf_models import sample_tokens
    torch.set_num_threads(1)
    model, _ = build_model(layers, 512, 16, 2, vocab)
    ids = sample_tokens(1, tokens, vocab=vocab)
    a, b = work / f"A_{layers}x{tokens}", work / f"B_{layers}x{tokens}"
    with torch.no_grad():
        with tic_trace.trace(model, a, adapter="hf", mode="stats", points_mode="full"):
            model(ids)
        model.model.layers[layers // 2].post_attention_layernorm.weight.mul_(1.001)
        with tic_trace.trace(model, b, adapter="hf", mode="stats", points_mode="full"):
            model(ids)
    tr = tic_trace.open_trace(a)
    recs = [r for p in tr.passes() for r in p.records]
    largest = max(r.nbytes for r in recs if r.has_data)
    logits = next(r.nbytes for r in recs if r.name == "lm_head:out")
    blob = sum(p.stat().st_size for p in a.rglob("*.bin"))
    return a, b, {"records": len(recs), "stored": sum(r.has_data for r in recs), "blob_bytes": blob,
                  "largest_tensor_bytes": largest, "logits_bytes": logits}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2x256,8x256,8x1024", help="comma-separated LAYERSxTOKENS")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2],
                    help="worker counts for the compare_values pass and the finder (comma-separated)")
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--child", nargs=3, metavar=("KIND", "A", "B"), help=argparse.SUPPRESS)
    ap.add_argument("--trace-mem", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child, trace_mem=args.trace_mem)
        return

    sys.path.insert(0, str(HERE.parent))
    work = Path(tempfile.mkdtemp(prefix="tic-bench-compare-", dir=args.dir))
    rows, fin_ws = [], []
    try:
        for size in args.sizes.split(","):
            layers, tokens = (int(x) for x in size.lower().split("x"))
            t0 = time.perf_counter()
            a, b, meta = make_traces(work, layers, tokens, args.vocab)
            t_trace = time.perf_counter() - t0
            fin = _run_child("finder", a, b, False)
            fin_mem = _run_child("finder", a, b, True)
            bare = _run_child("bare", a, b, False)
            bare_mem = _run_child("bare", a, b, True)
            vals = {w: _run_child(f"values:{w}", a, b, False) for w in args.workers}
            fin_w = {w: fin if w == 1 else _run_child(f"finder:{w}", a, b, False) for w in args.workers}
            fin_ws.append((size, meta, fin_w))
            vals_mem = _run_child(f"values:1", a, b, True)
            rows.append((size, meta, fin, fin_mem, bare, bare_mem, t_trace, vals, vals_mem))
            shutil.rmtree(a)
            shutil.rmtree(b)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    mb = 1e6
    print(f"\nHF Qwen3-MoE H=512, 16 experts top-2, vocab {args.vocab}, fp32; points_mode=full, ops stats; "
          f"side B: layer L/2 post-attention norm weight x1.001\n")
    print("| layers×tokens | records (stored) | blob per side | largest stored / compared tensor | "
          "find_divergence s | MB/s | bare memmap pass s | MB/s | finder ÷ bare |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size, meta, fin, _, bare, _, _, *_ in rows:
        both = 2 * meta["blob_bytes"]
        print(f"| {size} | {meta['records']} ({meta['stored']}) | {meta['blob_bytes'] / mb:.1f} MB | "
              f"{meta['largest_tensor_bytes'] / mb:.1f} / {meta['logits_bytes'] / mb:.1f} MB | "
              f"{fin['seconds']:.2f} | {both / mb / fin['seconds']:.0f} | "
              f"{bare['seconds']:.3f} | {both / mb / bare['seconds']:.0f} | {fin['seconds'] / bare['seconds']:.0f}× |")
    print("\nCPU time of this process (the machine is shared: wall time includes other jobs' load); "
          "load average during the finder call: " + ", ".join(f"{r[0]}: {r[2]['loadavg']:.1f}" for r in rows))
    print("\n| layers×tokens | find_divergence CPU s | MB/s | bare CPU s | MB/s | finder ÷ bare | compare_values "
          "(1 worker, in process) CPU s | MB/s | ÷ bare |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size, meta, fin, _, bare, _, _, vals, _ in rows:
        both, v1 = 2 * meta["blob_bytes"], vals.get(1)
        cells = (f"{v1['cpu_seconds']:.2f} | {v1['bytes'] / mb / v1['cpu_seconds']:.0f} | "
                 f"{(v1['bytes'] / v1['cpu_seconds']) / (both / bare['cpu_seconds']):.2f}×") if v1 else "- | - | -"
        print(f"| {size} | {fin['cpu_seconds']:.2f} | {both / mb / fin['cpu_seconds']:.0f} | {bare['cpu_seconds']:.3f} | "
              f"{both / mb / bare['cpu_seconds']:.0f} | {fin['cpu_seconds'] / bare['cpu_seconds']:.0f}× | {cells} |")
    print("\ncompare_values on every record stored on both sides, memory-mapped, through tic_trace.compare.parallel "
          "(forked workers where parallel.fork_is_safe(); wall time, includes starting the workers):\n")
    print("| layers×tokens | records | bytes (both sides) | " + " | ".join(
        f"{w} worker{'s' if w > 1 else ''}: s / MB/s / ÷ bare" for w in args.workers)
          + " | tracemalloc peak (1 worker) |")
    print("|---|---:|---:|" + "---:|" * len(args.workers) + "---:|")
    for size, meta, fin, _, bare, _, _, vals, vals_mem in rows:
        bare_rate = 2 * meta["blob_bytes"] / bare["seconds"]
        cells = []
        for w in args.workers:
            v = vals[w]
            rate = v["bytes"] / v["seconds"]
            cells.append(f"{v['seconds']:.2f} / {rate / mb:.0f} / {rate / bare_rate:.2f}×")
        print(f"| {size} | {vals[args.workers[0]]['points']} | {vals[args.workers[0]]['bytes'] / mb:.0f} MB | "
              + " | ".join(cells) + f" | {vals_mem['tracemalloc_peak'] / mb:.1f} MB |")
    print("\nfind_divergence(..., workers=N) (`--workers N`), each in a fresh process; CPU: the calling process "
          "/ its worker processes together (RUSAGE_CHILDREN) and per worker; same report: sha256 of the JSON "
          "report equal to the one-worker report:\n")
    print("| layers×tokens | workers | wall s | MB/s | speed-up | CPU s: caller / workers (per worker) | "
          "load avg | same report |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for size, meta, fw in fin_ws:
        base = fw[args.workers[0]]
        for w in args.workers:
            f = fw[w]
            print(f"| {size} | {w} | {f['seconds']:.2f} | {2 * meta['blob_bytes'] / mb / f['seconds']:.0f} | "
                  f"{base['seconds'] / f['seconds']:.2f}× | {f['cpu_seconds']:.2f} / {f['workers_cpu_seconds']:.2f} "
                  f"({f['workers_cpu_seconds'] / w if w > 1 else 0:.2f}) | {f['loadavg']:.1f} | "
                  f"{'yes' if f['report_sha'] == base['report_sha'] else 'NO'} |")
    print("\n| layers×tokens | both traces | finder: tracemalloc peak | ÷ compared tensor | RssAnon peak growth | "
          "peak RSS growth (VmHWM) | bare: tracemalloc peak | RssAnon growth | peak RSS growth |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size, meta, fin, fin_mem, bare, bare_mem, _, *_ in rows:
        print(f"| {size} | {2 * meta['blob_bytes'] / mb:.0f} MB | {fin_mem['tracemalloc_peak'] / mb:.1f} MB | "
              f"{fin_mem['tracemalloc_peak'] / meta['logits_bytes']:.1f}× | "
              f"{fin['anon_peak_growth_kib'] / 1e3:.1f} MB | {fin['peak_rss_growth_kib'] / 1e3:.1f} MB | "
              f"{bare_mem['tracemalloc_peak'] / mb:.1f} MB | {bare['anon_peak_growth_kib'] / 1e3:.1f} MB | "
              f"{bare['peak_rss_growth_kib'] / 1e3:.1f} MB |")
    print("\nverdicts: " + "; ".join(f"{s}: {f['verdict']} at {f['first']} ({f['points']} points)"
                                     for s, _, f, *_ in rows))
    print("building + tracing both sides: " + ", ".join(f"{r[0]}: {r[6]:.1f} s" for r in rows))
    print("RSS before the call (torch imported): " + ", ".join(f"{r[0]}: {r[2]['rss_before_kib'] / 1e3:.0f} MB"
                                                               for r in rows)
          + f"; raw ru_maxrss of the child (includes the peak inherited from the parent at exec): "
          + ", ".join(f"{r[0]}: {r[2]['ru_maxrss_raw_kib'] / 1e3:.0f} MB" for r in rows)
          + ("" if all(r[2]["hwm_reset"] for r in rows) else " (VmHWM reset unavailable: growth from ru_maxrss)"))


if __name__ == "__main__":
    main()
