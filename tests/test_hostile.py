"""Hostile traces and careless use (issue 10): one small test per way a trace or a hurried user can hurt.

A trace comes from someone else's cluster: the reader imports nothing it names, reads only bounded regular
files inside it, checks every field's type, and prints its strings as text. A pass is an answer only if its
forward returned, and a directory holds one run. The CLI names a bad argument in one line and exits 2.
The fuzzers over the same properties are in test_reliability.py.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tracemalloc
from pathlib import Path

import msgpack
import pytest
import torch

import tic_trace
from tic_trace import TraceDirectoryInUse, TraceFormatError, open_trace
from tic_trace.store import format as fmt
from tic_trace.graph.adapter import get_adapter, load_adapter, register_adapter
from tic_trace.view.align import CanonicalView
from tic_trace.graph.canonical import feeds_of
from tic_trace import find_divergence
from tic_trace.compare.diverge import Tolerance, rejudge
from tic_trace.report.html import render_html
from tic_trace.report.files import write_json
from tic_trace.testing.hf_models import build_hf_model, sample_tokens, tiny_qwen3_config
from tic_trace.report.text import visible
from tic_trace.tools.cli import main as cli
from tic_trace.testing.deadline import deadline

from conftest import trace_hf

IDS = sample_tokens(2, 6)
# Markup, a live link, a tag that would vanish, clear-screen, set-window-title and a bidi override (no "." in
# it: it is also a module name).
HOSTILE = "[/][link=http://e]x[/link][abc]\x1b[2J\x1b]0;t\x07\u202e"


# ================================================================================================ helpers

@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    """A real trace: one forward of a tiny HF Qwen3, canonical points in full."""
    d = tmp_path_factory.mktemp("dense") / "t"
    trace_hf(build_hf_model(tiny_qwen3_config(moe=False, num_hidden_layers=1)), d, IDS)
    return d


@pytest.fixture
def copy(dense, tmp_path) -> Path:
    return Path(shutil.copytree(dense, tmp_path / "t", symlinks=True))


def edit(path: Path, kind: int, fn) -> None:
    """Decode a framed file, let `fn` change it, write it back with valid framing and CRC."""
    obj = msgpack.unpackb(path.read_bytes()[fmt._HEADER.size:], raw=False)
    fn(obj)
    fmt.write_framed(path, kind, obj)


def read_all(root: Path) -> None:
    tr = open_trace(root)
    for r in tr.ranks:
        tr.rank_info(r)
        for p in tr.passes(r):
            for rec in p.records:
                if rec.has_data:
                    rec.values()
    v = CanonicalView(tr)
    for point, layer in v.points():
        v.load(point, layer)


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = cli(argv)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out + out.err




def small_peak(fn, budget: int = 16 << 20):
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        out = fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak - base < budget, f"allocated {(peak - base) / 2**20:.1f} MiB"
    return out


# ================================================================================================ 1. trusts nothing

def _plant_module(tmp_path: Path, monkeypatch, name: str) -> Path:
    marker = tmp_path / f"{name}.imported"
    (tmp_path / f"{name}.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from tic_trace.graph.adapter import Adapter\nclass Evil(Adapter):\n    name = 'evil'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return marker


@pytest.mark.parametrize("framework", ["planted_mod:Evil", "planted_mod"])
def test_manifest_framework_never_imports(copy, tmp_path, monkeypatch, framework):
    marker = _plant_module(tmp_path, monkeypatch, "planted_mod")
    edit(copy / "manifest.msgpack", fmt.KIND_MANIFEST, lambda m: m.update(framework=framework))
    with pytest.raises(TraceFormatError, match="framework") as ei:
        CanonicalView(str(copy))
    assert ei.value.path == str(copy / "manifest.msgpack")
    assert not marker.exists() and "planted_mod" not in sys.modules


def test_module_class_only_when_the_user_names_it(copy, tmp_path, monkeypatch):
    marker = _plant_module(tmp_path, monkeypatch, "user_adapter")
    assert load_adapter("user_adapter:Evil").name == "evil" and marker.exists()   # the Python API: explicit
    with pytest.raises(ValueError, match="no adapter is registered"):
        get_adapter("user_adapter:Evil")                                          # a name: registry only


def test_registered_adapter_is_found_by_the_manifest_name(copy):
    hf = type(get_adapter("hf"))

    class Renamed(hf):
        name = "renamed-hf"
    register_adapter(Renamed)
    edit(copy / "manifest.msgpack", fmt.KIND_MANIFEST, lambda m: m.update(framework="renamed-hf"))
    v = CanonicalView(str(copy))
    assert isinstance(v.adapter, Renamed) and v.points()


@pytest.mark.parametrize("target", ["/dev/zero", "fifo"])
@pytest.mark.parametrize("file", ["manifest.msgpack", "rank00000/rank.msgpack", "rank00000/pass00000.idx",
                                  "rank00000/pass00000.bin"])
def test_devices_and_fifos_are_refused_at_once(copy, tmp_path, target, file):
    p = copy / file
    p.unlink()
    if target == "fifo":
        os.mkfifo(p)
    else:
        os.symlink(target, p)
    with deadline(10), pytest.raises(TraceFormatError) as ei:
        small_peak(lambda: read_all(copy))
    assert ei.value.path == str(p)
    assert ("not a regular file" in ei.value.problem) or ("out of the trace directory" in ei.value.problem)


def test_size_claims_are_checked_before_allocation(copy):
    """A pass index whose own size is over its limit is refused from fstat, before a byte is read."""
    idx = copy / "rank00000/pass00000.idx"
    with open(idx, "r+b") as f:
        f.truncate(fmt._MAX_FILE_BYTES[fmt.KIND_INDEX] + 1)       # sparse: no disk used
    with pytest.raises(TraceFormatError, match="limit"):
        small_peak(lambda: read_all(copy), budget=1 << 20)


def _outside(tmp_path: Path, copy: Path, rel: str) -> Path:
    """Move `rel` out of the trace and leave a symlink to it: byte-for-byte the same, but outside."""
    out = tmp_path / "elsewhere" / rel.replace("/", "_")
    out.parent.mkdir(exist_ok=True)
    shutil.move(copy / rel, out)
    os.symlink(out, copy / rel)
    return out


@pytest.mark.parametrize("rel", ["rank00000", "rank00000/pass00000.bin", "rank00000/pass00000.idx", "manifest.msgpack"])
def test_no_symlink_leads_out_of_the_trace(copy, tmp_path, rel):
    _outside(tmp_path, copy, rel)
    with pytest.raises(TraceFormatError, match="out of the trace directory") as ei:
        read_all(copy)
    assert ei.value.path == str(copy / rel)


def test_symlink_inside_the_trace_is_fine(copy):
    blob = copy / "rank00000/pass00000.bin"
    os.rename(blob, copy / "rank00000/moved.bin")
    os.symlink("moved.bin", blob)
    read_all(copy)
    assert "rank00000/moved.bin" in open_trace(copy).ignored


@pytest.mark.parametrize("stray", ["rank²", "rank٣", "rank000000", "rank0", "rankabc"])
def test_odd_rank_names_are_ignored_and_named(copy, stray, capsys):
    shutil.copytree(copy / "rank00000", copy / stray)
    tr = open_trace(copy)
    assert tr.ranks == [0] and stray in tr.ignored
    read_all(copy)
    rc, out = run_cli(["inspect", str(copy)], capsys)
    assert rc == 0 and "ignored" in out and stray in out


@pytest.mark.parametrize("stray", ["pass00000.bak.idx", "pass0.idx", "pass000000.idx", "pass00000.idx~"])
def test_stray_pass_files_never_count_twice(copy, stray):
    shutil.copy(copy / "rank00000/pass00000.idx", copy / "rank00000" / stray)
    tr = open_trace(copy)
    assert tr.pass_indices(0) == [0] and f"rank00000/{stray}" in tr.ignored
    v = CanonicalView(tr)
    assert all(len(es) == 1 for es in v.entries.values())     # one entry per point: pass 0 counted once


WRONG_TYPES = {
    "manifest.msgpack": [("model", 5), ("model.num_attention_heads", "4"), ("versions", ["torch", "2"]),
                         ("framework", 7), ("model.moe_layers", "0,1"), ("tracer", "x"), ("created", "yesterday")],
    "rank00000/rank.msgpack": [("coords", "tp=0"), ("world_size", -1), ("run", 3)],
    "rank00000/pass00000.idx": [("notes", 3), ("tag", 5), ("rows.keys", "a"), ("rows.positions", [0.5]),
                                ("blind_regions", {"a": 1}), ("blob_nbytes", "12"), ("complete", "yes")],
}


@pytest.mark.parametrize("file,field,value", [(f, k, v) for f, kv in WRONG_TYPES.items() for k, v in kv])
def test_wrong_types_name_file_and_field(copy, file, field, value, capsys):
    kind = {"manifest.msgpack": fmt.KIND_MANIFEST, "rank00000/rank.msgpack": fmt.KIND_RANK}.get(file, fmt.KIND_INDEX)

    def put(d):
        *head, last = field.split(".")
        for k in head:
            d = d.setdefault(k, {})
        d[last] = value
    edit(copy / file, kind, put)
    with pytest.raises(TraceFormatError) as ei:
        read_all(copy)
    assert ei.value.path == str(copy / file) and f"field '{field}" in ei.value.problem, ei.value
    rc, out = run_cli(["diff", str(copy), str(copy)], capsys)
    assert rc == 2 and "Traceback" not in out and field in out


def test_huge_stats_only_shape_claim_builds_nothing_huge(copy):
    """A stats-only record claiming [2**40, 1] rows: indexed and compared by statistics, no 2**40 tuples."""
    def claim(idx):
        rec = next(r for r in idx["records"] if r["name"].endswith("model.norm:out"))
        rec.update(shape=[2**40, 1], offset=-1, nbytes=0, crc=None, mode="stats", row_index=None)
    edit(copy / "rank00000/pass00000.idx", fmt.KIND_INDEX, claim)
    v = CanonicalView(str(copy))
    ct = small_peak(lambda: v.load("final_norm", None))
    assert ct.values is None and ct.stats


def test_data_record_claiming_rows_it_does_not_hold(copy):
    def claim(idx):
        idx["rows"] = None
        rec = next(r for r in idx["records"] if r["name"].endswith("model.norm:out"))
        rec.update(shape=[2**40, 0], offset=0, nbytes=0, crc=None, mode="full")
    edit(copy / "rank00000/pass00000.idx", fmt.KIND_INDEX, claim)
    v = CanonicalView(str(copy))
    with pytest.raises(TraceFormatError, match="claims"):
        small_peak(lambda: v.load("final_norm", None))


def test_feeds_of_is_iterative_for_thousands_of_layers():
    present = {("embed", None)}
    assert feeds_of("final_norm", None, present, 2000) == [("embed", None)]
    assert feeds_of("output", 1999, present, 2000) == [("embed", None)]


def _walked_feeds(point, layer, present, n_layers):
    """feeds_of's answer by walking every layer (the definition the span jump must agree with)."""
    from tic_trace.graph.canonical import _raw_feeds
    out, seen, stack = [], set(), [iter(_raw_feeds(point, layer, n_layers, present))]
    while stack:
        f = next(stack[-1], None)
        if f is None:
            stack.pop()
        elif f not in seen:
            seen.add(f)
            if f in present:
                out.append(f)
            else:
                stack.append(iter(_raw_feeds(*f, n_layers, present)))
    return out


