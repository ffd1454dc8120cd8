"""The bf16 suite through the FULL finder (`find_divergence(..., reference=checkpoint)`) on real model code:
Megatron-core 0.16.1 (training side, A: one forward over the full sequences) against SGLang 0.5.23 (rollout
side, B: prefill + decode steps, forced responses), both bf16, both loaded from one HF checkpoint.

Precision faults are planted in one side's computation (tic_trace/testing/precision_faults.py); each must be
the report's first divergence at exactly its point and layer, with the right side blamed and both sides'
numbers in the finding. Clean pairs must get no operator, intrinsic or precision divergence.

At their defaults the two MoE implementations are *not* alike in precision: megatron-core rounds the top-k
routing weights to the activations' dtype (`softmax(..., dtype=float32).type_as(logits)`) while SGLang keeps
them in fp32. The finder reports that truthfully (precision at every MoE layer's `moe.topk_weights`, Megatron
the less exact side), so the faults that are not about the router are planted in the dense model, where
nothing precedes them, and the MoE pair is checked for exactly that finding and nothing else.

Order matters in this process: every Megatron trace is made first (megatron's gloo group is torn down
again), then SGLang's distributed state is initialised for the rest of the module.
"""
from __future__ import annotations

import json

import megatron.core  # noqa: F401 - a required test dependency: fail loudly if missing
import pytest
import sglang  # noqa: F401 - a required test dependency: fail loudly if missing
import torch
import transformers

import tic_trace
from tic_trace.adapters import sglang as sga
from tic_trace.adapters.megatron import MegatronAdapter
from tic_trace.adapters.megatron_weights import hf_to_megatron_state_dict, load_into
from tic_trace import find_divergence
from tic_trace.compare.diverge import rejudge
from tic_trace.replay.reference import ExactReference
from tic_trace.testing import megatron_cpu as mc
from tic_trace.testing import sglang_cpu as sc
from tic_trace.testing.hf_models import build_hf_model_stable, tiny_qwen3_config
from tic_trace.testing.precision_faults import PRECISION_FAULTS, _rmsnorm_bf16, _wrap

PROMPTS = {"req-a": [3, 5, 7, 9, 11], "req-b": [2, 4, 6, 8, 10, 12, 14, 16]}
RESPONSES = {"req-a": [20, 21, 22, 23, 24], "req-b": [30, 31, 32, 33, 34]}
SEQS = {rid: PROMPTS[rid] + RESPONSES[rid] for rid in PROMPTS}
DECODE = 4
LAYER = 1
NOT_CLEAN = ("operator", "intrinsic", "precision", "nonfinite", "weights")


def _sg_k_norm_no_upcast(model, layer):
    from tic_trace.testing.faults import _sg_layer
    _wrap(_sg_layer(model, layer).self_attn.k_norm, _rmsnorm_bf16)


# name -> (side planted, Megatron overrides or planter, SGLang planter, expected key, blamed side, cause)
MG_FAULTS = {     # name -> (planter, Megatron config overrides, model kind, expected key, blamed side, cause)
    "mg_rmsnorm_no_upcast": (PRECISION_FAULTS["rmsnorm_no_upcast"].plant_megatron, {}, "dense",
                             f"L{LAYER}.attn_norm", "A", "intrinsic"),
    "mg_qk_norm_no_upcast": (PRECISION_FAULTS["qk_norm_no_upcast"].plant_megatron, {}, "dense",
                             f"L{LAYER}.attn.q_norm", "A", "intrinsic"),
    # Megatron's own moe_router_dtype="fp32": fp32 router logits; SGLang's bf16 ones are the less exact
    "mg_router_fp32": (None, {"moe_router_dtype": "fp32"}, "moe", "L0.moe.router_logits", "B", "precision"),
}
SG_FAULTS = {
    "sg_qk_norm_no_upcast": (PRECISION_FAULTS["qk_norm_no_upcast"].plant_sglang, f"L{LAYER}.attn.q_norm", "B", "intrinsic"),
    "sg_k_norm_no_upcast": (_sg_k_norm_no_upcast, f"L{LAYER}.attn.k_norm", "B", "intrinsic"),
}


