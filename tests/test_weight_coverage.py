"""Weight sync compares every parameter of both sides, and says how many (issue 34, item 1).

Each side's parameter hashes are recorded in the HF checkpoint's layout (record/weight_pieces.py: the adapters
map fused and sharded parameters onto slices of checkpoint tensors, and the slices' hash shares add up to the
checkpoint tensor's hash), merged over ranks and compared tensor by tensor; the contract says "N of M
parameters compared" and names what was not. Real components: HF Llama / Qwen3, megatron-core's GPTModel
loaded with the project's own converter at TP 2 and EP 2, SGLang's model code. The faults are in the weights the
model computes with (a parameter scaled in place before the forward), never in a trace.
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
from tic_trace.adapters.megatron_weight_map import megatron_weight_pieces
from tic_trace.adapters.megatron_weights import hf_to_megatron_state_dict, load_into
from tic_trace.compare.contract import diff_contract
from tic_trace.record.stats import device_hash
from tic_trace.record.weight_pieces import hash_pieces, piece_hash
from tic_trace.testing import megatron_cpu as mc
from tic_trace.testing import sglang_cpu as sc
from tic_trace.testing.hf_models import build_hf_model_stable, sample_tokens, tiny_qwen3_config
from tic_trace.view.align import CanonicalView
from tic_trace.view.canonical_weights import merge_rank_pieces

from conftest import trace_hf

IDS = sample_tokens(2, 8)
PROMPTS = {"req-a": [3, 5, 7, 9, 11]}
DOWN = "model.layers.1.mlp.down_proj.weight"


def _weights(contract) -> tuple[list, list]:
    """(parameters said to differ between A and B, the coverage lines: the `hashes` line where some parameter
    was not compared, else the notes of the A-B `weights` differences, which end with the coverage)."""
    names = sorted(n for d in contract if d.section == "weights" and d.against == "B" for n in d.a)
    lines = [d.note for d in contract if d.section == "hashes"]
    return names, lines or [d.note for d in contract if d.section == "weights" and d.against == "B"]


def test_piece_shares_add_up_to_the_whole_tensors_hash():
    t = torch.randn(6, 10, 4).to(torch.bfloat16)
    for dim in range(3):
        step = (2, 5, 1)[dim]
        parts = [t.narrow(dim, s, step) for s in range(0, t.shape[dim], step)]
        offs = [tuple(s if d == dim else 0 for d in range(3)) for s in range(0, t.shape[dim], step)]
        total = sum(int(piece_hash(p, tuple(t.shape), o)) for p, o in zip(parts, offs))
        assert (total - int(device_hash(t))) % (1 << 64) == 0


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return build_hf_model_stable(cfg, dtype=torch.bfloat16)


def test_a_llama_whose_down_proj_differs_by_one_percent_is_named(tmp_path):
    """Not a canonical point's own parameter (its module's record is `mlp.out`'s input), still compared."""
    model = _llama()
    trace_hf(model, tmp_path / "a", IDS)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(1.01)
    trace_hf(model, tmp_path / "b", IDS)
    va, vb = CanonicalView(str(tmp_path / "a")), CanonicalView(str(tmp_path / "b"))
    names, lines = _weights(diff_contract(va, vb))
    assert names == [DOWN]
    n = len(dict(model.named_parameters()))
    assert lines == [f"parameters whose bits differ between A and B: {DOWN} ({n} of {n} parameters compared)"]
    # the same pair untouched: every parameter compared, nothing to say (the renderers print "agree")
    trace_hf(_llama(), tmp_path / "c", IDS)
    assert _weights(diff_contract(va, CanonicalView(str(tmp_path / "c")))) == ([], [])


def test_parameters_no_map_covers_are_named_and_agree_is_not_said(tmp_path):
    """A parameter the adapter cannot map (here: one the checkpoint has no tensor for, added to side B's model)
    is counted and named; the rest is compared."""
    model = build_hf_model_stable(tiny_qwen3_config(moe=False), dtype=torch.bfloat16)
    trace_hf(model, tmp_path / "a", IDS)
    model.model.layers[0].mlp.extra = torch.nn.Parameter(torch.ones(3))
    trace_hf(model, tmp_path / "b", IDS)
    names, lines = _weights(diff_contract(CanonicalView(str(tmp_path / "a")), CanonicalView(str(tmp_path / "b"))))
    n = len(dict(model.named_parameters()))
    assert names == [] and len(lines) == 1
    assert lines[0].startswith(f"weight hashes: {n - 1} of {n} parameters compared, all agree; 1 not compared")
    assert "held by B only: model.layers.0.mlp.extra" in lines[0]


