"""Reliability: hostile or damaged traces, crashes, full and unwritable disks, concurrent ranks, and the
promise that tracing never changes what the model computes.

The reader fuzzers start from a real trace and damage its files: bytes, msgpack payloads, decoded structure,
the directory itself (symlinks out of it or to devices, FIFOs, stray rank/pass names), fields of the wrong
type and huge size claims. The only exception a reader may raise is `TraceFormatError`, and its message must
name the damaged trace's file (and, for a wrong type, the field). The example count is bounded for CI;
the documented full run is

    TIC_TRACE_FUZZ_EXAMPLES=10000 pytest tests/test_reliability.py -k fuzz
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
import tracemalloc
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import msgpack
import numpy as np
import pytest
import torch

import hypothesis as hypothesis  # noqa: E402 - required
import transformers  # noqa: E402,F401 - a required test dependency: fail loudly if missing
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import tic_trace  # noqa: E402
from tic_trace import TraceFormatError, open_trace  # noqa: E402
from tic_trace.store import format as fmt  # noqa: E402
from tic_trace.record.stats import device_hash, device_stats, numpy_hash, numpy_stats, stats_dict  # noqa: E402
from tic_trace.testing.hf_models import build_hf_model, sample_tokens, tiny_qwen3_config  # noqa: E402
from tic_trace.testing.deadline import deadline

FUZZ_EXAMPLES = int(os.environ.get("TIC_TRACE_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=False, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
# Fuzzers that run a full comparison under tracemalloc per example: a fifth of the examples.
FUZZ_HEAVY = settings(FUZZ, max_examples=max(FUZZ_EXAMPLES // 5, 10))
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
REPO = Path(__file__).resolve().parents[1]


# ================================================================================================ helpers

@contextlib.contextmanager
def tic_warnings():
    """Collect the records logged on the "tic_trace" logger at WARNING or above (independent of caplog)."""
    got: list[logging.LogRecord] = []

    class H(logging.Handler):
        def emit(self, record):
            got.append(record)

    h = H(level=logging.WARNING)
    lg = logging.getLogger("tic_trace")
    lg.addHandler(h)
    try:
        yield got
    finally:
        lg.removeHandler(h)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The exact bit pattern of a tensor (NaN-safe, -0.0-safe) for bitwise comparison."""
    t = t.detach()
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bitwise_equal(a: Any, b: Any) -> None:
    fa, _ = torch.utils._pytree.tree_flatten(a)
    fb, _ = torch.utils._pytree.tree_flatten(b)
    ta = [x for x in fa if isinstance(x, torch.Tensor)]
    tb = [x for x in fb if isinstance(x, torch.Tensor)]
    assert len(ta) == len(tb) and ta, "outputs differ in structure"
    for x, y in zip(ta, tb):
        assert x.dtype == y.dtype and x.device == y.device and x.shape == y.shape
        assert torch.equal(bits(x), bits(y)), "traced output differs bitwise from the untraced one"


def read_everything(root: Path) -> int:
    """Read a trace the way a consumer does: manifest, every rank, every pass, every record's values.
    Returns the number of value arrays read."""
    tr = open_trace(root)
    n = 0
    for r in tr.ranks:
        tr.rank_info(r)
        for p in tr.passes(r):
            _ = p.index, p.tag, p.rows
            for rec in p.records:
                if not rec.has_data:
                    continue
                if rec.dtype.startswith("complex"):   # values() declines complex by design; raw bits are fine
                    rec.raw()
                else:
                    v = rec.values()
                    assert v.shape == rec.stored_shape
                n += 1
    return n


def frame(kind: int, payload: bytes) -> bytes:
    return fmt._HEADER.pack(fmt.MAGIC, fmt.SCHEMA_VERSION, kind, len(payload), zlib.crc32(payload)) + payload


def kind_of(name: str) -> int | None:
    if name.endswith("manifest.msgpack"):
        return fmt.KIND_MANIFEST
    if name.endswith("rank.msgpack"):
        return fmt.KIND_RANK
    if name.endswith(".idx"):
        return fmt.KIND_INDEX
    return None


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def materialize(files: dict[str, bytes], root: Path) -> Path:
    if root.exists():
        shutil.rmtree(root)
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return root


def compare_everything(root: Path) -> str:
    """Read a trace the way the finder does: its canonical view, every point, and a full comparison."""
    from tic_trace.view.align import CanonicalView
    from tic_trace import find_divergence
    v = CanonicalView(str(root))
    return find_divergence(v, v).verdict


def expect_ok_or_format_error(root: Path, event: Callable[[str], None] = lambda _: None, *,
                              compare: bool = False) -> str:
    """The contract: reading (and with `compare`, comparing) succeeds, or raises TraceFormatError naming a
    file of this trace."""
    try:
        read_everything(root)
        if compare:
            compare_everything(root)
    except TraceFormatError as e:
        msg = str(e)
        assert e.path and e.path in msg, f"error does not name its file: {msg}"
        assert Path(e.path) == root or Path(e.path).is_relative_to(root), f"names a file outside the trace: {msg}"
        event("TraceFormatError: " + re.sub(r"\d+", "N", re.sub(r"^record .*?: ", "record: ", e.problem))[:48])
        return "error"
    event("read fine")
    return "ok"


def tiny_model(moe: bool = True, dtype=torch.float32, **overrides):
    return build_hf_model(tiny_qwen3_config(moe=moe, **overrides), seed=0, dtype=dtype)


# ================================================================================================ fuzzing

class _Files(dict):
    """{relative path: bytes} of a trace, with a short repr (hypothesis prints the arguments of a failure)."""

    def __repr__(self):
        return f"<trace files: {', '.join(f'{k} ({len(v)} B)' for k, v in self.items())}>"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict[str, bytes]:
    """A real small trace as {relative path: bytes}: pass 0 a tiny fp32 HF Qwen3-MoE with points_mode="full",
    pass 1 a bf16 dense Qwen3 in rows mode (row_index, bf16 bit patterns)."""
    root = tmp_path_factory.mktemp("pristine") / "trace"
    model, ids = tiny_model(moe=True, num_hidden_layers=1), sample_tokens(1, 6)
    # Two tracers writing one run (as slime's one-tracer-per-micro-batch does): they share a run id.
    with tic_trace.trace(model, root, adapter="hf", points_mode="full", run="pristine") as t, torch.no_grad():
        model(ids)
    assert t.failed is None
    model, ids = tiny_model(moe=False, dtype=torch.bfloat16, num_hidden_layers=1), sample_tokens(2, 4, seed=2)
    with tic_trace.trace(model, root, adapter="hf", points_mode="rows", sample_rows=[1, 6], run="pristine") as t, \
            torch.no_grad():
        model(ids)
    assert t.failed is None
    assert any(r.row_index for r in open_trace(root).open_pass(0, 1).records)
    assert read_everything(root) > 10
    files = _Files(snapshot(root))
    assert {"manifest.msgpack", "rank00000/rank.msgpack", "rank00000/pass00000.idx", "rank00000/pass00000.bin",
            "rank00000/pass00001.idx", "rank00000/pass00001.bin"} <= set(files)
    return files


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "trace"


