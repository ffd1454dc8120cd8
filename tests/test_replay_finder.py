"""The bf16 suite through the FULL finder on HF<->HF (real transformers Qwen3-MoE, bf16): with
`reference=` the checkpoint, every precision fault planted in one side's computation is the report's first
divergence at exactly its point and layer, names the side whose op is the less exact one, and carries both
sides' numbers; clean bf16 pairs that differ only in op order or kernel get no operator, intrinsic or
precision divergence; a saved report with intrinsic findings re-judges to itself from its numbers alone.
The contract (versions, config, numerics, dtypes, weights) is in every report, first.
"""
import json

import pytest
import torch

from tic_trace import find_divergence
from tic_trace.compare.diverge import rejudge
from tic_trace.replay.reference import ExactReference
from tic_trace.testing.hf_models import sample_tokens
from tic_trace.testing.precision_faults import CLEAN, PRECISION_FAULTS
from tic_trace.tools.cli import main as cli

from conftest import bf16_model, checkpointed_trace, trace_hf

IDS = sample_tokens(2, 16)
RELIABLE = ["rmsnorm_no_upcast", "qk_norm_no_upcast", "rope_fp32_tables", "router_fp32", "fp32_residual",
            "lm_head_fp32"]
NOT_CLEAN = ("operator", "intrinsic", "precision", "nonfinite", "weights")


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    ck, a = checkpointed_trace(tmp_path_factory.mktemp("replay_finder"), bf16_model(), IDS)
    return ck, a, ExactReference(str(ck))


def _round_trip(rep) -> dict:
    doc = json.loads(json.dumps(rep.to_json()))
    assert rejudge(doc) == doc
    return doc


@pytest.mark.parametrize("name,layer", [(n, lay) for n in RELIABLE for lay in (0, 1)
                                        if PRECISION_FAULTS[n].layered or lay == 1])
def test_precision_fault_is_the_first_divergence_with_the_side(tmp_path, clean, name, layer):
    f = PRECISION_FAULTS[name]
    ck, a, ref = clean
    model = bf16_model()
    f.plant(model, layer)
    trace_hf(model, tmp_path / "b", IDS)
    rep = find_divergence(str(a), str(tmp_path / "b"), reference=ref)
    key = f"L{layer}.{f.point}" if f.layered else f.point
    side = "B" if f.worse == "planted" else "A"
    cause = "intrinsic" if f.worse == "planted" else "precision"
    assert rep.verdict == "divergent" and rep.exit_code == 1
    assert (rep.first["key"], rep.first["cause"], rep.first["replay"]["side"]) == (key, cause, side), \
        (rep.first["key"], rep.first["cause"], rep.first["replay"])
    finding = rep.findings[[x.key for x in rep.findings].index(key)]
    ea, eb = finding.detail["a"], finding.detail["b"]
    assert finding.detail["side"] == side and ea["rows"] == eb["rows"] == IDS.numel()
    if cause == "intrinsic":                       # same dtype: the blamed side is over its limit, the other not
        worse, better = (eb, ea) if side == "B" else (ea, eb)
        assert worse["excess"] > worse["limit"] >= better["excess"]
        assert "mean" in finding.summary and "ULP" in finding.summary and "correctly rounded" in finding.summary
    else:                                          # different dtypes: the coarser side is further from exact
        worse, better = (ea, eb) if side == "A" else (eb, ea)
        assert worse["rel_l2"] > better["rel_l2"] and worse["dtype"] == "bfloat16" and better["dtype"] == "float32"
        assert [d for d in rep.contract if d["kind"] == "precision" and d["key"] == key]   # the contract names it
    assert not [p.key for p in rep.points[:[p.key for p in rep.points].index(key)] if p.status == "divergent"]
    _round_trip(rep)


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_clean_bf16_pair_gets_no_operator_intrinsic_or_precision_divergence(tmp_path, clean, name):
    ck, a, ref = clean
    model = bf16_model()
    CLEAN[name](model)
    trace_hf(model, tmp_path / "b", IDS)
    rep = find_divergence(str(a), str(tmp_path / "b"), reference=ref)
    bad = [(f.cause, f.key) for f in rep.findings if f.cause in NOT_CLEAN and f.divergent]
    assert not bad, [f.summary for f in rep.findings if f.divergent]
    assert all(f.cause == "routing" for f in rep.findings)      # near-tie flips: the verdicts issue's business
    replayed = [p for p in rep.points if "excess" in ((p.intrinsic or {}).get("b") or {})]
    assert len(replayed) > 40
    assert rep.contract == [] or all(d["section"] == "numerics" for d in rep.contract)
    _round_trip(rep)


