"""The slime integration on slime's own code (vendored snapshots of slime 624b824a8 and Megatron-LM 1dcf0daf).

Each scenario of tests/slime_real_scenarios.py runs in its own process with the vendored Megatron-LM first on
the path (it must not meet the megatron-core wheel the rest of the suite imports); the reports are made here,
by the `tic-trace slime-report` command, on the traces the scenario wrote. The vendor folder is
``../shared/vendor`` next to the repository, or ``$TIC_TRACE_VENDOR_DIR`` (each tree can also be named by
``$TIC_TRACE_SLIME_DIR`` / ``$TIC_TRACE_MEGATRON_LM_DIR``). A public checkout has no snapshots: there these tests
skip with one line naming what is missing; CI ships them, so with ``CI=true`` their absence is a failure.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tic_trace.testing import child
from tic_trace.testing.slime_vendor import MEGATRON_ENV, SLIME_ENV, sources

from conftest import require_vendored_sources

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "slime_real_scenarios.py"


def run_scenario(name: str, out: Path) -> dict:
    require_vendored_sources()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for s in sources():                   # the scenario process uses exactly the trees this session found
        env[MEGATRON_ENV if s.name == "Megatron-LM" else SLIME_ENV] = str(s.path)
    r = child.run([sys.executable, str(SCRIPT), name, str(out)], capture_output=True, text=True,
                  cwd=ROOT, env=env)
    assert r.returncode == 0, f"scenario {name} failed (rc {r.returncode}):\n{r.stdout[-6000:]}\n{r.stderr[-8000:]}"
    return json.loads((out / "result.json").read_text())


def test_real_parse_args_flag_family(tmp_path):
    res = run_scenario("args", tmp_path)
    hook_paths = res["hook_paths"]
    # without --tic-trace, every argument slime and Megatron-LM parse is what they parse without our flags
    ours = {k: v for k, v in res["ours_off"].items() if not k.startswith("tic_trace")}
    assert ours == res["plain"]
    assert {k for k in res["ours_off"] if k.startswith("tic_trace")} == {
        "tic_trace", "tic_trace_dir", "tic_trace_rollout_ids", "tic_trace_max_samples", "tic_trace_mode",
        "tic_trace_filter", "tic_trace_every", "tic_trace_disk_budget"}
    assert res["ours_off"]["tic_trace"] is False
    # with it, the hook-path arguments slime defines point at the integration
    for attr, path in hook_paths.items():
        assert res["on"][attr] == path
        assert res["yaml"][attr] == path
    assert res["on"]["tic_trace_rollout_ids"] == [0, 3] and res["on"]["tic_trace_dir"] == str(tmp_path / "t")
    # --custom-config-path: slime setattr's the YAML keys after parsing; configure validates them
    assert res["yaml"]["tic_trace_rollout_ids"] == [2] and res["yaml"]["tic_trace_max_samples"] == 1
    assert res["yaml"]["tic_trace_dir"] == str(tmp_path / "y")
    # the SGLang server arguments exist in slime's parser (SGLang's ServerArgs, --sglang- prefixed)
    # every SGLang server argument configure() sets is one slime's parser defines (else it would not reach
    # the servers), and each is set
    assert all(res["server_args_in_slime_parser"].values()), res["server_args_in_slime_parser"]
    assert res["rollout"]["sglang_disable_cuda_graph"] is True and res["rollout"]["sglang_disable_radix_cache"] is True
    assert res["rollout"]["sglang_enforce_disable_flashinfer_allreduce_fusion"] is True
    assert any("tic_trace.adapters.sglang" in h["hook_factory"] for h in res["rollout"]["sglang_forward_hooks"])
    # fully asynchronous rollout: refused, naming the flag and what to do
    assert "generate_rollout_fully_async" in res["fully_async_refused"]
    assert "--debug-train-only" in res["fully_async_refused"]


def test_real_train_step0_when_log_prob_pass_is_skipped(tmp_path):
    """kl_coef 0 and one train step: slime's can_reuse_log_probs_in_loss skips the actor's log-prob pass;
    train step 0 is traced through slime's train -> train_one_step on Megatron's schedule, its forward only,
    only the micro-batch holding a selected sample (max 1 sample: index 0)."""
    res = run_scenario("train_step0", tmp_path)
    assert res["num_microbatches"] == [2] and sorted(sum(res["micro_batch_indices"], [])) == [0, 1]
    passes = res["passes"]
    assert [p["tag"] for p in passes] == ["train_step0"]
    keys = passes[0]["keys"]
    assert set(keys) == {"0-0", None} and keys.count("0-0") == 9    # sample 0 is 9 tokens; the rest is padding
    assert passes[0]["phases"] == ["forward"]


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    out = tmp_path_factory.mktemp("slime-flow")
    return run_scenario("flow", out)


def test_real_flow_tags_requests_and_traces_the_log_prob_pass(flow):
    # slime's generate_and_rm -> generate -> post sent each traced sample's request with its rid
    assert flow["requests"] == {"0": ["0-0", "0-1"], "1": ["1-2", "1-3"]}
    for rid in ("0", "1"):
        # slime's dynamic batching packed both samples into one micro-batch
        assert flow["micro_batches"][rid] == [[0, 1]]
        passes = flow["passes"][rid]
        # one pass: the actor's log-prob micro-batch; the ref pass ("ref_") and the training step are not traced
        assert [p["tag"] for p in passes] == ["logprob"]
        keys = passes[0]["keys"]
        r = int(rid)
        assert sorted(set(keys) - {None}) == [f"{r}-{2 * r}", f"{r}-{2 * r + 1}"] and keys[-1] is None


def test_real_flow_chains_the_users_hooks(flow):
    calls = [tuple(c) for c in flow["user_calls"]]
    assert calls[0] == ("init",)
    # forward_only called the user's hook for the ref pass then the actor pass, per rollout, with slime's list
    assert [c for c in calls if c[0] == "log_prob"] == [("log_prob", "ref_", "list"), ("log_prob", "", "list")] * 2
    assert [c for c in calls if c[0] == "train_step"] == [("train_step", 0, 0), ("train_step", 1, 0)]
    assert sorted(c[1] for c in calls if c[0] == "generate") == [0, 1, 2, 3]
    assert all(c[2] is False for c in calls if c[0] == "generate")


def test_real_flow_slime_report(flow, tmp_path):
    from tic_trace.testing.faults import FAULTS
    from tic_trace.tools.cli import main as cli_main
    clean = tmp_path / "r0.json"
    assert cli_main(["slime-report", flow["dir"], "--rollout-id", "0", "--json", str(clean)]) == 0
    rep0 = json.loads(clean.read_text())
    assert rep0["verdict"] == "consistent" and rep0["rows"]["matched"] == 20   # (9 + 3) + (5 + 3) rows
    # the Megatron side recorded slime's --hf-checkpoint; that folder holds no weights here (config and
    # tokenizer only), so slime-report says the replay is off and answers with the A-B rule
    from tic_trace.view.align import CanonicalView
    recorded = CanonicalView(rep0["slime"]["a"]).trace.manifest["slime"]["hf_checkpoint"]
    assert recorded and Path(recorded, "config.json").is_file() and rep0["slime"]["reference"] is None
    bad = tmp_path / "r1.json"
    assert cli_main(["slime-report", flow["dir"], "--rollout-id", "1", "--json", str(bad)]) == 1
    rep1 = json.loads(bad.read_text())
    fd = rep1["first_divergence"]
    assert (fd["point"], fd["layer"]) == (FAULTS["rmsnorm_eps"].point, 1)
    # slime's own metric over the traced samples, reconciled: rollout 0 has no cause; in rollout 1 the whole of it
    # is the forward part (same tokens, same semantics on both sides), which cites the finder's first divergence
    rec0, rec1 = rep0["reconciliation"], rep1["reconciliation"]
    assert rec0["causes"] == [] and rec0["metric"] < 1e-3
    parts = {p["name"]: p for p in rec1["parts"]}
    assert [p["name"] for p in rec1["parts"] if p["significant"]] == ["forward"]
    assert parts["forward"]["share"] > 0.99 and parts["forward"]["rows"] == rec1["rows"] > 0
    assert f"L1.{fd['point']}" in parts["forward"]["summary"]
    assert abs(sum(p["value"] for p in rec1["parts"]) - rec1["metric"]) <= 1e-9 * max(rec1["metric"], 1.0)


def test_real_drift_names_a_stale_weight_sync_at_its_rollout(tmp_path):
    """Seven rollouts through slime's own flow with --tic-trace-every: the engine stops getting the weight update
    at rollout 3; `tic-trace drift` names the weight sync from rollout 3 on, before the numerics, and the onset at
    rollout 3. Each traced rollout logged one line with its trace paths and sizes; rollout 6 (periodic) is in the
    periodic default mode (subset)."""
    from tic_trace.tools.cli import main as cli_main
    res = run_scenario("drift", tmp_path)
    stale = res["stale_from"]
    assert len(res["log"]) == res["rollouts"], res["log"]
    assert all("megatron " in ln and "sglang " in ln and "(none written)" not in ln for ln in res["log"])
    assert "traced (subset)" in res["log"][-1] and "traced (rows)" in res["log"][0]
    out = tmp_path / "drift.json"
    assert cli_main(["drift", res["dir"], "--json", str(out), "--html", str(tmp_path / "drift.html")]) == 1
    doc = json.loads(out.read_text())
    assert doc["weight_sync"]["from_rollout"] == stale and doc["weight_sync"]["parameters"]
    assert all(r["status"] == "compared" for r in doc["rollouts"])
    assert [r["verdict"] for r in doc["rollouts"][:stale]] == ["consistent"] * stale
    on = doc["onset"]
    assert on["rollout_id"] == stale and on["changes"][0]["kind"] == "weights"
    (tmp_path / "sizes.json").write_text(json.dumps(res["log"]))


@pytest.mark.parametrize("fault, key", [("precision", "L1.mid"), ("routing", None)])
def test_real_drift_names_an_engine_fault_at_its_rollout_and_point(tmp_path, fault, key):
    """The same seven rollouts on slime's own code path, the weights in sync, and from rollout 3 a fault in the
    engine's computation: a bf16 residual add (named at L1.mid) or a top-k bias in layer 1 (named in layer 1,
    with its routing share)."""
    from tic_trace.testing.drift_runs import LAYER
    from tic_trace.tools.cli import main as cli_main
    res = run_scenario(f"drift_{fault}", tmp_path)
    out = tmp_path / "drift.json"
    assert cli_main(["drift", res["dir"], "--json", str(out)]) == 1
    doc = json.loads(out.read_text())
    assert doc["weight_sync"] is None
    on = doc["onset"]
    assert on["rollout_id"] == res["stale_from"] and on["layer"] == LAYER
    if key:
        assert on["key"] == key
    else:
        assert any(c["kind"] == "routing" and c["summary"].startswith(f"layer {LAYER}:") for c in on["changes"])


# ------------------------------------------------------------------ the periodic default mode


@pytest.fixture(scope="module")
def default_mode_runs(tmp_path_factory):
    """Three runs (clean, precision, routing) of five rollouts in one engine+trainer world, --tic-trace-every 1
    and no --tic-trace-mode: rollouts 1-4 are traced in the periodic default mode only."""
    return run_scenario("drift_default_mode", tmp_path_factory.mktemp("slime-drift-default"))


def _drift_doc(run: dict, out: Path, expect_rc: int) -> dict:
    from tic_trace.tools.cli import main as cli_main
    assert cli_main(["drift", run["dir"], "--json", str(out)]) == expect_rc
    doc = json.loads(out.read_text())
    assert doc["weight_sync"] is None
    rollouts = doc["rollouts"]
    # every periodic rollout is compared on numbers: its rows met on both sides, errors at every layer's points
    assert [r["status"] for r in rollouts] == ["compared"] * len(rollouts)
    for r in rollouts[1:]:
        assert r["verdict"] != "not_comparable" and r["rows"] > 0, r
        assert isinstance(r["errors"]["mid"]["1"], float) and isinstance(r["dlogprob"], float), r["errors"].keys()
    return doc


def test_real_drift_default_periodic_mode_logs_its_traces(default_mode_runs):
    res = default_mode_runs
    for run in res["runs"].values():
        log = run["log"]
        assert len(log) == res["rollouts"], log
        assert "traced (rows)" in log[0] and all("traced (subset)" in ln for ln in log[1:]), log
        assert all("megatron " in ln and "sglang " in ln and "(none written)" not in ln for ln in log)


def test_real_drift_default_periodic_mode_clean_run_has_no_onset(default_mode_runs, tmp_path):
    doc = _drift_doc(default_mode_runs["runs"]["clean"], tmp_path / "clean.json", 0)
    assert doc["onset"] is None and doc["onset_note"].startswith("no onset")
    assert {r["verdict"] for r in doc["rollouts"]} == {"consistent"}


@pytest.mark.parametrize("fault", ["precision", "routing"])
def test_real_drift_default_periodic_mode_names_the_onset(default_mode_runs, tmp_path, fault):
    """A bf16 residual add / a top-k bias in the engine's layer 1 from rollout 3: with only the periodic
    default traces after rollout 0, the onset is at rollout 3 and its point, with its error."""
    from tic_trace.testing.drift_runs import LAYER
    res = default_mode_runs
    doc = _drift_doc(res["runs"][fault], tmp_path / f"{fault}.json", 1)
    on = doc["onset"]
    assert on["rollout_id"] == res["fault_from"] and on["layer"] == LAYER, on
    assert isinstance(on["error"], float) and on["error"] > on["threshold"] >= on["baseline"]
    start = res["fault_from"]
    assert [r["verdict"] for r in doc["rollouts"][:start]] == ["consistent"] * start
    if fault == "precision":
        assert on["key"] == "L1.mid"
    else:
        assert on["point"].startswith("moe."), on