def test_feeds_of_jumps_layers_that_hold_nothing_with_the_walks_answer():
    """Layers holding no present point are passed in one step, with the same feeds a walk through each finds;
    a claimed layer count of 2**31 - 1 costs what the present layers cost (checked by counting the points the
    walk visits, not by time)."""
    import random
    from tic_trace.graph import canonical
    rng = random.Random(7)
    names = [ps.name for ps in canonical.SCHEMA if ps.layered]
    for _ in range(200):
        n = rng.randint(1, 12)
        present = {(nm, lay) for lay in range(n) for nm in names if rng.random() < rng.choice((0.0, 0.1, 0.6))}
        present |= {("embed", None)} if rng.random() < 0.8 else set()
        for point, layer in [("final_norm", None), ("logits", None)] + [(rng.choice(names), rng.randrange(n))]:
            assert feeds_of(point, layer, present, n) == _walked_feeds(point, layer, present, n)
    visited = []
    real = canonical._raw_feeds

    def counted(*a):
        visited.append(a)
        assert len(visited) < 50, "feeds_of walks the layers that hold nothing one by one"
        return real(*a)
    canonical._raw_feeds = counted
    try:
        present = {("embed", None), ("mid", 0), ("output", 1)}
        assert feeds_of("final_norm", None, present, 2**31 - 1) == [("output", 1)]
        assert feeds_of("attn_norm", 5, present, 2**31 - 1) == [("output", 1)]
    finally:
        canonical._raw_feeds = real