def _no_upcast_side(path):
    """Side B: the clean model with layer 1's input RMSNorm computed in bf16 (no fp32 upcast), traced into `path`."""
    model = bf16_model()
    PRECISION_FAULTS["rmsnorm_no_upcast"].plant(model, 1)
    trace_hf(model, path, IDS)


def test_not_replayed_points_are_said_and_judged_by_the_a_minus_b_rule(tmp_path, clean):
    """A checkpoint without layer 1's o_proj: that point is not replayed (said in a note and in the point)
    and the fp32-residual precision fault after it is still found."""
    from safetensors.torch import load_file, save_file
    ck, a, _ = clean
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text((ck / "config.json").read_text())
    sd = {k: v for k, v in load_file(str(ck / "model.safetensors")).items() if "layers.1.self_attn.o_proj" not in k}
    save_file(sd, str(tmp_path / "ck" / "model.safetensors"))
    _no_upcast_side(tmp_path / "b")
    rep = find_divergence(str(a), str(tmp_path / "b"), reference=str(tmp_path / "ck"))
    p = next(p for p in rep.points if p.key == "L1.attn.out")
    assert "o_proj" in p.intrinsic["a"]["not_replayed"] and p.replay["side"] is None
    note = next(n for n in rep.notes if n.kind == "not_replayed")
    assert "L1.attn.out" in note.detail["points"]
    assert rep.first["key"] == "L1.attn_norm" and rep.first["cause"] == "intrinsic"
    _round_trip(rep)


def test_rejudge_with_other_margins_changes_only_the_replay_verdict(tmp_path, clean):
    from tic_trace.replay.intrinsic_verdict import Margins
    ck, a, ref = clean
    _no_upcast_side(tmp_path / "b")
    doc = _round_trip(find_divergence(str(a), str(tmp_path / "b"), reference=ref))
    assert doc["first_divergence"]["key"] == "L1.attn_norm"
    # limits doubled (the constant and the variant-based ones) and no blame by fingerprint: no side is abnormal
    loose = rejudge(doc, margins=Margins(over=2.0, variant_over=2.0, fingerprints=False))
    assert not [f for f in loose["findings"] if f["cause"] == "intrinsic"]
    assert loose["settings"]["margins"]["over"] == 2.0 and rejudge(loose) == loose


def test_without_reference_a_dtype_difference_is_a_precision_finding(tmp_path, clean):
    """No checkpoint: the contract's dtype difference still names the point, the coarser side blamed."""
    ck, a, _ = clean
    model = bf16_model()
    PRECISION_FAULTS["router_fp32"].plant(model, 1)
    trace_hf(model, tmp_path / "b", IDS)
    rep = find_divergence(str(a), str(tmp_path / "b"))
    assert (rep.first["key"], rep.first["cause"], rep.first["replay"]["side"]) == ("L1.moe.router_logits", "precision", "A")
    assert rep.contract[0]["section"] == "dtype" and rep.contract[0]["key"] == "L1.moe.router_logits"
    assert "by recorded dtype" in rep.findings[0].summary
    _round_trip(rep)


def test_weight_sync_bug_is_a_weights_finding_and_an_intrinsic_one(tmp_path, clean):
    """Side B's q_proj of layer 1 is not the checkpoint's: the contract names the parameter and the side, the
    replay blames B at L1.attn.q."""
    ck, a, ref = clean
    model = bf16_model()
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight[:, :8] *= 1.01
    trace_hf(model, tmp_path / "b", IDS)
    rep = find_divergence(str(a), str(tmp_path / "b"), reference=ref)
    assert (rep.first["key"], rep.first["cause"], rep.first["replay"]["side"]) == ("L1.attn.q", "intrinsic", "B")
    w = [f for f in rep.findings if f.cause == "weights"]
    assert [(f.key, f.detail["sides"]) for f in w] == [("L1.attn.q", ["B"])]
    assert w[0].detail["parameters"] == ["model.layers.1.self_attn.q_proj.weight"]
    # no reference: the weights finding is shown (not counted: hashes compare storage, the tensors decide)
    without = find_divergence(str(a), str(tmp_path / "b"))
    assert [(f.key, f.divergent) for f in without.findings if f.cause == "weights"] == [("L1.attn.q", False)]
    _round_trip(rep)