# The bf16 MoE suite (issue 23): precision faults planted in one side of the default Megatron <-> SGLang MoE
# pair, judged with the top-k weights' known precision difference accepted. name -> (side planted, planter,
# Megatron config overrides, expected key, blamed side, cause, the fault variant the blamed side must match
# or, for a precision finding, None: the dtypes are named instead). Megatron's router in fp32 is MG_FAULTS'
# `mg_router_fp32`, run here too.
_PF = PRECISION_FAULTS
MOE_FAULTS = {
    "mg_rmsnorm_no_upcast": ("A", _PF["rmsnorm_no_upcast"].plant_megatron, {}, f"L{LAYER}.attn_norm", "A",
                             "intrinsic", "no fp32 upcast"),
    "mg_mlp_norm_no_upcast": ("A", _PF["mlp_norm_no_upcast"].plant_megatron, {}, f"L{LAYER}.mlp_norm", "A",
                              "intrinsic", "no fp32 upcast"),
    "mg_k_norm_no_upcast": ("A", _PF["k_norm_no_upcast"].plant_megatron, {}, f"L{LAYER}.attn.k_norm", "A",
                            "intrinsic", "no fp32 upcast"),
    "mg_silu_bf16": ("A", _PF["silu_bf16"].plant_megatron, {}, f"L{LAYER}.moe.experts_out", "A", "intrinsic",
                     "silu in bf16 (an extra rounding), top-k weight applied before down_proj"),
    "mg_router_fp32": ("A", None, {"moe_router_dtype": "fp32"}, "L0.moe.router_logits", "B", "precision", None),
    "sg_mlp_norm_no_upcast": ("B", _PF["mlp_norm_no_upcast"].plant_sglang, {}, f"L{LAYER}.mlp_norm", "B",
                              "intrinsic", "no fp32 upcast"),
    "sg_qk_norm_no_upcast": ("B", _PF["qk_norm_no_upcast"].plant_sglang, {}, f"L{LAYER}.attn.q_norm", "B",
                             "intrinsic", "no fp32 upcast"),
    "sg_k_norm_no_upcast": ("B", _PF["k_norm_no_upcast"].plant_sglang, {}, f"L{LAYER}.attn.k_norm", "B",
                            "intrinsic", "no fp32 upcast"),
    "sg_silu_bf16": ("B", _PF["silu_bf16"].plant_sglang, {}, f"L{LAYER}.moe.experts_out", "B", "intrinsic",
                     "silu in bf16 (an extra rounding), fp32 combine"),
    "sg_router_fp32": ("B", _PF["router_fp32"].plant_sglang, {}, f"L{LAYER}.moe.router_logits", "A",
                       "precision", None),
}


def _moe_trace(name: str) -> str:
    """The Megatron trace of a MoE suite fault: MG_FAULTS' own where it is a MoE fault there too."""
    return name if MG_FAULTS.get(name, (None, None, "dense"))[2] == "moe" else f"moe_{name}"


def _megatron(out, cfg, sd, plant=None, dense=False, **overrides):
    """One bf16 Megatron forward over the full prompt+response sequences (one batch column per sample,
    right-padded; padding rows get no key)."""
    keys = list(SEQS)
    length = max(len(s) for s in SEQS.values())
    ids = torch.zeros(len(keys), length, dtype=torch.long)
    for b, k in enumerate(keys):
        ids[b, :len(SEQS[k])] = torch.tensor(SEQS[k])
    rk, rp, rt = [], [], []
    for s in range(length):                         # megatron rows are s-major
        for b, k in enumerate(keys):
            rk.append(k if s < len(SEQS[k]) else None)
            rp.append(s)
            rt.append(int(ids[b, s]))
    model = mc.build_gpt_model(cfg, dtype=torch.bfloat16, **overrides)
    load_into(model, hf_to_megatron_state_dict(sd, cfg, tp_rank=0, tp_size=1, ep_rank=0, ep_size=1,
                                               etp_rank=0, etp_size=1))
    if plant is not None:
        plant(model, LAYER)
    pos = torch.arange(length).unsqueeze(0).expand(len(keys), -1)
    with tic_trace.trace(model, out, adapter=MegatronAdapter(vocab_size=cfg.vocab_size), points_mode="full") as t, \
            torch.no_grad():
        t.set_rows(rk, rp, rt)
        model(ids, pos, attention_mask=None)
    assert t.failed is None, t.failed
    return out