def _megatron(out, cfg, sd):
    model = mc.build_gpt_model(cfg, dtype=torch.bfloat16)
    load_into(model, hf_to_megatron_state_dict(sd, cfg))
    ids = torch.tensor([PROMPTS["req-a"]])
    with tic_trace.trace(model, out, adapter=MegatronAdapter(vocab_size=cfg.vocab_size), points_mode="full") as t, \
            torch.no_grad():
        model(ids, torch.arange(ids.shape[1]).unsqueeze(0), attention_mask=None)
    assert t.failed is None, t.failed
    return model


@pytest.fixture(scope="module")
def mgsg(tmp_path_factory):
    """Megatron (A) and SGLang (B) traces of one checkpoint per kind, SGLang also with one weight scaled."""
    d = tmp_path_factory.mktemp("mgsg_weights")
    out = {}
    with mc.single_rank():
        for kind in ("dense", "moe"):
            cfg = tiny_qwen3_config(moe=kind == "moe")
            hf = build_hf_model_stable(cfg, dtype=torch.bfloat16)
            hf.save_pretrained(d / f"ck_{kind}")
            model = _megatron(d / f"mg_{kind}", cfg, hf.state_dict())
            out[f"mg_params_{kind}"] = len(dict(model.named_parameters()))
            out[f"hf_params_{kind}"] = {n: p.detach().clone() for n, p in hf.named_parameters()}
            out[f"cfg_{kind}"] = cfg
    sc.init_sglang_distributed(tp_size=1)
    try:
        for kind in ("dense", "moe"):
            ck = d / f"ck_{kind}"
            for planted in (False, True):
                m = sc.build_sglang_model(transformers.AutoConfig.from_pretrained(str(ck)), str(ck),
                                          dtype=torch.bfloat16)
                if planted:
                    mlp = m.model.layers[1].mlp
                    with torch.no_grad():
                        (mlp.experts.w2_weight[2] if kind == "moe" else mlp.down_proj.weight).mul_(1.01)
                with sga.trace_forwards(m, d / f"sg_{kind}_{planted}", points_mode="full") as t:
                    sc.SGLangRollout(m).generate(PROMPTS, 2)
                assert t.failed is None, t.failed
        yield d, out
    finally:
        sga.close_sessions()
        sc.destroy_sglang_distributed()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_megatron_and_sglang_weights_are_compared_parameter_by_parameter(mgsg, kind):
    """Fused QKV (interleaved per group) and gate/up on Megatron, stacked qkv_proj / gate_up_proj / w13 on
    SGLang, fp32 norms on Megatron against bf16 ones on SGLang: every checkpoint tensor compared; one expert's
    (or the MLP's) down_proj scaled on SGLang is named, and only it."""
    d, info = mgsg
    n_ckpt = len(info[f"hf_params_{kind}"]) + (3 * 4 * 2 - 2 * 2 if kind == "moe" else 0)   # per-expert tensors
    va = CanonicalView(str(d / f"mg_{kind}"))
    clean = _weights(diff_contract(va, CanonicalView(str(d / f"sg_{kind}_False"))))
    assert clean == ([], []), clean          # all compared and agree: the renderers' "weight hashes agree"
    names, lines = _weights(diff_contract(va, CanonicalView(str(d / f"sg_{kind}_True"))))
    want = "model.layers.1.mlp.experts.2.down_proj.weight" if kind == "moe" else DOWN
    assert names == [want]
    assert lines == [f"parameters whose bits differ between A and B: {want} ({n_ckpt} of {n_ckpt} parameters "
                     "compared)"]


def test_the_cli_states_the_coverage(mgsg, capsys):
    from tic_trace.tools.cli import main as cli
    d, _ = mgsg
    cli(["first-divergence", str(d / "mg_dense"), str(d / "sg_dense_True"), "--json", str(d / "r.json")])
    out = capsys.readouterr().out
    assert "weight hashes agree" not in out and f"differ between A and B: {DOWN} (25 of 25 parameters" in out
    doc = json.loads((d / "r.json").read_text())
    assert any(c["section"] == "weights" and DOWN in c["a"] for c in doc["contract"])


class _Shard(torch.nn.Module):
    """One rank's Megatron parameters as the converter makes them (names and tensors), for the weight map."""

    def __init__(self, sd: dict, config):
        super().__init__()
        self.config = config
        self._p = {k: torch.nn.Parameter(v, requires_grad=False) for k, v in sd.items()}
        for i, (k, v) in enumerate(self._p.items()):
            self.register_parameter(f"p{i}", v)

    def named_parameters(self, *a, **kw):
        return iter(self._p.items())


