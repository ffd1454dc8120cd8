"""The log-probs each side of slime used, recorded beside its trace (issue 37 item 1).

The scenario (tests/slime_real_scenarios.py `logprobs`) runs slime's own code from ../shared/vendor: requests through
generate_and_rm -> generate -> post over HTTP to SGLang's model code (answers shaped as SGLang's:
``meta_info.output_token_logprobs`` as ``[logprob, token, None]``), the trainer's log-prob pass (compute_log_prob ->
forward_only -> get_log_probs_and_entropy) and train step 0 (policy_loss_function), at --rollout-temperature 0.9.
The checks compare what was recorded with what slime itself holds: each sample's rollout_log_probs, the log-prob
pass's rollout_data["log_probs"], and the train_rollout_logprob_abs_diff slime logs.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest

from tic_trace import TraceFormatError, open_trace
from tic_trace.store import format as fmt
from tic_trace.store.used_logprobs import Sampling, UsedLogprobs, read, write_part

from test_slime_real import run_scenario

T = 0.9      # the scenario's --rollout-temperature


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("slime-logprobs")
    res = run_scenario("logprobs", out)
    res["path"] = Path(res["dir"])
    return res


def side(run, rollout_id: int, name: str):
    return read(run["path"] / f"rollout_{rollout_id:05d}" / name)


def slime_sample(run, rollout_id: int, index: int) -> dict:
    return next(s for s in run["samples"][str(rollout_id)] if s["index"] == index)


def test_rollout_side_records_the_returned_logprobs_and_sampling_of_traced_samples_only(run):
    got = side(run, 0, "sglang")
    assert [e.sample for e in got.entries] == ["0-0"]           # sample 1 is beyond --tic-trace-max-samples 1
    e, s = got.entries[0], slime_sample(run, 0, 0)
    r = s["response_length"]
    # exactly the numbers slime took from the answer into Sample.rollout_log_probs, at the response's positions
    assert e.logprobs.tolist() == s["rollout_log_probs"]
    assert e.tokens.tolist() == s["tokens"][-r:]
    assert e.positions.tolist() == list(range(len(s["tokens"]) - r, len(s["tokens"])))
    assert (e.sampling.temperature, e.sampling.top_p, e.sampling.top_k, e.sampling.min_p) == (T, 1.0, -1, 0.0)
    assert e.sampling.source == "sglang meta_info.output_token_logprobs"
    assert e.sampling.extra["request_id"] == "0-0"
    assert e.sampling.extra["env SGLANG_RETURN_ORIGINAL_LOGPROB (rollout process)"] == "unset"
    one = side(run, 1, "sglang")
    assert [e.sample for e in one.entries] == ["1-2", "1-3"]
    assert {e.sampling.extra["env SGLANG_RETURN_ORIGINAL_LOGPROB (rollout process)"] for e in one.entries} == {"1"}


def test_trainer_side_records_the_logprobs_slime_compares_with_rollout_temperature(run):
    got = side(run, 0, "megatron")
    assert [e.sample for e in got.entries] == ["0-0"]
    e = got.entries[0]
    # the log-prob pass's own output, as compute_log_prob stored it in rollout_data["log_probs"]
    assert e.logprobs.tolist() == run["trainer_log_probs"]["0"]["0"]
    assert e.sampling.temperature == T and e.sampling.top_p == 1.0 and e.sampling.top_k == -1
    assert e.sampling.extra["phase"] == "logprob" and e.sampling.extra["compared_by_slime"] is True
    assert e.mask.tolist() == slime_sample(run, 0, 0)["loss_mask"] == [1] * 4     # get_batch's loss_masks
    # rollout 1: kl_coef 0, one step: slime skipped the pass (no rollout_data["log_probs"]) and compared train
    # step 0's; the recorded numbers and masks give slime's own logged metric (its per-rollout mean over the
    # step's samples, each sample's masked mean)
    assert "1" not in run["trainer_log_probs"]
    a, b = side(run, 1, "megatron"), side(run, 1, "sglang")
    assert {e.sampling.extra["phase"] for e in a.entries} == {"train_step0"}
    assert [e.mask.tolist() for e in a.entries] == [slime_sample(run, 1, i)["loss_mask"] for i in (2, 3)] \
        == [[0, 1, 1, 1]] * 2
    assert all(e.mask is None for e in b.entries)         # the engine's answer carries no loss mask
    per_sample = [np.sum(x.mask * np.abs(x.logprobs - y.logprobs)) / np.sum(x.mask)
                  for x, y in zip(a.entries, b.entries)]
    assert len(per_sample) == 2 and np.mean(per_sample) == pytest.approx(run["logged"][1], rel=1e-5)
    assert run["logged"][1] > 1e-2          # the engine's log-probs were of the original logits (before T)


def test_keys_positions_and_tokens_match_across_sides_and_the_traced_logits(run):
    from tic_trace.view.align import CanonicalView
    for rollout_id in (0, 1, 3):
        base = run["path"] / f"rollout_{rollout_id:05d}"
        a, b = read(base / "megatron"), read(base / "sglang")
        assert [(e.sample, e.positions.tolist(), e.tokens.tolist()) for e in a.entries] == \
               [(e.sample, e.positions.tolist(), e.tokens.tolist()) for e in b.entries]
        # the token at position p is scored by the logits row p - 1 of the trace: the trainer's number is
        # log_softmax(z / rollout_temperature)[token] of Megatron's traced logits
        lg = CanonicalView(str(base / "megatron")).load("logits", None)
        row = {rid: i for i, rid in enumerate(lg.rows)}
        for e in a.entries:
            z = np.stack([lg.values[row[(e.sample, int(p) - 1)]] for p in e.positions]).astype(np.float64) / T
            want = z[np.arange(len(z)), e.tokens] - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) - z.max(-1)
            np.testing.assert_allclose(e.logprobs, want, atol=2e-5)


def test_streamed_requests_are_tagged_and_their_logprobs_recorded_from_the_sample(run, tmp_path):
    """Rollout 3: slime's sglang_streaming_rollout.generate_streaming sends through http_utils' client (SSE), not
    post: its requests still carry the rid, and the log-probs slime kept on the sample are recorded."""
    assert run["requests"]["3"] == ["3-6", "3-7"]
    got = side(run, 3, "sglang")
    assert [e.sample for e in got.entries] == ["3-6", "3-7"]
    for e in got.entries:
        s = slime_sample(run, 3, int(e.sample.split("-")[1]))
        assert e.logprobs.tolist() == s["rollout_log_probs"] and e.tokens.tolist() == s["tokens"][-4:]
        assert e.positions.tolist() == list(range(len(s["tokens"]) - 4, len(s["tokens"])))
        assert "rollout_log_probs" in e.sampling.source and e.sampling.temperature == T
    rc, rep = slime_report(run, 3, tmp_path / "r3.json")
    rec = rep["reconciliation"]
    assert rc == 0 and rep["rows"]["matched"] == 20 and rec["rows"] == 8 and rec["causes"] == []


def test_nothing_recorded_with_tracing_off(run):
    # rollout 2 ran with args.tic_trace false and the hooks still installed: no directory at all
    assert not (run["path"] / "rollout_00002").exists()
    # and importing the integration loads no recording code
    code = ("import sys, tic_trace.integrations.slime as s; "
            "print(any(m.endswith('used_logprobs') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_trace_is_read_as_before(run):
    """The used log-probs sit beside the ranks: not an ignored entry, and a tracer may still claim the directory."""
    for name in ("megatron", "sglang"):
        tr = open_trace(run["path"] / "rollout_00000" / name)
        assert tr.ignored == [] and tr.ranks == [0]


# ================================================================== tic-trace slime-report

def slime_report(run, rollout_id: int, out: Path, *extra: str) -> tuple[int, dict]:
    from tic_trace.tools.cli import main as cli_main
    rc = cli_main(["slime-report", str(run["path"]), "--rollout-id", str(rollout_id), "--json", str(out), *extra])
    return rc, json.loads(out.read_text())


def test_slime_report_reconciles_slimes_metric(run, tmp_path):
    """Rollout 1: the engine returned the log-probs of the original logits while the trainer divided by
    rollout_temperature. The report recomputes slime's logged metric from the recorded log-probs and puts it
    all on the semantics, naming both; the forward's part is float noise (every canonical point consistent), so
    the first divergence is the used-log-prob stage after the graph, its cause the semantics; a saved report read
    back (`report --from-json`, which re-judges) says the same."""
    from tic_trace.tools.cli import main as cli_main
    logged = run["logged"][1]
    rc, rep = slime_report(run, 1, tmp_path / "r1.json", "--slime-metric", repr(logged))
    rec = rep["reconciliation"]
    assert rc == 1 and rep["verdict"] == "divergent"
    assert all(p["status"] in ("ok", "over") for p in rep["points"])
    fd = rep["first_divergence"]
    assert (fd["key"], fd["cause"]) == ("used_logprob", "semantics") and "T = 0.9" in fd["summary"]
    assert [f["cause"] for f in rep["findings"] if f["divergent"]] == ["semantics"]
    assert cli_main(["report", "x", "--from-json", str(tmp_path / "r1.json"), "--json", str(tmp_path / "b.json")]) == 1
    back = json.loads((tmp_path / "b.json").read_text())
    assert back["first_divergence"] == fd and back["findings"] == rep["findings"]
    assert rec["recorded"] == logged and rec["metric"] == pytest.approx(logged, rel=1e-5)
    assert rec["rows"] == 8 and rec["samples"] == 2 and rec["only"] == {"a": 0, "b": 0}
    # the masked first tokens weigh 0: without the masks the same rows give another number
    a, b = side(run, 1, "megatron"), side(run, 1, "sglang")
    unmasked = np.mean([np.mean(np.abs(x.logprobs - y.logprobs)) for x, y in zip(a.entries, b.entries)])
    assert abs(unmasked - logged) > 1e-4
    parts = {p["name"]: p for p in rec["parts"]}
    assert sum(p["value"] for p in rec["parts"]) == pytest.approx(rec["metric"], rel=1e-9)
    assert parts["semantics"]["significant"] and parts["semantics"]["share"] > 0.99
    assert rec["sides"]["a"]["best"]["temperature"] == T and rec["sides"]["b"]["best"]["name"] == "raw"
    # the engine's requests said T = 0.9 while its numbers are of the raw logits: its fingerprint says both
    assert f"though it states T = {T:g}" in rec["sides"]["b"]["summary"]
    assert "though it states" not in rec["sides"]["a"]["summary"]
    assert abs(parts["forward"]["value"]) < 1e-5 and not parts["tokens"]["significant"]
    assert [c.split(":")[0] for c in rec["causes"]] == ["semantics"]
    # R3 off for this run: the Megatron side's manifest records slime's flag, and the part says so (not "not checked")
    assert open_trace(run["path"] / "rollout_00001" / "megatron").manifest["slime"]["use_rollout_routing_replay"] is False
    assert parts["routing_replay"]["state"] == "R3 off (--use-rollout-routing-replay not set): no routing-replay part"
    assert parts["routing_replay"]["missing"] == ""
    # rollout 0: both sides took their log-probs at T = 0.9: nothing to explain
    rc, rep = slime_report(run, 0, tmp_path / "r0.json")
    rec = rep["reconciliation"]
    assert rc == 0 and rec["causes"] == [] and rec["metric"] < 1e-5 and rec["rows"] == 4


@pytest.mark.parametrize("bad", ["nan", "inf", "-0.5", "lots"])
def test_slime_metric_is_a_number_of_nats(bad, tmp_path, capsys):
    from tic_trace.tools.cli import main as cli_main
    assert cli_main(["slime-report", str(tmp_path), "--rollout-id", "0", "--slime-metric", bad]) == 2
    assert "--slime-metric" in capsys.readouterr().err


def test_slime_report_names_a_corrupt_record_and_keeps_the_rest(run, tmp_path):
    base = tmp_path / "t"
    shutil.copytree(run["path"] / "rollout_00001", base / "rollout_00001")
    part = next((base / "rollout_00001" / "megatron" / fmt.USED_LOGPROBS_DIR).iterdir())
    part.write_bytes(part.read_bytes()[:-1])
    from tic_trace.tools.cli import main as cli_main
    rc = cli_main(["slime-report", str(base), "--rollout-id", "1", "--json", str(tmp_path / "r.json")])
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rc == 0 and rep["verdict"] == "consistent" and rep["rows"]["matched"] == 20
    assert str(part) in rep["reconciliation"]["unavailable"] and "truncated" in rep["reconciliation"]["unavailable"]


# ================================================================== the record on disk, hostile input

def entry(sample="0-0", n=3, first=5, mask=None, **sampling) -> UsedLogprobs:
    return UsedLogprobs(sample, np.arange(first, first + n), np.arange(n) + 7, -np.linspace(0.5, 2.0, n),
                        Sampling(**sampling), mask)


def test_parts_merge_across_turns_and_ranks(tmp_path):
    write_part(tmp_path / "a", "rollout-1", [entry(first=5, temperature=0.7)])
    write_part(tmp_path / "a", "rollout-2", [entry(first=12, temperature=0.7)])   # a second turn of the sample
    got = read(tmp_path / "a")
    assert len(got.files) == 2 and got.notes == [] and len(got.entries) == 1
    assert got.entries[0].positions.tolist() == [5, 6, 7, 12, 13, 14]
    mask = np.array([0.0] + [1.0] * 9)
    write_part(tmp_path / "b", "megatron-0", [entry(first=5, n=10, mask=mask, temperature=0.9)])
    write_part(tmp_path / "b", "megatron-1", [entry(first=5, n=10, mask=mask, temperature=0.9)])   # a TP twin
    got = read(tmp_path / "b")
    assert got.notes == [] and [e.positions.tolist() for e in got.entries] == [list(range(5, 15))]
    assert got.entries[0].mask.tolist() == mask.tolist()
    # the same (sample, position) with another token: the first is kept, and said
    write_part(tmp_path / "b", "megatron-2", [UsedLogprobs("0-0", np.array([6]), np.array([99]), np.array([-1.0]),
                                                           Sampling(temperature=0.9), np.array([1.0]))])
    got = read(tmp_path / "b")
    assert got.entries[0].tokens[1] == 8 and got.notes == [
        "sample '0-0' position 6: recorded with tokens 8 and 99; the first is kept"]


@pytest.fixture
def part(tmp_path) -> Path:
    write_part(tmp_path, "rollout-1", [entry(temperature=0.7)])
    return tmp_path / fmt.USED_LOGPROBS_DIR / "part-rollout-1.msgpack"


def rewrite(path: Path, fn) -> None:
    obj = msgpack.unpackb(path.read_bytes()[fmt._HEADER.size:], raw=False)
    fn(obj)
    fmt.write_framed(path, fmt.KIND_USED_LOGPROBS, obj)


def test_corrupt_part_names_the_file(part):
    data = bytearray(part.read_bytes())
    data[-3] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(TraceFormatError, match="checksum mismatch") as e:
        read(part.parents[1])
    assert e.value.path == str(part)
    part.write_bytes(bytes(data[:10]))
    with pytest.raises(TraceFormatError, match="truncated"):
        read(part.parents[1])


@pytest.mark.parametrize("edit, problem", [
    (lambda d: d.update(version=2), "not a version-1 used log-probs document"),
    (lambda d: d["entries"][0].update(logprobs=b"\0" * 5), "raw 8-byte"),
    (lambda d: d["entries"][0].update(tokens=b"\0" * 8), "one of each per token"),
    (lambda d: d["entries"][0].update(mask=b"\0" * 8), "and 1 mask values: one of each per token"),
    (lambda d: d["entries"][0].update(mask=np.array([1.0, np.nan, 0.0], "<f8").tobytes()), "not a finite number"),
    (lambda d: d["entries"][0].update(sample="x" * 300), "'sample' must be a string"),
    (lambda d: d["entries"][0].update(positions=np.array([-1, 0, 1], "<i8").tobytes()), "a position outside"),
    (lambda d: d["entries"][0]["sampling"].update(temperature="hot"), "sampling.temperature"),
    (lambda d: d["entries"][0]["sampling"].update(top_k=True), "sampling.top_k"),
    (lambda d: d["entries"][0]["sampling"].update(extra={"a": [1]}), "sampling.extra"),
    (lambda d: d["entries"].append("x"), "entry 1: not a map"),
])
def test_hostile_part_names_the_file_and_problem(part, edit, problem):
    rewrite(part, edit)
    with pytest.raises(TraceFormatError, match=problem) as e:
        read(part.parents[1])
    assert e.value.path == str(part)


def test_fuzzed_parts_only_ever_give_a_trace_format_error(part):
    """Any field of a part replaced by a value of any type (rewritten with valid framing): read() answers or
    raises TraceFormatError naming the file, never another exception."""
    import random
    rng = random.Random(37)
    good = msgpack.unpackb(part.read_bytes()[fmt._HEADER.size:], raw=False)
    values = [None, True, -1, 2**63, -2**63, 0.5, float("nan"), "", "x" * 5000, b"", b"\0" * 7, b"\xff" * 24, [], {},
              [1, 2], {"a": 1}, {1: 2}]

    def paths(obj, at=()):
        yield at
        if isinstance(obj, dict):
            for k, v in obj.items():
                yield from paths(v, at + (k,))
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                yield from paths(v, at + (i,))
    spots = [p for p in paths(good) if p]
    for _ in range(300):
        doc = msgpack.unpackb(msgpack.packb(good, use_bin_type=True), raw=False, strict_map_key=False)
        at = rng.choice(spots)
        target = doc
        for k in at[:-1]:
            target = target[k]
        target[at[-1]] = rng.choice(values)
        fmt.write_framed(part, fmt.KIND_USED_LOGPROBS, doc)
        try:
            read(part.parents[1])
        except TraceFormatError as e:
            assert e.path == str(part)


def test_strays_are_listed_and_links_out_refused(part, tmp_path):
    d = part.parent
    (d / "notes.txt").write_text("x")
    (d / ".part-rollout-9.msgpack.tmp").write_text("half-written")
    got = read(d.parent)
    assert got.ignored == ["notes.txt"] and len(got.entries) == 1
    outside = tmp_path.parent / f"{tmp_path.name}-outside.msgpack"
    shutil.copy(part, outside)
    os.symlink(outside, d / "part-rollout-2.msgpack")
    with pytest.raises(TraceFormatError, match="symlink leading out"):
        read(d.parent)
    os.unlink(d / "part-rollout-2.msgpack")
    os.mkfifo(d / "part-rollout-3.msgpack")
    with pytest.raises(TraceFormatError, match="not a regular file"):
        read(d.parent)


# ================================================================== the recording never breaks a run

def test_rollout_recording_keeps_positions_of_each_turn_and_never_raises(tmp_path, caplog):
    from tic_trace.integrations.slime.used_logprobs import record_response, response_entry
    answer = {"text": "", "meta_info": {"id": "3-0", "prompt_tokens": 4, "completion_tokens": 2,
                                        "output_token_logprobs": [[-0.25, 11, None], [-1.5, 12, None]]}}
    first = response_entry("3-0", {"input_ids": [1, 2, 3, 4], "sampling_params": {"temperature": 0.6}}, answer)
    assert first.positions.tolist() == [4, 5] and first.tokens.tolist() == [11, 12]
    assert (first.sampling.temperature, first.sampling.top_p, first.sampling.top_k) == (0.6, 1.0, -1)
    # a later turn's prompt holds the earlier turns: its answer continues from its own length
    later = response_entry("3-0", {"input_ids": [1, 2, 3, 4, 11, 12, 90], "sampling_params": {}}, answer)
    assert later.positions.tolist() == [7, 8]
    # a text request: SGLang's prompt_tokens says where the answer starts
    assert response_entry("3-0", {"text": "hi"}, answer).positions.tolist() == [4, 5]
    from tic_trace.integrations.slime import config
    config._WARNED.discard("used-logprobs-rollout")            # warned once per process: this test's own
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with caplog.at_level("WARNING", logger="tic_trace.slime"):
        record_response(blocked, "3-0", {"input_ids": [1]}, answer)           # cannot write: warns, no raise
        record_response(tmp_path, "3-0", {"input_ids": [1]}, {"meta_info": {"output_token_logprobs": [[0.0]]}})
    assert "not recorded" in caplog.text


def test_trainer_entries_state_what_get_log_probs_and_entropy_applied():
    """The call's own arguments say which rows and what semantics: the packed samples' response positions,
    rollout_temperature, the top-p replay when slime passed the rollout's nucleus ids; and whether slime's
    metric compares these numbers (with --use-rollout-logprobs it compares the train step's)."""
    import argparse

    import torch
    from tic_trace.integrations.slime.used_logprobs import trainer_entries
    args = argparse.Namespace(rollout_temperature=0.7, rollout_top_p=0.9, use_rollout_logprobs=True,
                              context_parallel_size=1)
    kw = {"unconcat_tokens": [torch.arange(10, 16), torch.arange(20, 29)], "total_lengths": [6, 9],
          "response_lengths": [2, 3], "top_p_token_ids": [[1], [2]], "top_p_token_offsets": [[0], [0]]}
    res = (torch.empty(0), {"log_probs": [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5, -0.25, -0.125])]})
    masks = [torch.tensor([1, 0]), torch.tensor([1, 1, 1])]
    got = trainer_entries(args, "logprob", [None, "4-1"], kw, res, masks)
    assert len(got) == 1                                   # the untraced sample is left out
    e = got[0]
    assert (e.sample, e.positions.tolist(), e.tokens.tolist()) == ("4-1", [6, 7, 8], [26, 27, 28])
    assert e.logprobs.tolist() == [-0.5, -0.25, -0.125] and e.mask.tolist() == [1.0, 1.0, 1.0]
    assert (e.sampling.temperature, e.sampling.top_p, e.sampling.top_k) == (0.7, 0.9, -1)
    assert e.sampling.extra == {"phase": "logprob", "compared_by_slime": False, "use_rollout_logprobs": True,
                                "top_p_replay": True}
    step0 = trainer_entries(args, "train_step0", ["4-0", None], {**kw, "top_p_token_ids": None}, res)[0]
    assert step0.sampling.top_p == 1.0 and step0.sampling.extra["compared_by_slime"] is True and step0.mask is None
    assert trainer_entries(argparse.Namespace(**{**vars(args), "context_parallel_size": 2}), "logprob",
                           ["4-0", "4-1"], kw, res) == []  # context-parallel shards: not recorded


def test_trainer_recording_failure_never_raises(tmp_path, caplog):
    import argparse
    from tic_trace.integrations.slime.used_logprobs import record_trainer
    args = argparse.Namespace(rollout_temperature=1.0, rollout_top_p=1.0, context_parallel_size=1)
    with caplog.at_level(logging.WARNING, logger="tic_trace.slime"):
        record_trainer(args, tmp_path, "logprob", ["0-0"], {"unconcat_tokens": [], "total_lengths": [],
                                                            "response_lengths": []}, ("x", {"log_probs": None}))
    assert not (tmp_path / fmt.USED_LOGPROBS_DIR).exists()