def test_manifest_with_2000_layers_compares(copy):
    edit(copy / "manifest.msgpack", fmt.KIND_MANIFEST, lambda m: m["model"].update(num_layers=2000))
    rep = find_divergence(str(copy), str(copy))
    assert rep.verdict == "consistent"


def test_shape_mismatch_names_the_point(tmp_path):
    """Sides whose models differ in width: every point not comparable, by name and shape; never consistent."""
    trace_hf(build_hf_model(tiny_qwen3_config(moe=False, num_hidden_layers=1)), tmp_path / "a", IDS)
    trace_hf(build_hf_model(tiny_qwen3_config(moe=False, num_hidden_layers=1, hidden_size=32)), tmp_path / "b", IDS)
    rep = find_divergence(str(tmp_path / "a"), str(tmp_path / "b"))
    assert rep.verdict != "consistent"
    embed = next(p for p in rep.points if p.key == "embed")
    assert embed.status == "not_comparable" and "[64]" in embed.reason and "[32]" in embed.reason


# ================================================================================================ 2. text, not markup

def _hostile_report(dense) -> dict:
    rep = find_divergence(str(dense), str(dense)).to_json()
    rep["points"][0]["key"] = HOSTILE
    rep["points"][0]["reason"] = HOSTILE
    rep["not_comparable"] = [{"key": HOSTILE, "reason": HOSTILE}]
    rep["worst_tokens"] = [{"sample": HOSTILE, "position": 1, "abs_dlogprob": 0.5, "logprob_a": -1.0,
                            "logprob_b": -1.5, "divergence_starts": HOSTILE, "routing_flip": False}]
    rep["sides"]["b"]["skipped_passes"] = [HOSTILE]
    return rep


