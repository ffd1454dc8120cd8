"""Dense layers inside a MoE model, as transformers builds them: Qwen2/3-MoE's `mlp_only_layers` and
`decoder_sparse_step`, DeepSeek-V3 / GLM-4.5's `first_k_dense_replace`. The exact replay must read each
layer's own kind from config.json: a dense layer replayed as a MoE block has no experts to read, and its
`mlp.out` would go unjudged against the reference."""
import numpy as np
import pytest
import torch

from tic_trace import find_divergence
from tic_trace.replay.checkpoint import CheckpointError
from tic_trace.replay.model_spec import model_spec
from tic_trace.testing.hf_models import build_hf_model_stable, sample_tokens, tiny_qwen3_config

from conftest import trace_hf

IDS = sample_tokens(2, 10)


def _cfg(**over) -> dict:
    base = dict(model_type="qwen3_moe", num_hidden_layers=6, hidden_size=64, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=128, num_experts=4, num_experts_per_tok=2)
    return {**base, **over}


def test_each_layers_kind_follows_transformers_rule():
    spec = model_spec(_cfg(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert [spec.at_layer(i).num_experts for i in range(6)] == [0, 4, 0, 0, 0, 4]
    spec = model_spec(_cfg(first_k_dense_replace=2))
    assert [spec.at_layer(i).num_experts for i in range(6)] == [0, 0, 4, 4, 4, 4]
    assert model_spec(_cfg()).at_layer(0).num_experts == 4


@pytest.mark.parametrize("key,value", [("mlp_only_layers", "0"), ("mlp_only_layers", [True]),
                                       ("mlp_only_layers", [-1]), ("decoder_sparse_step", 0)])
def test_a_bad_dense_layer_setting_names_its_key(key, value):
    with pytest.raises(CheckpointError, match=f"key '{key}'"):
        model_spec(_cfg(**{key: value}))


def _model():
    return build_hf_model_stable(tiny_qwen3_config(moe=True, num_hidden_layers=3, mlp_only_layers=[0],
                                                   decoder_sparse_step=1), dtype=torch.bfloat16)


def test_bf16_clean_pair_replays_the_dense_layer(tmp_path):
    model = _model()
    assert type(model.model.layers[0].mlp).__name__ == "Qwen3MoeMLP"
    model.save_pretrained(tmp_path / "ck")
    trace_hf(model, tmp_path / "a", IDS)
    trace_hf(model, tmp_path / "b", IDS)
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"), reference=str(tmp_path / "ck"))
    assert rep.verdict == "consistent", [(f.cause, f.key, f.summary) for f in rep.findings if f.divergent]
    assert not [n for n in rep.notes if n.kind == "not_replayed"], rep.notes
    judged = {p.key for p in rep.points if p.intrinsic}
    assert {"L0.mlp.out", "L1.moe.experts_out", "L2.mlp.out"} <= judged


def test_fault_in_the_dense_layer_blames_its_side(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path / "ck")
    trace_hf(model, tmp_path / "a", IDS)
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: o * 1.02)
    trace_hf(model, tmp_path / "b", IDS)
    first = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"),
                            reference=str(tmp_path / "ck")).to_json()["first_divergence"]
    assert (first["key"], first["replay"]["side"]) == ("L0.mlp.out", "B"), (first["key"], first["replay"])
