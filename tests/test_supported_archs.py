"""Supported architectures are a list: each adapter names the architectures its table maps, a trace of any
other is refused by name (not comparable, exit 3) unless unverified mappings are accepted, and then every
report says so. The README's table is the code's.

Every model here is a tiny random one of a real transformers 5.24 class, built locally (no hub access); the
SGLang side runs SGLang's own model code on the CPU.
"""
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as T

import tic_trace
from tic_trace.graph.adapter import PointMap, get_adapter
from tic_trace.graph.supported import supported_architectures_markdown
from tic_trace.adapters import hf as hf_adapter
from tic_trace.adapters import megatron as mg_adapter
from tic_trace.adapters import sglang_names
from tic_trace.view.align import CanonicalView
from tic_trace.compare.contract import CONFIG_KEYS, _diff_dicts, checkpoint_config
from tic_trace import find_divergence
from tic_trace.compare.diverge import rejudge
from tic_trace.testing.hf_models import build_hf_model, build_hf_model_stable, sample_tokens
from tic_trace.tools.cli import main as cli

from arch_configs_gemma_phi3_gptoss import GEMMA_PHI3_GPTOSS
from arch_configs_qwen3next import qwen3next_config
from conftest import trace_hf

ROOT = Path(__file__).resolve().parents[1]
IDS = sample_tokens(2, 10)
COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, intermediate_size=128, max_position_embeddings=256, rms_norm_eps=1e-6,
              tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
_NO_HEAD_DIM = {k: v for k, v in COMMON.items() if k != "head_dim"}
_MLA = {**_NO_HEAD_DIM, "num_key_value_heads": 4}        # MLA: every head has its own k and v
_DEEPSEEK_MOE = dict(**MOE, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)

# One tiny config per row of the HF adapter's table (test_every_hf_table_row_is_run checks they are the same set).
VERIFIED = {
    "LlamaForCausalLM": lambda: T.LlamaConfig(**COMMON),
    "Qwen2ForCausalLM": lambda: T.Qwen2Config(**COMMON),
    "Qwen3ForCausalLM": lambda: T.Qwen3Config(**COMMON),
    "Qwen3MoeForCausalLM": lambda: T.Qwen3MoeConfig(**COMMON, **MOE, num_experts=4, norm_topk_prob=True),
    "Qwen2MoeForCausalLM": lambda: T.Qwen2MoeConfig(**COMMON, **MOE, num_experts=4, shared_expert_intermediate_size=64),
    "MixtralForCausalLM": lambda: T.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
    "OlmoeForCausalLM": lambda: T.OlmoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2),
    **GEMMA_PHI3_GPTOSS,
    "Glm4MoeForCausalLM": lambda: T.Glm4MoeConfig(**COMMON, **_DEEPSEEK_MOE, attention_bias=True),
    "DeepseekV3ForCausalLM": lambda: T.DeepseekV3Config(**_MLA, **_DEEPSEEK_MOE, kv_lora_rank=32, q_lora_rank=24,
                                                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
    # hybrid: layers 0 and 2 linear attention (dense MLP), 1 and 3 gated attention (MoE)
    "Qwen3NextForCausalLM": qwen3next_config,
}
# Architectures the red team found mapped wrongly (or with false contract differences): refused by name (none of
# HF's today: the test below runs again for the next one)
REFUSED: dict = {}


def _config(factory):
    cfg = factory()
    cfg._attn_implementation = "eager"
    return cfg


def _pair(tmp_path: Path, factory, dtype=torch.float32, stable=False):
    """A clean pair: one tiny random model of the class traced twice (A, B), and the model."""
    cfg = _config(factory)
    model = (build_hf_model_stable if stable else build_hf_model)(cfg, dtype=dtype)
    trace_hf(model, tmp_path / "a", IDS)
    trace_hf(model, tmp_path / "b", IDS)
    return tmp_path / "a", tmp_path / "b", model