def _shown_as_text(out: str) -> None:
    assert "\x1b" not in out and "\u202e" not in out and "\x07" not in out       # escapes made visible
    assert "\\x1b[2J" in out and "\\u202e" in out
    assert "[/]" in out and "[abc]" in out and "[link=http:" in out  # markup shown literally
    assert "Traceback" not in out


def test_report_strings_are_text_in_the_terminal(dense, tmp_path, capsys):
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps(_hostile_report(dense)))
    rc, out = run_cli(["report", "x", "--from-json", str(path), "--all"], capsys)
    assert rc == 0
    _shown_as_text(out)


def test_trace_strings_are_text_in_inspect(tmp_path, capsys):
    model = build_hf_model(tiny_qwen3_config(moe=False, num_hidden_layers=1))
    model.model.add_module(HOSTILE, torch.nn.Identity())
    with tic_trace.trace(model, tmp_path / "t", adapter="hf", tag=HOSTILE, sample_keys=[HOSTILE, "b"]) as t, \
            torch.no_grad():
        model(IDS)
        getattr(model.model, HOSTILE)(torch.ones(2))
    assert t.failed is None
    rc, out = run_cli(["inspect", str(tmp_path / "t"), "--records"], capsys)
    assert rc == 0 and "Traceback" not in out
    assert "\x1b" not in out and "\u202e" not in out and "\x07" not in out
    # Table cells are cut to their column ("…"): the start of the string shows, literally.
    assert "[/][link=http://e]x[/link][abc]\\x1b" in out


