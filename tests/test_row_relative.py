"""Row-relative errors (issue 23, item 4): a few massive rows neither hide ordinary rows' errors nor make jumps.

The model is a real HF Qwen3 (bf16, small random config) shaped like a trained one
(`tic_trace.testing.trained_like`): BOS at position 0 of every sample embeds with two residual channels
10^4x the median, so its rows hold > 99.99% of the residual stream's squared norm. Over all rows at once a
residual's relative error is then the BOS rows' alone (tiny), while the next RMSNorm rescales every row and
shows the ordinary rows' error: an all-rows rule reads a jump of ~50x there on a clean pair. The finder's
all-rows error is a quantile of the rows' own relative errors, and the inherited error the same quantile of
each row's own inputs' error, so a norm shows no jump; one bad ordinary row is still found at its point.
"""
import json

import pytest
import torch

from tic_trace import find_divergence
from tic_trace.compare.diverge import rejudge
from tic_trace.testing.hf_models import build_hf_model, sample_tokens, tiny_qwen3_config
from tic_trace.testing.trained_like import BOS, bos_first, massive_activations, massive_share

from conftest import trace_hf
from test_worst_token import one_token_mlp

BATCH, SEQ = 4, 32
NORMS = ("attn_norm", "mlp_norm", "final_norm", "attn.q_norm", "attn.k_norm")


def _model(attn: str):
    model = build_hf_model(tiny_qwen3_config(moe=False, num_hidden_layers=4), dtype=torch.bfloat16)
    massive_activations(model, (BOS,), scale=1e4)
    model.config._attn_implementation = attn
    return model


def _ids():
    return bos_first(sample_tokens(BATCH, SEQ))


def _trace(path, attn: str, plant=None):
    model = _model(attn)
    if plant is not None:
        plant(model)
    trace_hf(model, path, _ids(), sample_keys=[f"s{i}" for i in range(BATCH)])
    return model


def _all_rows_jump(rep) -> list[str]:
    """Points where one relative L2 over all rows (the rule before row-relative errors) over tolerance jumps
    more than `growth` x over its inputs': what the pair would have been blamed for."""
    rel = {p.key: (p.metrics or {}).get("rel_l2") for p in rep.points}
    out = []
    for p in rep.points:
        ins = [rel[k] for k in p.inputs if rel.get(k) is not None]
        if rel[p.key] is not None and p.tol and rel[p.key] > p.tol and ins and rel[p.key] > 10 * max(ins):
            out.append(p.key)
    return out


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    d = tmp_path_factory.mktemp("rowrel")
    model = _trace(d / "eager", "eager")
    return d, model


def test_the_model_has_massive_rows(eager):
    _, model = eager
    ids = _ids()
    with torch.no_grad():
        h = model.model.embed_tokens(ids)
    assert massive_share(h, ids == BOS) > 0.9999     # 4 of 128 rows hold nearly all of the squared norm


def test_clean_eager_vs_sdpa_no_operator_divergence_at_a_norm(eager):
    """HF eager attention against SDPA (both clean), bf16, massive BOS rows: no operator finding anywhere,
    although the all-rows relative L2 jumps ~50x at the norms."""
    d, _ = eager
    _trace(d / "sdpa", "sdpa")
    rep = find_divergence(str(d / "eager"), str(d / "sdpa"))
    # the pair differs and is over bf16's tolerance downstream: this is not a bit-identical pair ...
    assert any(p.status == "over" for p in rep.points)
    # ... where one all-rows relative L2 would blame a norm (the false `operator` of issue 23)
    jumps = _all_rows_jump(rep)
    assert any(k.endswith(NORMS) for k in jumps), jumps
    assert [f.key for f in rep.findings if f.divergent] == [], [f.summary for f in rep.findings]
    assert rep.verdict == "consistent", rep.first and rep.first["summary"]
    by = {p.key: p for p in rep.points}
    for key in jumps:
        p = by[key]
        assert p.status != "divergent" and p.growth < 10, (key, p.error, p.input_error)
    doc = json.loads(json.dumps(rep.to_json()))
    assert rejudge(doc) == doc


def test_fault_on_an_ordinary_row_after_the_massive_rows_is_found_at_its_point(eager):
    """One ordinary token's down-projection in layer 2 computed with weights 30% off, side B otherwise SDPA
    (clean): found at L2.mlp.out, decided by that token's row, nothing before it blamed."""
    d, _ = eager
    b, t = 2, 21
    assert int(_ids()[b, t]) != BOS
    _trace(d / "fault", "sdpa", lambda m: one_token_mlp(m, 2, b, t, rel=0.3))
    rep = find_divergence(str(d / "eager"), str(d / "fault"))
    assert rep.verdict == "divergent"
    fd = rep.first
    assert fd["key"] == "L2.mlp.out" and fd["cause"] == "operator", fd["summary"]
    assert fd["decided_by_row"] == f"s{b}@{t}", fd["worst_rows"]
    keys = [p.key for p in rep.points]
    assert all(p.status != "divergent" for p in rep.points[:keys.index("L2.mlp.out")])


def test_excess_is_row_relative_so_massive_rows_do_not_hide_ordinary_rows_errors():
    """A side's excess over the rounding floor (IntrinsicError.excess, and each clean variant's, which set the
    envelope) is measured per row against that row's own floor: one row 10^4x the others, correctly rounded,
    no longer hides a 3x-floor error in every ordinary row (over all elements at once it reads ~1.0)."""
    import numpy as np

    from tic_trace.replay.grid import grid_spacing, round_to, row_relative_excess
    from tic_trace.replay.intrinsic import intrinsic_error

    rng = np.random.default_rng(0)
    exact = rng.standard_normal((32, 64))
    exact[0] *= 1e4                                   # the massive row (BOS)
    rounded = round_to(exact, "bfloat16")
    y = rounded + 2 * grid_spacing(rounded, "bfloat16") * rng.choice([-1.0, 1.0], exact.shape)
    y[0] = rounded[0]                                 # ordinary rows 2 bf16 steps off, the massive one rounded
    e = intrinsic_error("mid", 1, y.astype(np.float32), exact, "bfloat16")
    assert e.dtype == "bfloat16"
    all_elements = e.rel_l2 / e.rel_floor
    assert all_elements < 1.1                          # the massive row's floor swamps the rest
    assert e.excess == e.row_excess and e.excess > 4.0, (e.excess, all_elements)
    floor = rounded - exact
    # a correctly rounded side is 1.0 whatever its rows' scales; a uniform error reads the same either way
    assert row_relative_excess(floor, floor) == pytest.approx(1.0)
    uniform = rng.standard_normal((32, 64))
    f = round_to(uniform, "bfloat16") - uniform
    assert row_relative_excess(2 * f, f) == pytest.approx(2.0)
    # rows too short for their own floor fall back to the all-elements ratio (top-k weights: k values a row)
    assert row_relative_excess(f[:, :4], f[:, :4]) == 0.0
