"""Tracing overhead on a CPU HF Qwen3-MoE forward: untraced vs tic-trace `stats` / `full` vs torch's
DebugMode (with and without tensor hashes) vs plain forward hooks that clone every module output.

    python benchmarks/bench_tracer.py                      # the table in benchmarks/README.md
    python benchmarks/bench_tracer.py --repeats 3 --tokens 128 --no-profile   # quick look

Every variant runs in the same process, interleaved round by round (so drift hits all of them alike), after
warm-up; each cell is the median over the rounds (minor page faults: the process's, per forward). Full mode's disk rate is compared with a plain sequential
write + fsync of a big file into the same directory, measured in the same run. The stats mode is then
profiled with pyinstrument (cProfile when pyinstrument is missing) and the top of the profile printed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tic_trace  # noqa: E402
from tic_trace.testing.hf_models import build_hf_model, sample_tokens, tiny_qwen3_config  # noqa: E402


def build_model(layers: int, hidden: int, experts: int, topk: int, vocab: int):
    cfg = tiny_qwen3_config(
        moe=True, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
        head_dim=hidden // 8, num_experts=experts, num_experts_per_tok=topk, moe_intermediate_size=hidden // 2,
        vocab_size=vocab, max_position_embeddings=4096)
    return build_hf_model(cfg, seed=0), cfg


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def disk_write_rate(directory: Path, total: int = 512 << 20, chunk: int = 8 << 20) -> float:
    """Sequential write + fsync of one big file: bytes per second."""
    buf = os.urandom(chunk)
    path = directory / "disk_rate.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(total // chunk):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    path.unlink()
    return total / dt


class CloneHooks:
    """The naive alternative: a forward hook on every module that clones its outputs into a list."""

    def __init__(self, model):
        self.model, self.saved, self.handles = model, [], []

    def __enter__(self):
        def hook(mod, args, out):
            self.saved.append(torch.utils._pytree.tree_map(
                lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else None, out))
        self.handles = [m.register_forward_hook(hook) for m in self.model.modules()]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.saved.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: on a shared 2-core machine, 2 OpenMP threads turn "
                         "other jobs' load into noise)")
    ap.add_argument("--dir", type=Path, default=None, help="where traces are written (default: a temp dir)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--profile-lines", type=int, default=40, help="lines of the flat (self-time) profile to print")
    ap.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    args = ap.parse_args()

    from torch.utils._debug_mode import DebugMode

    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    torch.manual_seed(0)
    model, cfg = build_model(args.layers, args.hidden, args.experts, args.topk, args.vocab)
    ids = sample_tokens(1, args.tokens, vocab=args.vocab)
    work = Path(tempfile.mkdtemp(prefix="tic-bench-", dir=args.dir))
    counter = [0]

    def fresh_dir() -> Path:
        counter[0] += 1
        return work / f"t{counter[0]}"

    info: dict = {}

    def traced(mode: str, points_mode: str):
        def run():
            out = fresh_dir()
            with tic_trace.trace(model, out, adapter="hf", mode=mode, points_mode=points_mode) as t:
                model(ids)
            assert t.failed is None, t.failed
            info[f"{mode}/{points_mode}"] = (out, t)
        return run

    def debug_mode(hashes: str | None):
        def run():
            with contextlib.ExitStack() as st:
                dm = st.enter_context(DebugMode())
                if hashes:
                    st.enter_context(DebugMode.log_tensor_hashes(hash_fn=hashes))
                model(ids)
            info[f"debugmode/{hashes}"] = len(dm.operators)
        return run

    def clone_hooks():
        with CloneHooks(model) as h:
            model(ids)
            info["hooks"] = sum(len(torch.utils._pytree.tree_leaves(s)) for s in h.saved)

    variants = {
        "untraced": lambda: model(ids),
        "tic-trace stats": traced("stats", "stats"),
        "tic-trace full (points full, ops stats)": traced("stats", "full"),
        "DebugMode (no hashes)": debug_mode(None),
        "DebugMode + log_tensor_hashes('norm')": debug_mode("norm"),
        "DebugMode + log_tensor_hashes('hash_tensor')": debug_mode("hash_tensor"),
        "forward hooks cloning every module output": clone_hooks,
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    faults: dict[str, list[int]] = {k: [] for k in variants}
    with torch.no_grad():
        for _ in range(args.warmup):
            for fn in variants.values():
                fn()
        for _ in range(args.repeats):
            for name, fn in variants.items():
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                c0, t0 = time.process_time(), time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
                keep = {v[0] for v in info.values() if isinstance(v, tuple)}
                for p in work.iterdir():          # keep the disk clean between rounds (outside the timing)
                    if p not in keep:
                        shutil.rmtree(p, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    cmed = {k: statistics.median(v) for k, v in cpu.items()}
    load1 = os.getloadavg()
    base = med["untraced"]
    stats_dir, stats_t = info["stats/stats"]
    full_dir, full_t = info["stats/full"]
    records = sum(len(p.records) for p in tic_trace.open_trace(full_dir).passes())
    full_bytes = dir_bytes(full_dir)
    full_blob = sum(p.stat().st_size for p in full_dir.rglob("*.bin"))
    disk = disk_write_rate(work)
    full_rate = full_bytes / med["tic-trace full (points full, ops stats)"]

    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
          f"{torch.__version__} ({torch.get_num_threads()} threads), python {platform.python_version()}")
    print(f"model: HF Qwen3-MoE H={args.hidden} layers={args.layers} experts={args.experts} top-{args.topk} "
          f"vocab={args.vocab}, {args.tokens} tokens x batch 1, fp32, CPU; median of {args.repeats} "
          f"(after {args.warmup} warm-up); load average {load0[0]:.1f} at start, {load1[0]:.1f} at end\n")
    print("| variant | wall s (median) | × untraced | × DebugMode+hashes | CPU s (median) | × untraced | "
          "minor page faults (median) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    dmh = med["DebugMode + log_tensor_hashes('norm')"]
    for k in variants:
        print(f"| {k} | {med[k]:.3f} | {med[k] / base:.2f} | {med[k] / dmh:.2f} | {cmed[k]:.3f} | "
              f"{cmed[k] / cmed['untraced']:.2f} | {statistics.median(faults[k]):.0f} |")
    print(f"\nrecords per pass: {records} (ops {sum(r.kind == 'op' for p in tic_trace.open_trace(full_dir).passes() for r in p.records)}); "
          f"DebugMode logged {info['debugmode/None']} ops; clone hooks saved {info['hooks']} tensors")
    print(f"full mode: {full_bytes / 1e6:.1f} MB per pass ({full_blob / 1e6:.1f} MB tensor bytes), "
          f"{full_rate / 1e6:.1f} MB/s while tracing; disk sequential write+fsync: {disk / 1e6:.0f} MB/s "
          f"(full mode uses {100 * full_rate / disk:.1f}% of it)")
    print(f"stats mode: {dir_bytes(stats_dir) / 1e6:.2f} MB per pass")
    s_ratio, f_ratio = med["tic-trace stats"] / base, med["tic-trace full (points full, ops stats)"] / base
    dmh_ratio = med["tic-trace stats"] / dmh
    cs, cf = cmed["tic-trace stats"] / cmed["untraced"], cmed["tic-trace full (points full, ops stats)"] / cmed["untraced"]
    cd = cmed["tic-trace stats"] / cmed["DebugMode + log_tensor_hashes('norm')"]
    met = lambda r, bound: f"{r:.2f}x {'met' if r <= bound else 'MISSED'}"    # noqa: E731
    print(f"\ntargets (issue 12), wall; CPU: stats <= 2x untraced: {met(s_ratio, 2)}; {met(cs, 2)} | "
          f"stats <= 0.5x DebugMode+hashes: {met(dmh_ratio, 0.5)}; {met(cd, 0.5)} | "
          f"full <= 2.5x untraced: {met(f_ratio, 2.5)}; {met(cf, 2.5)}")

    result = {"median_s": med, "all_s": times, "cpu_median_s": cmed, "minor_faults": faults, "load": [load0, load1], "records": records, "full_bytes": full_bytes,
              "disk_write_Bps": disk, "full_Bps": full_rate}

    if not args.no_profile:
        print("\n--- profile of one stats-mode traced forward ---")
        run = variants["tic-trace stats"]
        with torch.no_grad():
            try:
                from pyinstrument import Profiler
                prof = Profiler(interval=0.0005)
                prof.start()
                run()
                prof.stop()
                flat = prof.output_text(unicode=False, color=False, flat=True)
                print("\n".join(flat.splitlines()[:args.profile_lines]))
            except ImportError:
                import cProfile
                import pstats
                pr = cProfile.Profile()
                pr.enable()
                run()
                pr.disable()
                pstats.Stats(pr).sort_stats("tottime").print_stats(args.profile_lines)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