def test_pristine_trace_reads(pristine, scratch):
    assert expect_ok_or_format_error(materialize(pristine, scratch)) == "ok"


def _position(draw, n: int) -> int:
    # Biased towards the header and the first msgpack bytes, where lengths and types live.
    if n <= 0:
        return 0
    return draw(st.one_of(st.integers(0, min(n - 1, 48)), st.integers(0, n - 1)))


@st.composite
def damaged_bytes(draw, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        n = len(out)
        op = draw(st.sampled_from(["flip", "set", "truncate", "extend", "insert", "delete", "zero"]))
        if op == "flip" and n:
            i = _position(draw, n)
            out[i] ^= draw(st.integers(1, 255))
        elif op == "set" and n:
            i = _position(draw, n)
            out[i] = draw(st.sampled_from([0x00, 0xFF, 0x7F, 0x80, 0xDD, 0xDF, 0xDB, 0xC6, 0xCF, 0xD3, 0xC1]))
        elif op == "truncate":
            del out[draw(st.integers(0, n)):]
        elif op == "extend":
            out += draw(st.binary(min_size=1, max_size=64))
        elif op == "insert":
            i = _position(draw, n + 1)
            out[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete" and n:
            i = _position(draw, n)
            del out[i:i + draw(st.integers(1, 16))]
        elif op == "zero" and n:
            i = _position(draw, n)
            k = draw(st.integers(1, 64))
            out[i:i + k] = bytes(len(out[i:i + k]))
    return bytes(out)


@given(data=st.data())
@FUZZ
def test_fuzz_raw_bytes(pristine, scratch, data):
    """Flip, set, truncate, extend, insert, delete bytes of any one file (framing and CRC left as damaged)."""
    name = data.draw(st.sampled_from(sorted(pristine)), label="file")
    files = dict(pristine)
    files[name] = data.draw(damaged_bytes(pristine[name]), label="bytes")
    expect_ok_or_format_error(materialize(files, scratch), hypothesis.event)


@given(data=st.data())
@FUZZ
def test_fuzz_payload_with_valid_crc(pristine, scratch, data):
    """Damage the msgpack payload of a framed file and recompute length and CRC, so the damage reaches the
    decoder and the semantic checks instead of stopping at the checksum."""
    framed = sorted(n for n in pristine if kind_of(n) is not None)
    name = data.draw(st.sampled_from(framed), label="file")
    payload = pristine[name][fmt._HEADER.size:]
    files = dict(pristine)
    files[name] = frame(kind_of(name), data.draw(damaged_bytes(payload), label="payload"))
    expect_ok_or_format_error(materialize(files, scratch), hypothesis.event)


HOSTILE_INTS = [0, 1, -1, 2, 3, 4, 7, 8, -2, 255, 2**31 - 1, 2**31, -2**31, 2**32, 2**32 + 1, 2**40, 2**53,
                2**62, 2**63 - 1, -2**63, 2**64 - 1]
HOSTILE_STRS = ["", ".", "..", "../pass00000.bin", "../../manifest.msgpack", "/etc/passwd", "a\x00b", "x" * 300,
                "pass00000.bin", "pass00001.bin", "rank.msgpack", "float32", "bfloat16", "float8_e4m3fn", "int64",
                "bool", "complex64", "complex128", "uint8", "no-such-dtype", "stats", "full", "rows", "out", "op",
                "forward", "recompute", "ü\u202e", "offset", "shape"]
RECORD_FIELDS = ["name", "module", "kind", "op", "call", "seq", "phase", "dtype", "shape", "mode", "stats", "hash",
                 "offset", "nbytes", "crc", "row_index", "ops_in_region", "point", "extra"]
PASS_FIELDS = ["records", "blob", "blob_nbytes", "index", "tag", "rows", "rank", "pass_number", "keys", "positions",
               "tokens", "blind_regions", "notes"]

_leaf = st.one_of(
    st.sampled_from(HOSTILE_INTS), st.integers(-2**63, 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e300]),
    st.sampled_from(HOSTILE_STRS), st.text(max_size=12), st.binary(max_size=8), st.none(), st.booleans())
_shape = st.lists(st.one_of(st.sampled_from(HOSTILE_INTS), st.integers(-3, 16)), max_size=70)
hostile_value = st.recursive(
    st.one_of(_leaf, _shape),
    lambda c: st.one_of(st.lists(c, max_size=5),
                        st.dictionaries(st.one_of(st.sampled_from(RECORD_FIELDS + PASS_FIELDS), st.text(max_size=6)),
                                        c, max_size=5)),
    max_leaves=12)


def _slots(obj: Any, depth: int = 0, limit: int = 4) -> list[tuple[Any, Any]]:
    """Every (container, key) in a decoded msgpack tree, to depth `limit`."""
    out = []
    if depth > limit:
        return out
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append((obj, k))
            out.extend(_slots(v, depth + 1, limit))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.append((obj, i))
            out.extend(_slots(v, depth + 1, limit))
    return out


@given(data=st.data())
@FUZZ
def test_fuzz_structure_with_valid_crc(pristine, scratch, data):
    """Decode a framed file, replace/delete/add fields anywhere in it (record fields, blob name and size, row
    tables, manifest) with hostile values, re-encode and re-frame with a valid CRC."""
    framed = sorted(n for n in pristine if kind_of(n) is not None)
    name = data.draw(st.sampled_from(framed), label="file")
    obj = msgpack.unpackb(pristine[name][fmt._HEADER.size:], raw=False)
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        slots = _slots(obj)
        op = data.draw(st.sampled_from(["replace"] * 4 + ["delete", "add", "replace_root"]), label="op")
        if op == "replace_root" or not slots:
            obj = data.draw(hostile_value, label="root")
            continue
        cont, key = slots[data.draw(st.integers(0, len(slots) - 1), label="slot")]
        if op == "replace":
            cont[key] = data.draw(hostile_value, label="value")
        elif op == "delete":
            del cont[key]
        elif isinstance(cont, dict):
            cont[data.draw(st.sampled_from(RECORD_FIELDS + PASS_FIELDS), label="key")] = data.draw(hostile_value)
        else:
            cont.insert(key, data.draw(hostile_value, label="value"))
    files = dict(pristine)
    files[name] = frame(kind_of(name), msgpack.packb(obj, use_bin_type=True))
    expect_ok_or_format_error(materialize(files, scratch), hypothesis.event)




@pytest.fixture(scope="module")
def outside(pristine, tmp_path_factory) -> Path:
    """A copy of the trace outside the fuzzed one: the target of symlinks that leave the trace."""
    return materialize(pristine, tmp_path_factory.mktemp("outside") / "trace")


_LINK_TARGETS = ["/dev/zero", "/dev/null", "/dev/urandom", "/etc/hostname", "/", "outside", "outside-same",
                 "dangling", "inside-other", "self"]
_STRAYS = ["rank²", "rank٣", "rank000000", "rank0", "rank00001-file", "rank00001-link-out", "rank00001-link-in",
           "pass00000.bak.idx", "pass00001.incomplete.idx", "pass00002.idx", "pass0.idx", "pass00000.idx~"]


def _replace_with(p: Path, how: str, root: Path, outside: Path, data) -> None:
    """Replace file `p` of the trace at `root` by a symlink, FIFO or directory."""
    p.unlink()
    if how == "fifo":
        os.mkfifo(p)
    elif how == "dir":
        p.mkdir()
    else:
        rel = p.relative_to(root)
        target = {"outside": outside / "manifest.msgpack", "outside-same": outside / rel,
                  "dangling": root / "no-such-file", "self": p}.get(how)
        if how == "inside-other":
            others = sorted(q for q in root.rglob("*") if q.is_file() and not q.is_symlink() and q != p)
            target = Path(os.path.relpath(others[data.draw(st.integers(0, len(others) - 1), label="other")], p.parent)) \
                if others else root
        os.symlink(target if target is not None else how, p)


def _add_stray(root: Path, stray: str, outside: Path) -> None:
    rank = root / "rank00000"
    if os.path.lexists(root / stray) or os.path.lexists(root / "rank00001") and stray.startswith("rank00001") \
            or os.path.lexists(rank / stray):
        return
    if stray.startswith("pass"):
        if (rank / "pass00000.idx").is_file():
            shutil.copy(rank / "pass00000.idx", rank / stray)
    elif stray == "rank00001-file":
        (root / "rank00001").write_bytes(b"not a directory")
    elif stray == "rank00001-link-out":
        os.symlink(outside / "rank00000", root / "rank00001")
    elif stray == "rank00001-link-in":
        os.symlink("rank00000", root / "rank00001")
    elif rank.is_dir() and not rank.is_symlink():
        fifos = lambda d, names: [n for n in names if stat.S_ISFIFO(os.lstat(os.path.join(d, n)).st_mode)]  # noqa: E731
        shutil.copytree(rank, root / stray, symlinks=True, ignore=fifos)


@given(data=st.data())
@FUZZ
def test_fuzz_filesystem_structure(pristine, scratch, outside, data):
    """Structural mutations of the directory itself: files replaced by symlinks (to devices, out of the trace,
    dangling, to other files of the trace), FIFOs or directories; stray rank and pass entries with non-ASCII
    digits, second spellings, backups, symlinked rank directories. Read and compare: no hang, no unbounded
    allocation, only TraceFormatError naming a file of the trace."""
    root = materialize(pristine, scratch)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        files = sorted(q for q in root.rglob("*") if q.is_file() and not q.is_symlink())
        op = data.draw(st.sampled_from(["link", "fifo", "dir", "stray"]), label="op")
        if op == "stray" or not files:
            _add_stray(root, data.draw(st.sampled_from(_STRAYS), label="stray"), outside)
            continue
        p = files[data.draw(st.integers(0, len(files) - 1), label="file")]
        how = data.draw(st.sampled_from(_LINK_TARGETS), label="target") if op == "link" else op
        _replace_with(p, how, root, outside, data)
    with deadline(60):
        expect_ok_or_format_error(root, hypothesis.event, compare=True)


def _declared(td: type, prefix: tuple = ()) -> list[tuple[tuple, Any]]:
    """(field path, declared type) of every field of a schema TypedDict, nested maps included."""
    from typing import get_args, get_origin, get_type_hints, is_typeddict
    out = []
    for name, tp in get_type_hints(td).items():
        out.append((prefix + (name,), tp))
        inner = [a for a in (get_args(tp) or (tp,)) if is_typeddict(a)] if get_origin(tp) is not list else []
        for sub in inner:
            out.extend(_declared(sub, prefix + (name,)))
    return out


@given(data=st.data())
@FUZZ
def test_fuzz_wrong_types_name_the_field(pristine, scratch, data):
    """Any declared field of the manifest, rank file, pass index or a record, set to a value of the wrong type
    (or out of its bounds): a TraceFormatError naming that file and that field, never anything else."""
    from tic_trace.store import schema
    name = data.draw(st.sampled_from(sorted(n for n in pristine if kind_of(n) is not None)), label="file")
    kind = kind_of(name)
    obj = msgpack.unpackb(pristine[name][fmt._HEADER.size:], raw=False)
    target, td = obj, {fmt.KIND_MANIFEST: schema.Manifest, fmt.KIND_RANK: schema.RankInfo,
                       fmt.KIND_INDEX: schema.PassMeta}[kind]
    if kind == fmt.KIND_INDEX and data.draw(st.booleans(), label="in a record"):
        target, td = obj["records"][data.draw(st.integers(0, len(obj["records"]) - 1), label="record")], schema.RecordWire
    path, tp = data.draw(st.sampled_from(_declared(td)), label="field")
    value = data.draw(hostile_value, label="value")
    hypothesis.assume(not schema.conforms(value, tp))
    parent = target
    for k in path[:-1]:
        hypothesis.assume(isinstance(parent.get(k), dict))
        parent = parent[k]
    parent[path[-1]] = value
    files = dict(pristine)
    files[name] = frame(kind, msgpack.packb(obj, use_bin_type=True))
    root = materialize(files, scratch)
    with pytest.raises(TraceFormatError) as ei:
        read_everything(root)
    assert ei.value.path == str(root / name), ei.value
    # The field is named as repr() quotes it: a hostile key holding ' makes repr use double quotes.
    assert re.search("field [\"']" + re.escape(".".join(path)), ei.value.problem), ei.value


_HUGE = st.sampled_from([2**31 - 1, 2**31, 2**32, 2**40, 2**53, 2**62, 2**63 - 1, 2**64 - 1, 1 << 16])


@given(data=st.data())
@FUZZ_HEAVY
def test_fuzz_huge_claims(pristine, scratch, data):
    """Size and count claims made huge with the right type (shapes, byte lengths, offsets, row indices, layer
    and head counts): read and compare within a small memory budget, or a TraceFormatError."""
    idx_name = data.draw(st.sampled_from(["rank00000/pass00000.idx", "rank00000/pass00001.idx"]), label="pass")
    idx = msgpack.unpackb(pristine[idx_name][fmt._HEADER.size:], raw=False)
    man = msgpack.unpackb(pristine["manifest.msgpack"][fmt._HEADER.size:], raw=False)
    for _ in range(data.draw(st.integers(1, 3), label="claims")):
        where = data.draw(st.sampled_from(["shape", "nbytes", "offset", "row_index", "blob_nbytes", "model",
                                           "stats-only shape"]), label="claim")
        rec = idx["records"][data.draw(st.integers(0, len(idx["records"]) - 1), label="record")]
        huge = data.draw(_HUGE, label="value")
        if where == "shape" and rec["shape"]:
            rec["shape"][data.draw(st.integers(0, len(rec["shape"]) - 1))] = huge
        elif where == "stats-only shape":
            rec.update(shape=[huge, *rec["shape"][1:]], offset=-1, nbytes=0, crc=None, mode="stats", row_index=None)
        elif where in ("nbytes", "offset"):
            rec[where] = huge
        elif where == "row_index":
            rec["row_index"] = [huge]
        elif where == "blob_nbytes":
            idx["blob_nbytes"] = huge
        else:
            key = data.draw(st.sampled_from(["num_layers", "num_attention_heads", "head_dim", "vocab_size",
                                             "num_experts_per_tok", "num_key_value_heads"]), label="model field")
            man.setdefault("model", {})[key] = huge
    files = dict(pristine)
    files[idx_name] = frame(fmt.KIND_INDEX, msgpack.packb(idx, use_bin_type=True))
    files["manifest.msgpack"] = frame(fmt.KIND_MANIFEST, msgpack.packb(man, use_bin_type=True))
    root = materialize(files, scratch)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        with deadline(60):
            expect_ok_or_format_error(root, hypothesis.event, compare=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak - base < 256 << 20, f"allocated {(peak - base) / 2**20:.0f} MiB on a trace of a few KiB"


# ------------------------------------------------------------------------------------------------ hand-crafted

def _index(pristine, i: int = 0) -> dict:
    return msgpack.unpackb(pristine[f"rank00000/pass{i:05d}.idx"][fmt._HEADER.size:], raw=False)


def _data_record(idx: dict) -> dict:
    return next(r for r in idx["records"] if r["offset"] >= 0 and r["nbytes"] > 64)


def _edit_record(**fields) -> Callable[[dict], None]:
    def edit(idx):
        rec = _data_record(idx)
        rec.update(fields)
        idx["records"] = [rec]          # one record: the allocation check measures the hostile part only
    return edit


def _edit_pass(**fields) -> Callable[[dict], None]:
    def edit(idx):
        idx["records"] = [_data_record(idx)]
        idx.update(fields)
    return edit


HOSTILE_INDEXES = {
    "huge shape, honest nbytes": _edit_record(shape=[2**31, 2**30], nbytes=2**63),
    "shape whose int64 product wraps to 0": _edit_record(shape=[2**32, 2**32], nbytes=0),
    "shape whose int64 product wraps to 1": _edit_record(shape=[2**63 + 1, 2**63 + 1], nbytes=4),
    "shape with a dim over int64": _edit_record(shape=[2**64 - 1, 0], nbytes=0),
    "zero-size shape with a huge dim": _edit_record(shape=[2**62, 0], nbytes=0),
    "shape with 100 dims": _edit_record(shape=[1] * 100, nbytes=4),
    "negative dim": _edit_record(shape=[-1, 4], nbytes=16),
    "shape not a list": _edit_record(shape="abc"),
    "shape of floats": _edit_record(shape=[2.0, 3.0]),
    "offset beyond the blob": _edit_record(offset=2**40),
    "offset at int64 max": _edit_record(offset=2**63 - 1),
    "offset uint64 max": _edit_record(offset=2**64 - 1),
    "offset infinite": _edit_record(offset=float("inf")),
    "offset NaN": _edit_record(offset=float("nan")),
    "offset a string": _edit_record(offset="12"),
    "nbytes negative": _edit_record(nbytes=-4),
    "nbytes beyond the blob": _edit_record(nbytes=2**40),
    "nbytes a list": _edit_record(nbytes=[1]),
    "negative offset + negative nbytes": _edit_record(offset=-2**63, nbytes=-2**63),
    "dtype unknown": _edit_record(dtype="float128"),
    "dtype wrong type": _edit_record(dtype=5),
    "dtype changed to a wider one": _edit_record(dtype="float64"),
    "name not a string": _edit_record(name=None),
    "call not an int": _edit_record(call="abc"),
    "seq a list": _edit_record(seq=[1, 2]),
    "call infinite": _edit_record(call=float("inf")),
    "stats with wrong value types": _edit_record(stats={k: "x" for k in fmt.STAT_FIELDS}),
    "stats a list": _edit_record(stats=[1, 2, 3]),
    "extra a list": _edit_record(extra=[1, 2]),
    "row_index of strings": _edit_record(mode="rows", row_index=["a"]),
    "row_index long": _edit_record(mode="rows", row_index=list(range(20000))),
    "crc a string": _edit_record(crc="abc"),
    "hash a string": _edit_record(hash="abc"),
    "record is a list": lambda idx: idx.update(records=[[1, 2, 3]]),
    "records not a list": lambda idx: idx.update(records={"a": 1}),
    "blob ../": _edit_pass(blob="../manifest.msgpack"),
    "blob ../../": _edit_pass(blob="../../x"),
    "blob absolute": _edit_pass(blob="/etc/passwd"),
    "blob empty name": _edit_pass(blob=""),
    "blob '.'": _edit_pass(blob="."),
    "blob with NUL": _edit_pass(blob="pass00000\x00.bin"),
    "blob name too long": _edit_pass(blob="p" * 5000),
    "blob the index itself": _edit_pass(blob="pass00000.idx"),
    "blob not a string": _edit_pass(blob=7),
    "blob_nbytes wrong": _edit_pass(blob_nbytes=2**63),
    "blob_nbytes negative": _edit_pass(blob_nbytes=-1),
    "index not an int": _edit_pass(index="abc"),
    "index infinite": _edit_pass(index=float("inf")),
    "rows not a map": _edit_pass(rows=[1, 2]),
    "rows keys/positions lengths differ": _edit_pass(rows={"keys": ["a"], "positions": [0, 1]}),
    "rows positions of strings": _edit_pass(rows={"keys": ["a"], "positions": ["x"]}),
    "rows keys of lists": _edit_pass(rows={"keys": [[1]], "positions": [0]}),
    "rows tokens of wrong length": _edit_pass(rows={"keys": ["a"], "positions": [0], "tokens": [1, 2]}),
    "index without records": lambda idx: (idx.clear(), idx.update({"__list__": True})),
}

# msgpack payloads whose headers declare enormous containers while the file is tiny.
HOSTILE_PAYLOADS = {
    "array32 of 2**31 elements": b"\xdd" + (2**31).to_bytes(4, "big") + b"\xc0" * 8,
    "map32 of 2**31 pairs": b"\xdf" + (2**31).to_bytes(4, "big") + b"\xa1a\xc0" * 4,
    "str32 of 2**31 bytes": b"\xdb" + (2**31).to_bytes(4, "big") + b"abc",
    "bin32 of 2**31 bytes": b"\xc6" + (2**31).to_bytes(4, "big") + b"abc",
    "ext32 of 2**31 bytes": b"\xc9" + (2**31).to_bytes(4, "big") + b"\x01abc",
    "records: array32 of 2**31": b"\x81\xa7records\xdd" + (2**31).to_bytes(4, "big") + b"\xc0",
    "deeply nested arrays": b"\x91" * 100000 + b"\xc0",
    "trailing bytes": msgpack.packb({"records": []}) + b"\x00",
    "reserved byte 0xc1": b"\xc1",
    "empty payload": b"",
}


def _expect_error_small_peak(root: Path, budget: int = 4 << 20) -> TraceFormatError:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        with pytest.raises(TraceFormatError) as ei:
            read_everything(root)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak - base < budget, f"reader allocated {(peak - base) / 2**20:.1f} MiB before rejecting"
    e = ei.value
    assert e.path in str(e) and Path(e.path).is_relative_to(root)
    return e


@pytest.mark.parametrize("case", sorted(HOSTILE_INDEXES))
def test_hostile_index_fields(pristine, tmp_path, case):
    idx = _index(pristine)
    HOSTILE_INDEXES[case](idx)
    files = dict(pristine)
    files["rank00000/pass00000.idx"] = frame(fmt.KIND_INDEX, msgpack.packb(idx, use_bin_type=True))
    root = materialize(files, tmp_path / "trace")
    if case == "blob ../":
        # The escape target exists with exactly the declared size, so only the name check can stop it.
        idx["blob_nbytes"] = len(pristine["manifest.msgpack"])
        (root / "rank00000/pass00000.idx").write_bytes(frame(fmt.KIND_INDEX, msgpack.packb(idx, use_bin_type=True)))
    e = _expect_error_small_peak(root)
    assert "pass00000" in e.path


@pytest.mark.parametrize("case", sorted(HOSTILE_PAYLOADS))
@pytest.mark.parametrize("file", ["manifest.msgpack", "rank00000/rank.msgpack", "rank00000/pass00000.idx"])
def test_hostile_msgpack_payload(pristine, tmp_path, case, file):
    files = dict(pristine)
    files[file] = frame(kind_of(file), HOSTILE_PAYLOADS[case])
    root = materialize(files, tmp_path / "trace")
    e = _expect_error_small_peak(root)
    assert e.path == str(root / file)


def test_hostile_header_length(pristine, tmp_path):
    """A header declaring a 2**63-byte payload on a small file: rejected from the file size, no allocation."""
    files = dict(pristine)
    payload = pristine["rank00000/pass00000.idx"][fmt._HEADER.size:]
    files["rank00000/pass00000.idx"] = fmt._HEADER.pack(fmt.MAGIC, fmt.SCHEMA_VERSION, fmt.KIND_INDEX, 2**63,
                                                        zlib.crc32(payload)) + payload
    e = _expect_error_small_peak(materialize(files, tmp_path / "trace"))
    assert "truncated" in e.problem


def test_error_names_wrong_schema_and_kind(pristine, tmp_path):
    files = dict(pristine)
    m = files["manifest.msgpack"]
    files["manifest.msgpack"] = m[:8] + (fmt.SCHEMA_VERSION + 1).to_bytes(2, "little") + m[10:]
    files["rank00000/rank.msgpack"] = frame(fmt.KIND_INDEX, pristine["rank00000/rank.msgpack"][fmt._HEADER.size:])
    root = materialize(files, tmp_path / "t")
    with pytest.raises(TraceFormatError, match="schema version"):
        open_trace(root)
    files["manifest.msgpack"] = m
    root = materialize(files, tmp_path / "t")
    with pytest.raises(TraceFormatError, match="expected a rank file") as ei:
        read_everything(root)
    assert ei.value.path == str(root / "rank00000/rank.msgpack")


# ================================================================================================ crash (SIGKILL)

_LOOP_CHILD = textwrap.dedent("""
    import sys, time, torch, tic_trace
    from tic_trace.testing.hf_models import build_hf_model, sample_tokens, tiny_qwen3_config
    out, rank, passes, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    model = build_hf_model(tiny_qwen3_config(moe=True), seed=0)
    ids = sample_tokens(2, 16)
    while go != "-" and not __import__("os").path.exists(go):
        time.sleep(0.005)
    t = tic_trace.trace(model, out, adapter="hf", points_mode="full", rank=rank).start()
    i = 0
    with torch.no_grad():
        while passes < 0 or i < passes:
            model(ids)
            t.step()
            i += 1
    t.stop()
    assert t.failed is None, t.failed
""")


def _child(out: Path, rank: int, passes: int, go: Path | str = "-") -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", _LOOP_CHILD, str(out), str(rank), str(passes), str(go)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _same_values_across_passes(tr, rank: int) -> int:
    """Every pass of a loop over the same input holds the same records with the same hashes and bytes."""
    passes = list(tr.passes(rank))
    ref = {r.name: (r.hash, r.crc) for r in passes[0].records}
    for p in passes[1:]:
        assert {r.name: (r.hash, r.crc) for r in p.records} == ref
    return len(passes)


@pytest.mark.slow
def test_sigkill_mid_pass_leaves_complete_passes_readable(tmp_path):
    out = tmp_path / "trace"
    proc = _child(out, 0, -1)
    rank_dir = out / "rank00000"
    deadline = time.monotonic() + 120
    killed_mid_pass = False
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            names = os.listdir(rank_dir) if rank_dir.exists() else []
            if sum(n.endswith(".idx") for n in names) >= 2 and any(n.endswith(".bin.tmp") for n in names):
                os.kill(proc.pid, signal.SIGKILL)
                killed_mid_pass = True
                break
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate(timeout=30)
    assert killed_mid_pass, f"child never reached two passes: {err.decode()[-2000:]}"
    assert proc.returncode == -signal.SIGKILL

    idx = sorted(p.name for p in rank_dir.glob("pass*.idx"))
    assert len(idx) >= 2
    # The pass in flight (its temporary blob existed when the kill was sent) left a temporary file, or at most
    # a renamed blob without an index: the reader sees exactly the passes that have an index, all complete.
    tr = open_trace(out)
    assert tr.pass_indices(0) == list(range(len(idx)))
    assert read_everything(out) > 0
    assert _same_values_across_passes(tr, 0) == len(idx)

    # A new run into the same directory is refused before it writes anything: a reader never mixes runs.
    before = snapshot(out)
    model = tiny_model(moe=True)
    with pytest.raises(tic_trace.TraceDirectoryInUse, match="another run"):
        tic_trace.trace(model, out, adapter="hf", points_mode="full").start()
    assert snapshot(out) == before
    assert not any(m._forward_hooks for m in model.modules()), "a refused tracer left hooks behind"


# ================================================================================================ disk full

class _Disk:
    """A byte budget shared by every file tic_trace.store.format opens under `root`; writes beyond it raise ENOSPC."""

    def __init__(self, root: Path, budget: int):
        self.root, self.left, self.hits = str(root), budget, 0


class _BudgetFile:
    def __init__(self, f, disk: _Disk):
        self._f, self._disk = f, disk

    def write(self, b):
        n = memoryview(b).nbytes
        if n > self._disk.left:
            self._disk.hits += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._disk.left -= n
        return self._f.write(b)

    def __getattr__(self, k):
        return getattr(self._f, k)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


@contextlib.contextmanager
def full_disk(monkeypatch, root: Path, budget: int):
    disk = _Disk(root, budget)
    real = os.fdopen

    def fdopen(fd, *a, **k):
        f = real(fd, *a, **k)
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        return _BudgetFile(f, disk) if target.startswith(disk.root) else f

    monkeypatch.setattr(fmt.os, "fdopen", fdopen)
    try:
        yield disk
    finally:
        monkeypatch.undo()


def _loop(model, ids, t, n: int) -> list[torch.Tensor]:
    outs = []
    with torch.no_grad():
        for _ in range(n):
            outs.append(model(ids).logits)
            t.step()
    return outs


def _per_pass_bytes(tmp_path, model, ids) -> int:
    probe = tmp_path / "probe"
    t = tic_trace.trace(model, probe, adapter="hf", points_mode="full").start()
    _loop(model, ids, t, 1)
    t.stop()
    return sum(p.stat().st_size for p in (probe / "rank00000").glob("pass00000.*"))


def _check_disabled_cleanly(out: Path, t, outs, ref, warnings, min_passes: int) -> None:
    for o in outs:
        assert_bitwise_equal(o, ref)
    assert t.failed is not None and isinstance(t.failed, OSError)
    assert len(warnings) == 1, [w.getMessage()[:200] for w in warnings]
    assert "tracing disabled" in warnings[0].getMessage()
    tr = open_trace(out)
    n = len(tr.pass_indices(0))
    assert n >= min_passes
    assert tr.incomplete_runs(), "the trace does not say that its run ended early"     # issue 22 item 5
    if n:
        read_everything(out)
        _same_values_across_passes(tr, 0)
    assert not [p for p in (out / "rank00000").iterdir() if p.name.endswith(".tmp")], "temporary files left"


@pytest.mark.parametrize("where", ["manifest", "first blob", "blob of pass 2", "index of pass 2"])
def test_disk_full_simulated(tmp_path, monkeypatch, where):
    model = tiny_model(moe=True)
    ids = sample_tokens(2, 8)
    with torch.no_grad():
        ref = model(ids).logits
    per_pass = _per_pass_bytes(tmp_path, model, ids)
    idx_size = (tmp_path / "probe/rank00000/pass00000.idx").stat().st_size
    head = sum(p.stat().st_size for p in [tmp_path / "probe/manifest.msgpack", tmp_path / "probe/rank00000/rank.msgpack"])
    budget = {"manifest": 10, "first blob": head + 100, "blob of pass 2": head + 2 * per_pass + 100,
              "index of pass 2": head + 3 * per_pass - idx_size // 2}[where]
    out = tmp_path / "trace"
    with tic_warnings() as warnings, full_disk(monkeypatch, out, budget) as disk:
        t = tic_trace.trace(model, out, adapter="hf", points_mode="full").start()
        outs = _loop(model, ids, t, 5)
        t.stop()
    assert disk.hits >= 1
    want = {"manifest": 0, "first blob": 0, "blob of pass 2": 2, "index of pass 2": 2}[where]
    if where == "manifest":
        assert not (out / "manifest.msgpack").exists()
        for o in outs:
            assert_bitwise_equal(o, ref)
        assert len(warnings) == 1 and t.failed is not None
        return
    _check_disabled_cleanly(out, t, outs, ref, warnings, want)
    assert len(open_trace(out).pass_indices(0)) == want


@pytest.mark.skipif(not IS_ROOT, reason="mounting a tmpfs needs root")
def test_disk_full_real_tmpfs(tmp_path):
    model = tiny_model(moe=True)
    ids = sample_tokens(2, 8)
    with torch.no_grad():
        ref = model(ids).logits
    per_pass = _per_pass_bytes(tmp_path, model, ids)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    size = ((2 * per_pass + 12 * 4096 + 4095) // 4096) * 4096     # room for two passes (files use whole pages)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"mount -t tmpfs not permitted here: {r.stderr.decode().strip()}")
    try:
        out = mnt / "trace"
        with tic_warnings() as warnings:
            t = tic_trace.trace(model, out, adapter="hf", points_mode="full").start()
            outs = _loop(model, ids, t, 6)
            t.stop()
        assert isinstance(t.failed, OSError) and t.failed.errno == errno.ENOSPC, t.failed
        _check_disabled_cleanly(out, t, outs, ref, warnings, 1)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# ================================================================================================ unwritable

def _trace_into(out: Path):
    model = tiny_model(moe=False)
    ids = sample_tokens(2, 8)
    with torch.no_grad():
        ref = model(ids).logits
    with tic_warnings() as warnings:
        t = tic_trace.trace(model, out, adapter="hf", points_mode="full")
        with t, torch.no_grad():
            got = model(ids).logits
        with torch.no_grad():
            after = model(ids).logits
    assert_bitwise_equal(got, ref)
    assert_bitwise_equal(after, ref)
    assert t.failed is not None and len(warnings) == 1, [w.getMessage()[:200] for w in warnings]
    return t


def test_unwritable_path_under_a_file(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    t = _trace_into(f / "trace")
    assert isinstance(t.failed, OSError)


@pytest.mark.skipif(IS_ROOT, reason="root bypasses permission bits (chmod 000); the read-only mount test covers root")
def test_unwritable_chmod_000(tmp_path):
    d = tmp_path / "locked"
    d.mkdir()
    d.chmod(0)
    try:
        _trace_into(d / "trace")
    finally:
        d.chmod(0o755)


@pytest.mark.skipif(not IS_ROOT, reason="mounting needs root")
def test_unwritable_read_only_mount(tmp_path):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"mount not permitted here: {r.stderr.decode().strip()}")
    try:
        t = _trace_into(mnt / "trace")
        assert isinstance(t.failed, OSError) and t.failed.errno == errno.EROFS
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_unwritable_rank_dir_after_start(tmp_path):
    """The directory disappears under a running tracer (e.g. cleaned by another job): one warning, no raise."""
    model = tiny_model(moe=True)
    ids = sample_tokens(2, 8)
    with torch.no_grad():
        ref = model(ids).logits
    out = tmp_path / "trace"
    with tic_warnings() as warnings:
        t = tic_trace.trace(model, out, adapter="hf", points_mode="full").start()
        outs = _loop(model, ids, t, 1)
        shutil.rmtree(out / "rank00000")
        (out / "rank00000").write_text("not a directory")
        outs += _loop(model, ids, t, 2)
        t.stop()
    for o in outs:
        assert_bitwise_equal(o, ref)
    assert t.failed is not None and len(warnings) == 1


# ================================================================================================ several ranks

@pytest.mark.slow
def test_concurrent_ranks_share_one_directory(tmp_path):
    out, go = tmp_path / "trace", tmp_path / "go"
    n_ranks, n_passes = 4, 3
    procs = [_child(out, r, n_passes, go) for r in range(n_ranks)]
    time.sleep(0.5)
    go.write_text("go")            # release them together: manifests and passes are written concurrently
    errs = []
    for p in procs:
        _, err = p.communicate(timeout=240)
        errs.append(err.decode()[-2000:])
    assert all(p.returncode == 0 for p in procs), errs

    tr = open_trace(out)
    assert tr.manifest["format"] == "tic-trace" and tr.manifest["framework"] == "hf"
    assert tr.manifest["model"]["num_layers"] == 2 and tr.manifest["model"]["num_experts"] == 4
    assert tr.ranks == list(range(n_ranks))
    hashes = None
    for r in range(n_ranks):
        assert tr.rank_info(r)["rank"] == r
        assert tr.pass_indices(r) == list(range(n_passes))
        for p in tr.passes(r):
            assert p.meta["rank"] == r
        assert _same_values_across_passes(tr, r) == n_passes
        h = {rec.name: rec.hash for rec in next(tr.passes(r)).records}
        assert hashes is None or h == hashes
        hashes = h
    assert read_everything(out) > 0
    left = [p for p in out.rglob("*") if p.name.endswith(".tmp")]
    assert not left, left


# ================================================================================================ bitwise equality

@dataclass
class ModelCase:
    """A model to check tracing against: `build()` returns (model, forward), `forward(model)` runs one
    forward and returns its outputs (any pytree of tensors). Adapters of other frameworks add entries."""
    name: str
    build: Callable[[], tuple[torch.nn.Module, Callable[[torch.nn.Module], Any]]]
    adapter: str | None
    sample_rows: tuple[int, ...] = (0, 3, 13)
    trace_kw: dict = dataclasses.field(default_factory=dict)
    teardown: Callable[[], None] = lambda: None


def _hf_case(moe: bool, dtype: torch.dtype) -> ModelCase:
    def build():
        model = tiny_model(moe=moe, dtype=dtype)
        ids = sample_tokens(2, 12)
        return model, lambda m: m(ids, use_cache=False, output_hidden_states=True)[:2]
    return ModelCase(f"hf-{'moe' if moe else 'dense'}-{str(dtype)[6:]}", build, "hf")


def _megatron_case(moe: bool) -> ModelCase:
    """Real megatron-core GPTModel (local spec, TP1) with the HF test model's weights."""
    from tic_trace.testing import megatron_cpu as mc

    def build():
        from tic_trace.adapters.megatron_weights import hf_to_megatron_state_dict, load_into
        cfg = tiny_qwen3_config(moe=moe)
        hf_sd = build_hf_model(cfg, seed=0).state_dict()
        mc.init_parallel(0, 1)
        model = mc.build_gpt_model(cfg)
        load_into(model, hf_to_megatron_state_dict(hf_sd, cfg))
        ids = sample_tokens(2, 12)
        pos = torch.arange(12).unsqueeze(0).expand(2, -1)
        return model, lambda m: m(ids, pos, attention_mask=None)
    return ModelCase(f"megatron-{'moe' if moe else 'dense'}", build, "megatron",
                     teardown=lambda: mc.destroy(remove_patches=True))


def _sglang_case(moe: bool) -> ModelCase:
    """Real SGLang model code as a rollout: batched prefill of two requests, then decode steps; every
    forward is one pass (the engine calls `model.forward` directly, as SGLang's runners do)."""
    from tic_trace.testing import sglang_cpu as sc

    def build():
        cfg = tiny_qwen3_config(moe=moe)
        sc.init_sglang_distributed(tp_size=1)
        model = sc.build_sglang_model(cfg, sc.hf_checkpoint_weights(build_hf_model(cfg, seed=0)))

        def forward(m):
            res = sc.SGLangRollout(m).generate({"a": [3, 5, 7, 9, 11], "b": [2, 4, 6, 8, 10, 12, 14]}, 3,
                                               forced_tokens={"a": [20, 21, 22], "b": [30, 31, 32]})
            return [r.next_token_logits for r in res.records]
        return model, forward
    return ModelCase(f"sglang-{'moe' if moe else 'dense'}", build, "sglang", sample_rows=(0, 4, 9),
                     trace_kw={"auto_step": True}, teardown=sc.destroy_sglang_distributed)


BITWISE_MODELS: list[ModelCase] = [
    _hf_case(False, torch.float32),
    _hf_case(True, torch.float32),
    _hf_case(False, torch.bfloat16),
    _hf_case(True, torch.bfloat16),
    _megatron_case(False),
    _megatron_case(True),
    _sglang_case(False),
    _sglang_case(True),
]


@pytest.mark.parametrize("mode", ["stats", "full", "rows"])
@pytest.mark.parametrize("case", BITWISE_MODELS, ids=lambda c: c.name)
def test_traced_output_bitwise_equal_untraced(tmp_path, case: ModelCase, mode: str):
    model, forward = case.build()
    try:
        with torch.no_grad():
            ref = forward(model)
        kw = {"sample_rows": list(case.sample_rows)} if mode == "rows" else {}
        with tic_warnings() as warnings:
            t = tic_trace.trace(model, tmp_path / "t", adapter=case.adapter, mode=mode, points_mode=mode,
                                **case.trace_kw, **kw)
            with t, torch.no_grad():
                got = forward(model)
        assert t.failed is None and not warnings, t.failed
        assert_bitwise_equal(got, ref)
        with torch.no_grad():
            assert_bitwise_equal(forward(model), ref)       # hooks and wrappers are gone after stop()
    finally:
        case.teardown()
    p = next(open_trace(tmp_path / "t").passes())
    assert len(p.records) > 20
    if mode != "stats":
        assert any(r.mode == mode and r.has_data for r in p.records)
    read_everything(tmp_path / "t")


# ================================================================================================ stats agreement

_STATS_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.int64,
                 torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64]


def _values(dtype, n: int, case: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if not dtype.is_floating_point and not dtype.is_complex:
        info = torch.iinfo(dtype)
        return torch.randint(max(info.min, -2**40), min(info.max, 2**40), (n,), generator=g,
                             dtype=torch.int64).to(dtype)
    base = torch.randn(n, generator=g, dtype=torch.float64) * 3
    if case == "specials" and n > 8:
        base[1], base[3], base[5], base[7], base[8] = float("nan"), float("inf"), -float("inf"), -0.0, 1e-40
    elif case == "nonfinite":
        base[:] = float("nan")
        base[::3] = float("inf")
        base[1::5] = -float("inf")
    if dtype.is_complex:
        return torch.complex(base, base.flip(0)).to(dtype)
    return base.to(dtype)


def _agree(t: torch.Tensor, dev_stats: torch.Tensor | None = None) -> None:
    from tic_trace.store.dtypes import dtype_info, torch_dtype_name
    from tic_trace.record.capture import _as_storage
    name = torch_dtype_name(t.dtype)
    raw = _as_storage(t.contiguous(), dtype_info(name).storage)
    assert int(device_hash(t)) == numpy_hash(raw)
    dev = stats_dict((device_stats(t) if dev_stats is None else dev_stats).cpu().numpy())
    host = numpy_stats(raw, name)
    assert dev.keys() == host.keys()
    for k in dev:
        if k in ("sum", "sumsq"):     # float64 sums: numpy and torch add in different orders
            assert dev[k] == pytest.approx(host[k], rel=1e-12, abs=1e-300, nan_ok=True), (k, dev[k], host[k])
        else:                         # counts, extremes, non-finite counts: exact
            assert dev[k] == host[k] or (dev[k] != dev[k] and host[k] != host[k]), (k, dev[k], host[k])


@pytest.mark.parametrize("path", ["default", "masked", "tiny-chunks"])
@pytest.mark.parametrize("case", ["finite", "specials", "nonfinite"])
@pytest.mark.parametrize("dtype", _STATS_DTYPES, ids=lambda d: str(d)[6:])
def test_stats_and_hash_agree_between_device_and_numpy(monkeypatch, dtype, case, path):
    """`numpy_stats`/`numpy_hash` (from stored bits) agree with `device_stats`/`device_hash`: the hash, count,
    extremes and non-finite counts exactly; sum and sum of squares to float64 rounding (numpy and torch add in
    different orders, before and after the stats.py optimisation alike). Paths: the CPU fast path / CPU
    masked fallback ("default"), the branch-free masked path accelerators always take ("masked"), and hashing
    in many chunks without the cached index table and scratch buffers ("tiny-chunks")."""
    from tic_trace.record import stats as stats_mod
    if path == "tiny-chunks":
        monkeypatch.setattr(stats_mod, "_CHUNK", 97)
        monkeypatch.setattr(stats_mod, "_TABLE_MAX", 50)
    for shape in [(0,), (1,), (7, 5), (3, 1000), (2, 3, 4)]:
        n = int(np.prod(shape))
        t = _values(dtype, n, case, seed=n).reshape(shape)
        dev = None
        if path == "masked" and n and (dtype.is_floating_point or dtype.is_complex):
            flat = (torch.view_as_real(t) if t.is_complex() else t).reshape(-1)
            flat = flat if flat.dtype in stats_mod._NATIVE_FLOAT else flat.float()
            count = torch.tensor(float(flat.numel()), dtype=torch.float64)
            dev = stats_mod._masked_stats(flat, count)
        _agree(t, dev)
        if t.dim() >= 2 and t.shape[0] > 1 and t.shape[1] > 1:
            _agree(t.transpose(0, 1))                       # non-contiguous: hashed in logical order
        with torch.inference_mode():                        # scratch/table reuse across inference mode
            _agree(t.clone())


def test_stats_do_not_go_through_dispatch_modes():
    """The tracer's own stats kernels are invisible to dispatch modes (ours or the user's)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x, y = torch.randn(64, 8), torch.tensor([1.0, float("nan")])
    with Spy():
        device_stats(x)
        device_hash(x)
        device_stats(y)
    assert seen == []