def test_error_messages_are_text(tmp_path, capsys):
    rc, out = run_cli(["inspect", str(tmp_path / HOSTILE)], capsys)
    assert rc == 2 and len(out.strip().splitlines()) == 1
    _shown_as_text(out)


def test_html_and_json_files_hold_no_raw_control_characters(dense, tmp_path):
    rep = _hostile_report(dense)
    html = render_html(rep)
    assert "\x1b" not in html and "\u202e" not in html and "\\x1b[2J" in html
    assert "[link=http://e]" in html and "<link" not in html
    write_json(rep, tmp_path / "r.json")
    assert b"\x1b" not in (tmp_path / "r.json").read_bytes()


def test_visible_escapes_every_control_class():
    assert visible("a\x00b\x7fc\x85d\u200be\u2028f\ttab") == "a\\x00b\\x7fc\\x85d\\u200be\\u2028f\\x09tab"
    assert visible("plain ascii [x]") == "plain ascii [x]" and visible("ü日本") == "ü日本"


# ================================================================================================ 3. no partial or stale answers

class _Boom(torch.nn.Module):
    """A planted failure in the computation: the MLP of layer 0 raises on a chosen call."""

    def __init__(self, mlp, fail_on: set[int]):
        super().__init__()
        self.mlp, self.fail_on, self.calls = mlp, fail_on, 0

    def forward(self, x):
        self.calls += 1
        if self.calls in self.fail_on:
            raise RuntimeError("planted: out of memory")
        return self.mlp(x)


def _failing_model(fail_on: set[int]):
    model = build_hf_model(tiny_qwen3_config(moe=False, num_hidden_layers=1))
    model.model.layers[0].mlp = _Boom(model.model.layers[0].mlp, fail_on)
    return model


def test_pass_whose_forward_raised_is_skipped_and_reported(dense, tmp_path, capsys):
    out = tmp_path / "t"
    model = _failing_model({1})
    with pytest.raises(RuntimeError, match="planted"):
        with tic_trace.trace(model, out, adapter="hf", points_mode="full"), torch.no_grad():
            model(IDS)
    tr = open_trace(out)
    assert tr.pass_indices(0) == [] and tr.incomplete_pass_indices(0) == [0]
    assert "raised RuntimeError" in tr.skipped()[0]
    rep = find_divergence(str(dense), str(out))
    assert rep.verdict == "not_comparable"                  # never CONSISTENT against a full trace
    assert rep.sides["b"]["skipped_passes"]
    rc, text = run_cli(["diff", str(dense), str(out)], capsys)
    assert "incomplete pass skipped" in text and "CONSISTENT" not in text


def test_complete_passes_stay_readable_next_to_an_incomplete_one(tmp_path):
    out = tmp_path / "t"
    model = _failing_model({2})
    t = tic_trace.trace(model, out, adapter="hf", points_mode="full", auto_step=True).start()
    with torch.no_grad():
        model(IDS)
        with pytest.raises(RuntimeError):
            model(IDS)
        model(IDS)
    t.stop()
    tr = open_trace(out)
    assert tr.pass_indices(0) == [0, 2] and tr.incomplete_pass_indices(0) == [1]
    assert (out / "rank00000/pass00001.incomplete.idx").exists()
    read_all(out)


