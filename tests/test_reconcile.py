"""Reconciling slime's train_rollout_logprob_abs_diff with the traced forward (compare/reconcile.py, issue 37).

Both sides run real code (tic_trace/testing/logprob_sides.py): the engine's log-probs come from SGLang 0.5.23's
`Sampler.forward` on a tiny Qwen3-MoE's logits, the trainer's from slime's own `get_log_probs_and_entropy`, and
slime's own reduction gives the metric each split must add up to. Each fault is a parameter the code runs with
(the trainer's --rollout-temperature, slime's rollout top-p replay, a template token, a routing bias): each case
names its part and share; the clean run has none.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from tic_trace.compare.reconcile import ORDER, Side, SlimeReduction, reconcile
from tic_trace.store.used_logprobs import Sampling
from tic_trace.testing.logprob_sides import RESPONSE, SAMPLES, SPEC, key, produce, used_side

from conftest import require_vendored_sources


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_vendored_sources()
    return produce(SPEC, tmp_path_factory.getbasetemp() / "logprob_sides")


def _engine(eng, run, t=1.0, top_p=1.0, **kw):
    return used_side("sglang", eng, run, Sampling(t, top_p, -1, 0.0, "sglang output_token_logprobs"), **kw)


def _trainer(tr, run, t=1.0, top_p=1.0, **kw):
    return used_side("megatron", tr, run, Sampling(t, top_p, -1, 0.0, "slime compute_log_prob"), **kw)


def _part(r, name):
    return next(p for p in r["parts"] if p["name"] == name)


def _adds_up(r):
    assert [p["name"] for p in r["parts"]] == list(ORDER)
    assert math.isclose(sum(p["value"] for p in r["parts"]), r["metric"], rel_tol=1e-9, abs_tol=1e-15)


def test_clean_run_shows_the_metric_with_no_cause(runs):
    eng, tr = runs
    r = reconcile(_trainer(tr, "clean"), _engine(eng, "clean"))
    _adds_up(r)
    assert math.isclose(r["metric"], float(tr["clean/metric"]), rel_tol=1e-3, abs_tol=1e-7)
    assert r["metric"] < 1e-5 and r["causes"] == []
    assert not any(p["significant"] for p in r["parts"])
    for side in ("a", "b"):      # T = 1: "raw" and "temperature" are one candidate, never a distinction
        assert r["sides"][side]["verdict"] == "match" and r["sides"][side]["best"]["name"] == "raw"
        assert "temperature" not in {c["name"] for c in r["sides"][side]["candidates"]}
    assert _part(r, "routing_replay")["missing"] == "routing replay not checked"


def test_temperature_applied_by_the_engine_only_is_the_semantics_part(runs):
    eng, tr = runs
    r = reconcile(_trainer(tr, "t07"), _engine(eng, "t07", t=0.7))
    _adds_up(r)
    assert math.isclose(r["metric"], float(tr["t07/metric"]), rel_tol=1e-5)
    sem = _part(r, "semantics")
    assert sem["significant"] and sem["share"] > 0.99, r["parts"]
    assert [c.split(":")[0] for c in r["causes"]] == ["semantics"]
    assert "T = 0.7" in sem["summary"] and "the raw logits, no temperature" in sem["summary"]
    assert r["sides"]["b"]["best"]["name"] == "temperature" and r["sides"]["a"]["best"]["name"] == "raw"
    fixed = reconcile(_trainer(tr, "t07_scaled", t=0.7), _engine(eng, "t07", t=0.7))   # --rollout-temperature 0.7
    assert fixed["metric"] < 1e-5 and fixed["causes"] == []


def test_top_p_renormalised_by_the_trainer_only_is_the_semantics_part(runs):
    eng, tr = runs
    r = reconcile(_trainer(tr, "topp", top_p=0.9), _engine(eng, "topp", top_p=0.9))
    _adds_up(r)
    sem = _part(r, "semantics")
    assert sem["significant"] and sem["share"] > 0.95, r["parts"]
    assert r["sides"]["a"]["best"]["name"] == "raw+top_p" and r["sides"]["b"]["best"]["name"] == "raw"
    assert "top-p renormalisation at p = 0.9" in sem["summary"] and "full distribution" in sem["summary"]


def test_template_shift_is_the_tokens_part(runs):
    eng, tr = runs
    r = reconcile(_trainer(tr, "shift"), _engine(eng, "clean"))
    _adds_up(r)
    assert math.isclose(r["metric"], float(tr["shift/metric"]), rel_tol=1e-5)
    tok = _part(r, "tokens")
    assert tok["significant"] and tok["share"] > 0.99 and tok["samples"] == 1
    assert tok["rows"] == RESPONSE      # every row from the shift on: a row with the same token has another context
    assert "shifted template" in tok["summary"] and f"{key(1)}@" in tok["summary"]
    assert [c.split(":")[0] for c in r["causes"]] == ["tokens"]


def _r3_rows(eng, tr):
    """What the routing-replay check gives: the forward rows whose expert sets differ (its differing_rows())."""
    out = set()
    for s in range(SAMPLES):
        a, b = tr[f"r3/{s}/experts"], eng[f"clean/{s}/experts"]
        out |= {(key(s), q) for q in range(len(a)) if set(a[q, 0]) != set(b[q, 0])}
    return out


def _r3_check(eng, tr, run="r3"):
    """compare/routing_replay.py's check on the engine's returned ids against the trainer's applied ones."""
    from tic_trace.compare.routing_replay import AppliedLayer, check_routing_replay
    rollout = {key(s): eng[f"clean/{s}/experts"] for s in range(SAMPLES)}
    applied = {}
    for L in range(rollout[key(0)].shape[1]):
        rows = [(key(s), q) for s in range(SAMPLES) for q in range(len(tr[f"{run}/{s}/experts"]))]
        ids = np.concatenate([tr[f"{run}/{s}/experts"][:, L] for s in range(SAMPLES)])
        applied[L] = AppliedLayer(L, rows, ids)
    return check_routing_replay(rollout, applied)


