"""Sliding windows on the Llama-style families (Mistral, Mixtral, Qwen2/3 with `use_sliding_window`), and the
note for points where both sides are over the clean envelope alike.

Before, the exact replay knew windows only for Gemma and GPT-OSS: a windowed Mixtral or Qwen2 layer was
replayed over every key, both sides sat hundreds of times over the envelope, the rule blamed neither (they
were alike) and the pair read as consistent, the replay having judged nothing there."""
import pytest
import torch
import transformers as T

from tic_trace import find_divergence
from tic_trace.testing.hf_models import build_hf_model_stable, sample_tokens

from arch_configs_gemma_phi3_gptoss import COMMON
from conftest import trace_hf

IDS = sample_tokens(2, 12)        # 12 tokens: windows of 4 leave most keys out
WINDOWED = {
    "mixtral": lambda: T.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=4),
    # layer 0 full, layer 1 windowed (max_window_layers)
    "qwen2": lambda: T.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=4, max_window_layers=1),
}


def _model(name: str):
    cfg = WINDOWED[name]()
    cfg._attn_implementation = "eager"
    return build_hf_model_stable(cfg, dtype=torch.bfloat16)


def _pair(tmp_path, model, plant_b=None):
    model.save_pretrained(tmp_path / "ck")
    trace_hf(model, tmp_path / "a", IDS)
    if plant_b is not None:
        plant_b(model)
    trace_hf(model, tmp_path / "b", IDS)
    return find_divergence(str(tmp_path / "a"), str(tmp_path / "b"), reference=str(tmp_path / "ck"))


@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_windowed_clean_pair_is_judged_inside_its_envelope(tmp_path, name):
    rep = _pair(tmp_path, _model(name))
    assert rep.verdict == "consistent", [(f.cause, f.key) for f in rep.findings if f.divergent]
    assert not [n for n in rep.notes if n.kind in ("both_over_envelope", "not_replayed")
                and any("attn" in k for k in n.detail["points"])], rep.notes
    for p in rep.points:
        if p.point == "attn.core":
            assert all(e["excess"] <= e["limit"] for e in p.intrinsic.values()), (p.key, p.intrinsic)


def test_side_that_ignores_the_window_is_blamed(tmp_path):
    """Side B builds Mixtral's mask without the window (every earlier key): found at the first layer's
    attention, blamed on B."""
    def no_window(model):
        model.config.sliding_window = None
    rep = _pair(tmp_path, _model("mixtral"), no_window)
    first = rep.to_json()["first_divergence"]
    assert (first["key"], first["replay"]["side"]) == ("L0.attn.core", "B"), (first["key"], first["replay"])


def test_both_sides_over_the_envelope_alike_is_said(tmp_path):
    """Both sides compute layer 1's attention with another softmax scale than the checkpoint's config states:
    neither is blamed (they are alike), and the report says the replay judged nothing there."""
    def rescale(model):
        model.model.layers[1].self_attn.scaling *= 1.25
    model = _model("qwen2")
    rescale(model)
    rep = _pair(tmp_path, model)
    note = next((n for n in rep.notes if n.kind == "both_over_envelope"), None)
    assert note is not None and "L1.attn.core" in note.detail["points"], rep.notes
    assert "L0.attn.core" not in note.detail["points"]