def _rollout(ck, out, plant=None, chunked=None):
    model = sc.build_sglang_model(transformers.AutoConfig.from_pretrained(str(ck)), str(ck), dtype=torch.bfloat16)
    if plant is not None:
        plant(model, LAYER)
    with sga.trace_forwards(model, out, points_mode="full") as t:
        res = sc.SGLangRollout(model).generate(PROMPTS, DECODE, forced_tokens=RESPONSES, chunked_prefill_size=chunked)
    assert t.failed is None and res.outputs == RESPONSES
    return out


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    """Checkpoints (moe, dense) and every Megatron trace, made before SGLang is initialised."""
    d = tmp_path_factory.mktemp("mgsg_replay")
    out = {}
    with mc.single_rank():
        for kind in ("moe", "dense"):
            cfg = tiny_qwen3_config(moe=kind == "moe")
            hf = build_hf_model_stable(cfg, dtype=torch.bfloat16)
            hf.save_pretrained(d / f"ck_{kind}")
            out[f"ck_{kind}"] = d / f"ck_{kind}"
            out[f"mg_{kind}"] = _megatron(d / f"mg_{kind}", cfg, hf.state_dict())
            for name, (plant, over, k, *_rest) in MG_FAULTS.items():
                if k == kind:
                    out[name] = _megatron(d / name, cfg, hf.state_dict(), plant, **over)
            for name, (where, plant, over, *_rest) in MOE_FAULTS.items():
                if kind == "moe" and where == "A" and _moe_trace(name) not in out:
                    out[_moe_trace(name)] = _megatron(d / _moe_trace(name), cfg, hf.state_dict(), plant, **over)
    sc.init_sglang_distributed(tp_size=1)
    try:
        out["sg_moe"] = _rollout(out["ck_moe"], d / "sg_moe")
        out["sg_moe_chunked3"] = _rollout(out["ck_moe"], d / "sg_moe_chunked3", chunked=3)
        out["sg_dense"] = _rollout(out["ck_dense"], d / "sg_dense")
        out["sg_dense_chunked4"] = _rollout(out["ck_dense"], d / "sg_dense_chunked4", chunked=4)
        out["sg_dense_chunked3"] = _rollout(out["ck_dense"], d / "sg_dense_chunked3", chunked=3)
        out["dir"] = d
        yield out
    finally:
        sga.close_sessions()
        sc.destroy_sglang_distributed()


def _find(a, b, ck):
    rep = find_divergence(str(a), str(b), reference=ExactReference(str(ck)))
    doc = json.loads(json.dumps(rep.to_json()))
    assert rejudge(doc) == doc                     # the saved numbers reproduce the report exactly
    return rep


def _assert_found(rep, key, side, cause):
    assert rep.verdict == "divergent" and rep.first is not None, [(f.cause, f.key) for f in rep.findings]
    assert (rep.first["key"], rep.first["cause"], rep.first["replay"]["side"]) == (key, cause, side), \
        (rep.first["key"], rep.first["cause"], rep.first["replay"], [(f.cause, f.key) for f in rep.findings])
    f = next(f for f in rep.findings if f.key == key and f.cause == cause)
    assert f.detail["side"] == side and isinstance(f.detail["a"], dict) and isinstance(f.detail["b"], dict)
    if cause == "intrinsic":                       # the numbers of both sides are in the finding
        assert "excess" in f.summary and "ULP" in f.summary and "correctly rounded" in f.summary


@pytest.mark.parametrize("name", sorted(MG_FAULTS))
def test_precision_fault_in_megatron_found_by_the_finder(sides, name):
    _p, _o, kind, key, side, cause = MG_FAULTS[name]
    _assert_found(_find(sides[name], sides[f"sg_{kind}"], sides[f"ck_{kind}"]), key, side, cause)


@pytest.mark.parametrize("name", sorted(SG_FAULTS))
def test_precision_fault_in_sglang_found_by_the_finder(tmp_path, sides, name):
    plant, key, side, cause = SG_FAULTS[name]
    sg = _rollout(sides["ck_dense"], tmp_path / "sg", plant)
    _assert_found(_find(sides["mg_dense"], sg, sides["ck_dense"]), key, side, cause)


@pytest.mark.parametrize("sg", ["sg_dense", "sg_dense_chunked4", "sg_dense_chunked3"])
def test_clean_bf16_megatron_sglang_pair_gets_no_divergence(sides, sg):
    rep = _find(sides["mg_dense"], sides[sg], sides["ck_dense"])
    bad = [(f.cause, f.key, f.summary) for f in rep.findings if f.cause in NOT_CLEAN and f.divergent]
    assert not bad, bad
    assert rep.verdict == "consistent", rep.verdict
    replayed = [p for p in rep.points if p.intrinsic and "excess" in (p.intrinsic.get("b") or {})]
    assert len(replayed) > 30 and not [p.key for p in rep.points if p.status == "divergent"]