def test_forward_part_cites_the_finder(runs):
    eng, tr = runs
    finder = {"verdict": "divergent", "first_divergence": {"key": "L0.moe.topk_ids", "cause": "routing"},
              "attribution": {"first": "L0.moe.experts_out"}}
    r = reconcile(_trainer(tr, "r3"), _engine(eng, "clean"), finder=finder)
    assert "the finder's first divergence: L0.moe.topk_ids [routing] (attribution: L0.moe.experts_out)" in \
        _part(r, "forward")["summary"]
    clean = reconcile(_trainer(tr, "clean"), _engine(eng, "clean"), finder={"verdict": "consistent"})
    assert "the finder: consistent" in _part(clean, "forward")["summary"]


def test_routing_replay_rows_are_the_routing_part(runs):
    eng, tr = runs
    rows = _r3_rows(eng, tr)
    assert rows, "the planted selection bias changes no row's experts"
    r = reconcile(_trainer(tr, "r3"), _engine(eng, "clean"), r3=rows)
    _adds_up(r)
    rr, fwd = _part(r, "routing_replay"), _part(r, "forward")
    assert rr["significant"] and rr["rows"] > 0 and rr["value"] > fwd["value"], r["parts"]
    assert "routing_replay" in [c.split(":")[0] for c in r["causes"]]
    check = _r3_check(eng, tr)          # the same rows through the routing-replay check itself
    assert check.differing_rows() == frozenset(rows)
    assert reconcile(_trainer(tr, "r3"), _engine(eng, "clean"), r3=check)["parts"] == r["parts"]
    applied = reconcile(_trainer(tr, "clean"), _engine(eng, "clean"), r3=_r3_check(eng, tr, "clean"))
    assert _part(applied, "routing_replay")["value"] == 0 and applied["causes"] == []    # R3 on, ids applied
    assert "no split row ran other experts" in _part(applied, "routing_replay")["summary"]
    unchecked = reconcile(_trainer(tr, "r3"), _engine(eng, "clean"))      # R3 not checked: all of it is forward
    assert _part(unchecked, "routing_replay")["value"] == 0 and "not checked" in _part(unchecked, "routing_replay")["summary"]
    assert math.isclose(_part(unchecked, "forward")["value"], rr["value"] + fwd["value"], rel_tol=1e-9)


