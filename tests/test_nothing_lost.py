"""Nothing lost silently (issue 22, item 5): a write failure ends the run as incomplete, said in the trace,
`inspect` and every verdict; taps are per tracer (two tracers on two threads record only their own calls); a
forward hook added after the trace started is in the trace; a torch.compile'd module is named.

The write failures are real ones: a child process runs under RLIMIT_FSIZE with SIGXFSZ ignored, so the kernel
fails the tracer's write with EFBIG once a file would grow past the limit (a fault of the environment, not of the
trace). Faults planted in the model go into its computation (a forward hook), never into a trace.
"""
from __future__ import annotations

import json
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import tic_trace
from tic_trace.testing import child
from tic_trace import find_divergence, open_trace
from tic_trace.testing.hf_models import build_hf_model, sample_tokens, tiny_qwen3_config
from tic_trace.tools.cli import main as cli

REPO = Path(__file__).resolve().parents[1]


def run_cli(argv: list, capsys) -> tuple[int, str]:
    try:
        rc = cli([str(x) for x in argv])
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out + out.err


# ================================================================================================ write failure

# Six forwards: the first small, the others larger. Under the limit the first pass's blob fits and the second's
# does not: one pass survives, as on a disk that fills up during the run.
_CHILD = textwrap.dedent("""
    import json, resource, signal, sys
    import torch
    import tic_trace
    from tic_trace.testing.hf_models import build_hf_model, sample_tokens, tiny_qwen3_config

    out_a, out_b, probe, where = sys.argv[1:5]
    model = build_hf_model(tiny_qwen3_config(moe=False), seed=0)
    inputs = [sample_tokens(1, 4, seed=1)] + [sample_tokens(2, 16, seed=s) for s in range(2, 7)]
    with torch.no_grad():
        plain = [model(x).logits for x in inputs]

    def loop(t):
        outs = []
        with torch.no_grad():
            for j, x in enumerate(inputs):
                t.sample_keys = [f"forward{j}.sample{i}" for i in range(x.shape[0])]   # each row traced once
                outs.append(model(x).logits)
                t.step()
        return outs

    with tic_trace.trace(model, probe, adapter="hf", points_mode="full") as t:
        loop(t)
    sizes = [p.stat().st_size for p in sorted(t.passes_written[0].parent.glob("pass*.bin"))]
    with tic_trace.trace(model, out_a, adapter="hf", points_mode="full") as t:
        loop(t)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)     # an over-limit write fails with EFBIG, not a signal
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    t = tic_trace.trace(model, out_b, adapter="hf", points_mode="full").start()
    # "pass 1": room for pass 0 only. "everything": not even the rank file can be rewritten.
    limit = (sizes[0] + sizes[1]) // 2 if where == "pass 1" else 64
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    outs = loop(t)
    t.stop()
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    print(json.dumps({"failed": repr(t.failed), "sizes": sizes, "limit": limit,
                      "bitwise": all(torch.equal(a, b) for a, b in zip(outs, plain))}))
""")