def test_default_moe_pair_differs_only_in_the_precision_of_the_routing_weights(sides):
    """megatron-core rounds top-k weights to bf16, SGLang keeps fp32: a precision finding at each MoE layer's
    topk_weights, Megatron (A) the less exact, with both sides' numbers; no operator or intrinsic finding."""
    rep = _find(sides["mg_moe"], sides["sg_moe"], sides["ck_moe"])
    found = [(f.cause, f.key, f.detail.get("side")) for f in rep.findings if f.cause in NOT_CLEAN]
    assert found == [("precision", "L0.moe.topk_weights", "A"), ("precision", "L1.moe.topk_weights", "A")], found
    f = rep.findings[[x.cause for x in rep.findings].index("precision")]
    assert f.detail["a"]["dtype"] == "bfloat16" and f.detail["b"]["dtype"] == "float32"
    assert rep.first["key"] == "L0.moe.topk_weights" and rep.first["cause"] == "precision"


def test_default_moe_pair_says_how_much_of_its_gap_the_topk_weights_rounding_explains(sides):
    """The attribution of the default bf16 MoE pair: each topk_weights precision finding carries its share of
    the log-prob gap, and the shares add up to the measured gap (docs/attribution.md)."""
    rep = find_divergence(str(sides["mg_moe"]), str(sides["sg_moe"]), reference=str(sides["ck_moe"]),
                          attribution=True)
    att = rep.attribution
    assert att is not None and "unavailable" not in att, att
    assert 0.8 <= att["explained"] <= 1.25, att["explained"]
    shares = {f.key: f.share for f in rep.findings if f.cause == "precision"}
    assert set(shares) == {"L0.moe.topk_weights", "L1.moe.topk_weights"} and None not in shares.values()
    kinds = {k["kind"]: k for k in att["by_kind"]}
    assert "topk_weights" in kinds
    # Megatron (A) rounds them: its side of the topk_weights terms is where their share comes from
    tw = [s for s in att["by_point"] if s["point"] == "moe.topk_weights"]
    assert all(abs(s["share_a"]) >= abs(s["share_b"]) for s in tw), tw
    doc = json.loads(json.dumps(rep.to_json()))
    assert rejudge(doc) == doc


# ------------------------------------------------------------------ dataflow order, accepted precision (issue 23)

TOPK_W = [("precision", "L0.moe.topk_weights"), ("precision", "L1.moe.topk_weights")]


def _listed(rep, causes=NOT_CLEAN):
    return [(f.cause, f.key, f.divergent) for f in rep.findings if f.cause in causes]


@pytest.mark.parametrize("sg", ["sg_moe", "sg_moe_chunked3"])
def test_clean_moe_pair_with_topk_weights_accepted_blames_no_side(sides, sg):
    """Clean bf16 MoE pairs (plain and chunked prefill of 3): with the top-k weights' precision accepted,
    nothing is divergent and no side is blamed at any replayed point."""
    rep = find_divergence(str(sides["mg_moe"]), str(sides[sg]), reference=ExactReference(str(sides["ck_moe"])),
                          accept_precision=["moe.topk_weights"])
    assert rep.verdict == "consistent" and rep.first is None, rep.first and rep.first["summary"]
    assert not [(f.cause, f.key) for f in rep.findings if f.divergent]
    blamed = [p.key for p in rep.points if (p.replay or {}).get("side") and not (p.replay or {}).get("accepted")]
    assert not blamed, blamed
    assert len([p for p in rep.points if p.intrinsic and "excess" in (p.intrinsic.get("b") or {})]) > 40


@pytest.mark.parametrize("name", sorted(MOE_FAULTS))
def test_moe_precision_fault_found_with_its_side_and_fingerprint(tmp_path, sides, name):
    """Each fault of the bf16 MoE suite is the answer at exactly its point and layer, with the side, and the
    known fault the blamed side's output reproduces (or, for an fp32 choice, both dtypes), once the top-k
    weights' precision difference is accepted; nothing before it is divergent."""
    where, plant, _over, key, side, cause, words = MOE_FAULTS[name]
    a = sides[_moe_trace(name)] if where == "A" else sides["mg_moe"]
    b = _rollout(sides["ck_moe"], tmp_path / "sg", plant) if where == "B" else sides["sg_moe"]
    rep = find_divergence(str(a), str(b), reference=ExactReference(str(sides["ck_moe"])),
                          accept_precision=["moe.topk_weights"])
    _assert_found(rep, key, side, cause)
    f = next(f for f in rep.findings if f.key == key and f.cause == cause)
    if words is not None:
        got = f.detail[side.lower()]
        assert got["match_kind"] == "fault" and f"{side}'s" in f.summary and f"matches *{words}*" in f.summary, \
            (got.get("match"), got.get("match_kind"), f.summary)
    else:
        assert "bfloat16" in f.summary and "float32" in f.summary, f.summary
    before = [g.key for g in rep.findings if g.divergent and g.key != key]
    order = [p.key for p in rep.points]
    assert not [k for k in before if order.index(k) < order.index(key)], before
    doc = json.loads(json.dumps(rep.to_json()))
    assert rejudge(doc) == doc


