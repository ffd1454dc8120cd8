"""Every verdict line says what it covered (issue 34, principle 1): points compared N of M (those only one side
has named), rows compared N of M (rows only one side has counted), with --reference points replayed N of M (those
not replayed named, with why), with attribution tokens attributed N of M (with the budget), and drift's rollouts
compared N of M (the skipped named). One typed place, the report's `coverage` (report/coverage.py), read by the
terminal, the HTML and the saved JSON, checked when a saved report is read back. Real transformers Qwen3 models;
a layer's points left out of side B by the tracer's own filter, rows left out by tracing fewer samples."""
from __future__ import annotations

import copy
import html
import io
import json
import shutil

import pytest
import torch
from rich.console import Console

from tic_trace import find_divergence
from tic_trace.record.filters import Filters
from tic_trace.report.html import render_html
from tic_trace.report.terminal import headline, render_terminal
from tic_trace.testing.faults import plant
from tic_trace.testing.hf_models import build_hf_model_stable, sample_tokens, tiny_qwen3_config
from tic_trace.tools.cli import main as cli

from conftest import trace_hf

IDS = sample_tokens(2, 8)          # 16 rows


def _model():
    return build_hf_model_stable(tiny_qwen3_config(moe=False), seed=0, dtype=torch.float32)


@pytest.fixture(scope="module")
def sides(tmp_path_factory) -> dict:
    """The checkpoint and traces of one fp32 model: `a` whole; `no_mlp1` with layer 1's MLP left out by the
    tracer's filter; `s0` of sample s0 only; `fault` with a softmax-scale fault planted in layer 1."""
    d = tmp_path_factory.mktemp("cov")
    m = _model()
    m.save_pretrained(d / "ck")
    trace_hf(m, d / "a", IDS)
    trace_hf(m, d / "no_mlp1", IDS, filters=Filters(exclude_modules=["model.layers.1.mlp*"]))
    trace_hf(m, d / "s0", IDS[:1])
    f = _model()
    plant(f, "hf", "softmax_scale", 1)
    trace_hf(f, d / "fault", IDS)
    return {k: str(d / k) for k in ("ck", "a", "no_mlp1", "s0", "fault")}


def _lines(doc: dict) -> list[str]:
    buf = io.StringIO()
    render_terminal(doc, Console(file=buf, width=400))
    return buf.getvalue().splitlines()


def _covered(doc: dict) -> str:
    """The coverage on the terminal's verdict line (line 0, after the headline); the same on the HTML banner."""
    line = _lines(doc)[0]
    assert line.startswith(headline(doc) + " — covered: "), line
    covered = line.split(" — covered: ", 1)[1]
    page = render_html(doc)
    banner = page[page.index('class="banner'):]
    assert html.escape("covered: " + covered, quote=False) in banner[:banner.index("</div>")], covered
    return covered


def test_points_one_side_lacks_are_named_on_the_verdict_line(sides, tmp_path, capsys):
    doc = json.loads(json.dumps(find_divergence(sides["a"], sides["no_mlp1"]).to_json()))
    line = _covered(doc)
    assert "points compared 33 of 34 (1 only on side A: L1.mlp.out)" in line, line
    pts = doc["coverage"]["points"]
    assert (pts["compared"], pts["total"]) == (33, 34)
    assert pts["only_a"] == {"count": 1, "first": [{"key": "L1.mlp.out"}]} and pts["only_b"]["count"] == 0
    assert "replay" not in doc["coverage"] and "attribution" not in doc["coverage"]
    # read back: the saved report renders the same line; a malformed coverage is refused by field, exit 2
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    assert cli(["report", "x", "--from-json", str(path)]) == 0
    assert line in capsys.readouterr().out
    bad = copy.deepcopy(doc)
    bad["coverage"]["points"]["compared"] = "all"
    path.write_text(json.dumps(bad))
    assert cli(["report", "x", "--from-json", str(path)]) == 2
    cap = capsys.readouterr()
    assert "coverage.points.compared" in cap.out + cap.err and "Traceback" not in cap.out + cap.err


