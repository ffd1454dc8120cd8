"""Replay cost: the exact (float64) replay of one layer of the benchmark model against its traced forward.

    python benchmarks/bench_replay.py            # the row in benchmarks/README.md

Model: bench_tracer.py's HF Qwen3-MoE (H=512, 4 layers, 8/4 heads of 64, 16 experts top-2, vocab 4096),
512 tokens x batch 1, here in bf16 (the precision the replay is for). Side: one `points_mode="full"` trace.
Timed, each the median of `--repeats` rounds after one warm-up: the untraced forward, the traced forward
(trace written), the replay of every point of one layer (`SideReplayer.replay_all(layers=[1])`: loading the
layer's points and their inputs from the trace, reading the layer's weights from the safetensors checkpoint,
float64 recomputation and metrics), and the replay of the whole trace. One intra-op thread (shared machine).
"""
from __future__ import annotations

import argparse
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
from tic_trace.view.align import CanonicalView  # noqa: E402
from tic_trace.replay.intrinsic import SideReplayer  # noqa: E402
from tic_trace.replay.reference import ExactReference  # noqa: E402
from tic_trace.testing.hf_models import build_hf_model_stable, sample_tokens, tiny_qwen3_config  # noqa: E402


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layer", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = tiny_qwen3_config(moe=True, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                            num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=2,
                            moe_intermediate_size=256, vocab_size=4096, max_position_embeddings=4096)
    model = build_hf_model_stable(cfg, dtype=torch.bfloat16)
    ids = sample_tokens(1, args.tokens, vocab=4096)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model.save_pretrained(tmp / "ck")

        def forward():
            with torch.no_grad():
                model(ids)

        def traced():
            shutil.rmtree(tmp / "t", ignore_errors=True)
            with tic_trace.trace(model, tmp / "t", adapter="hf", points_mode="full"), torch.no_grad():
                model(ids)

        t_fwd = median_time(forward, args.repeats)
        t_traced = median_time(traced, args.repeats)
        ref = ExactReference(str(tmp / "ck"))
        results = []

        def replay_layer():
            results[:] = SideReplayer(CanonicalView(str(tmp / "t")), ref).replay_all(layers=[args.layer])

        def replay_all():
            SideReplayer(CanonicalView(str(tmp / "t")), ref).replay_all()

        t_layer = median_time(replay_layer, args.repeats)
        t_all = median_time(replay_all, 1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"tokens {args.tokens}, threads {args.threads}, {len(results)} points in layer {args.layer}")
    print(f"| untraced forward | traced forward (full) | replay of one layer | replay of the whole trace | peak RSS |")
    print(f"| {t_fwd * 1e3:.0f} ms | {t_traced * 1e3:.0f} ms | {t_layer * 1e3:.0f} ms "
          f"({t_layer / t_traced:.2f}x the traced forward) | {t_all * 1e3:.0f} ms | {peak:.0f} MiB |")


if __name__ == "__main__":
    main()