@pytest.mark.parametrize("kind,tp,ep", [("dense", 2, 1), ("moe", 2, 2)])
def test_megatron_tp_and_ep_shards_merge_to_the_checkpoint_tensors(kind, tp, ep):
    """The converter that loads Megatron in every test (hf_to_megatron_state_dict) makes each rank's shards at
    TP 2 / EP 2; the weight map's pieces of all ranks merge to exactly each checkpoint tensor's hash."""
    cfg = tiny_qwen3_config(moe=kind == "moe")
    hf = build_hf_model_stable(cfg, dtype=torch.bfloat16)
    mcfg = mc.build_transformer_config(cfg, dtype=torch.bfloat16)
    per_rank = []
    for t, e in [(t, e) for t in range(tp) for e in range(ep)]:     # every rank of a TP x EP grid
        coords = {"tp_rank": t, "tp_size": tp, "ep_rank": e, "ep_size": ep, "etp_rank": t, "etp_size": tp}
        sd = hf_to_megatron_state_dict(hf.state_dict(), cfg, tp_rank=t, tp_size=tp, ep_rank=e, ep_size=ep)
        shard = _Shard(sd, mcfg)
        params = dict(shard.named_parameters())
        plan = megatron_weight_pieces([shard], params, coords, [0], cfg.vocab_size)
        assert set(plan) == set(params), set(params) - set(plan)
        per_rank.append({k: hash_pieces(params[k], plan[k]) for k in plan})
    merged = merge_rank_pieces(per_rank)
    assert merged.partial == {} and merged.unmapped == []
    want = {}
    for name, p in hf.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            for e in range(p.shape[0]):
                g, u = p[e].chunk(2, 0)
                want[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = g
                want[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = u
        elif name.endswith("experts.down_proj"):
            for e in range(p.shape[0]):
                want[name.replace("down_proj", f"{e}.down_proj.weight")] = p[e]
        else:
            want[name] = p
    assert set(merged.tensors) == set(want)
    for name, t in want.items():
        assert merged.tensors[name][0]["bfloat16"] == int(device_hash(t.contiguous())), name


def test_a_checkpoint_no_megatron_or_sglang_hash_agrees_with_is_not_comparable(mgsg, tmp_path, capsys):
    """The hashes in the checkpoint's layout check the reference for frameworks whose parameter names are not
    the checkpoint's: the right checkpoint is confirmed tensor by tensor on both sides, another seed's is refused."""
    from tic_trace.compare.contract import reference_entries
    from tic_trace.replay.checkpoint import HFCheckpoint
    from tic_trace.tools.cli import main as cli
    d, info = mgsg
    mg, sg = str(d / "mg_dense"), str(d / "sg_dense_False")
    ck = HFCheckpoint(d / "ck_dense")
    for view in (CanonicalView(mg), CanonicalView(sg)):
        assert [e.note for e in reference_entries("A", view, ck) if e.key == "hashes"] == []   # all confirmed
    build_hf_model_stable(info["cfg_dense"], seed=1, dtype=torch.bfloat16).save_pretrained(tmp_path / "other")
    assert cli(["first-divergence", mg, sg, "--reference", str(tmp_path / "other")]) == 3
    out = capsys.readouterr().out
    assert "whose hash differs from the checkpoint's on every side" in out and "FIRST DIVERGENCE" not in out


def test_drift_weight_check_states_what_it_compared():
    from tic_trace.drift.weights import contract_weights, weight_sync
    from tic_trace.drift.schema import RolloutEntry
    line = ("weight hashes: 24 of 25 parameters compared, all agree; 1 not compared "
            "(not mappable to a checkpoint tensor on A: A:decoder.layers.0.x)")
    ok = contract_weights({"contract": [{"section": "hashes", "key": "A-B", "a": 24, "b": 25, "note": line}]})
    assert ok.agree is True and ok.note == line
    none = contract_weights({"contract": [{"section": "hashes", "key": "A-B", "a": 0, "b": 3,
                                           "note": "weight hashes: 0 of 3 parameters compared; 3 not compared"}]})
    assert none.agree is None
    bad_line = f"parameters whose bits differ between A and B: {DOWN} (25 of 25 parameters compared)"
    bad = contract_weights({"contract": [
        {"section": "weights", "key": "L1.mlp.out", "a": [DOWN], "b": [DOWN], "against": "B", "note": bad_line}]})
    assert bad.agree is False and bad.differing == [DOWN]
    sync = weight_sync([RolloutEntry(0, "r0", "compared", weights=ok), RolloutEntry(1, "r1", "compared", weights=bad)],
                       ["megatron", "sglang"])
    assert sync.from_rollout == 1 and DOWN in sync.summary and "(25 of 25 parameters compared)" in sync.summary
