"""`tic-trace drift RUN_DIR` on runs made of real traced forwards: megatron-core's GPTModel (the trainer) and
SGLang's Qwen3-MoE model code (the engine) over six rollouts, the weights moved by a training step between
rollouts and pushed to both (tic_trace/testing/drift_runs.py). Faults start at rollout 3 in the engine's
computation: a stale weight sync, a bf16 residual add, a routing bias. Each must be named at rollout 3 and at its
point; the clean run has no onset. The flag on slime's own code path: tests/test_slime_real.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tic_trace.drift.onset import departures
from tic_trace.drift.schema import SCHEMA, DriftSchemaError, validate
from tic_trace.testing.drift_runs import LAYER
from tic_trace.tools.cli import main as cli

START = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tic_trace.testing.drift_runs import build_runs
    base = tmp_path_factory.mktemp("drift-runs")
    return build_runs(base, {"clean": (None, START), "stale": ("stale_sync", START),
                             "precision": ("precision", START), "routing": ("routing", START)}, n_rollouts=6)


def _drift(run: Path, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / f"{run.name}.json"
    rc = cli(["drift", str(run), "--json", str(out), "--html", str(tmp_path / f"{run.name}.html"), *extra])
    return rc, validate(json.loads(out.read_text()))


def test_clean_run_has_no_onset(runs, tmp_path):
    rc, doc = _drift(runs["clean"], tmp_path)
    assert rc == 0 and doc["schema"] == SCHEMA
    assert doc["onset"] is None and doc["onset_note"].startswith("no onset")
    assert doc["weight_sync"] is None
    assert [r["rollout_id"] for r in doc["rollouts"]] == list(range(6))
    assert all(r["status"] == "compared" and r["verdict"] == "consistent" for r in doc["rollouts"])
    # every rollout has per-layer errors of the canonical points and a measured Δ log-prob
    r0 = doc["rollouts"][0]
    assert set(r0["errors"]["attn_norm"]) == {"0", "1"} and r0["dlogprob"] is not None
    # the trainer's weights changed at every rollout, and the engine's with them
    assert all(r["weights"]["changed_a"] and r["weights"]["changed_b"] and not r["weights"]["one_sided"]
               and r["weights"]["points_hashed"] for r in doc["rollouts"][1:])


def test_stale_weight_sync_is_named_first_at_its_rollout(runs, tmp_path, capsys):
    rc, doc = _drift(runs["stale"], tmp_path)
    assert rc == 1
    ws = doc["weight_sync"]
    assert ws["from_rollout"] == START and ws["how"] == "changed on one side only"
    assert ws["points"] and ws["parameters"] and "stale" in ws["summary"]
    assert all(not r["weights"]["one_sided"] for r in doc["rollouts"][:START])
    on = doc["onset"]
    assert on["rollout_id"] == START and on["changes"][0]["kind"] == "weights"
    out = capsys.readouterr().out
    assert out.index("WEIGHT SYNC") < out.index("ONSET")        # weights before any numerics


def test_precision_change_named_at_its_rollout_and_point(runs, tmp_path):
    rc, doc = _drift(runs["precision"], tmp_path)
    assert rc == 1 and doc["weight_sync"] is None
    on = doc["onset"]
    assert (on["rollout_id"], on["key"]) == (START, f"L{LAYER}.mid")
    assert on["confirmed_by"] == 2 and float(on["error"]) > float(on["threshold"])


def test_routing_change_named_at_its_rollout_and_layer(runs, tmp_path):
    rc, doc = _drift(runs["routing"], tmp_path)
    assert rc == 1 and doc["weight_sync"] is None
    on = doc["onset"]
    assert on["rollout_id"] == START and on["layer"] == LAYER
    assert any(c["kind"] == "routing" and c["summary"].startswith(f"layer {LAYER}:") for c in on["changes"])
    assert doc["rollouts"][START]["flips"][str(LAYER)]["flipped"] > 0
    assert all(not r["flips"].get(str(LAYER), {}).get("flipped") for r in doc["rollouts"][:START])


def test_missing_and_corrupt_rollouts_are_named_and_skipped(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["precision"], run)
    shutil.rmtree(run / "rollout_00001" / "sglang")
    idx = sorted((run / "rollout_00004" / "megatron").rglob("*.idx"))[0]
    idx.write_bytes(idx.read_bytes()[: len(idx.read_bytes()) // 2])
    (run / "rollout_00002" / "PRUNED").write_text("disk budget 1 MB")
    for p in (run / "rollout_00002").iterdir():
        if p.is_dir():
            shutil.rmtree(p)
    rc, doc = _drift(run, tmp_path)
    by = {r["rollout_id"]: r for r in doc["rollouts"]}
    assert [r["rollout_id"] for r in doc["rollouts"]] == list(range(6))
    assert by[1]["status"] == "skipped" and "sglang side missing" in by[1]["reason"]
    assert by[2]["status"] == "skipped" and "pruned by the disk budget" in by[2]["reason"]
    assert by[4]["status"] == "skipped" and str(idx.parent) in by[4]["reason"], by[4]["reason"]
    # 0, 3 and 5 remain: rollout 3 has one earlier rollout (no baseline for it), and 5's range includes 3's
    # error: with the rollouts that would have shown it skipped, the rule names no onset (and says so); the run
    # is still divergent from rollout 3 on, and exits 1 saying so
    assert doc["onset"] is None and doc["onset_note"].startswith("no onset")
    assert rc == 1 and doc["divergent_since"]["rollout_id"] == 3
    assert [r["rollout_id"] for r in doc["rollouts"] if r["status"] == "compared"] == [0, 3, 5]


def test_any_numbered_pair_layout_with_sides(runs, tmp_path):
    run = tmp_path / "pairs"
    for r in range(6):
        src = runs["precision"] / f"rollout_{r:05d}"
        shutil.copytree(src / "megatron", run / f"step_{r}" / "trainer")
        shutil.copytree(src / "sglang", run / f"step_{r}" / "engine")
    rc, doc = _drift(run, tmp_path, "--sides", "trainer,engine", "--workers", "2")
    assert rc == 1 and (doc["onset"]["rollout_id"], doc["onset"]["key"]) == (START, f"L{LAYER}.mid")
    assert doc["sides"] == ["trainer", "engine"]


def test_fewer_than_two_earlier_rollouts_is_no_baseline(runs, tmp_path):
    run = tmp_path / "short"
    for r in (2, 3):
        shutil.copytree(runs["precision"] / f"rollout_{r:05d}", run / f"rollout_{r:05d}")
    rc, doc = _drift(run, tmp_path)
    assert doc["onset"] is None and doc["onset_note"].startswith("no baseline")
    assert rc == 1 and doc["divergent_since"]["rollout_id"] == 3      # no baseline, but 3 is divergent


def test_every_entry_is_compared_or_named(runs, tmp_path, capsys):
    """Another name before the number, a symlink to a rollout inside the run: compared (the onset stays at the
    rollout the fault began). A symlink out of the run or to nothing: a skipped rollout naming it. Any other
    entry: named as no rollout."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    shutil.copytree(runs["precision"], run)
    (run / "rollout_00003").rename(run / "rollout_v2_00003")
    (run / "store").mkdir()
    (run / "rollout_00004").rename(run / "store" / "r4")
    (run / "rollout_00004").symlink_to(run / "store" / "r4")
    outside.mkdir()
    (run / "rollout_00005").rename(outside / "r5")
    (run / "rollout_00005").symlink_to(outside / "r5")
    (run / "rollout_00006").symlink_to(run / "gone")
    (run / "notes.txt").write_text("a note")
    rc, doc = _drift(run, tmp_path)
    by = {r["rollout_id"]: r for r in doc["rollouts"]}
    assert sorted(by) == list(range(7))
    assert [i for i in by if by[i]["status"] == "compared"] == [0, 1, 2, 3, 4]
    assert by[3]["dir"].endswith("rollout_v2_00003") and by[4]["dir"].endswith("rollout_00004")
    assert "leading out of the run directory" in by[5]["reason"] and "r5" in by[5]["reason"]
    assert "broken symlink" in by[6]["reason"]
    assert rc == 1 and (doc["onset"]["rollout_id"], doc["onset"]["key"]) == (START, f"L{LAYER}.mid")
    named = {o["name"]: o["reason"] for o in doc["others"]}
    assert set(named) == {"notes.txt", "store"} and "does not end in a number" in named["store"]
    out = capsys.readouterr().out
    assert "notes.txt" in out and "broken symlink" in out


