"""Passes over the same rows (issue 34, item 6): the same batch traced more than once in one trace (the actor
and the reference model in one training step, or two steps over one batch) is compared pass with pass, with
each pass's coverage, instead of refused as rows named twice. Real transformers models; every difference is in
the computation (another model's weights, a planted fault), never in a trace.
"""
from __future__ import annotations

import pytest
import torch

import tic_trace
from tic_trace.compare.diverge import find_divergence, rejudge
from tic_trace.report.terminal import headline
from tic_trace.testing.faults import plant
from tic_trace.testing.hf_models import build_hf_model, sample_tokens, tiny_qwen3_config
from tic_trace.tools.cli import main as cli
from tic_trace.view.align import CanonicalView

IDS = sample_tokens(2, 6, seed=1)
ROWS = IDS.numel()


def dense(seed=0):
    return build_hf_model(tiny_qwen3_config(moe=False), seed=seed)


def weights(seed):
    """Load the weights of `dense(seed)` into a model (the actor's or the reference model's)."""
    sd = dense(seed).state_dict()
    return lambda m: m.load_state_dict(sd)


def traced(out, steps, first_tag=None, tags=()) -> str:
    """One model object run on the same batch once per entry of `steps` (each prepares the model first: loads
    other weights, as slime swaps the reference model's weights into the actor's module), one pass each (the
    first tagged `first_tag`, the next ones `tags`), in one trace."""
    model = dense(0)
    with tic_trace.trace(model, out, adapter="hf", points_mode="full", tag=first_tag) as t, torch.no_grad():
        for i, prepare in enumerate(steps):
            if i:
                t.step(tags[i - 1] if tags else None)
            prepare(model)
            model(IDS)
    assert t.failed is None, t.failed
    return str(out)


def _passes_note(rep):
    return next(n for n in rep.notes if n.kind == "passes")


def test_actor_and_reference_in_one_trace_are_compared_pass_with_pass(tmp_path):
    """Both sides trace the actor then the reference model over one batch: consistent, each pass's rows
    compared, said on the verdict line (was: NOT COMPARABLE, rows held more than once)."""
    actor, ref = weights(0), weights(1)
    a = traced(tmp_path / "a", [actor, ref])
    b = traced(tmp_path / "b", [actor, ref])
    va = CanonicalView(a)
    assert va.load("logits", None).values[:ROWS].tolist() != va.load("logits", None).values[ROWS:].tolist()
    rep = find_divergence(a, b)
    line = headline(rep.to_json())
    assert rep.verdict == "consistent", line
    assert (rep.rows["duplicates_a"], rep.rows["duplicates_b"]) == (0, 0)
    assert rep.rows["matched"] == 2 * ROWS
    assert rep.identity["passes"] == {"by": "order", "a": {"1": ROWS, "2": ROWS}, "b": {"1": ROWS, "2": ROWS},
                                      "matched": {"1": ROWS, "2": ROWS}}
    assert (f"compared pass with pass in order: pass 1: {ROWS} of {ROWS} rows compared, pass 2: {ROWS} of "
            f"{ROWS} rows compared") in line, line
    doc = rep.to_json()
    assert rejudge(doc) == doc


def test_a_fault_in_the_second_pass_is_found_on_that_pass(tmp_path):
    """Side B's reference model (its second pass) has a planted fault: the divergence is found, on rows of the
    second pass; the first pass is clean."""
    actor, ref = weights(0), weights(1)
    a = traced(tmp_path / "a", [actor, ref])

    def bad_ref(m):
        ref(m)
        plant(m, "hf", "softmax_scale", 1)
    b = traced(tmp_path / "b", [actor, bad_ref])
    rep = find_divergence(a, b)
    assert rep.verdict == "divergent" and rep.first["key"] == "L1.attn.core", headline(rep.to_json())
    rows = [r["row"] for r in rep.first["worst_rows"] if r["status"] == "divergent"]
    assert rows and all(r.split("@")[0].endswith("/pass2") for r in rows), rows


def test_a_pass_one_side_alone_has_is_counted_not_refused(tmp_path):
    """Side B also traced the reference model; side A only the actor: the actor pass is compared, B's second
    pass is named as B's alone (its rows unmatched, another sample set), the verdict stands on what matched."""
    actor, ref = weights(0), weights(1)
    a = traced(tmp_path / "a", [actor])
    b = traced(tmp_path / "b", [actor, ref])
    rep = find_divergence(a, b)
    line = headline(rep.to_json())
    assert rep.verdict == "consistent", line
    assert rep.rows["matched"] == ROWS and rep.rows["unmatched_b"] == ROWS
    assert f"pass 2: side B only ({ROWS} rows, not compared)" in line, line


def test_passes_by_tag_match_passes_in_another_order(tmp_path, capsys):
    """A traces actor then reference, B reference then actor, each pass tagged: in order the passes are other
    models (divergent, at the first point), by tag they meet (consistent)."""
    actor, ref = weights(0), weights(1)
    a = traced(tmp_path / "a", [actor, ref], first_tag="actor", tags=["ref"])
    b = traced(tmp_path / "b", [ref, actor], first_tag="ref", tags=["actor"])
    assert find_divergence(a, b).verdict == "divergent"
    rep = find_divergence(CanonicalView(a, passes_by="tag"), CanonicalView(b, passes_by="tag"))
    assert rep.verdict == "consistent", headline(rep.to_json())
    assert rep.identity["passes"]["matched"] == {"actor": ROWS, "ref": ROWS}
    assert cli(["diff", a, b, "--passes-by", "tag"]) == 0
    assert "compared pass with pass by the passes' tags" in capsys.readouterr().out
    with pytest.raises(ValueError, match="passes_by"):
        CanonicalView(a, passes_by="steps")
