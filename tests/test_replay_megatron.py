"""The exact reference and the intrinsic rule on real megatron-core 0.16.1 (CPU, one rank, bf16) against
HF bf16 with the same checkpoint: a clean HF<->Megatron pair is not blamed, Megatron's own
`moe_router_dtype="fp32"` is a precision difference at the first router, and precision faults planted in
Megatron's computation are found at their point with Megatron blamed."""
from __future__ import annotations

import megatron.core  # noqa: F401 - a required test dependency: fail loudly if missing
import pytest
import torch

import tic_trace
from tic_trace.adapters.megatron import MegatronAdapter
from tic_trace.adapters.megatron_weights import hf_to_megatron_state_dict, load_into
from tic_trace.view.align import CanonicalView
from tic_trace.replay.intrinsic import IntrinsicError, replay_side
from tic_trace.replay.intrinsic_verdict import abnormal, first_intrinsic_divergence, intrinsic_walk
from tic_trace.replay.reference import ExactReference
from tic_trace.testing import megatron_cpu as mc
from tic_trace.testing.hf_models import build_hf_model_stable, sample_tokens, tiny_qwen3_config
from tic_trace.testing.precision_faults import PRECISION_FAULTS

from conftest import trace_hf

IDS = sample_tokens(2, 16)
KEYS = ["s0", "s1"]
CFG = tiny_qwen3_config(moe=True)


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    """(checkpoint dir, HF bf16 trace, HF state dict) of the tiny Qwen3-MoE."""
    d = tmp_path_factory.mktemp("mg_replay")
    hf = build_hf_model_stable(CFG, dtype=torch.bfloat16)
    hf.save_pretrained(d / "ck")
    trace_hf(hf, d / "hf", IDS, sample_keys=KEYS)
    with mc.single_rank():
        yield d / "ck", d / "hf", hf.state_dict()


def _megatron(out, sd, plant=None, layer=1, **overrides):
    model = mc.build_gpt_model(CFG, dtype=torch.bfloat16, **overrides)
    load_into(model, hf_to_megatron_state_dict(sd, CFG, tp_rank=0, tp_size=1, ep_rank=0, ep_size=1,
                                               etp_rank=0, etp_size=1))
    if plant is not None:
        plant(model, layer)
    pos = torch.arange(IDS.shape[1]).unsqueeze(0).expand_as(IDS)
    with tic_trace.trace(model, out, adapter=MegatronAdapter(vocab_size=CFG.vocab_size), points_mode="full",
                         sample_keys=KEYS) as t, torch.no_grad():
        model(IDS, pos, attention_mask=None)
    assert t.failed is None, t.failed
    return out


def test_clean_megatron_bf16_replays_within_every_envelope(tmp_path, sides):
    ck, hf, sd = sides
    res = replay_side(CanonicalView(str(_megatron(tmp_path / "mg", sd))), ExactReference(str(ck)))
    done = [r for r in res if isinstance(r, IntrinsicError)]
    assert len(done) >= 40 and not [r for r in done if abnormal(r)]
    walk = intrinsic_walk(CanonicalView(str(hf)), CanonicalView(str(tmp_path / "mg")), ExactReference(str(ck)))
    assert walk and all(v.side is None for v in walk), [v for v in walk if v.side]


def test_megatron_fp32_router_is_a_precision_difference_blaming_the_bf16_side(tmp_path, sides):
    ck, hf, sd = sides
    mg = _megatron(tmp_path / "mg", sd, moe_router_dtype="fp32")
    got = first_intrinsic_divergence(str(hf), str(mg), ExactReference(str(ck)))
    assert got is not None and (got.key, got.side, got.kind) == ("L0.moe.router_logits", "A", "precision"), got
    assert CanonicalView(str(mg)).trace.manifest["numerics"]["moe_router_dtype"] == "fp32"


@pytest.mark.parametrize("name", ["rmsnorm_no_upcast", "qk_norm_no_upcast"])
def test_precision_fault_in_megatron_found_with_megatron_blamed(tmp_path, sides, name):
    ck, hf, sd = sides
    f = PRECISION_FAULTS[name]
    mg = _megatron(tmp_path / "mg", sd, plant=f.plant_megatron, layer=1)
    got = first_intrinsic_divergence(str(hf), str(mg), ExactReference(str(ck)))
    assert got is not None and (got.key, got.side, got.kind) == (f"L1.{f.point}", "B", "intrinsic"), got


def test_clean_megatron_bf16_is_reproduced_by_clean_variants(tmp_path, sides):
    """megatron-core's own bf16 ops are among the clean variants on its own inputs (replay/variants.py): its
    norms apply the gain before the cast back, its experts the top-k weight before down_proj; no point is
    matched by a fault or by nothing."""
    ck, hf, sd = sides
    res = {r.key: r for r in replay_side(CanonicalView(str(_megatron(tmp_path / "mg", sd))), ExactReference(str(ck)))
           if isinstance(r, IntrinsicError) and r.match_kind}
    assert len(res) >= 30 and all(r.match_kind == "clean" and r.match_equal > 0.9 for r in res.values()), \
        [(k, r.match_kind, r.match, r.match_equal) for k, r in res.items() if r.match_kind != "clean" or r.match_equal <= 0.9]
    assert res["L1.attn_norm"].match == "fp32_gain_before_cast" and res["L1.moe.experts_out"].match == "probs_before_down"


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_trained_like_megatron_bf16_pair_blames_no_side_and_names_no_operator(tmp_path, sides, moe, seed):
    """head_dim 128, massive BOS channels, norm gains (QK-norms included) log-normal over 0.002-40: Megatron's
    local attention (the scale inside the score GEMM, softmax in fp32) is a clean implementation the envelope
    holds, and what the attention amplifies of the sides' clean q/k differences is carried, not an operator's
    fault. Only near-tie routing flips may remain."""
    from tic_trace import find_divergence
    from tic_trace.testing import trained_like as tl
    cfg = tiny_qwen3_config(moe=moe, hidden_size=256, head_dim=128)
    hf = build_hf_model_stable(cfg, seed=seed, dtype=torch.bfloat16)
    with torch.no_grad():
        tl.massive_activations(hf, seed=seed)
        tl.lognormal_norm_gains(hf, include_qk=True)
    ids = tl.bos_first(sample_tokens(2, 12))
    hf.save_pretrained(tmp_path / "ck")
    trace_hf(hf, tmp_path / "hf", ids)
    model = mc.build_gpt_model(cfg, dtype=torch.bfloat16)
    load_into(model, hf_to_megatron_state_dict(hf.state_dict(), cfg))
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with tic_trace.trace(model, tmp_path / "mg", adapter=MegatronAdapter(vocab_size=cfg.vocab_size),
                         points_mode="full") as t, torch.no_grad():
        model(ids, pos, attention_mask=None)
    assert t.failed is None, t.failed
    rep = find_divergence(str(tmp_path / "hf"), str(tmp_path / "mg"), reference=str(tmp_path / "ck"))
    assert {f.cause for f in rep.findings if f.divergent} <= {"routing"}, [f.key for f in rep.findings]
    assert not [p.key for p in rep.points if (p.replay or {}).get("side")]
    routing = [f for f in rep.findings if f.cause == "routing"]
    assert all(f.detail["unexplained"] == 0 for f in routing), routing
