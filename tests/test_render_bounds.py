"""Every renderer of a saved report is bounded in size, and re-judging one is linear in its size, whatever the
file holds: a report of a real traced pair (transformers Qwen3-MoE, a planted softmax-scale fault) blown up
to 20k points and 20k worst tokens, with a 2 MB summary and a first divergence of 200k inputs. Bounds are
counted (lines, bytes, dictionary look-ups), never timed. And what re-judging a saved report reads back is
checked by the report's schema first (tic_trace/store/schema.py)."""
from __future__ import annotations

import copy
import io
import json
from collections import UserDict

import pytest
import torch
from rich.console import Console

from tic_trace import find_divergence
from tic_trace.compare.judge import Tolerance
from tic_trace.compare.verdict import assess
from tic_trace.report.bounds import HTML, MAX_TEXT, TERMINAL
from tic_trace.report.html import render_html
from tic_trace.report.schema import Report
from tic_trace.report.terminal import render_terminal
from tic_trace.report.text import MAX_PIECE
from tic_trace.testing.faults import plant
from tic_trace.testing.hf_models import build_hf_model_stable, sample_tokens, tiny_qwen3_config

from conftest import trace_hf

N = 20_000


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    base = tmp_path_factory.mktemp("bounds")
    ids = sample_tokens(2, 8)
    for side in ("a", "b"):
        m = build_hf_model_stable(tiny_qwen3_config(moe=True), seed=0, dtype=torch.float32)
        if side == "b":
            plant(m, "hf", "softmax_scale", 1)
        trace_hf(m, base / side, ids)
    return json.loads(json.dumps(find_divergence(str(base / "a"), str(base / "b")).to_json()))


def _blown_up(report: dict, n: int) -> dict:
    """`report` with its layers repeated to n points and its worst token repeated n times (positions apart)."""
    big = copy.deepcopy(report)
    layered = [p for p in report["points"] if p["layer"] == 0]
    points = [p for p in report["points"] if p["layer"] is not None or p["key"] == "embed"]
    layer = 2
    while len(points) < n:
        points += [dict(p, layer=layer, key=f"L{layer}.{p['point']}", inputs=[]) for p in layered]
        layer += 1
    big["points"] = points + [p for p in report["points"] if p["layer"] is None and p["key"] != "embed"]
    w = report["worst_tokens"][0]
    big["worst_tokens"] = [dict(w, position=1000 + i) for i in range(n)]
    return big


def test_renderings_of_a_hostile_report_are_bounded_in_size(report):
    big = _blown_up(report, N)
    big["findings"][0]["summary"] = "x" * 2_000_000
    big["first_divergence"]["inputs"] = ["L0.input"] * 200_000
    console = Console(file=io.StringIO(), width=160)
    render_terminal(big, console, all_points=True)
    out = console.file.getvalue()
    lines = out.splitlines()
    assert len(lines) < TERMINAL.points + TERMINAL.worst_tokens + 1000, len(lines)
    assert max(len(x) for x in lines) <= MAX_PIECE + 200 and len(out) < 2_000_000, len(out)
    assert "more characters of long texts not shown" in out and "more nested entries not shown" in out
    page = render_html(big)
    assert len(page) < 12_000_000 and page.count("x" * (MAX_TEXT + 1)) == 0
    assert f"{len(big['points']) - HTML.points:,} more points not shown" in page


def test_rejudging_many_worst_tokens_walks_each_tokens_own_errors(report):
    """Each worst token's divergence start reads its own per-point errors, not every point of the report:
    2000 tokens without per-point errors over 2000 points made 4M look-ups (20k x 20k: minutes)."""
    class Counting(UserDict):
        reads = 0

        def get(self, k, default=None):
            Counting.reads += 1
            return super().get(k, default)

        def __contains__(self, k):
            Counting.reads += 1
            return super().__contains__(k)

    rep = Report.from_json(_blown_up(report, 2000))
    label = rep.worst_tokens[0].label
    own = dict(next(iter(report["token_errors"].values())))          # one real token's errors per point
    assert own
    errors = {w.label: Counting() for w in rep.worst_tokens}
    errors[label] = Counting(own)
    assess(rep.points, Tolerance(), worst_tokens=rep.worst_tokens, token_errors=errors)
    assert Counting.reads <= 10 * (len(rep.worst_tokens) + len(own)), Counting.reads


@pytest.mark.parametrize("field,value,named", [
    ("structure", {"layers": "x"}, "field 'structure.layers' must be a map"),
    ("identity", "abc", "field 'identity' must be a map"),
    ("settings", {"tolerance": "x"}, "field 'settings.tolerance' must be a map"),
    ("settings", {"tolerance": {"growth": -1}}, "field 'settings.tolerance.growth' must be a finite number >= 0"),
    ("rows", {"a": 24, "b": 24, "matched": -5}, "field 'rows.matched' must be a non-negative integer"),
])
def test_a_saved_reports_objects_are_checked_by_its_schema(report, tmp_path, capsys, field, value, named):
    """What the re-judgement reads back (the structure, the row identity, the settings, the row counts) is
    refused by name (exit 2), never an AttributeError line or a value taken on trust."""
    from tic_trace.tools.cli import main as cli
    bad = dict(copy.deepcopy(report), **{field: value})
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    assert cli(["report", "x", "--from-json", str(path)]) == 2
    out = capsys.readouterr()
    assert named in " ".join((out.out + out.err).split()) and str(path) in out.out + out.err