def _trace_with_failing_writes(tmp_path: Path, where: str) -> tuple[Path, Path, dict]:
    a, b = tmp_path / "a", tmp_path / "b"
    r = child.run([sys.executable, "-c", _CHILD, str(a), str(b), str(tmp_path / "probe"), where],
                  capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    facts = json.loads(r.stdout.strip().splitlines()[-1])
    assert facts["sizes"][0] < facts["limit"] < facts["sizes"][1] or where != "pass 1", facts
    assert "EFBIG" in facts["failed"] or "File too large" in facts["failed"], facts
    assert facts["bitwise"], "a failing write changed the model's outputs"
    return a, b, facts


def test_a_failed_write_makes_the_run_incomplete_everywhere(tmp_path, capsys):
    a, b, _ = _trace_with_failing_writes(tmp_path, "pass 1")
    tb = open_trace(b)
    assert tb.pass_indices(0) == [0], "the limit was meant to let exactly pass 0 through"
    lines = tb.incomplete_runs()
    assert len(lines) == 1 and "a write to the trace failed" in lines[0] and "pass 1 lost" in lines[0], lines
    assert "4 later forwards not recorded" in lines[0] and "1 passes written" in lines[0], lines
    assert open_trace(a).incomplete_runs() == []
    # The trace's own file says it: rank.msgpack of side B.
    assert tb.rank_info(0)["incomplete"]["lost_pass"] == 1

    # The control: the same six forwards traced whole (the probe) are consistent with side A.
    assert find_divergence(str(a), str(tmp_path / "probe")).verdict == "consistent"
    rep = find_divergence(str(a), str(b))
    assert rep.verdict == "not_comparable", rep.verdict
    assert [n.kind for n in rep.notes][:1] == ["incomplete_run"] and "side B" in rep.notes[0].summary
    assert rep.sides["b"]["run_incomplete"] == lines
    assert any(x["key"] == "run" for x in rep.not_comparable)
    # Either order: the incomplete side is never part of a consistent pair.
    assert find_divergence(str(b), str(a)).verdict == "not_comparable"

    rc, out = run_cli(["first-divergence", a, b], capsys)
    assert rc == 3 and "incomplete" in out, out[-2000:]
    rc, out = run_cli(["inspect", b], capsys)
    assert rc == 0 and "RUN INCOMPLETE" in out and "pass 1 lost" in out, out[-2000:]
    # A saved report re-judged keeps the fact: re-judging is not a way to a consistent verdict.
    (tmp_path / "r.json").write_text(json.dumps(rep.to_json()))
    rc, out = run_cli(["report", "x", "--from-json", tmp_path / "r.json"], capsys)
    assert rc == 3 and "incomplete" in out, out[-2000:]


def test_a_rank_file_that_cannot_be_rewritten_is_removed_and_read_as_incomplete(tmp_path, capsys):
    a, b, _ = _trace_with_failing_writes(tmp_path, "everything")
    assert not (b / "rank00000" / "rank.msgpack").exists()
    lines = open_trace(b).incomplete_runs()
    assert len(lines) == 1 and "missing: the run is incomplete" in lines[0], lines
    rc, out = run_cli(["first-divergence", a, b], capsys)
    assert rc == 2 and "incomplete" in out, out[-2000:]        # no answer, naming the file and why
    rc, out = run_cli(["inspect", b], capsys)
    assert "RUN INCOMPLETE" in out, out[-2000:]


# ================================================================================================ taps per tracer

def _records(trace_dir: Path) -> list[dict]:
    """Each pass as {record name: (dtype, shape, hash)}, plus its notes."""
    out = []
    for p in open_trace(trace_dir).passes(0):
        d = {r.name: (r.dtype, tuple(r.shape), r.hash) for r in p.records}
        d["<notes>"] = tuple(p.meta.get("notes") or [])
        out.append(d)
    return out


def _forwards(model, inputs, t, before=None, after=None) -> list[torch.Tensor]:
    if before is not None:
        before.wait()
    outs = []
    with torch.no_grad():
        for j, x in enumerate(inputs):
            t.sample_keys = [f"forward{j}.sample{i}" for i in range(x.shape[0])]    # each row traced once
            outs.append(model(x).logits)
            t.step()
    if after is not None:
        after.wait()
    return outs


def test_two_tracers_on_two_threads_record_only_their_own_rope_calls(tmp_path):
    """HF's RoPE (`apply_rotary_pos_emb`) is a module-level function, tapped by both tracers at once: each must
    record its own thread's calls only, exactly what it records alone."""
    cfg = tiny_qwen3_config(moe=False)
    models = [build_hf_model(cfg, seed=0), build_hf_model(cfg, seed=1)]
    inputs = [[sample_tokens(2, 8, seed=s + 10 * k) for s in range(4)] for k in range(2)]
    alone = []
    for k, m in enumerate(models):
        with tic_trace.trace(m, tmp_path / f"alone{k}", adapter="hf", points_mode="full") as t:
            alone.append(_forwards(m, inputs[k], t))
    # Both tracers are live during both threads' forwards (the barriers): every RoPE call passes both patches.
    started, finished = threading.Barrier(2, timeout=120), threading.Barrier(2, timeout=120)
    results: dict[int, object] = {}

    def run(k: int) -> None:
        try:
            t = tic_trace.trace(models[k], tmp_path / f"together{k}", adapter="hf", points_mode="full").start()
            outs = _forwards(models[k], inputs[k], t, started, finished)
            t.stop()
            results[k] = (outs, t.failed)
        except BaseException as e:  # noqa: BLE001 - reported below
            results[k] = e
    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(300)
    import transformers.models.qwen3.modeling_qwen3 as q3
    assert not hasattr(q3.apply_rotary_pos_emb, "__wrapped__"), "a tap was left installed after both stopped"
    for k in range(2):
        assert not isinstance(results[k], BaseException), results[k]
        outs, failed = results[k]
        assert failed is None, failed
        for got, want in zip(outs, alone[k]):
            assert torch.equal(got, want)
        together, solo = _records(tmp_path / f"together{k}"), _records(tmp_path / f"alone{k}")
        assert len(together) == len(solo) == 4
        for i, (a, b) in enumerate(zip(together, solo)):
            assert any("fn:apply_rotary_pos_emb" in n for n in a), "no RoPE tap recorded"
            assert a.keys() == b.keys(), (k, i, sorted(set(a) ^ set(b))[:6])
            assert a == b, (k, i, [n for n in a if a[n] != b[n]][:6])
        rep = find_divergence(str(tmp_path / f"alone{k}"), str(tmp_path / f"together{k}"))
        assert rep.verdict == "consistent", (rep.verdict, rep.first)


# ================================================================================================ late hooks

def test_a_forward_hook_added_after_the_trace_started_is_in_the_trace(tmp_path):
    """A user's hook that changes `mlp`'s output, registered once `trace()` runs (after the tracer's own hook):
    the recorded `mlp.out` is the output the model goes on with, so the fault is found where it is."""
    cfg = tiny_qwen3_config(moe=False)
    ids = sample_tokens(2, 8)
    clean = build_hf_model(cfg, seed=0)
    with tic_trace.trace(clean, tmp_path / "a", adapter="hf", points_mode="full"), torch.no_grad():
        clean(ids)
    model = build_hf_model(cfg, seed=0)
    mlp = model.model.layers[1].mlp
    with torch.no_grad():
        want = model(ids).logits
        handle = mlp.register_forward_hook(lambda m, a, out: out * 1.01)
        want_faulty = model(ids).logits
        handle.remove()
        with tic_trace.trace(model, tmp_path / "b", adapter="hf", points_mode="full"):
            handle = mlp.register_forward_hook(lambda m, a, out: out * 1.01)     # the planted fault
            got = model(ids).logits
        handle.remove()
    assert torch.equal(got, want_faulty) and not torch.equal(got, want)
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"))
    assert rep.verdict == "divergent"
    assert rep.first["key"] == "L1.mlp.out", rep.first["key"]


# ================================================================================================ torch.compile

def test_a_torch_compiled_module_is_named_and_the_trace_is_of_the_eager_computation(tmp_path, capsys):
    """Under the tracer a torch.compile'd module runs eagerly: the pass and the report say so, and what the
    trace holds is the eager computation (equal to the uncompiled model's, bit for bit, on this machine)."""
    cfg = tiny_qwen3_config(moe=False, num_hidden_layers=1)
    ids = sample_tokens(1, 4)
    eager = build_hf_model(cfg, seed=0)
    with tic_trace.trace(eager, tmp_path / "a", adapter="hf", points_mode="full"), torch.no_grad():
        want = eager(ids).logits
    model = build_hf_model(cfg, seed=0)
    model.model.layers[0].mlp.compile()           # inductor, in place: Module.compile
    with torch.no_grad():
        model(ids)                                # compiled (and run compiled) untraced
        with tic_trace.trace(model, tmp_path / "b", adapter="hf", points_mode="full"):
            got = model(ids).logits
    assert torch.equal(got, want), "the traced forward was not the eager computation the note says it is"
    notes = next(open_trace(tmp_path / "b").passes()).meta["notes"]
    said = [n for n in notes if "torch.compile'd module(s) model.layers.0.mlp" in n]
    assert said and "ran eagerly" in said[0], notes
    assert not any("torch.compile" in n for n in next(open_trace(tmp_path / "a").passes()).meta["notes"])
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"))
    assert said[0] in rep.sides["b"]["tracer_notes"]
    rc, out = run_cli(["first-divergence", tmp_path / "a", tmp_path / "b"], capsys)
    assert rc == 0 and "torch.compile'd module(s) model.layers.0.mlp" in " ".join(out.split()), out[-2000:]


def test_a_later_tracer_of_the_same_run_keeps_an_earlier_ones_failure(tmp_path):
    """Tracers that write one run together (one per micro-batch, `run=`): the second one's rank file must not
    erase what the first one's failure left there."""
    from tic_trace.store.writer import TraceWriter
    w = TraceWriter(tmp_path / "t", 0, {"framework": "torch"}, {"world_size": 1}, "job")
    w.begin_pass({}).close()
    assert w.mark_incomplete({"reason": "a write to the trace failed: OSError: [Errno 28] No space left on device",
                              "lost_pass": 1, "passes_written": 1, "forwards_not_recorded": 0})
    TraceWriter(tmp_path / "t", 0, {"framework": "torch"}, {"world_size": 1}, "job")
    lines = open_trace(tmp_path / "t").incomplete_runs()
    assert len(lines) == 1 and "No space left on device" in lines[0], lines


# ================================================================================================ structure

def test_another_number_of_experts_is_named_as_a_structural_difference(tmp_path, capsys):
    """Qwen3-MoE with 4 routed experts against the same model with 8: not an operator divergence at the
    embedding (before: `embed [operator]`), but the structure, named, and not comparable."""
    ids = sample_tokens(2, 8)
    four = build_hf_model(tiny_qwen3_config(moe=True, num_experts=4), seed=0)
    eight = build_hf_model(tiny_qwen3_config(moe=True, num_experts=8), seed=0)
    with torch.no_grad():       # every weight the two share is the same: only the experts differ
        mine = four.state_dict()
        for k, p in eight.state_dict().items():
            if k in mine and mine[k].shape == p.shape:
                p.copy_(mine[k])
    for name, m in (("a", four), ("b", eight)):
        with tic_trace.trace(m, tmp_path / name, adapter="hf", points_mode="full"), torch.no_grad():
            m(ids)
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"))
    assert rep.verdict == "not_comparable", (rep.verdict, rep.first)
    assert rep.structure == {"experts": {"a": 4, "b": 8}}
    notes = [n for n in rep.notes if n.kind == "structure"]
    assert notes and "side A has 4 routed experts per MoE layer, side B 8" in notes[0].summary
    rc, out = run_cli(["first-divergence", tmp_path / "a", tmp_path / "b"], capsys)
    assert rc == 3 and "routed experts" in out, out[-2000:]
