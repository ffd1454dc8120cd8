"""Attribution cost: the exact model's float64 forward and backward (`replay.attribution.attribute`) against
the traced forward and against the finder with the reference, on bench_replay.py's model.

    python benchmarks/bench_attribution.py       # the row in benchmarks/README.md

Model: HF Qwen3-MoE (H=512, 4 layers, 8/4 heads of 64, 16 experts top-2, vocab 4096) in bf16, `--tokens`
tokens x batch 2. Side A: the model as saved; side B: the same weights with RMSNorm without its fp32 upcast in
layer 1 (tic_trace.testing.precision_faults), so there is a gap to attribute. Timed, each the median of
`--repeats` rounds after one warm-up: the untraced forward, the traced forward (`points_mode="full"`, trace
written), `find_divergence(reference=...)` and the same with `attribution=True`, and `attribute()` alone.
"""
from __future__ import annotations

import argparse
import resource
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import tic_trace  # noqa: E402
from bench_replay import median_time  # noqa: E402
from tic_trace.replay.attribution import attribute  # noqa: E402
from tic_trace.replay.reference import ExactReference  # noqa: E402
from tic_trace.testing.hf_models import build_hf_model_stable, sample_tokens, tiny_qwen3_config  # noqa: E402
from tic_trace.testing.precision_faults import PRECISION_FAULTS  # noqa: E402
from tic_trace.view.align import CanonicalView  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = tiny_qwen3_config(moe=True, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                            num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=2,
                            moe_intermediate_size=256, vocab_size=4096, max_position_embeddings=4096)
    ids = sample_tokens(2, args.tokens, vocab=4096)
    a, b = build_hf_model_stable(cfg, dtype=torch.bfloat16), build_hf_model_stable(cfg, dtype=torch.bfloat16)
    PRECISION_FAULTS["rmsnorm_no_upcast"].plant(b, 1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        a.save_pretrained(tmp / "ck")

        def forward():
            with torch.no_grad():
                a(ids)

        def traced(model=a, name="a"):
            shutil.rmtree(tmp / name, ignore_errors=True)
            with tic_trace.trace(model, tmp / name, adapter="hf", points_mode="full"), torch.no_grad():
                model(ids)

        t_fwd = median_time(forward, args.repeats)
        t_traced = median_time(traced, args.repeats)
        traced(b, "b")
        ref = ExactReference(str(tmp / "ck"))
        out = {}

        def finder(attribution=False):
            out["rep"] = tic_trace.find_divergence(str(tmp / "a"), str(tmp / "b"), reference=ref,
                                                   attribution=attribution)

        def attribute_only():
            out["att"] = attribute(CanonicalView(str(tmp / "a")), CanonicalView(str(tmp / "b")), ref)

        t_find = median_time(finder, 1)
        t_find_att = median_time(lambda: finder(True), 1)
        t_att = median_time(attribute_only, args.repeats)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    att = out["att"]
    print(f"tokens 2 x {args.tokens}, threads {args.threads}; answer {att.first}, explained {att.explained:.2f}")
    print("| untraced forward | traced forward (full) | finder + reference | finder + reference + attribution "
          "| attribute() alone | peak RSS |")
    print(f"| {t_fwd * 1e3:.0f} ms | {t_traced * 1e3:.0f} ms | {t_find * 1e3:.0f} ms | {t_find_att * 1e3:.0f} ms "
          f"| {t_att * 1e3:.0f} ms ({t_att / t_traced:.1f}x the traced forward) | {peak:.0f} MiB |")


if __name__ == "__main__":
    main()