def test_a_run_divergent_from_its_first_rollout_exits_1(runs, tmp_path, capsys):
    """Every rollout divergent, none growing over its earlier range: no onset, but exit 1, "divergent since
    rollout 0" (a CI gate on `drift` must not pass a run broken from the start)."""
    run = tmp_path / "broken"
    for i, r in enumerate((3, 4, 5, 4)):
        shutil.copytree(runs["precision"] / f"rollout_{r:05d}", run / f"rollout_{i:05d}")
    rc, doc = _drift(run, tmp_path)
    assert all(r["verdict"] == "divergent" for r in doc["rollouts"])
    assert doc["onset"] is None and rc == 1
    assert doc["divergent_since"]["rollout_id"] == 0 and doc["divergent_since"]["rollouts"] == 4
    assert "divergent since rollout 0" in capsys.readouterr().out
    assert "divergent since rollout 0" in (tmp_path / "broken.html").read_text()


def test_html_page_plots_each_point_kind_and_marks_the_onset(runs, tmp_path):
    _drift(runs["precision"], tmp_path)
    page = (tmp_path / "precision.html").read_text()
    assert "<svg" in page and "onset: L1.mid" in page and "<script" not in page
    assert "<title>attn_norm</title>" in page


def test_bad_run_dir_is_a_clear_error(tmp_path, capsys):
    assert cli(["drift", str(tmp_path / "nope")]) == 2
    (tmp_path / "empty").mkdir()
    assert cli(["drift", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr()
    assert "no numbered rollout directory" in err.out + err.err
    # an output never lands inside the run it reads
    assert cli(["drift", str(tmp_path / "empty"), "--json", str(tmp_path / "empty" / "d.json")]) == 2
    assert not (tmp_path / "empty" / "d.json").exists()


def test_every_command_documents_its_exit_codes(capsys):
    from tic_trace.tools.cli import build_parser
    commands = build_parser()._subparsers._group_actions[0].choices
    for name in commands:
        assert cli([name, "--help"]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert "exit codes: 0 " in out and " 2 error" in out, name
    assert "divergent since rollout N" in " ".join(commands["drift"].format_help().split())


def test_onset_rule_needs_the_error_to_stay_above():
    spike = [(0, 1e-3), (1, 1.2e-3), (2, 9e-3), (3, 1.1e-3), (4, 1e-3)]
    assert departures(spike, 3.0, 1e-5) == []
    step = [(0, 1e-3), (1, 1.2e-3), (2, 9e-3), (3, 8e-3), (4, 1e-2)]
    assert [d[0] for d in departures(step, 3.0, 1e-5)] == [2]
    tiny = [(0, 1e-8), (1, 2e-8), (2, 9e-7), (3, 9e-7)]      # x45, but under the noise floor
    assert departures(tiny, 3.0, 1e-5) == []


def test_schema_refuses_a_bad_document_naming_the_field(runs, tmp_path):
    _, doc = _drift(runs["clean"], tmp_path)
    bad = json.loads(json.dumps(doc))
    bad["rollouts"][2]["errors"]["attn_norm"]["0"] = "lots"
    with pytest.raises(DriftSchemaError, match=r"rollouts\[2\]\.errors\.attn_norm\.0"):
        validate(bad)


def test_renderings_are_bounded(runs, tmp_path):
    from rich.console import Console

    from tic_trace.drift.html import render_drift_html
    from tic_trace.drift.terminal import MAX_ROLLOUTS, render_drift
    _, doc = _drift(runs["clean"], tmp_path)
    many = dict(doc, rollouts=[dict(doc["rollouts"][0], rollout_id=i) for i in range(3000)])
    console = Console(record=True, width=200)
    render_drift(many, console)
    assert f"… {3000 - MAX_ROLLOUTS} more rollouts not shown" in console.export_text()
    assert "more rollouts not shown (see the JSON)" in render_drift_html(many)