def test_pass_ended_inside_a_forward_is_incomplete(tmp_path):
    model = build_hf_model(tiny_qwen3_config(moe=False, num_hidden_layers=1))
    t = tic_trace.trace(model, tmp_path / "t", adapter="hf").start()
    h = model.model.layers[0].register_forward_hook(lambda *a: t.step())
    with torch.no_grad():
        model(IDS)
    h.remove()
    t.stop()
    tr = open_trace(tmp_path / "t")
    assert tr.incomplete_pass_indices(0) == [0] and "still running" in tr.skipped()[0]


def test_second_trace_into_a_directory_is_refused(dense, tmp_path):
    out = Path(shutil.copytree(dense, tmp_path / "t"))
    before = sorted((p.name, p.stat().st_size) for p in out.rglob("*"))
    model = build_hf_model(tiny_qwen3_config(moe=False, num_hidden_layers=1))
    with pytest.raises(TraceDirectoryInUse, match="another run"):
        with tic_trace.trace(model, out, adapter="hf"), torch.no_grad():
            model(IDS)
    assert sorted((p.name, p.stat().st_size) for p in out.rglob("*")) == before
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    with torch.no_grad():
        model(IDS)          # the model is untouched


def test_one_run_may_span_several_tracers(tmp_path):
    model = build_hf_model(tiny_qwen3_config(moe=False, num_hidden_layers=1))
    for _ in range(2):
        with tic_trace.trace(model, tmp_path / "t", adapter="hf", run="job-7"), torch.no_grad():
            model(IDS)
    assert open_trace(tmp_path / "t").pass_indices(0) == [0, 1]


def test_non_trace_directory_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    model = build_hf_model(tiny_qwen3_config(moe=False, num_hidden_layers=1))
    with pytest.raises(TraceDirectoryInUse, match="holds no trace"):
        tic_trace.trace(model, tmp_path, adapter="hf").start()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_rejudge_never_says_consistent_without_a_comparable_point(dense):
    rep = find_divergence(str(dense), str(dense)).to_json()
    for p in rep["points"]:
        p.update(status="not_comparable", error=None)
    assert rejudge(rep, Tolerance())["verdict"] == "not_comparable"


# ================================================================================================ 5. the CLI

def _cli_cases(dense: Path, tmp: Path) -> dict[str, tuple[list[str], str]]:
    (tmp / "dir").mkdir()
    (tmp / "file").write_text("x")
    (tmp / "bad.json").write_text("{not json")
    (tmp / "list.json").write_text("[1, 2]")
    (tmp / "types.json").write_text(json.dumps({"verdict": "consistent", "points": [{"key": 1}]}))
    d = str(dense)
    return {
        "--html to a directory": (["diff", d, d, "--html", str(tmp / "dir")], "--html"),
        "--json to a directory": (["diff", d, d, "--json", str(tmp / "dir")], "--json"),
        # a character device is a stream to write (/dev/stdout must work): /dev/full fails at the write, in one line
        "--json to /dev/full": (["diff", d, d, "--json", "/dev/full"], "cannot write the JSON report to /dev/full"),
        "--json in a missing directory": (["diff", d, d, "--json", str(tmp / "nope/r.json")], "does not exist"),
        "--from-json not JSON": (["report", "x", "--from-json", str(tmp / "bad.json")], "not a JSON file"),
        "--from-json a list": (["report", "x", "--from-json", str(tmp / "list.json")], "not a tic-trace JSON report"),
        "--from-json wrong types": (["report", "x", "--from-json", str(tmp / "types.json")], "points[0]"),
        "--from-json a directory": (["report", "x", "--from-json", str(tmp / "dir")], "regular file"),
        "--filter bad regex": (["inspect", d, "--filter", "re:(unclosed"], "regular expression"),
        "demo --layer 99": (["demo", "--layer", "99", "--out", str(tmp / "demo")], "--layer 99"),
        "demo --fault typo": (["demo", "--fault", "router_bf61", "--out", str(tmp / "demo")], "router_bf61"),
        "demo --out FILE": (["demo", "--out", str(tmp / "file")], "not a directory"),
        "--tol =1": (["diff", d, d, "--tol", "=1"], "NAME=VALUE"),
        "--tol misspelled point": (["diff", d, d, "--tol", "attn.cor=1e-3"], "attn.core"),
        "--tol not a number": (["diff", d, d, "--tol", "bfloat16=abc"], "number"),
        "--tol negative": (["diff", d, d, "--tol", "bfloat16=-1"], "0 or more"),
        "--growth 0": (["diff", d, d, "--growth", "0"], "--growth"),
        "--limit -5": (["inspect", d, "--limit", "-5"], "--limit"),
        "--rank 99": (["inspect", d, "--rank", "99"], "--rank 99"),
        "--pass 99": (["inspect", d, "--pass", "99"], "--pass 99"),
        "--adapter-a unknown": (["diff", d, d, "--adapter-a", "nosuch"], "nosuch"),
    }


