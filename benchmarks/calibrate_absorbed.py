"""Calibration and validation of the replay on MLA's absorbed path: SGLang 0.5.23's DeepSeek-V3 in bf16 (real
model code, CPU: prefill on the MHA path, decode on the absorbed path, whose kv_b is never materialised) against
HF transformers, judged against the checkpoint both loaded (docs/replay.md, "The absorbed path").

Per case (seed x weight distribution x nope head dim): a clean pair, whose SGLang `attn.core` ratio (excess /
its same-input envelope) is recorded and must stay under 1 with no side blamed (SGLang's CPU router
precision, a known difference of that path, accepted by name); and decode-only faults planted in SGLang's
absorbed weights or kernel, each of which must be the first intrinsic divergence at its layer's `attn.core`,
SGLang blamed. Seeds split into halves (even: calibration, odd: validation): the table gives each.

    .venv/bin/python benchmarks/calibrate_absorbed.py --seeds 4 --nope 16,64
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import tic_trace  # noqa: E402
from tic_trace import find_divergence  # noqa: E402
from tic_trace.adapters import sglang as sga  # noqa: E402
from tic_trace.replay.intrinsic_verdict import first_intrinsic_divergence  # noqa: E402
from tic_trace.replay.reference import ExactReference  # noqa: E402
from tic_trace.testing import sglang_cpu as sc  # noqa: E402
from tic_trace.testing import trained_like as tl  # noqa: E402
from tic_trace.testing.sglang_cpu_kernels import LatentCacheAttnBackend  # noqa: E402

from arch_configs_mla import mla_config, mla_hf_model  # noqa: E402

PROMPTS = {"req-a": [0, 5, 7, 9, 11, 13, 15, 17], "req-b": [0, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22]}
RESPONSES = {"req-a": [30, 31, 32, 33, 34], "req-b": [40, 41, 42, 43, 44]}
DECODE = 4
DISTS = ("random", "wide_gains", "massive")
LAYER = 1


def _attn(model, layer: int):
    return model.model.layers[layer].self_attn


def _fp8(name: str):
    def plant(model):
        w = getattr(_attn(model, LAYER), name)
        w.copy_(w.to(torch.float8_e4m3fn).to(w.dtype))
    return plant


def _bf16_softmax_decode(model):
    """The absorbed attention's softmax in bf16 at one layer (SGLang's attn_mqa, decode only)."""
    from tic_trace.replay.attention_kernels import softmax_bf16 as _softmax_bf16
    from tic_trace.testing.sglang_cpu_kernels import _tnb
    mqa = _attn(model, LAYER).attn_mqa
    inner = mqa.forward

    def forward(*a, **k):
        upstream = _tnb.scaled_dot_product_attention

        def sdpa(q, kk, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, **_):
            if enable_gqa and kk.shape[-3] != q.shape[-3]:
                kk = kk.repeat_interleave(q.shape[-3] // kk.shape[-3], dim=-3)
                v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
            lq, lk = q.shape[-2], kk.shape[-2]
            mask = attn_mask if attn_mask is not None else torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
            return _softmax_bf16(q, kk, v, mask, scale if scale is not None else q.shape[-1] ** -0.5, q.dtype)
        _tnb.scaled_dot_product_attention = sdpa
        try:
            return inner(*a, **k)
        finally:
            _tnb.scaled_dot_product_attention = upstream
    mqa.forward = forward


FAULTS = {"w_vc_fp8": _fp8("w_vc"), "w_kc_fp8": _fp8("w_kc"), "softmax_bf16": _bf16_softmax_decode}


def _model(dist: str, seed: int, nope: int):
    cfg = mla_config("deepseek", qk_nope_head_dim=nope, v_head_dim=nope)
    model = mla_hf_model(cfg, torch.bfloat16, seed=seed)
    if dist == "wide_gains":
        tl.lognormal_norm_gains(model, seed=seed)
    elif dist == "massive":
        tl.massive_activations(model, seed=seed)
    return model


def _traces(work: Path, model, plant) -> tuple[str, str, str]:
    ck, hf, sg = work / "ck", work / "hf", work / "sg"
    model.save_pretrained(ck)
    with tic_trace.trace(model, hf, adapter="hf", points_mode="full") as t, torch.no_grad():
        for rid in PROMPTS:
            t.sample_keys = [rid]
            model(torch.tensor([PROMPTS[rid] + RESPONSES[rid]]))
            t.step()
    import transformers as T
    cfg = T.AutoConfig.from_pretrained(ck)
    sgm = sc.build_sglang_model(cfg, str(ck), dtype=torch.bfloat16)
    if plant is not None:
        with torch.no_grad():
            plant(sgm)
    with sga.trace_forwards(sgm, sg, points_mode="full"):
        sc.SGLangRollout(sgm, attn_backend_cls=LatentCacheAttnBackend).generate(PROMPTS, DECODE,
                                                                                 forced_tokens=RESPONSES)
    return str(ck), str(hf), str(sg)


def case(dist: str, seed: int, nope: int) -> dict:
    out: dict = {"dist": dist, "seed": seed, "nope": nope}
    with tempfile.TemporaryDirectory() as d:
        ck, hf, sg = _traces(Path(d) / "clean", _model(dist, seed, nope), None)
        rep = find_divergence(hf, sg, reference=ck, accept_precision=["moe.router_logits", "moe.topk_weights"])
        out["clean_ratio"] = max(p.intrinsic["b"]["excess"] / p.intrinsic["b"]["limit"] for p in rep.points
                                 if p.point == "attn.core" and isinstance((p.intrinsic or {}).get("b"), dict))
        out["clean_blamed"] = [p.key for p in rep.points if (p.replay or {}).get("side")
                               and not p.replay.get("accepted") and not p.point.startswith("moe.")]
        for name, plant in FAULTS.items():
            ck, hf, sg = _traces(Path(d) / name, _model(dist, seed, nope), plant)
            got = first_intrinsic_divergence(hf, sg, ExactReference(ck))
            out[name] = got is not None and (got.key, got.side) == (f"L{LAYER}.attn.core", "B")
            out[name + "_ratio"] = next((p.intrinsic["b"]["excess"] / p.intrinsic["b"]["limit"]
                                         for p in find_divergence(hf, sg, reference=ck).points
                                         if p.key == f"L{LAYER}.attn.core"), None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--nope", default="16,64")
    ap.add_argument("--out", default=None, help="write every case as JSON here")
    args = ap.parse_args()
    sc.init_sglang_distributed(tp_size=1)
    t0, rows = time.time(), []
    for nope in (int(x) for x in args.nope.split(",")):
        for dist in DISTS:
            for seed in range(args.seeds):
                rows.append(case(dist, seed, nope))
                print(json.dumps(rows[-1]), flush=True)
    for half, name in ((0, "calibration (even seeds)"), (1, "validation (odd seeds)")):
        sel = [r for r in rows if r["seed"] % 2 == half]
        print(f"{name}: clean pairs {len(sel)}, blamed {sum(bool(r['clean_blamed']) for r in sel)}, "
              f"largest attn.core ratio {max(r['clean_ratio'] for r in sel):.3f}; "
              + ", ".join(f"{f} found {sum(r[f] for r in sel)}/{len(sel)}" for f in FAULTS))
    print(f"{len(rows)} cases in {time.time() - t0:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    sc.destroy_sglang_distributed()


if __name__ == "__main__":
    main()