def _arch_notes(rep):
    notes = rep["notes"] if isinstance(rep, dict) else [n.__dict__ for n in rep.notes]
    return [n for n in notes if n["kind"] == "unverified_mapping"]


# ------------------------------------------------------------------------------------------------ the tables

def test_every_hf_table_row_is_run():
    """A row added to the table without a model here is a row nobody verified; a refused class in the table
    is a contradiction."""
    assert set(VERIFIED) == set(hf_adapter.ARCHITECTURES)
    assert not set(REFUSED) & set(hf_adapter.ARCHITECTURES)
    assert set(REFUSED) <= set(hf_adapter.REFUSED)


def test_readme_table_is_the_code_table():
    """The README's supported-architectures block is exactly what the adapters' tables render."""
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- supported-architectures:begin.*?-->\n(.*?)<!-- supported-architectures:end -->", readme, re.S)
    assert m, "README.md has no supported-architectures block"
    assert m.group(1).strip() == supported_architectures_markdown().strip(), (
        "README's table is not the code's: paste the output of `python -c 'from tic_trace.graph.supported import "
        "supported_architectures_markdown as f; print(f())'` between the markers")
    for ad in ("hf", "megatron", "sglang"):      # every verified and every refused name is in it
        a = get_adapter(ad)
        for name in list(a.architectures) + list(a.refused):
            assert f"`{name}`" in m.group(1), (ad, name)


# ------------------------------------------------------------------------------------------------ verified: HF