def test_rows_only_one_side_has_are_counted_on_the_verdict_line(sides):
    doc = find_divergence(sides["a"], sides["s0"]).to_json()
    line = _covered(doc)
    assert "rows compared 8 of 16 (8 only side A has)" in line, line
    assert doc["coverage"]["rows"] == {"compared": 8, "total": 16, "only_a": 8, "only_b": 0, "different_tokens": 0}
    assert "points compared 34 of 34;" in line, line


def test_rows_whose_tokens_differ_are_counted_on_the_verdict_line(sides, tmp_path):
    ids = IDS.clone()
    ids[1, -1] = (ids[1, -1] + 1) % 50        # the last row of sample s1 holds another token on side B
    trace_hf(_model(), tmp_path / "b", ids)
    doc = find_divergence(sides["a"], str(tmp_path / "b")).to_json()
    line = _covered(doc)
    assert "rows compared 15 of 16 (1 with different tokens)" in line, line
    assert doc["coverage"]["rows"] == {"compared": 15, "total": 16, "only_a": 0, "only_b": 0, "different_tokens": 1}


def test_points_not_replayed_are_named_with_why(sides):
    doc = find_divergence(sides["a"], sides["no_mlp1"], reference=sides["ck"]).to_json()
    line = _covered(doc)
    rep = doc["coverage"]["replay"]
    (named,) = rep["not_replayed"]["first"]
    assert named["key"] == "L1.output" and named["reason"].startswith("B: ") and "L1.mlp.out" in named["reason"], rep
    assert rep["replayed"] == rep["total"] - 1 and rep["total"] + rep["derived"] == 33, rep
    assert f"points replayed {rep['replayed']} of {rep['total']} (not replayed: L1.output)" in line, line


def test_tokens_attributed_within_a_budget_smaller_than_the_rows(sides):
    doc = find_divergence(sides["a"], sides["fault"], reference=sides["ck"], attribution=True,
                          attribution_tokens=3).to_json()
    att = doc["attribution"]
    assert "unavailable" not in att, att
    line = _covered(doc)
    cov = doc["coverage"]["attribution"]
    # the log-prob rows both sides scored (each sample's last position predicts no token of the batch)
    assert cov == {"tokens": att["tokens"], "total": att["tokens_total"], "budget": 3}, cov
    assert 1 <= att["tokens"] <= 3 < att["tokens_total"] <= 16, att
    assert f"tokens attributed {att['tokens']} of {att['tokens_total']} (budget 3)" in line, line


def test_drift_verdict_line_counts_the_rollouts_and_names_the_skipped(sides, tmp_path):
    from tic_trace.drift.html import render_drift_html
    from tic_trace.drift.schema import DriftSchemaError, validate
    from tic_trace.drift.terminal import render_drift
    from tic_trace.drift.timeline import build_drift
    run = tmp_path / "run"
    for rid in range(3):
        for side in ("a", "b") if rid != 1 else ("a",):      # rollout 1: side b was never written
            shutil.copytree(sides["a"], run / f"rollout_{rid:05d}" / side)
    doc = json.loads(json.dumps(build_drift(run, sides=("a", "b")).to_json()))
    validate(doc)
    cov = doc["coverage"]["rollouts"]
    assert (cov["compared"], cov["total"], cov["skipped"]["count"]) == (2, 3, 1), cov
    assert cov["skipped"]["first"][0]["rollout_id"] == 1 and "b side missing" in cov["skipped"]["first"][0]["reason"]
    buf = io.StringIO()
    render_drift(doc, Console(file=buf, width=400))
    line = next(x for x in buf.getvalue().splitlines() if x.startswith("covered: "))
    assert line.startswith("covered: rollouts compared 2 of 3 (1 skipped: 1 (b side missing"), line
    assert html.escape(line, quote=False) in render_drift_html(doc)
    doc["coverage"]["rollouts"]["compared"] = 5
    with pytest.raises(DriftSchemaError, match="drift.coverage.rollouts"):
        validate(doc)
