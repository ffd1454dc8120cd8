"""Red-team faults (tic_trace/testing/faults.py, suite "redteam"): bugs unlike the core suite's, planted in
one side's computation on real model code, each found at its point and layer with its cause; and the two
lies they exposed, fixed in the finder:

- a point whose input could not be compared (rows of another shape) was judged as if that input agreed
  exactly ("its inputs agree exactly"): an operator divergence blamed on the wrong region. Now an uncompared
  input is replaced by its own compared feeds (`diverge._compared_feeds`): no point lists an uncompared
  input, and the error is charged to the region that spans it;
- top-k ids of another width (top-1 on one side, top-2 on the other) were "not comparable", and the
  difference surfaced as an operator divergence at the experts' output. Now every row is a flip the router
  logits cannot explain: cause `routing` at the ids point, naming both widths; with `--reference`, the side
  whose top-k does not fit the checkpoint's config is "not replayed" (the replay crashed the report before).
"""
from __future__ import annotations

import json

import pytest
import torch

from tic_trace.graph.canonical import key_name
from tic_trace import find_divergence
from tic_trace.compare.diverge import rejudge
from tic_trace.testing.faults import FAULTS, plant, redteam_faults
from tic_trace.testing.hf_models import build_hf_model, sample_tokens, tiny_qwen3_config

from conftest import bf16_model, checkpointed_trace, trace_hf

IDS = sample_tokens(2, 10)


def _round_trip(rep) -> dict:
    doc = json.loads(json.dumps(rep.to_json()))
    assert rejudge(doc) == doc
    return doc


def _no_uncompared_inputs(rep) -> None:
    """Every point's inputs were compared: an uncompared input would pass on an error of 0 it never had."""
    uncompared = {p.key for p in rep.points if p.status == "not_comparable"}
    for p in rep.points:
        assert not set(p.inputs or []) & uncompared, (p.key, p.inputs, uncompared)


def _assert_found(rep, name: str, layer: int) -> None:
    f = FAULTS[name]
    key = key_name(f.point, layer if f.layered else None)
    assert rep.verdict == "divergent" and rep.exit_code == 1
    assert (rep.first["key"], rep.first["cause"]) == (key, f.cause), (rep.first["key"], rep.first["cause"])
    order = [p.key for p in rep.points]
    assert all(p.status in ("ok", "not_comparable") for p in rep.points[:order.index(key)])
    _no_uncompared_inputs(rep)
    _round_trip(rep)


@pytest.fixture(scope="module")
def clean_moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("redteam") / "moe"
    trace_hf(build_hf_model(tiny_qwen3_config(moe=True)), d, IDS)
    return d


@pytest.mark.parametrize("name,layer", [(n, lay) for n in redteam_faults("hf") for lay in (0, 1)
                                        if FAULTS[n].layered or lay == 1])
def test_redteam_fault_found_hf(tmp_path, clean_moe, name, layer):
    model = build_hf_model(tiny_qwen3_config(moe=True))
    plant(model, "hf", name, layer)
    trace_hf(model, tmp_path / "b", IDS)
    _assert_found(find_divergence(str(clean_moe), str(tmp_path / "b")), name, layer)


def test_topk_width_is_routing_not_an_operator(tmp_path, clean_moe):
    """Top-1 on B where A and the config say top-2: every token flips, no margin explains it, and the
    experts' output is not an operator divergence whose inputs 'agree exactly'."""
    model = build_hf_model(tiny_qwen3_config(moe=True))
    plant(model, "hf", "topk_width", 1)
    trace_hf(model, tmp_path / "b", IDS)
    rep = find_divergence(str(clean_moe), str(tmp_path / "b"))
    routing = next(f for f in rep.findings if f.key == "L1.moe.topk_ids")
    assert routing.divergent and routing.computational
    assert routing.detail["k"] == 2 and routing.detail["k_b"] == 1
    assert routing.detail["flipped"] == routing.detail["unexplained"] == IDS.numel()
    assert "side A selects 2 experts per token, side B 1" in routing.summary
    assert not [f for f in rep.findings if f.cause == "operator"]
    experts = next(p for p in rep.points if p.key == "L1.moe.experts_out")
    assert "L1.moe.topk_weights" not in experts.inputs and "L1.moe.router_logits" in experts.inputs
    assert {d["key"] for d in rep.to_json()["not_comparable"]} == {"L1.moe.topk_weights"}


def _bf16_pair_with_reference(tmp_path, change_b):
    """The tiny bf16 MoE saved as an HF checkpoint and traced as side A; the same weights with `change_b`
    applied traced as side B; the report with the checkpoint as reference."""
    from tic_trace.replay.reference import ExactReference
    ids = sample_tokens(2, 16)
    ck, a = checkpointed_trace(tmp_path, bf16_model(), ids)
    b = bf16_model()
    change_b(b)
    trace_hf(b, tmp_path / "b", ids)
    return find_divergence(str(a), str(tmp_path / "b"), reference=ExactReference(str(ck)))