@pytest.mark.parametrize("run,per_token", [("masked", False), ("per_token", True)])
def test_metric_is_slimes_own_reduction(runs, run, per_token):
    eng, tr = runs
    trainer = _trainer(tr, run)
    mask = {(key(s), int(p)): float(m) for s, u in enumerate(trainer.used)
            for p, m in zip(u.positions, tr[f"{run}/{s}/mask"])}
    groups = {key(s): g for s, g in enumerate(next(x for x in SPEC["trainer"]["runs"] if x["name"] == run)
                                              .get("groups") or range(SAMPLES))}
    r = reconcile(trainer, _engine(eng, "t07", t=0.7),
                  reduction=SlimeReduction(per_token=per_token, groups=groups, loss_mask=mask))
    _adds_up(r)
    assert math.isclose(r["metric"], float(tr[f"{run}/metric"]), rel_tol=1e-5)
    plain = reconcile(trainer, _engine(eng, "t07", t=0.7))
    assert not math.isclose(plain["metric"], r["metric"], rel_tol=1e-4)    # the masks and groups matter


def test_rows_without_logits_are_named_not_split(runs):
    eng, tr = runs
    engine = _engine(eng, "t07", t=0.7)
    engine = Side(engine.name, engine.used, {k: v for k, v in engine.logits.items() if k != key(0)})
    r = reconcile(_trainer(tr, "t07"), engine)
    _adds_up(r)
    un = _part(r, "unmeasured")
    assert un["rows"] == len(engine.used[0].positions) and "without a traced logits row on sglang" in un["missing"]
    assert un["value"] > 0 and r["sides"]["b"]["missing"] == un["rows"]
    u0 = engine.used[0]
    short = Side(engine.name, [type(u0)(u0.sample, u0.positions[:-2], u0.tokens[:-2], u0.logprobs[:-2], u0.sampling),
                               *engine.used[1:]], engine.logits)
    r = reconcile(_trainer(tr, "t07"), short)
    assert r["only"] == {"a": 2, "b": 0} and r["rows"] == SAMPLES * RESPONSE - 2
    assert "2 rows megatron-only: a used log-prob the other side lacks, left out of the metric" in r["notes"]


def test_a_side_without_used_logprobs_is_refused(runs):
    eng, tr = runs
    r = reconcile(Side("megatron", []), _engine(eng, "clean"))
    assert "megatron recorded no used log-probs" in r["unavailable"]
    assert "parts" not in r
    disjoint = _engine(eng, "clean")
    disjoint = Side("sglang", [type(u)("x" + u.sample, u.positions, u.tokens, u.logprobs, u.sampling)
                               for u in disjoint.used], None)
    assert "no (sample, position) row" in reconcile(_trainer(tr, "clean"), disjoint)["unavailable"]
    assert np.isfinite(reconcile(_trainer(tr, "clean"), _engine(eng, "clean", logits=False))["metric"])


def _report(rec):
    from tic_trace.report.schema import Report
    return Report(verdict="consistent", first=None, findings=[], notes=[], points=[], not_comparable=[], rows={},
                  worst_tokens=[], routing={}, settings={}, sides={}, reconciliation=rec)


def test_terminal_json_and_html_show_the_split(runs):
    import json

    from rich.console import Console

    from tic_trace.report.html import render_html
    from tic_trace.report.schema import Report
    from tic_trace.report.terminal import render_terminal
    eng, tr = runs
    rec = reconcile(_trainer(tr, "t07"), _engine(eng, "t07", t=0.7), recorded=float(tr["t07/metric"]))
    doc = json.loads(json.dumps(_report(rec).to_json()))
    assert Report.from_json(doc).reconciliation["parts"] == rec["parts"]
    con = Console(record=True, width=200)
    render_terminal(doc, con)
    out = con.export_text()
    m = f"{rec['metric']:.3g}"
    assert f"slime's train_rollout_logprob_abs_diff = {m} nats over 3 traced samples (24 rows; slime logged {m}): " \
           "semantics 100%" in out
    assert "semantics" in out and "T = 0.7" in out and "routing replay" in out
    page = render_html(doc)
    assert 'id="reconciliation"' in page and "semantics 100%" in page and "T = 0.7" in page
    clean = json.loads(json.dumps(_report(reconcile(_trainer(tr, "clean"), _engine(eng, "clean"))).to_json()))
    con = Console(record=True, width=200)
    render_terminal(clean, con)
    assert "no cause (every part under 0.001 nats or 5% of the metric)" in con.export_text()
    refused = _report(reconcile(Side("megatron", []), _engine(eng, "clean"))).to_json()
    assert "not made — megatron recorded no used log-probs" in render_html(refused)


