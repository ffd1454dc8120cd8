"""The used-log-prob stage after the canonical graph (compare/used_logprob_stage.py, issue 37): the
reconciliation's significant parts outside the forward are findings there, and where the forward is consistent
the first of them is the first divergence. Real reconciliations end to end: tests/test_slime_logprobs.py."""
from __future__ import annotations

from tic_trace.compare.used_logprob_stage import STAGE, judge_used_logprobs, stage_findings
from tic_trace.report.schema import CAUSES, Finding, FirstDivergence, Report


def _part(name: str, value: float, metric: float, significant: bool) -> dict:
    return {"name": name, "value": value, "share": value / metric, "rows": 8, "samples": 2, "missing": "",
            "significant": significant, "summary": f"{name} summary"}


def _rec(**values: float) -> dict:
    metric = sum(values.values())
    return {"metric": metric, "tol": 1e-3, "rows": 8, "samples": 2,
            "parts": [_part(n, v, metric, abs(v) > 1e-3 and abs(v) / metric >= 0.05) for n, v in values.items()]}


def _report(verdict: str, rec: dict | None, first: FirstDivergence | None = None) -> Report:
    return Report(verdict=verdict, first=first, findings=[], notes=[], points=[], not_comparable=[], rows={},
                  worst_tokens=[], routing={}, settings={}, sides={}, reconciliation=rec)


def test_a_semantics_part_on_a_consistent_forward_is_the_first_divergence():
    rep = _report("consistent", _rec(tokens=0.0, semantics=0.09, residual=1e-8, routing_replay=0.0, forward=2e-7))
    judge_used_logprobs(rep)
    assert rep.verdict == "divergent" and rep.exit_code == 1
    assert (rep.first.key, rep.first.cause, rep.first.layer) == (STAGE, "semantics", None)
    assert rep.first.error == 0.09 and rep.first.rows == 8
    (f,) = rep.findings
    assert f.divergent and f.detail["share_of_metric"] > 0.99 and "of slime's train_rollout_logprob_abs_diff" in f.summary
    assert f.cause in CAUSES and f.remedy


def test_a_divergent_forward_keeps_its_first_divergence_and_gains_the_stage_findings():
    first = FirstDivergence(key="L1.attn_norm", point="attn_norm", layer=1, status="divergent", cause="operator")
    forward = Finding("operator", "L1.attn_norm", 1, True, True, "operator")
    rep = _report("divergent", _rec(tokens=0.02, semantics=0.0, forward=0.05, routing_replay=0.03), first)
    rep.findings = [forward]
    judge_used_logprobs(rep)
    assert rep.verdict == "divergent" and rep.first is first
    assert [f.cause for f in rep.findings] == ["operator", "tokens", "routing_replay"]


def test_nothing_outside_the_forward_adds_nothing():
    for rec in (_rec(semantics=1e-7, forward=0.05), {"unavailable": "no used log-probs"}, None):
        rep = _report("consistent", rec)
        judge_used_logprobs(rep)
        assert rep.verdict == "consistent" and rep.first is None and rep.findings == []
    # the forward and the unmeasured rows are never the stage's: the first is the finder's, the other coverage
    assert stage_findings(_rec(unmeasured=0.05, forward=0.05)) == []


def test_judging_twice_gives_one_finding_per_part():
    rep = _report("consistent", _rec(semantics=0.05, residual=0.04))
    judge_used_logprobs(rep)
    judge_used_logprobs(rep)
    assert [f.cause for f in rep.findings] == ["semantics", "used_logprobs"]