def test_cli_reference_contract_first_and_the_side_in_every_rendering(tmp_path, clean, capsys):
    ck, a, _ = clean
    model = bf16_model()
    PRECISION_FAULTS["router_fp32"].plant(model, 1)
    trace_hf(model, tmp_path / "b", IDS)
    js, html = tmp_path / "r.json", tmp_path / "r.html"
    assert cli(["first-divergence", str(a), str(tmp_path / "b"), "--reference", str(ck), "--json", str(js),
                "--html", str(html)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("FIRST DIVERGENCE at L1.moe.router_logits [precision]: side A")
    assert lines[1].startswith("CONTRACT: 1 difference")
    assert "dtype" in lines[2] and "L1.moe.router_logits [precision]" in lines[2]
    doc = json.loads(js.read_text())
    assert list(doc)[:4] == ["schema", "verdict", "exit_code", "contract"]
    page = html.read_text()
    assert page.index('id="contract"') < page.index('id="answer"')
    assert cli(["report", "x", "--from-json", str(js)]) == 1          # re-rendered from the saved numbers
    assert cli(["first-divergence", str(a), str(tmp_path / "b"), "--reference", str(tmp_path)]) == 2   # no config.json


def test_demo_bf16_precision_fault_names_the_point_and_the_side(tmp_path, capsys):
    assert cli(["demo", "--fault", "rmsnorm_no_upcast", "--dtype", "bfloat16", "--out", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    # the answer names the side by the fault its output matches (replay/variants.py fingerprints)
    assert "FIRST DIVERGENCE at L1.attn_norm [intrinsic]: B's RMSNorm at L1 matches *no fp32 upcast*" in out
    assert (tmp_path / "d" / "checkpoint" / "config.json").is_file()
    doc = json.loads((tmp_path / "d" / "report.json").read_text())
    assert doc["settings"]["reference"]["path"] == str(tmp_path / "d" / "checkpoint")
    assert cli(["demo", "--fault", "router_bf16", "--dtype", "bfloat16", "--out", str(tmp_path / "d")]) == 2


def test_slime_report_replays_against_the_recorded_hf_checkpoint(tmp_path, clean, capsys):
    """The Megatron side's manifest records slime's --hf-checkpoint (integrations/slime/megatron_hooks.py);
    slime-report replays against it, --reference overrides it, --no-reference turns it off. (The sides here
    are HF traces laid out as a slime rollout directory: the report reads adapters from the manifests.)"""
    from tic_trace.integrations.slime.config import rollout_dir
    ck, _, _ = clean
    rdir = rollout_dir(tmp_path / "run", 0)
    model = bf16_model()
    trace_hf(model, rdir / "megatron", IDS, manifest={"slime": {"rollout_id": 0, "hf_checkpoint": str(ck)}})
    _no_upcast_side(rdir / "sglang")
    js = tmp_path / "r.json"
    assert cli(["slime-report", str(tmp_path / "run"), "--rollout-id", "0", "--json", str(js)]) == 1
    out = capsys.readouterr().out
    assert f"exact replay against the run's --hf-checkpoint {ck}" in out
    doc = json.loads(js.read_text())
    assert (doc["first_divergence"]["key"], doc["first_divergence"]["cause"]) == ("L1.attn_norm", "intrinsic")
    assert doc["slime"]["reference"] == str(ck)
    assert cli(["slime-report", str(tmp_path / "run"), "--rollout-id", "0", "--no-reference", "--json", str(js)]) == 0
    assert "exact replay: off (--no-reference)" in capsys.readouterr().out


def test_rejudge_of_a_tampered_replay_record_does_not_crash(tmp_path, clean):
    ck, a, ref = clean
    _no_upcast_side(tmp_path / "b")
    doc = _round_trip(find_divergence(str(a), str(tmp_path / "b"), reference=ref))
    p = next(p for p in doc["points"] if p["key"] == "L1.attn_norm")
    p["intrinsic"]["b"]["rel_l2"] = "not a number"
    p["intrinsic"]["a"]["numel"] = "many"
    out = rejudge(doc)
    assert out["first_divergence"] is None or out["first_divergence"]["key"] != "L1.attn_norm"
