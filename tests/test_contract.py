"""The contract diff (tic_trace/compare/contract.py) and parameter hashes (tic_trace/record/weights.py) on real HF
pairs: no tensor value is read, and each planted difference is named in its section at its point."""
import pytest
import torch

import tic_trace

from tic_trace.view.align import CanonicalView
from tic_trace.replay.checkpoint import HFCheckpoint
from tic_trace.compare.contract import diff_contract
from tic_trace.testing.hf_models import sample_tokens
from tic_trace.testing.precision_faults import PRECISION_FAULTS
from tic_trace.view.weight_map import weight_hashes_by_point

from conftest import bf16_model, checkpointed_trace, trace_hf

IDS = sample_tokens(2, 8)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    ck, a = checkpointed_trace(tmp_path_factory.mktemp("contract"), bf16_model(), IDS)
    return HFCheckpoint(ck), a


def _diff(a, b, ck=None):
    return diff_contract(CanonicalView(str(a)), CanonicalView(str(b)), ck)


def test_identical_pair_has_an_empty_contract_diff(tmp_path, clean):
    ck, a = clean
    trace_hf(bf16_model(), tmp_path / "b", IDS)
    assert _diff(a, tmp_path / "b", ck) == []


def test_fp32_router_is_a_precision_difference_at_its_point(tmp_path, clean):
    ck, a = clean
    model = bf16_model()
    PRECISION_FAULTS["router_fp32"].plant(model, 1)
    trace_hf(model, tmp_path / "b", IDS)
    d = _diff(a, tmp_path / "b")
    assert [(x.section, x.key, x.kind, x.a, x.b) for x in d] == [
        ("dtype", "L1.moe.router_logits", "precision", "bfloat16", "float32")]


def test_config_and_numerics_differences(tmp_path, clean):
    ck, a = clean
    model = bf16_model(rms_norm_eps=1e-5)
    model.set_attn_implementation("sdpa")
    trace_hf(model, tmp_path / "b", IDS)
    d = {(x.section, x.key, x.against, x.side): x for x in _diff(a, tmp_path / "b", ck)}
    assert d[("config", "rms_norm_eps", "B", None)].b == 1e-5
    assert ("config", "rms_norm_eps", "checkpoint", "B") in d and ("config", "rms_norm_eps", "checkpoint", "A") not in d
    assert (d[("numerics", "attn_implementation", "B", None)].a, d[("numerics", "attn_implementation", "B", None)].b) \
        == ("eager", "sdpa")


def test_weight_hashes_name_the_point_and_the_side_that_differs_from_the_checkpoint(tmp_path, clean):
    ck, a = clean
    model = bf16_model()
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight[0, 0] += 0.5
    trace_hf(model, tmp_path / "b", IDS)
    by_point = weight_hashes_by_point(CanonicalView(str(a)))
    assert ("attn.q", 1) in by_point and ("moe.experts_out", 0) in by_point and ("logits", None) in by_point
    d = [x for x in _diff(a, tmp_path / "b", ck) if x.section == "weights"]
    assert [(x.key, x.against, x.side) for x in d] == [("L1.attn.q", "B", None), ("L1.attn.q", "checkpoint", "B")]
    assert d[0].a == ["model.layers.1.self_attn.q_proj.weight"]


def test_weights_rehashed_only_when_changed():
    from tic_trace.record.weights import ParameterHasher
    model = bf16_model()
    h = ParameterHasher()
    first = h([model])
    assert "lm_head.weight" in first and len(first) == len(list(model.parameters()))
    assert h([model]) is None                    # nothing changed: nothing repeated
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1.0
    second = h([model])
    assert list(second) == ["lm_head.weight"] and second["lm_head.weight"][0] != first["lm_head.weight"][0]


def test_weights_hashed_beside_the_forward_equal_the_pass_end_hashes_and_follow_late_changes():
    """`begin` hashes CPU parameters on a background thread; the pass-end call joins it. The hashes equal
    those of a hasher that never began; a parameter changed in place between `begin` and the call is hashed
    again (its version moved), not reported with the value the thread read."""
    from tic_trace.record.stats import numpy_hash
    from tic_trace.record.weights import ParameterHasher
    model = bf16_model()
    plain = ParameterHasher()([model])
    h = ParameterHasher()
    h.begin([model])
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1.0
    got = h([model])
    assert got.keys() == plain.keys()
    assert {k: v for k, v in got.items() if k != "lm_head.weight"} == \
        {k: v for k, v in plain.items() if k != "lm_head.weight"}
    w = model.lm_head.weight.detach()
    assert got["lm_head.weight"][0] == numpy_hash(w.view(torch.int16).numpy()) != plain["lm_head.weight"][0]
    h.begin([model])                               # nothing changed since: no thread, nothing re-emitted
    assert h._background is None and h([model]) is None


def test_weights_traced_on_the_cpu_are_hashed_beside_the_forward(tmp_path):
    """Through the tracer: a CPU model's pass records every parameter's hash, equal to numpy's of its bits."""
    from tic_trace.record.stats import numpy_hash
    model = bf16_model()
    with tic_trace.trace(model, tmp_path / "t", adapter="hf") as t, torch.no_grad():
        model(sample_tokens(1, 6))
    assert t.failed is None
    weights = next(tic_trace.open_trace(tmp_path / "t").passes()).meta["weights"]
    params = dict(model.named_parameters())
    assert weights.keys() == params.keys()
    for k, (h, dtype, shape) in weights.items():
        assert h == numpy_hash(params[k].detach().view(torch.int16).numpy()) and dtype == "bfloat16"
