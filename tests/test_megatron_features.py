"""Megatron-core switches that its module structure does not show (Qwen3-Next's gated attention, NoPE layers,
off-by-one sinks, latent MoE...): a real megatron-core 0.16.1 GPTModel built with one on is traced,
marked unverified at trace time, and its comparison refused (exit 3) with the switch named; the same model with
every switch off stays verified. GPT-OSS's switches and Qwen2-MoE's gated shared expert are mapped
(tests/test_megatron_gptoss.py, tests/test_megatron_families.py) on one rank only: with another layout they are
refused."""
from __future__ import annotations

import megatron.core  # noqa: F401 - a required test dependency: fail loudly if missing
import pytest
import torch

import tic_trace
from tic_trace import find_divergence
from tic_trace.adapters.megatron import MegatronAdapter
from tic_trace.adapters.megatron_features import FEATURES, feature_refusal
from tic_trace.testing import megatron_cpu as mc
from tic_trace.testing.hf_models import sample_tokens, tiny_qwen3_config

IDS = sample_tokens(1, 8)

# switches megatron-core builds and runs on CPU (local spec), each with the word its refusal must name
SWITCHES = {
    "off_by_one_sinks": ({"softmax_type": "off-by-one"}, "softmax_type"),
    "gated_attention": ({"attention_output_gate": True}, "attention_output_gate"),
    "nope_layers": ({"no_rope_freq": 2}, "no_rope_freq"),
}


def _trace(out, **switches) -> str:
    model = mc.build_gpt_model(tiny_qwen3_config(moe=True), **switches)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    pos = torch.arange(IDS.shape[1]).unsqueeze(0)
    with tic_trace.trace(model, out, adapter=MegatronAdapter(vocab_size=128), points_mode="full") as t, \
            torch.no_grad():
        model(IDS, pos, attention_mask=None)
    assert t.failed is None, t.failed
    return str(out)


@pytest.fixture(scope="module")
def plain(tmp_path_factory, megatron_rank) -> str:
    return _trace(tmp_path_factory.mktemp("plain") / "t")


def test_plain_model_records_every_switch_off_and_stays_verified(plain):
    from tic_trace.view.align import CanonicalView
    cfg = CanonicalView(plain).config
    assert cfg["architecture_verified"] is True and feature_refusal(cfg) is None
    assert {f"megatron_{f}" for f in FEATURES} <= set(cfg)
    rep = find_divergence(plain, plain)
    assert rep.verdict == "consistent" and rep.exit_code == 0


@pytest.mark.parametrize("case", sorted(SWITCHES))
def test_a_switch_the_rows_do_not_map_is_refused_by_name(tmp_path, plain, case, caplog):
    switches, word = SWITCHES[case]
    with caplog.at_level("WARNING"):
        traced = _trace(tmp_path / "t", **switches)
    assert any("UNVERIFIED MAPPING" in r.message and word in r.message for r in caplog.records)
    from tic_trace.view.align import CanonicalView
    assert CanonicalView(traced).config["architecture_verified"] is False
    rep = find_divergence(traced, plain)
    assert rep.verdict == "not_comparable" and rep.exit_code == 3 and rep.points == []
    notes = [n for n in rep.notes if n.kind == "unverified_mapping"]
    assert [n.detail["side"] for n in notes] == ["a"] and word in notes[0].summary


def test_switches_not_built_on_cpu_are_refused_from_their_facts():
    """Gated DeltaNet / DSA layers and latent MoE need kernels CPUs lack: the refusal is read from the facts."""
    ad = MegatronAdapter()
    base = {"architecture": "GPTModel/TransformerLayer/SelfAttention/MoELayer", "megatron_softmax_type": "vanilla"}
    assert ad.check_architecture(base).verified
    for field, value in (("experimental_attention_variant", "gated_delta_net"), ("moe_latent_size", 64),
                         ("position_embedding_type", "learned_absolute"), ("moe_apply_probs_on_input", True),
                         ("softmax_type", "off-by-one"), ("mrope_section", "[16, 24, 24]")):
        c = ad.check_architecture({**base, f"megatron_{field}": value})
        assert not c.verified and field in c.why and FEATURES[field].wrong in c.why, (field, c.why)
    # a trace written before the switches were recorded says nothing of them
    assert ad.check_architecture({"architecture": base["architecture"]}).verified


def test_gpt_oss_switches_are_verified_on_one_rank_only():
    ad = MegatronAdapter()
    gpt_oss = {"architecture": "GPTModel/TransformerLayer/SelfAttention/MoELayer",
               "megatron_softmax_type": "learnable", "megatron_window_size": "(127, 0)",
               "megatron_activation_func_clamp_value": 7.0, "megatron_glu_linear_offset": 1.0,
               "megatron_position_embedding_type": "yarn"}
    assert ad.check_architecture(gpt_oss).verified
    for layout, word in (({"tensor_model_parallel_size": 2}, "tensor_model_parallel_size"),
                         ({"expert_model_parallel_size": 4}, "expert_model_parallel_size"),
                         ({"sequence_parallel": True}, "sequence parallelism")):
        c = ad.check_architecture({**gpt_oss, **layout})
        assert not c.verified and word in c.why and "softmax_type" in c.why and "one rank" in c.why
    # the plain rows at TP 2 stay verified (tests/test_megatron_adapter.py runs them)
    assert ad.check_architecture({"architecture": gpt_oss["architecture"], "tensor_model_parallel_size": 2}).verified