@pytest.mark.parametrize("name", sorted(VERIFIED))
def test_verified_hf_architecture_clean_pair(tmp_path, name):
    """A clean pair of the class is consistent with no unverified note, lists no point as missing, records
    every point the table promises and none it says the class lacks, and its residual stream adds up."""
    a, b, model = _pair(tmp_path, VERIFIED[name])
    assert type(model).__name__ == name
    v = CanonicalView(str(a))
    assert v.config["architecture"] == name and v.config["architecture_verified"] is True
    rep = find_divergence(str(a), str(b))
    assert rep.verdict == "consistent", [(p.key, p.status) for p in rep.points if p.status != "ok"]
    assert not _arch_notes(rep) and rep.sides["a"]["architecture"] == {"name": name, "verified": True, "why": ""}
    assert rep.not_comparable == []          # a dense model without QK-norm lists no attn.q_norm as missing
    promised = set(v.adapter.promised_points(v.config))
    assert {p for p, _ in v.points()} == promised | {"logprobs"}
    arch = hf_adapter.ARCHITECTURES[name]
    assert not promised & set(arch.lacks)
    names = {r.name for r in v.trace.open_pass(0, 0).records}
    for pm in hf_adapter.POINTS:             # what the table says the class lacks, it really does not run
        if pm.point in arch.lacks:
            assert not [n for n in names if pm.regex().match(n)], (name, pm.point)
    # the points are what their names say: the residual stream around attention and MLP adds up
    present = {p for p, _ in v.points()}
    att_branch, mlp_branch = (p if p in present else f for p, f in (("attn.post_norm", "attn.out"),
                                                                     ("mlp.post_norm", "mlp.out")))
    for layer in range(2):
        inp, att, mid, mlp, out = (v.load(p, layer).values for p in ("input", att_branch, "mid", mlp_branch, "output"))
        np.testing.assert_allclose(inp + att, mid, rtol=0, atol=1e-6)
        np.testing.assert_allclose(mid + mlp, out, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", sorted(VERIFIED))
def test_verified_hf_architecture_replay_covers_what_the_table_says(tmp_path, name):
    """A bf16 clean pair replayed against its own checkpoint: no divergence, no contract difference (config
    keys under other names, RoPE spelling, Mixtral's renormalised top-k agree with the checkpoint), and the
    replay judges every point but exactly the table's `replay_gaps`."""
    a, b, model = _pair(tmp_path, VERIFIED[name], dtype=torch.bfloat16, stable=True)
    model.save_pretrained(tmp_path / "ck")
    rep = find_divergence(str(a), str(b), reference=str(tmp_path / "ck"))
    assert rep.verdict == "consistent", [(f.cause, f.key, f.summary) for f in rep.findings if f.divergent]
    # no difference; the "reference" section only says what the replay used (Mixtral: its fused expert
    # parameters' hashes confirm only some of the checkpoint's per-expert tensors)
    assert [d for d in rep.contract if d["section"] != "reference"] == []
    assert all(d["key"] in ("hashes", "weights") for d in rep.contract)
    gaps = next((n.detail["points"] for n in rep.notes if n.kind == "not_replayed"), {})
    assert {k.split(".", 1)[1] for k in gaps} == set(hf_adapter.ARCHITECTURES[name].replay_gaps), gaps
    # each side within the envelope of clean implementations at every replayed point: "equally far from exact"
    # on both sides is a consistent pair, and also what a replay of the wrong op looks like
    far = [(p.key, s, e["excess"], e["limit"]) for p in rep.points for s, e in (p.intrinsic or {}).items()
           if isinstance(e, dict) and isinstance(e.get("limit"), float) and e["excess"] > e["limit"]]
    assert not far, far


@pytest.mark.parametrize("target", ["router", "expert"])
def test_mixtral_router_and_experts_are_replayed_from_block_sparse_moe(tmp_path, target):
    """The checkpoint keeps Mixtral's `block_sparse_moe.gate` and w1/w2/w3 experts: side B's router, or one
    expert's down projection, off the checkpoint by 2% is blamed on side B at exactly that point."""
    from tic_trace.replay.intrinsic_verdict import first_intrinsic_divergence
    from tic_trace.replay.reference import ExactReference
    model = build_hf_model_stable(_config(VERIFIED["MixtralForCausalLM"]), dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "ck")
    trace_hf(model, tmp_path / "a", IDS)
    mlp = model.model.layers[1].mlp
    with torch.no_grad():
        (mlp.gate.weight if target == "router" else mlp.experts.down_proj[0]).mul_(1.02)
    trace_hf(model, tmp_path / "b", IDS)
    got = first_intrinsic_divergence(str(tmp_path / "a"), str(tmp_path / "b"), ExactReference(str(tmp_path / "ck")))
    point = "moe.router_logits" if target == "router" else "moe.experts_out"
    assert got is not None and (got.key, got.side) == (f"L1.{point}", "B"), got


def test_a_rope_kind_the_replay_lacks_leaves_only_the_rope_points_unjudged(tmp_path):
    """Phi-3's longrope (the 128k checkpoints): the checkpoint still serves as the reference for every other
    point; the RoPE points are said not replayed, naming the kind, and a fault elsewhere is still blamed."""
    from tic_trace.replay.intrinsic_verdict import first_intrinsic_divergence
    from tic_trace.replay.reference import ExactReference
    half = 64 // 4 // 2
    cfg = T.Phi3Config(**{k: v for k, v in COMMON.items() if k != "head_dim"}, original_max_position_embeddings=32,
                       rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                        "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                        "long_factor": [2.0 + 0.5 * i for i in range(half)]})
    cfg._attn_implementation = "eager"
    model = build_hf_model_stable(cfg, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "ck")
    trace_hf(model, tmp_path / "a", IDS)
    trace_hf(model, tmp_path / "b", IDS)
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"), reference=str(tmp_path / "ck"))
    assert rep.verdict == "consistent"
    gaps = next(n.detail["points"] for n in rep.notes if n.kind == "not_replayed")
    assert {k.split(".", 1)[1] for k in gaps} == {"attn.q_rope", "attn.k_rope"}, gaps
    assert "longrope" in str(gaps)
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight.mul_(1.02)
    trace_hf(model, tmp_path / "c", IDS)
    got = first_intrinsic_divergence(str(tmp_path / "a"), str(tmp_path / "c"), ExactReference(str(tmp_path / "ck")))
    assert got is not None and (got.key, got.side) == ("L1.attn.out", "B"), got


def _olmoe_q_norm_in_bf16(norm):
    """OLMoE's q_norm without its fp32 upcast (a precision fault; same dtype, same weights)."""
    def forward(x):
        return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))
    norm.forward = forward