CLI_CASES = ["--html to a directory", "--json to a directory", "--json to /dev/full", "--json in a missing directory",
             "--from-json not JSON", "--from-json a list", "--from-json wrong types", "--from-json a directory",
             "--filter bad regex", "demo --layer 99", "demo --fault typo", "demo --out FILE", "--tol =1",
             "--tol misspelled point", "--tol not a number", "--tol negative", "--growth 0", "--limit -5",
             "--rank 99", "--pass 99", "--adapter-a unknown"]


@pytest.mark.parametrize("case", CLI_CASES)
def test_cli_names_a_bad_argument_in_one_line(dense, tmp_path, capsys, case):
    argv, says = _cli_cases(dense, tmp_path)[case]
    rc, out = run_cli(argv, capsys)
    assert rc == 2, out
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1 and "error" in lines[0] and says in lines[0], out
    assert not list(tmp_path.rglob("*.tmp")) and not (tmp_path / "demo").exists()


def test_json_to_a_directory_leaves_nothing_behind(dense, tmp_path):
    """Even past argument checks (the path became a directory meanwhile), a failed write leaves no temp file."""
    rep = find_divergence(str(dense), str(dense)).to_json()
    (tmp_path / "r.json").mkdir()
    with pytest.raises(OSError):
        write_json(rep, tmp_path / "r.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_demo_out_never_deletes_what_it_did_not_create(tmp_path, capsys):
    from tic_trace.tools.demo import MARKER, prepare_out
    out = tmp_path / "D"
    (out / "A").mkdir(parents=True)
    (out / "A" / "thesis.tex").write_text("mine")
    (out / "B").mkdir()
    rc, text = run_cli(["demo", "--out", str(out)], capsys)
    assert rc == 2 and "not empty" in text
    assert (out / "A" / "thesis.tex").read_text() == "mine" and (out / "B").is_dir()
    # An earlier demo's own output (marked) is reused: its A/ and B/ go, other files stay.
    demo = tmp_path / "demo"
    demo.mkdir()
    (demo / MARKER).write_text("")
    (demo / "A").mkdir()
    (demo / "keep.txt").write_text("x")
    prepare_out(demo)
    assert not (demo / "A").exists() and (demo / "keep.txt").exists()


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_created_files_honour_the_umask(dense, tmp_path, umask):
    old = os.umask(umask)
    try:
        model = build_hf_model(tiny_qwen3_config(moe=False, num_hidden_layers=1))
        trace_hf(model, tmp_path / "t", IDS)
        write_json(find_divergence(str(dense), str(dense)).to_json(), tmp_path / "r.json")
    finally:
        os.umask(old)
    files = [p for p in (tmp_path / "t").rglob("*") if p.is_file()] + [tmp_path / "r.json"]
    assert len(files) >= 5
    for p in files:
        assert p.stat().st_mode & 0o777 == 0o666 & ~umask, p