def _mixed(name, arrays, runs, sampling_of):
    """One side whose samples come from different runs (sample s from runs[s]), each stating its own run's
    sampling parameters (sampling_of(run)): the requests of one rollout at two temperatures."""
    used, logits = [], {}
    for s, run in enumerate(runs):
        one = used_side(name, arrays, run, sampling_of(run))
        used.append(one.used[s])
        logits[key(s)] = one.logits[key(s)]
    return Side(name, used, logits)


def test_a_side_stating_two_temperatures_is_fingerprinted_per_group(runs):
    """The engine's sample 0 was sampled at T = 0.7 (and says so), samples 1 and 2 at T = 1; the trainer scored all
    three with --rollout-temperature 1. One semantics over all the engine's rows matches neither group: the split
    must move each row by its own group's semantics."""
    from tic_trace.compare.logprob_semantics import Semantics, recompute
    from tic_trace.compare.reconcile import join, slime_weights
    eng, tr = runs
    engine = _mixed("sglang", eng, ["t07", "clean", "clean"],
                    lambda run: Sampling(0.7 if run == "t07" else 1.0, 1.0, -1, 0.0, "sglang output_token_logprobs"))
    trainer = _mixed("megatron", tr, ["t07", "clean", "clean"],
                     lambda run: Sampling(1.0, 1.0, -1, 0.0, "slime compute_log_prob"))
    r = reconcile(trainer, engine)
    _adds_up(r)
    # what the rows' own groups imply: D2 = u_A - u_B + l_B(s_B) - l_B(raw), s_B the row's group's semantics
    rows = join(trainer, engine, SlimeReduction())
    w, sem = slime_weights(rows.keys, SlimeReduction()), []
    for s, _ in rows.keys:
        sem.append(Semantics(temperature=0.7) if s == key(0) else Semantics())
    z, t = np.stack(rows.z["b"]), rows.tok["b"]
    own = np.array([recompute(z[i:i + 1], t[i:i + 1], x)[0] for i, x in enumerate(sem)])
    d0 = rows.u["a"] - rows.u["b"]
    d2 = d0 + own - recompute(z, t, Semantics())
    want = float(np.sum(w * np.abs(d0)) - np.sum(w * np.abs(d2)))
    sem_part = _part(r, "semantics")
    assert want > 0.01 and math.isclose(sem_part["value"], want, rel_tol=1e-6), (sem_part, want)
    assert sem_part["share"] > 0.99 and abs(_part(r, "residual")["value"]) < 1e-5, r["parts"]
    b = r["sides"]["b"]
    assert [(g["stated"], g["verdict"], g["best"]["name"], g["samples"], g["rows"]) for g in b["groups"]] == [
        ("T = 0.7", "match", "temperature", 1, RESPONSE), ("T = 1", "match", "raw", 2, 2 * RESPONSE)], b
    assert b["groups"][0]["best"]["temperature"] == 0.7 and b["verdict"] == "match"
    assert "groups" not in r["sides"]["a"] and r["sides"]["a"]["best"]["name"] == "raw"   # one group: as before
    assert "logits / T, T = 0.7) on the 1 sample stating T = 0.7" in sem_part["summary"]
    assert "sglang's samples state 2 different sampling parameters: each group fingerprinted" in " ".join(r["notes"])
    assert r["common"]["name"] == "raw"
    from tic_trace.report.reconcile_lines import reconciliation_lines
    lines = reconciliation_lines({"reconciliation": r})
    assert any(x.startswith("    B [T = 0.7; 1 sample]: sglang's log-probs are over the full distribution "
                            "(logits / T, T = 0.7)") for x in lines), lines
    assert any(x.startswith("    B [T = 1; 2 samples]: sglang's log-probs are over the full distribution "
                            "(the raw logits") for x in lines), lines
    assert not any(x.startswith("    A [") for x in lines)      # the trainer has one group: one line, as before
    from tic_trace.report.html import render_html
    page = render_html(_report(r).to_json())
    assert "B [T = 0.7; 1 sample]: sglang&#x27;s log-probs are over the full distribution" in page
    # the trainer following each request's temperature (--rollout-temperature per group): each row's common
    # semantics is its own group's, and nothing is left to explain
    both = reconcile(_mixed("megatron", tr, ["t07_scaled", "clean", "clean"],
                            lambda run: Sampling(0.7 if run == "t07_scaled" else 1.0, 1.0, -1, 0.0, "slime")), engine)
    _adds_up(both)
    assert both["metric"] < 1e-5 and both["causes"] == [], both["parts"]
    assert both["common"] is None and [c["name"] for c in both["commons"]] == ["temperature", "raw"]


