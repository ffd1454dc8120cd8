"""The exact reference and the intrinsic rule on real SGLang 0.5.23 model code (CPU, bf16): a rollout with
prefill and decode steps (attention of a decode row reads the sample's earlier rows from other passes) is
replayed within every envelope; against HF bf16 with the same checkpoint the only findings are SGLang's
fp32 routing weights (a real precision difference: HF rounds them to bf16), and a precision fault planted
in SGLang's computation is found at its point with SGLang blamed."""
from __future__ import annotations

import pytest
import sglang  # noqa: F401 - a required test dependency: fail loudly if missing
import torch
import transformers

import tic_trace
from tic_trace.adapters import sglang as sga
from tic_trace.view.align import CanonicalView
from tic_trace.replay.intrinsic import IntrinsicError, replay_side
from tic_trace.replay.intrinsic_verdict import abnormal, intrinsic_walk
from tic_trace.replay.reference import ExactReference
from tic_trace.testing import sglang_cpu as sc
from tic_trace.testing.hf_models import build_hf_model_stable, tiny_qwen3_config
from tic_trace.testing.precision_faults import PRECISION_FAULTS

PROMPTS = {"req-a": [3, 5, 7, 9, 11], "req-b": [2, 4, 6, 8, 10, 12, 14, 16]}
RESPONSES = {"req-a": [20, 21, 22, 23, 24], "req-b": [30, 31, 32, 33, 34]}
DECODE = 4
ROUTING_WEIGHTS = [("L0.moe.topk_weights", "A", "precision"), ("L1.moe.topk_weights", "A", "precision")]


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    d = tmp_path_factory.mktemp("sg_replay")
    hf = build_hf_model_stable(tiny_qwen3_config(moe=True), dtype=torch.bfloat16)
    hf.save_pretrained(d / "ck")
    with tic_trace.trace(hf, d / "hf", adapter="hf", points_mode="full") as t, torch.no_grad():
        for rid in PROMPTS:
            t.sample_keys = [rid]
            hf(torch.tensor([PROMPTS[rid] + RESPONSES[rid]]))
            t.step()
    assert t.failed is None
    sc.init_sglang_distributed(tp_size=1)
    try:
        yield d / "ck", d / "hf"
    finally:
        sga.close_sessions()
        sc.destroy_sglang_distributed()


def _rollout(ck, out, plant=None):
    model = sc.build_sglang_model(transformers.AutoConfig.from_pretrained(str(ck)), str(ck), dtype=torch.bfloat16)
    if plant is not None:
        plant(model, 1)
    with sga.trace_forwards(model, out, points_mode="full") as t:
        res = sc.SGLangRollout(model).generate(PROMPTS, DECODE, forced_tokens=RESPONSES)
    assert t.failed is None and res.outputs == RESPONSES
    return out


def _findings(ck, a, b):
    walk = intrinsic_walk(CanonicalView(str(a)), CanonicalView(str(b)), ExactReference(str(ck)))
    assert len(walk) > 40
    return [(v.key, v.side, v.kind) for v in walk if v.side is not None]


def test_clean_sglang_rollout_replays_within_every_envelope(tmp_path, sides):
    ck, hf = sides
    sg = _rollout(ck, tmp_path / "sg")
    res = replay_side(CanonicalView(str(sg)), ExactReference(str(ck)))
    done = {r.key: r for r in res if isinstance(r, IntrinsicError)}
    assert len(done) >= 40 and not [r for r in done.values() if abnormal(r)]
    prompt_rows = sum(len(p) for p in PROMPTS.values())
    assert done["L1.attn.core"].rows == prompt_rows + DECODE * len(PROMPTS)       # decode rows replayed too
    assert done["logits"].dtype == "bfloat16" and done["logits"].recorded_dtype == "float32"
    assert _findings(ck, hf, sg) == ROUTING_WEIGHTS
    numerics = CanonicalView(str(sg)).trace.manifest["numerics"]      # the engine's own server arguments
    assert numerics["attention_backend"] == "torch_native" and numerics["kv_cache_dtype"] == "auto"


def test_precision_fault_in_sglang_found_with_sglang_blamed(tmp_path, sides):
    ck, hf = sides
    sg = _rollout(ck, tmp_path / "sg", PRECISION_FAULTS["qk_norm_no_upcast"].plant_sglang)
    assert _findings(ck, hf, sg) == [ROUTING_WEIGHTS[0], ("L1.attn.q_norm", "B", "intrinsic"), ROUTING_WEIGHTS[1]]