def test_topk_width_bf16_with_reference_is_not_replayed_not_a_crash(tmp_path):
    """With the checkpoint as reference, the side whose top-k does not fit the config is not replayed at that
    point (the reason says why), and the A-B rule names the routing cause."""
    rep = _bf16_pair_with_reference(tmp_path, lambda b: plant(b, "hf", "topk_width", 1))
    assert (rep.first["key"], rep.first["cause"]) == ("L1.moe.topk_ids", "routing")
    ids_point = next(p for p in rep.points if p.key == "L1.moe.topk_ids")
    assert "another top-k" in ids_point.intrinsic["b"]["not_replayed"]
    assert "not_replayed" not in ids_point.intrinsic["a"]
    _no_uncompared_inputs(rep)
    _round_trip(rep)


# ------------------------------------------------------------------------------------------------
# Megatron (training side, fp32) against SGLang (rollout side: prefill + decode), faults on SGLang

@pytest.fixture(scope="module")
def mgsg(tmp_path_factory):
    """A clean Megatron trace, then SGLang's distributed state for the rest of the module (one
    torch.distributed group at a time: megatron's first)."""
    import test_sglang_adapter as sglang_adapter
    from tic_trace.testing import sglang_cpu as sc
    root = tmp_path_factory.mktemp("redteam_mgsg")
    hf = build_hf_model(sglang_adapter.moe_cfg(), seed=0)
    sglang_adapter.trace_megatron(root / "mg", hf.config, hf.state_dict(), sglang_adapter.SEQS)
    sc.init_sglang_distributed(tp_size=1)
    try:
        yield sglang_adapter, root / "mg", sc.hf_checkpoint_weights(hf)
    finally:
        sc.destroy_sglang_distributed()


@pytest.mark.parametrize("name", redteam_faults("sglang"))
def test_redteam_fault_found_megatron_vs_sglang(tmp_path, mgsg, name):
    from tic_trace.testing import sglang_cpu as sc
    T, mg, weights = mgsg
    T.rollout(sc.build_sglang_model(T.moe_cfg(), weights), tmp_path / "sg", fault=name)
    rep = find_divergence(str(mg), str(tmp_path / "sg"))
    _assert_found(rep, name, T.FAULT_LAYER)
    if name == "topk_width":
        routing = next(f for f in rep.findings if f.cause == "routing")
        assert (routing.detail["k"], routing.detail["k_b"]) == (2, 1)


# ------------------------------------------------------------------------------------------------
# bf16 with the checkpoint as reference: a computational fault at a point the sides record in different
# dtypes is `intrinsic` on the side that computes another op, not a `precision` choice

def _fp32_topk_weights(model, layer: int, renormalise: bool) -> None:
    """Qwen3-MoE's HF router keeping its top-k weights in fp32 (as SGLang does), optionally without the
    renormalisation the config asks for."""
    import torch.nn.functional as F
    gate = model.model.layers[layer].mlp.gate

    def forward(hidden_states):
        hs = hidden_states.reshape(-1, gate.hidden_dim)
        logits = F.linear(hs, gate.weight)
        top, idx = torch.topk(torch.softmax(logits, dtype=torch.float, dim=-1), gate.top_k, dim=-1)
        return logits, (top / top.sum(-1, keepdim=True) if renormalise else top), idx
    gate.forward = forward


@pytest.mark.parametrize("renormalise", [True, False])
def test_another_dtype_is_precision_only_while_both_sides_are_exact(tmp_path, renormalise):
    rep = _bf16_pair_with_reference(tmp_path, lambda b: _fp32_topk_weights(b, 1, renormalise))
    point = next(p for p in rep.points if p.key == "L1.moe.topk_weights")
    assert point.dtypes == {"a": "bfloat16", "b": "float32"}
    if renormalise:       # a precision choice: fp32 weights are the more exact, bf16 side A the less
        assert (point.cause, point.replay["side"]) == ("precision", "A")
    else:                 # B drops the renormalisation: B computes another op, in whatever dtype
        assert (point.cause, point.replay["side"]) == ("intrinsic", "B"), point.replay
        assert (rep.first["key"], rep.first["cause"]) == ("L1.moe.topk_weights", "intrinsic")
    _round_trip(rep)


def test_nan_on_both_sides_alike_is_consistent_but_noted(tmp_path, clean_moe):
    """Both sides NaN at the same element: they agree (no finding, exit 0), and the report says both compute
    non-finite values from that point on; against a clean side the same trace is a `nonfinite` divergence."""
    for side in ("a", "b"):
        model = build_hf_model(tiny_qwen3_config(moe=True))
        plant(model, "hf", "nan_one_token", 1)
        trace_hf(model, tmp_path / side, IDS)
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"))
    assert rep.verdict == "consistent" and rep.exit_code == 0 and rep.findings == []
    note = next(n for n in rep.notes if n.kind == "nonfinite_shared")
    assert next(iter(note.detail["points"])) == "L1.attn.out" and "logits" in note.detail["points"]
    _round_trip(rep)
    rep = find_divergence(str(clean_moe), str(tmp_path / "b"))
    assert (rep.first["key"], rep.first["cause"]) == ("L1.attn.out", "nonfinite")
    assert not [n for n in rep.notes if n.kind == "nonfinite_shared"]


def test_terminal_headline_names_shared_nonfinite(tmp_path, capsys):
    from tic_trace.tools.cli import main as cli
    for side in ("a", "b"):
        model = build_hf_model(tiny_qwen3_config(moe=True))
        plant(model, "hf", "nan_one_token", 1)
        trace_hf(model, tmp_path / side, IDS)
    assert cli(["first-divergence", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert head.startswith("CONSISTENT") and "BOTH sides compute NaN/Inf" in head and "accumulated" not in head