def test_routing_replay_part_says_whether_r3_was_off_or_not_recorded(runs):
    from tic_trace.compare.reconcile_parts import R3State
    from tic_trace.report.reconcile_lines import part_line
    eng, tr = runs
    off = reconcile(_trainer(tr, "r3"), _engine(eng, "clean"), r3_state=R3State(False))
    rr = _part(off, "routing_replay")
    assert rr["state"] == rr["summary"] == "R3 off (--use-rollout-routing-replay not set): no routing-replay part"
    assert rr["missing"] == "" and rr["value"] == 0
    assert part_line(rr).endswith("0 rows — R3 off (--use-rollout-routing-replay not set): no routing-replay part")
    why = "no routed experts were recorded under rollout_00000/routing_replay/"
    on = reconcile(_trainer(tr, "r3"), _engine(eng, "clean"), r3_state=R3State(True, why))
    rr = _part(on, "routing_replay")
    assert rr["missing"] == f"routing replay not checked: R3 on (--use-rollout-routing-replay) but {why}"
    assert "state" not in rr and part_line(rr).endswith(f"— not measured: {rr['missing']}")
    assert off["metric"] == on["metric"] and _part(off, "forward")["value"] == _part(on, "forward")["value"]
    unknown = reconcile(_trainer(tr, "r3"), _engine(eng, "clean"))        # the API without a word: as before
    assert _part(unknown, "routing_replay")["missing"] == "routing replay not checked"


def test_slime_report_reads_r3_from_the_megatron_manifest(tmp_path):
    """slime-report's reconciliation takes R3 on or off from slime's flag as the Megatron side's manifest
    records it (integrations/slime/megatron_hooks.py), and says why it has no check when it was on."""
    from conftest import trace_hf
    from tic_trace.compare.reconcile_parts import R3State
    from tic_trace.testing.hf_models import build_hf_model, sample_tokens, tiny_qwen3_config
    from tic_trace.tools.slime_reconcile import r3_state, routing_replay
    from tic_trace.view.align import CanonicalView
    model, ids = build_hf_model(tiny_qwen3_config(moe=False, num_hidden_layers=1)), sample_tokens(1, 4)
    views = {}
    for flag in (False, True, None):
        d = tmp_path / f"r3_{flag}" / "megatron"
        slime = {"rollout_id": 0} if flag is None else {"rollout_id": 0, "use_rollout_routing_replay": flag}
        trace_hf(model, d, ids, manifest={"slime": slime})
        views[flag] = CanonicalView(str(d))
    rdir = tmp_path / "r3_True"
    r3, note = routing_replay(rdir, {"megatron": views[True], "sglang": views[True]})
    assert r3 is None and note is None                                    # nothing recorded
    assert r3_state(tmp_path / "r3_False", views[False], r3, note) == R3State(False)
    on = r3_state(rdir, views[True], r3, note)
    assert on.on and "no routed experts were recorded under r3_True/routing_replay/" in on.why
    (rdir / "routing_replay").mkdir()
    (rdir / "routing_replay" / "rank00000.routed_experts.msgpack").write_bytes(b"not msgpack")
    r3, note = routing_replay(rdir, {"megatron": views[True], "sglang": views[True]})
    assert r3 is None and note
    bad = r3_state(rdir, views[True], r3, note)
    assert bad.on and bad.why.startswith("its record cannot be read (") and "rank00000" in bad.why
    assert r3_state(tmp_path / "r3_None", views[None], None, None) is None    # the manifest does not say
