"""The replay at real size: `find_divergence(A, B, reference=ckpt)` against the two traced forwards.

    python benchmarks/bench_replay_real.py                    # the table in benchmarks/README.md
    python benchmarks/bench_replay_real.py --profile out.html # + a pyinstrument profile of the finder

Model: an HF Llama at a 135M-class model's width (hidden 576, 30 layers, 9/3 heads of 64, MLP 1536, vocab
49152, tied embeddings: SmolLM-135M's config), bf16, trained-like weights (`--dist trained`: a massive BOS
channel and log-normal norm gains, tic_trace/testing/trained_like.py) or the test suite's random ones
(`--dist random`); 6 x 52 tokens, BOS first. Side A runs HF's eager attention, side B torch's SDPA: a clean
pair, every point replayed on each side. Timed once each on one intra-op thread (the measurement in issue 33
was on one core): tracing side A, tracing side B (`points_mode="full"`, trace written), and the finder with
the reference, each `--repeat` times (the least CPU time of each counts: the host is shared). The target
(issue 33): the finder at most 2x the two traced forwards together.
"""
from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tic_trace  # noqa: E402
from tic_trace import find_divergence  # noqa: E402
from tic_trace.testing import trained_like as tl  # noqa: E402
from tic_trace.testing.hf_models import build_hf_model_stable, sample_tokens  # noqa: E402


def llama_config(layers: int):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
                       num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                       rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048)


CPU: list[float] = []       # process CPU seconds of each timed step (every thread: the tracer's writer too)
REPEAT = [1]


def timed(fn) -> float:
    """The least wall seconds of REPEAT calls of fn(); their least process CPU seconds appended to CPU (the host
    is shared: CPU is the steadier, and the least of a few is the least disturbed)."""
    walls, cpus = [], []
    for _ in range(REPEAT[0]):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        cpus.append(time.process_time() - c0)
        walls.append(time.perf_counter() - t0)
    CPU.append(min(cpus))
    return min(walls)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--seq", type=int, default=52)
    ap.add_argument("--dist", choices=("trained", "random"), default="trained")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3, help="times each step is timed (the least counts)")
    ap.add_argument("--profile", default="", help="write a pyinstrument HTML profile of the finder here")
    args = ap.parse_args()
    REPEAT[0] = max(1, args.repeat)
    torch.set_num_threads(args.threads)
    model = build_hf_model_stable(llama_config(args.layers), seed=1, dtype=torch.bfloat16)
    if args.dist == "trained":
        with torch.no_grad():
            tl.massive_activations(model, seed=1)
            tl.lognormal_norm_gains(model)
    ids = tl.bos_first(sample_tokens(args.batch, args.seq, vocab=49152))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model.save_pretrained(tmp / "ck")

        last = {}

        def trace(side):                # a new directory each time: the finder reads the last
            last[side] = path = tmp / f"{side}{len(list(tmp.glob(side + '*')))}"
            with tic_trace.trace(model, path, adapter="hf", points_mode="full") as t, torch.no_grad():
                model(ids)
            assert t.failed is None, t.failed

        trace("warm-up")                # the tracer's one-time costs (its kernels' JIT compile) out of the timing
        with torch.no_grad():
            t_fwd = timed(lambda: model(ids))
        t_a = timed(lambda: trace("a"))
        model.set_attn_implementation("sdpa")
        t_b = timed(lambda: trace("b"))
        rep = []

        def finder():
            rep.append(find_divergence(str(last["a"]), str(last["b"]), reference=str(tmp / "ck")))
        t_find = timed(finder)
        if args.profile:            # one more run, profiled: the timing above is without the profiler
            from pyinstrument import Profiler
            prof = Profiler(interval=0.005)
            prof.start()
            finder()
            prof.stop()
            Path(args.profile).write_text(prof.output_html())
            print(prof.output_text(unicode=False, color=False, show_all=False)[:6000])
    r = rep[-1]
    replayed = sum(1 for p in r.points if p.intrinsic and "a" in p.intrinsic)
    blamed = [(p.key, (p.replay or {}).get("reason", "")[:160]) for p in r.points if (p.replay or {}).get("side")]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cov = r.to_json().get("coverage", {}).get("replay", {})
    print(f"{args.layers} layers, {args.batch} x {args.seq} tokens, {args.dist} weights, {args.threads} thread(s), "
          f"least of {REPEAT[0]}; verdict {r.verdict}, {replayed} points replayed, {len(blamed)} blamed; "
          f"rows {cov.get('rows')}, columns {cov.get('columns')}")
    for key, why in blamed[:6]:
        print(f"  blamed {key}: {why}")
    c_fwd, c_a, c_b, c_find = CPU
    print("| | untraced forward | trace A (eager) | trace B (SDPA) | finder + reference | finder / (A + B) | peak RSS |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(f"| wall | {t_fwd:.1f} s | {t_a:.1f} s | {t_b:.1f} s | {t_find:.1f} s | {t_find / (t_a + t_b):.2f} | "
          f"{peak:.0f} MiB |")
    print(f"| CPU | {c_fwd:.1f} s | {c_a:.1f} s | {c_b:.1f} s | {c_find:.1f} s | {c_find / (c_a + c_b):.2f} | |")


if __name__ == "__main__":
    main()