def test_default_moe_pair_with_topk_weights_accepted_is_consistent(sides):
    """With the top-k weights' precision difference accepted, the clean default pair's answer is whatever
    else is there: nothing. The difference is still listed, named with both dtypes and the coarser side."""
    rep = find_divergence(str(sides["mg_moe"]), str(sides["sg_moe"]), reference=ExactReference(str(sides["ck_moe"])),
                          accept_precision=["moe.topk_weights"])
    assert _listed(rep) == [(c, k, False) for c, k in TOPK_W], _listed(rep)
    assert rep.verdict == "consistent" and rep.first is None, rep.first and rep.first["summary"]
    f = rep.findings[0]
    assert f.detail["accepted"] == "moe.topk_weights" and f.detail["coarser"] == "A"
    assert "bfloat16" in f.summary and "float32" in f.summary and "accepted" in f.summary
    p = next(p for p in rep.points if p.key == "L0.moe.topk_weights")
    assert p.replay["accepted"] == "moe.topk_weights" and p.status != "divergent"
    doc = json.loads(json.dumps(rep.to_json()))
    assert doc["settings"]["accept_precision"] == ["moe.topk_weights"]
    assert rejudge(doc) == doc
    # re-judged without accepting it, the same saved numbers lead with it again
    again = rejudge(doc, accept_precision=[])
    assert again["verdict"] == "divergent" and again["first_divergence"]["key"] == "L0.moe.topk_weights"


def test_moe_fault_is_the_answer_once_the_topk_weights_are_accepted(tmp_path, sides):
    """SGLang's layer-1 Q-norm without the fp32 upcast, in the MoE model: in dataflow order the top-k weights
    of layer 0 come first (and lead without acceptance); accepted, the planted point is the answer, and the
    precision findings are still listed."""
    plant, key, side, cause = SG_FAULTS["sg_qk_norm_no_upcast"]
    sg = _rollout(sides["ck_moe"], tmp_path / "sg", plant)
    rep = _find(sides["mg_moe"], sg, sides["ck_moe"])
    assert (rep.first["key"], rep.first["cause"]) == ("L0.moe.topk_weights", "precision")
    assert (cause, key, True) in _listed(rep), _listed(rep)
    doc = json.loads(json.dumps(rep.to_json()))
    accepted = rejudge(doc, accept_precision=["moe.topk_weights"])
    fd = accepted["first_divergence"]
    assert (fd["key"], fd["cause"], fd["replay"]["side"]) == (key, cause, side), fd["summary"]
    listed = [(f["cause"], f["key"], f["divergent"]) for f in accepted["findings"]]
    assert ("precision", "L0.moe.topk_weights", False) in listed and ("precision", "L1.moe.topk_weights", False) in listed
    # the same from the traces, with the setting given to the finder
    fresh = find_divergence(str(sides["mg_moe"]), str(sg), reference=ExactReference(str(sides["ck_moe"])),
                            accept_precision=["moe.topk_weights"])
    assert fresh.first["key"] == key and fresh.first["cause"] == cause


def test_operator_fault_before_the_topk_weights_leads_in_dataflow_order(tmp_path, sides):
    """Without a reference the top-k weights' precision difference is found by recorded dtype; an operator
    fault upstream of it (SGLang's layer-0 input-norm epsilon 1e-6 -> 1e-2) is the first finding in dataflow
    order, whatever the cause, and the precision finding is listed after it."""
    from tic_trace.testing.faults import plant as plant_fault
    sg = _rollout(sides["ck_moe"], tmp_path / "sg", lambda m, _layer: plant_fault(m, "sglang", "rmsnorm_eps", 0))
    rep = find_divergence(str(sides["mg_moe"]), str(sg))
    assert (rep.first["key"], rep.first["cause"]) == ("L0.attn_norm", "operator"), \
        (rep.first["key"], [(f.cause, f.key) for f in rep.findings])
    listed = _listed(rep)
    assert listed[0] == ("operator", "L0.attn_norm", True)
    assert ("precision", "L0.moe.topk_weights", True) in listed, listed
    f = next(f for f in rep.findings if f.key == "L0.moe.topk_weights")
    assert "by recorded dtype" in f.summary and f.detail["coarser"] == "A"
