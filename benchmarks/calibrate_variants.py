"""Calibrate the variant envelope's margin on one half of the clean pairs and validate it on the other.

    python benchmarks/calibrate_variants.py --seeds 4 --head-dims 16,64,128      # docs/replay.md, "Calibration"
    python benchmarks/calibrate_variants.py --mla --seeds 4 --head-dims 16,128   # DeepSeek-V3's latent ops
    python benchmarks/calibrate_variants.py --arch Gemma3ForCausalLM --seeds 4 --head-dims 16,128

Real HF Qwen3-MoE bf16 (transformers' modeling code), three weight distributions (random init; wide
log-normal norm gains; log-normal gains + massive-activation channels + attention sinks:
`tic_trace/testing/trained_like.py`), several head sizes. Side A is unmodified HF; side B a clean
implementation (`tic_trace/testing/clean_variants.py`, fp32 RoPE tables rounded once, each sample run alone)
or one precision fault (`precision_faults.py`) planted at layer `seed % 2`. Both are replayed against the
same checkpoint; each side's point is measured against the worst clean variant on its own inputs
(`replay/variants.py`). Seeds of even index form the calibration half, odd ones the validation half.

Prints, per half: per op the largest ratio excess / worst-clean-variant excess over every clean side (the
margin a clean implementation needs), the margin the calibration half implies (its largest ratio, +2 %,
rounded up), and with the default margins (`Margins()`): clean pairs blamed and faults found at exactly their
point and layer with the side (and, for 16-bit faults, the matching variant) named.

`--mla`: DeepSeek-V3 (multi-latent attention, sigmoid group-limited MoE, a dense first layer) instead;
`--head-dims` are then q/k's nope dims (rope dims half of them, v as nope). MLA's own ops (its latent norms,
RoPE and attention: `families/deepseek/ops.py`) have no clean variants: they are judged by the constant envelope, so
this mode also prints, per envelope-judged op, the largest clean excess on each half against
`intrinsic_verdict.ENVELOPE`. The trained-like "massive" weights get no attention sinks there (the sink
construction reads q_proj/k_proj).

`--arch` NAME: one of the Gemma 2, Gemma 3, Phi-3 and GPT-OSS configs of the test suite
(`tests/arch_configs_gemma_phi3_gptoss.py`) at the given head dims, with the clean pairs that are clean for it
(the attention emulations know no soft-cap or sinks: Gemma 2 and GPT-OSS run without them) and its faults.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tic_trace  # noqa: E402
from tic_trace.replay.intrinsic import IntrinsicError  # noqa: E402
from tic_trace.replay.intrinsic_verdict import ENVELOPE, intrinsic_walk  # noqa: E402
from tic_trace.replay.reference import ExactReference  # noqa: E402
from tic_trace.testing import trained_like  # noqa: E402
from tic_trace.testing.clean_variants import CLEAN_VARIANTS, rope_fp32_tables  # noqa: E402
from tic_trace.testing.hf_models import build_hf_model_stable, sample_tokens, tiny_qwen3_config  # noqa: E402
from tic_trace.testing.precision_faults import PRECISION_FAULTS  # noqa: E402
from tic_trace.view.align import CanonicalView  # noqa: E402

CLEAN = ["identical", *CLEAN_VARIANTS, "rope_fp32_tables_rounded", "batch_split"]
FAULTS = ["rmsnorm_no_upcast", "mlp_norm_no_upcast", "final_norm_no_upcast", "qk_norm_no_upcast",
          "k_norm_no_upcast", "softmax_bf16", "silu_bf16", "rope_fp32_tables", "router_fp32", "lm_head_fp32"]
DISTS = ["random", "gains", "massive"]


DENSE = False       # --dense: the dense Qwen3 (no router, no experts) instead of Qwen3-MoE
MLA = False         # --mla: DeepSeek-V3
# clean implementations and faults that apply to MLA's modules (no q/k/v projections, no QK-norm, no RoPE
# through apply_rotary_pos_emb)
MLA_CLEAN = ["identical", "tp2_row_parallel", "flash_attention", "sdpa_math", "sdpa", "fused_norm", "batch_split"]
MLA_FAULTS = ["rmsnorm_no_upcast", "mlp_norm_no_upcast", "final_norm_no_upcast", "softmax_bf16",
              "q_a_norm_no_upcast", "kv_a_norm_no_upcast"]


ARCH = ""          # --arch: one of ARCH_CASES
_NORM_FAULTS = ["rmsnorm_no_upcast", "mlp_norm_no_upcast", "final_norm_no_upcast"]
_ATTN_CLEAN = ["flash_attention", "sdpa_math", "sdpa"]
# (clean pairs, faults, whether trained_like.attention_sinks applies: it edits q_proj / k_proj)
ARCH_CASES = {
    "Gemma2ForCausalLM": (["identical", "tp2_row_parallel", "batch_split"],
                          ["gemma_input_norm_no_upcast", "gemma_attn_post_norm_no_upcast"], True),
    "Gemma3ForCausalLM": (["identical", "tp2_row_parallel", *_ATTN_CLEAN, "batch_split"],
                          ["gemma_input_norm_no_upcast", "gemma_attn_post_norm_no_upcast", "gemma_q_norm_no_upcast",
                           "softmax_bf16"], True),
    "Phi3ForCausalLM": (["identical", "tp2_row_parallel", *_ATTN_CLEAN, "fused_norm", "batch_split"],
                        [*_NORM_FAULTS, "softmax_bf16"], False),
    "GptOssForCausalLM": (["identical", "tp2_row_parallel", "fused_norm", "batch_split"], _NORM_FAULTS, True),
}


def arch_config(name: str, head_dim: int):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from arch_configs_gemma_phi3_gptoss import GEMMA_PHI3_GPTOSS
    cfg = GEMMA_PHI3_GPTOSS[name]()
    if name == "Phi3ForCausalLM":       # head_dim = hidden / heads
        cfg.hidden_size = head_dim * cfg.num_attention_heads
    else:
        cfg.head_dim = head_dim
        if hasattr(cfg, "query_pre_attn_scalar"):
            cfg.query_pre_attn_scalar = head_dim
    cfg._attn_implementation = "eager"
    return cfg


def deepseek_config(nope: int):
    from transformers import DeepseekV3Config
    cfg = DeepseekV3Config(vocab_size=128, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=4, intermediate_size=128, max_position_embeddings=256,
                           rms_norm_eps=1e-6, tie_word_embeddings=False, n_routed_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
                           topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=64,
                           q_lora_rank=48, qk_nope_head_dim=nope, qk_rope_head_dim=max(nope // 2, 8), v_head_dim=nope)
    cfg._attn_implementation = "eager"
    return cfg


def build(dist: str, seed: int, head_dim: int, ids: torch.Tensor):
    cfg = (arch_config(ARCH, head_dim) if ARCH else deepseek_config(head_dim) if MLA
           else tiny_qwen3_config(moe=not DENSE, head_dim=head_dim))
    m = build_hf_model_stable(cfg, seed=seed, dtype=torch.bfloat16)
    if dist in ("gains", "massive"):
        trained_like.lognormal_norm_gains(m, seed=seed, sigma=1.5, high=41.0, include_qk=True)
    if dist == "massive":
        trained_like.massive_activations(m, sorted({int(t) for t in ids[:, 0]}), channels=(3, 17), scale=2000.0, positive=True)
        if not MLA and (not ARCH or ARCH_CASES[ARCH][2]):
            trained_like.attention_sinks(m)
    return m


def trace(model, path: Path, ids: torch.Tensor, split: bool = False) -> None:
    shutil.rmtree(path, ignore_errors=True)
    t = tic_trace.trace(model, path, adapter="hf", points_mode="full")
    t.start()
    with torch.no_grad():
        if split:                         # each sample alone: other GEMM shapes, same rows
            for i in reversed(range(ids.shape[0])):
                t.sample_keys = [f"s{i}"]
                model(ids[i:i + 1])
                t.step()
        else:
            model(ids)
    t.stop()
    assert t.failed is None, t.failed


def side_b(name: str, dist: str, seed: int, hd: int, ids, path: Path) -> None:
    m = build(dist, seed, hd, ids)
    ctx = rope_fp32_tables(m) if name == "rope_fp32_tables_rounded" else contextlib.nullcontext()
    if name in CLEAN_VARIANTS:
        CLEAN_VARIANTS[name](m)
    elif name in PRECISION_FAULTS:
        PRECISION_FAULTS[name].plant(m, seed % 2)
    with ctx:
        trace(m, path, ids, split=name == "batch_split")


def case(work: Path, name: str, dist: str, seed: int, hd: int, ids) -> dict:
    base = work / f"{dist}_{seed}_{hd}"
    if not (base / "a").exists():
        a = build(dist, seed, hd, ids)
        a.save_pretrained(base / "ck")
        trace(a, base / "a", ids)
    side_b(name, dist, seed, hd, ids, base / "b")
    walk = intrinsic_walk(CanonicalView(str(base / "a")), CanonicalView(str(base / "b")), ExactReference(str(base / "ck")))
    ratios, envelope_judged = [], []
    for v in walk:
        for e in (v.a, v.b) if name not in PRECISION_FAULTS else (v.a,):
            if isinstance(e, IntrinsicError) and e.match_layout:    # an undeclared TP split: named, not judged
                continue
            if isinstance(e, IntrinsicError) and e.clean_excess > 0:
                ratios.append((e.envelope_key, e.excess / max(e.clean_excess, 1.0)))
            elif isinstance(e, IntrinsicError) and e.envelope_key in ENVELOPE and e.dtype == "bfloat16":
                envelope_judged.append((e.envelope_key, e.excess))
    blamed = [(v.key, v.side, v.kind, (v.b.match_kind, v.b.match) if isinstance(v.b, IntrinsicError) else ("", ""))
              for v in walk if v.side]
    fault_ratio = None
    if name in PRECISION_FAULTS:        # the planted side at the fault's own point, against its variant limit
        f = PRECISION_FAULTS[name]
        key = f"L{seed % 2}.{f.point}" if f.layered else f.point
        e = next((v.b for v in walk if v.key == key), None)
        if isinstance(e, IntrinsicError) and e.clean_excess > 0:
            fault_ratio = e.excess / max(e.clean_excess, 1.0)
    return {"ratios": ratios, "envelope": envelope_judged, "blamed": blamed, "fault_ratio": fault_ratio}


def fault_found(name: str, seed: int, blamed: list) -> bool:
    f = PRECISION_FAULTS[name]
    key = f"L{seed % 2}.{f.point}" if f.layered else f.point
    side = "B" if f.worse == "planted" else "A"
    if not blamed or blamed[0][0] != key or blamed[0][1] != side:
        return False
    # a 16-bit fault: its variant is named (an op with no variants, MLA's latent norms, has none to name)
    return f.worse == "clean" or blamed[0][3][0] in ("fault", "")


def main() -> None:
    import tic_trace.replay.variant_fit as variant_fit
    variant_fit.STOP_AT_EXACT_CLEAN = False  # every clean variant: each clean side measured against the worst
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--head-dims", default="16,64")
    ap.add_argument("--dists", default=",".join(DISTS))
    ap.add_argument("--dense", action="store_true", help="the dense model (MoE-only faults left out)")
    ap.add_argument("--mla", action="store_true", help="DeepSeek-V3 (multi-latent attention) instead of Qwen3")
    ap.add_argument("--arch", choices=sorted(ARCH_CASES), help="a Gemma 2/3, Phi-3 or GPT-OSS model instead")
    args = ap.parse_args()
    global DENSE, MLA, ARCH
    DENSE, MLA, ARCH = args.dense, args.mla, args.arch or ""
    faults = (ARCH_CASES[ARCH][1] if ARCH else MLA_FAULTS if MLA
              else [f for f in FAULTS if not (DENSE and PRECISION_FAULTS[f].moe_only)])
    clean = ARCH_CASES[ARCH][0] if ARCH else MLA_CLEAN if MLA else CLEAN
    torch.set_num_threads(1)
    ids = sample_tokens(args.batch, args.seq)
    hds = [int(x) for x in args.head_dims.split(",")]
    dists = args.dists.split(",")
    halves = {0: defaultdict(list), 1: defaultdict(list)}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for dist in dists:
            for hd in hds:
                for seed in range(args.seeds):
                    h = halves[seed % 2]
                    for name in clean + faults:
                        r = case(Path(tmp), name, dist, seed, hd, ids)
                        for op, x in r["ratios"]:
                            h[("ratio", op)].append(x)
                        for op, x in r["envelope"]:
                            h[("envelope", op)].append(x)
                        if name in PRECISION_FAULTS:
                            if r["fault_ratio"] is not None:
                                h[("fault", name)].append(r["fault_ratio"])
                            h["faults"].append((name, dist, seed, hd, fault_found(name, seed, r["blamed"]), r["blamed"][:1]))
                        else:
                            h["clean"].append((name, dist, seed, hd, r["blamed"]))
                    print(f"# {dist} hd={hd} seed={seed} done ({time.time() - t0:.0f}s)", file=sys.stderr)
    report(halves)


def _tagged(halves: dict, tag: str) -> list[str]:
    """The names recorded under `tag` ("ratio", "fault", "envelope") on either half."""
    return sorted({k[1] for h in halves.values() for k in h if isinstance(k, tuple) and k[0] == tag})


def report(halves: dict) -> None:
    ops = _tagged(halves, "ratio")
    print("| op | calibration: max clean excess / worst clean variant | validation |")
    print("|---|---:|---:|")
    for op in ops:
        c, v = (max(halves[i].get(("ratio", op)) or [math.nan]) for i in (0, 1))
        print(f"| {op} | {c:.3f} | {v:.3f} |")
    fl = _tagged(halves, "fault")
    print("\n| 16-bit fault | calibration: fault side excess / worst clean variant (min-max) | validation |")
    print("|---|---:|---:|")
    for name in fl:
        c, v = (halves[i].get(("fault", name)) or [math.nan] for i in (0, 1))
        print(f"| {name} | {min(c):.3f}-{max(c):.3f} | {min(v):.3f}-{max(v):.3f} |")
    env = _tagged(halves, "envelope")
    print("\n| op judged by its constant envelope | ENVELOPE | calibration: max clean excess | validation |")
    print("|---|---:|---:|---:|")
    for op in env:
        c, v = (max(halves[i].get(("envelope", op)) or [math.nan]) for i in (0, 1))
        print(f"| {op} | {ENVELOPE[op]:.2f} | {c:.3f} | {v:.3f} |")
    cal = max(max(x) for k, x in halves[0].items() if isinstance(k, tuple) and k[0] == "ratio")
    print(f"\nmargin implied by the calibration half: {math.ceil(cal * 1.02 * 100) / 100:.2f} "
          f"(largest clean ratio {cal:.3f}); largest on the validation half "
          f"{max(max(x) for k, x in halves[1].items() if isinstance(k, tuple) and k[0] == 'ratio'):.3f}")
    for i, label in ((0, "calibration"), (1, "validation")):
        clean, faults = halves[i]["clean"], halves[i]["faults"]
        bad = [c for c in clean if c[4]]
        missed = [f for f in faults if not f[4]]
        print(f"\n{label}: clean pairs blamed {len(bad)}/{len(clean)}; faults found {len(faults) - len(missed)}/{len(faults)}")
        for c in bad[:8]:
            print(f"  blamed clean {c[0]} {c[1]} seed {c[2]} hd {c[3]}: {c[4][:2]}")
        for f in missed[:12]:
            print(f"  missed {f[0]} {f[1]} seed {f[2]} hd {f[3]}: first {f[5]}")


if __name__ == "__main__":
    main()