@pytest.mark.parametrize("fault", ["weight", "no_upcast"])
def test_olmoe_whole_projection_qk_norm_is_replayed(tmp_path, fault):
    """OLMoE normalises q over all heads at once (a gain heads x head_dim wide): the replay does too, so side
    B's q_norm with a gain 2% off the checkpoint, or computed without the fp32 upcast, is blamed on side B at
    exactly L1.attn.q_norm (a per-head replay would be off on both sides alike and judge nothing)."""
    from tic_trace.replay.intrinsic_verdict import first_intrinsic_divergence
    from tic_trace.replay.reference import ExactReference
    model = build_hf_model_stable(_config(VERIFIED["OlmoeForCausalLM"]), dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "ck")
    trace_hf(model, tmp_path / "a", IDS)
    norm = model.model.layers[1].self_attn.q_norm
    assert norm.weight.numel() == model.config.num_attention_heads * (model.config.hidden_size //
                                                                       model.config.num_attention_heads)
    if fault == "weight":
        with torch.no_grad():
            norm.weight.mul_(1.02)
    else:
        _olmoe_q_norm_in_bf16(norm)
    trace_hf(model, tmp_path / "b", IDS)
    got = first_intrinsic_divergence(str(tmp_path / "a"), str(tmp_path / "b"), ExactReference(str(tmp_path / "ck")))
    assert got is not None and (got.key, got.side) == ("L1.attn.q_norm", "B"), got


def test_dense_pairs_without_qk_norm_do_not_list_it_missing_but_qwen3_has_it(tmp_path):
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM"):
        a, b, _ = _pair(tmp_path / name, VERIFIED[name])
        rep = find_divergence(str(a), str(b))
        assert not [x for x in rep.not_comparable if x["key"].endswith(("q_norm", "k_norm"))], rep.not_comparable
        assert "attn.q_norm" not in CanonicalView(str(a)).adapter.promised_points(CanonicalView(str(a)).config)
    a, _, model = _pair(tmp_path / "qwen3", VERIFIED["Qwen3ForCausalLM"])
    v = CanonicalView(str(a))
    assert v.config["qk_norm"] and ("attn.q_norm", 0) in set(v.points())
    assert "attn.q_norm" in v.adapter.promised_points(v.config)
    # Qwen3 has it: a trace without its records (filtered out here) lists it as missing
    trace_hf(model, tmp_path / "qwen3" / "c", IDS, filters=tic_trace.Filters(exclude_modules=["*q_norm*"]))
    rep = find_divergence(str(a), str(tmp_path / "qwen3" / "c"))
    assert {"attn.q_norm"} <= {x["key"] for x in rep.not_comparable if "promises it" in x["reason"]}


# ------------------------------------------------------------------------------------------------ refused: HF

def test_unverified_hf_architecture_is_refused_by_name(tmp_path, monkeypatch):
    """The trace records the class and marks itself unverified; the comparator refuses the pair before
    measuring anything: not_comparable, naming the class and what the table would get wrong. (Every HF class
    the tables know is verified now, so the refusal is given to one the tables do not map.)"""
    name = "MistralForCausalLM"
    monkeypatch.setitem(hf_adapter.REFUSED, name, "a refusal given by this test")
    a, b, model = _pair(tmp_path, lambda: T.MistralConfig(**COMMON))
    assert type(model).__name__ == name
    m = CanonicalView(str(a)).config
    assert m["architecture"] == name and m["architecture_verified"] is False
    rep = find_divergence(str(a), str(b))
    assert rep.verdict == "not_comparable" and rep.exit_code == 3 and rep.points == []
    notes = _arch_notes(rep)
    assert [n["detail"]["side"] for n in notes] == ["a", "b"]
    for n in notes:
        assert name in n["summary"] and hf_adapter.REFUSED[name] in n["summary"] and n["detail"]["refused"]
    assert {x["key"] for x in rep.not_comparable} == {"architecture"}
    doc = json.loads(json.dumps(rep.to_json()))
    assert rejudge(doc) == doc               # a saved refusal stays one


