"""The used-log-prob stage: the last stage of the dataflow, after the canonical graph's `logprobs` (issue 37).

The canonical graph ends at each side's own log-softmax of its traced logits. What each side then *used* — the
log-prob SGLang returned, the one the trainer computed — can differ from it and from the other side for reasons
outside the forward: another semantics (a temperature on one side, top-p renormalisation, raw vs processed
logits), other tokens, a routing replay not applied, a number computed outside the traced forward. The
reconciliation (compare/reconcile.py) measures each of those as a part of slime's metric; here its significant
parts outside the forward become the report's findings at this stage, each with its share of the metric, and
where the forward itself is consistent the first of them is the first divergence: the two sides did not use the
same log-probs, and this is why.
"""
from __future__ import annotations

from typing import Any

from ..report.schema import USED_LOGPROB_STAGE as STAGE, FirstDivergence, Finding, Report

# The reconciliation's parts outside the forward, in its order, and the class of cause each makes (the forward
# part's cause is the finder's own; `unmeasured` is coverage, never a cause).
_CAUSE = {"tokens": "tokens", "semantics": "semantics", "residual": "used_logprobs",
          "routing_replay": "routing_replay"}
_REMEDY = {
    "tokens": "the two sides scored different tokens: check the chat template and that the trainer scores the "
              "response token ids the engine returned",
    "semantics": "take both sides' log-probs under one semantics: the same temperature (slime's "
                 "--rollout-temperature), top-k / top-p renormalisation on both or neither, and raw or processed "
                 "logits alike (SGLANG_RETURN_ORIGINAL_LOGPROB on the SGLang servers)",
    "used_logprobs": "a side's used log-probs are not its own traced logits under any known semantics: look for "
                     "a logit processor, penalties or logit bias, or log-probs taken from another forward",
    "routing_replay": "routing replay (R3) is on but the trainer did not apply the rollout's experts where named: "
                      "check that every MoE layer replays and in the rollout's slot order",
}


def stage_findings(rec: dict | None) -> list[Finding]:
    """The findings of the used-log-prob stage: one per significant part of the reconciliation outside the
    forward, in the reconciliation's order; none when it was not made."""
    if not isinstance(rec, dict) or "unavailable" in rec:
        return []
    out = []
    metric = rec.get("metric")
    for part in rec.get("parts") or []:
        if not isinstance(part, dict) or not part.get("significant") or part.get("name") not in _CAUSE:
            continue
        cause = _CAUSE[part["name"]]
        share = part.get("share")
        of = (f"{100 * share:.0f}% of slime's train_rollout_logprob_abs_diff ({part.get('value'):.3g} of "
              f"{metric:.3g} nats)" if isinstance(share, float) and isinstance(metric, float) else "")
        out.append(Finding(cause, STAGE, None, True, True, f"{part.get('summary')}" + (f": {of}" if of else ""),
                           _REMEDY[cause], {"part": part["name"], "value": part.get("value"), "share_of_metric": share,
                                            "rows": part.get("rows"), "samples": part.get("samples")}))
    return out


def judge_used_logprobs(rep: Report) -> None:
    """Add the stage's findings to a report holding a reconciliation; where the forward is consistent, the first
    of them is the first divergence and the verdict is divergent. A report that is not comparable stays so."""
    found = stage_findings(rep.reconciliation)
    if not found:
        return
    rep.findings = [f for f in rep.findings if f.key != STAGE] + found
    if rep.verdict == "consistent":
        rep.verdict = "divergent"
        rep.first = _first(found[0], rep.reconciliation)


def _first(f: Finding, rec: dict[str, Any]) -> FirstDivergence:
    return FirstDivergence(key=STAGE, point=STAGE, layer=None, status="divergent", error=f.detail.get("value"),
                           tol=rec.get("tol"), rows=int(f.detail.get("rows") or 0), cause=f.cause, summary=f.summary)