# A class no table names (Mistral: mapped like Llama, never verified here) is unverified as a refused one is
_UNLISTED = {"MistralForCausalLM": lambda: T.MistralConfig(**COMMON)}


@pytest.mark.parametrize("name", ["MistralForCausalLM"])
def test_cli_refuses_then_traces_with_the_opt_in_saying_unverified_everywhere(tmp_path, capsys, name):
    a, b, _ = _pair(tmp_path, {**REFUSED, **_UNLISTED}[name])
    capsys.readouterr()
    assert cli(["first-divergence", str(a), str(b)]) == 3
    out = capsys.readouterr().out
    assert out.startswith("NOT COMPARABLE: unverified architecture mapping") and name in out.splitlines()[0]
    assert "--allow-unverified" in out
    j, h = tmp_path / "r.json", tmp_path / "r.html"
    assert cli(["first-divergence", str(a), str(b), "--allow-unverified", "--json", str(j), "--html", str(h)]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("CONSISTENT") and "UNVERIFIED MAPPING" in first and name in first
    doc = json.loads(j.read_text())
    notes = _arch_notes(doc)
    assert len(notes) == 2 and all(name in n["summary"] and not n["detail"]["refused"] for n in notes)
    assert doc["settings"]["allow_unverified"] is True and doc["sides"]["b"]["architecture"]["verified"] is False
    html = h.read_text()
    assert "Unverified mapping" in html and name in html
    assert rejudge(doc) == doc               # re-judged, the note stays: it is a fact of the traces
    assert cli(["report", "x", "--from-json", str(j)]) == 0
    assert "UNVERIFIED MAPPING" in capsys.readouterr().out.splitlines()[0]
    assert cli(["inspect", str(a)]) == 0
    assert f"UNVERIFIED MAPPING: architecture {name}" in capsys.readouterr().out
    rep = find_divergence(str(a), str(b), allow_unverified=True)
    assert rep.verdict == "consistent" and len(_arch_notes(rep)) == 2


# ------------------------------------------------------------------------------------------------ contract

def _ckpt(tmp_path: Path, factory, edit=None):
    model = build_hf_model(_config(factory))
    model.save_pretrained(tmp_path / "ck")
    if edit is not None:
        p = tmp_path / "ck" / "config.json"
        cfg = json.loads(p.read_text())
        edit(cfg)
        p.write_text(json.dumps(cfg))
    # the facts of config.json alone: the reference refuses these architectures' tensors (MLA's o_proj, GPT-OSS's
    # expert layout are ops it does not model), and what is tested here is how config keys are named
    from types import SimpleNamespace

    from tic_trace.replay.checkpoint import read_config
    from tic_trace.replay.model_spec import model_spec
    cfg = read_config(tmp_path / "ck" / "config.json")
    return get_adapter("hf").describe([model]), checkpoint_config(SimpleNamespace(spec=model_spec(cfg), config=cfg))


def test_config_keys_under_other_names_are_no_contract_difference(tmp_path):
    """DeepSeek-V3 names its experts `n_routed_experts` / `n_shared_experts`, Mixtral `num_local_experts`: the
    HF side describes them as the checkpoint and the SGLang adapter do (refused or not, never a false
    `num_experts 0 vs 4`)."""
    desc, ck = _ckpt(tmp_path / "ds", VERIFIED["DeepseekV3ForCausalLM"])
    assert desc["num_experts"] == 4 and desc["shared_experts"] is True and desc["num_experts_per_tok"] == 2
    assert _diff_dicts("config", desc, ck, CONFIG_KEYS) == []
    desc, ck = _ckpt(tmp_path / "mx", VERIFIED["MixtralForCausalLM"])
    assert desc["num_experts"] == 4 and desc["norm_topk_prob"] is True
    assert _diff_dicts("config", desc, ck, CONFIG_KEYS) == []


def test_rope_scaling_spelled_differently_is_no_difference_but_another_factor_is(tmp_path):
    """GPT-OSS's YaRN as the loaded config states it (defaults filled in) against its checkpoint, and against
    a config.json that spells the kind `type` and leaves the defaults out: no difference. Another factor is."""
    desc, ck = _ckpt(tmp_path / "same", VERIFIED["GptOssForCausalLM"])
    assert desc["rope_scaling"]["rope_type"] == "yarn"
    assert _diff_dicts("config", desc, ck, CONFIG_KEYS) == []

    def old_spelling(cfg):
        rope = cfg.pop("rope_parameters", None) or cfg.pop("rope_scaling")
        cfg["rope_theta"] = rope.pop("rope_theta", cfg.get("rope_theta"))
        cfg["rope_scaling"] = {"type": rope.pop("rope_type"), "factor": rope["factor"],
                               "original_max_position_embeddings": rope["original_max_position_embeddings"]}
    desc, ck = _ckpt(tmp_path / "old", VERIFIED["GptOssForCausalLM"], old_spelling)
    assert ck["rope_scaling"] != desc["rope_scaling"]            # spelled differently, really
    assert _diff_dicts("config", desc, ck, CONFIG_KEYS) == []

    def other_factor(cfg):
        (cfg.get("rope_parameters") or cfg["rope_scaling"])["factor"] = 8.0
    desc, ck = _ckpt(tmp_path / "other", VERIFIED["GptOssForCausalLM"], other_factor)
    assert [d.key for d in _diff_dicts("config", desc, ck, CONFIG_KEYS)] == ["rope_scaling"]


# ------------------------------------------------------------------------------------------------ Megatron, SGLang

def test_megatron_structures_are_named_and_only_the_tested_mla_stack_is_verified():
    """A real megatron-core GPTModel (local spec) is named by its module structure and verified; of the
    multi-latent attention stacks only the tested DeepSeek-V3 one (dense first layer, then MoE:
    tests/test_megatron_mla.py) is; a structure with a component known to be mapped wrongly is refused naming
    it."""
    from tic_trace.testing import megatron_cpu as mc
    from tic_trace.testing.hf_models import tiny_qwen3_config
    ad = get_adapter("megatron")
    with mc.single_rank():
        for moe, want in ((False, "GPTModel/TransformerLayer/SelfAttention/MLP"),
                          (True, "GPTModel/TransformerLayer/SelfAttention/MoELayer")):
            model = mc.build_gpt_model(tiny_qwen3_config(moe=moe))
            facts = ad.architecture_facts([model])
            assert facts == {"architecture": want, "architecture_verified": True}
            assert ad.check_architecture(ad.describe([model])).verified
        # every rank writes the one manifest: a pipeline stage holding only the dense first layer of a
        # dense+MoE stack names the whole stack's structure (taken from the config's layer pattern)
        mixed = mc.build_gpt_model(tiny_qwen3_config(moe=True, mlp_only_layers=[0]))
        want = "GPTModel/TransformerLayer/SelfAttention/MLP+MoELayer"
        assert ad.architecture_of([mixed]) == want
        mixed.decoder.layers = torch.nn.ModuleList([mixed.decoder.layers[0]])
        assert type(mixed.decoder.layers[0].mlp).__name__ == "MLP" and ad.architecture_of([mixed]) == want
    assert ad.check_architecture({"architecture": "GPTModel/TransformerLayer/MLASelfAttention/MLP+MoELayer"}).verified
    assert not ad.check_architecture({"architecture": "GPTModel/TransformerLayer/MLASelfAttention/MoELayer"}).verified
    c = ad.check_architecture({"architecture": "MambaModel/MambaLayer/-/-"})
    assert not c.verified and "MambaModel" in c.why and "Mamba mixers" in c.why
    assert not ad.check_architecture({}).verified       # a trace that names no architecture is not verified


def test_sglang_table_only_holds_classes_run_against_another_framework():
    ad = get_adapter("sglang")
    assert set(ad.architectures) == {"Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                                    "LlamaForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM",
                                    "Gemma3ForCausalLM", "GptOssForCausalLM", "Glm4MoeForCausalLM",
                                    "DeepseekV3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
                                    "OlmoeForCausalLM"}
    c = ad.check_architecture({"architecture": "DeepseekV2ForCausalLM"})     # V3's code, V2's routing: not run
    assert not c.verified and "V2's routing" in c.why, c
    assert set(sglang_names.ARCH_OF_CLASS) >= set(ad.architectures)   # every verified class has a name table


def test_sglang_classes_run_at_one_rank_only_are_refused_above_it():
    """The table's "(TP=1)" rows: a trace of such a class at TP > 1 is refused by name; Qwen3's rows (run at
    TP=2) are not, and neither is TP=1."""
    ad = get_adapter("sglang")
    for name in sglang_names.ONE_RANK:
        assert "(TP=1)" in ad.architectures[name].mapped, name
        assert ad.check_architecture({"architecture": name, "tensor_model_parallel_size": 1}).verified
        c = ad.check_architecture({"architecture": name, "tensor_model_parallel_size": 2})
        assert not c.verified and "TP=1 only" in c.why and name in c.why, c
    assert ad.check_architecture({"architecture": "Qwen3ForCausalLM", "tensor_model_parallel_size": 2}).verified


def test_sglang_qwen2_against_hf_qwen2(tmp_path):
    """The SGLang Qwen2 row: SGLang's own Qwen2 model code (prefill + decode rollout) against HF's Qwen2 with
    the same weights: consistent, both verified, every promised point recorded, none listed missing."""
    from tic_trace.tools.demo_pairs import SAMPLE_KEYS, trace_sglang_rollout
    cfg = _config(VERIFIED["Qwen2ForCausalLM"])
    cfg.architectures = ["Qwen2ForCausalLM"]
    model = build_hf_model(cfg)
    ids = sample_tokens(2, 12)
    trace_hf(model, tmp_path / "hf", ids, sample_keys=SAMPLE_KEYS)
    trace_sglang_rollout(tmp_path / "sg", model, ids)
    vb = CanonicalView(str(tmp_path / "sg"))
    assert vb.config["architecture"] == "Qwen2ForCausalLM" and vb.config["architecture_verified"] is True
    assert {p for p, _ in vb.points()} == set(vb.adapter.promised_points(vb.config)) | {"logprobs"}
    rep = find_divergence(str(tmp_path / "hf"), vb)
    assert rep.verdict == "consistent", [(p.key, p.status, p.error) for p in rep.points if p.status != "ok"]
    assert rep.not_comparable == [] and not _arch_notes(rep) and rep.contract == []


def test_a_custom_adapter_without_a_table_is_unverified():
    """An adapter that declares no architectures cannot vouch for any: its traces are unverified."""
    from tic_trace.graph.adapter import Adapter

    class Bare(Adapter):
        name = "bare"
        points = (PointMap("embed", r"emb:out"),)
    c = Bare().check_architecture({"architecture": "Whatever"})
    assert not c.verified and "declares no table" in c.why


def test_tracing_an_unverified_model_never_breaks_the_forward(tmp_path, caplog):
    """The architecture is recorded at trace start: a loud log line, the forward's output untouched."""
    model = build_hf_model(_config(_UNLISTED["MistralForCausalLM"]))
    with torch.no_grad():
        want = model(IDS).logits
    with caplog.at_level("WARNING", logger="tic_trace.adapter"):
        with tic_trace.trace(model, tmp_path / "t", adapter="hf", points_mode="full") as t, torch.no_grad():
            got = model(IDS).logits
    assert t.failed is None and torch.equal(got, want)
    assert any("UNVERIFIED MAPPING" in r.getMessage() and "MistralForCausalLM" in r.getMessage() for r in caplog.records)
