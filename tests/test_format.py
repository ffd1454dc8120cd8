"""The trace format: framing, checksums, and clear errors for bad files."""
import math
import os
import struct
import time
import zlib

import msgpack
import numpy as np
import pytest
import torch

import tic_trace
from tic_trace import TraceFormatError, open_trace
from tic_trace.store.format import _HEADER, KIND_INDEX, MAGIC, SCHEMA_VERSION, write_framed
from tic_trace.testing.hf_models import build_hf_model, sample_tokens

from conftest import trace_hf


@pytest.fixture
def small_trace(tmp_path, hf_dense_config):
    trace_hf(build_hf_model(hf_dense_config), tmp_path / "t", sample_tokens(1, 4))
    return tmp_path / "t"


def _read_all(path):
    tr = open_trace(path)
    n = 0
    for p in tr.passes():
        for r in p.records:
            if r.has_data:
                r.values()
                n += 1
    return n


def test_layout_and_memmap_without_copy(small_trace):
    assert (small_trace / "manifest.msgpack").is_file()
    assert (small_trace / "rank00000" / "rank.msgpack").is_file()
    assert (small_trace / "rank00000" / "pass00000.idx").is_file()
    assert (small_trace / "rank00000" / "pass00000.bin").is_file()
    assert not list(small_trace.rglob("*.tmp"))
    p = next(open_trace(small_trace).passes())
    rec = next(r for r in p.records if r.has_data)
    raw = rec.raw()
    assert isinstance(raw.base, np.memmap) or isinstance(raw, np.memmap) or raw.base is not None
    assert not raw.flags.writeable
    assert _read_all(small_trace) > 10


def test_truncated_index_names_the_file(small_trace):
    idx = small_trace / "rank00000" / "pass00000.idx"
    idx.write_bytes(idx.read_bytes()[:-7])
    with pytest.raises(TraceFormatError) as e:
        _read_all(small_trace)
    assert str(idx) in str(e.value) and "truncated" in str(e.value)


def test_corrupted_index_byte_is_a_checksum_error(small_trace):
    idx = small_trace / "rank00000" / "pass00000.idx"
    data = bytearray(idx.read_bytes())
    data[len(data) // 2] ^= 0x40
    idx.write_bytes(bytes(data))
    with pytest.raises(TraceFormatError, match="checksum"):
        _read_all(small_trace)


def test_corrupted_blob_is_caught_when_read(small_trace):
    blob = small_trace / "rank00000" / "pass00000.bin"
    data = bytearray(blob.read_bytes())
    data[100] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(TraceFormatError) as e:
        _read_all(small_trace)
    assert str(blob) in str(e.value) and "checksum" in str(e.value)


def test_truncated_blob_is_rejected_at_open(small_trace):
    blob = small_trace / "rank00000" / "pass00000.bin"
    blob.write_bytes(blob.read_bytes()[:-1])
    with pytest.raises(TraceFormatError, match="truncated"):
        _read_all(small_trace)


def test_version_mismatch(small_trace):
    man = small_trace / "manifest.msgpack"
    data = bytearray(man.read_bytes())
    struct.pack_into("<H", data, 8, SCHEMA_VERSION + 1)
    man.write_bytes(bytes(data))
    with pytest.raises(TraceFormatError, match="schema version"):
        open_trace(small_trace)


def test_oversized_size_field_rejected_before_allocation(small_trace):
    import tracemalloc
    idx = small_trace / "rank00000" / "pass00000.idx"
    payload = msgpack.unpackb(idx.read_bytes()[_HEADER.size:], raw=False)
    rec = next(r for r in payload["records"] if r["offset"] >= 0)
    rec["shape"] = [1 << 20, 1 << 20]
    rec["nbytes"] = (1 << 40) * 4
    write_framed(idx, KIND_INDEX, payload)   # valid framing: only the sizes lie
    tracemalloc.start()
    with pytest.raises(TraceFormatError, match="beyond the blob"):
        _read_all(small_trace)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 32 << 20


def test_hostile_msgpack_length_is_rejected(tmp_path):
    """A payload declaring a 2**31-element array must not allocate it."""
    payload = b"\xdd" + struct.pack(">I", 1 << 31)   # array32 header, no elements
    path = tmp_path / "manifest.msgpack"
    path.write_bytes(_HEADER.pack(MAGIC, SCHEMA_VERSION, 1, len(payload), zlib.crc32(payload)) + payload)
    with pytest.raises(TraceFormatError, match="undecodable"):
        open_trace(tmp_path)


def test_not_a_trace(tmp_path):
    with pytest.raises(TraceFormatError, match="not a trace directory"):
        open_trace(tmp_path / "missing")
    (tmp_path / "manifest.msgpack").write_bytes(b"hello world, not a trace at all")
    with pytest.raises(TraceFormatError, match="magic"):
        open_trace(tmp_path)


def test_crash_leaves_earlier_passes_readable(tmp_path, hf_dense_config):
    """A pass that never finished leaves only a temporary blob: earlier passes read fine."""
    model = build_hf_model(hf_dense_config)
    t = tic_trace.trace(model, tmp_path / "t", adapter="hf")
    t.start()
    with torch.no_grad():
        model(sample_tokens(1, 3))
        t.step()
        model(sample_tokens(1, 3))   # pass 1 is open: its blob is still a temporary file
    tr = open_trace(tmp_path / "t")
    assert tr.pass_indices(0) == [0]
    assert len(next(tr.passes()).records) > 10
    t.stop()
    assert open_trace(tmp_path / "t").pass_indices(0) == [0, 1]


def test_product_code_never_unpickles():
    import pathlib
    import re
    root = pathlib.Path(tic_trace.__file__).parent.parent
    pat = re.compile(r"(^|[^a-z_])(pickle\.loads?|torch\.load\(|cloudpickle|dill\.loads?)")
    offenders = [str(p) for d in ("tic_trace", "adapters", "tools") for p in (root / d).rglob("*.py")
                 if pat.search(p.read_text())]
    assert offenders == []


@pytest.mark.parametrize("durable", [False, True])
def test_a_closed_pass_is_readable_at_once_and_fsynced_before_or_after_close(tmp_path, monkeypatch, durable,
                                                                            hf_dense_config):
    """`durable=True`: the blob is fsynced by the closing thread before `close` returns. Default: the closing
    thread never fsyncs (a background thread does, and `wait_for_disk` returns once it has); either way the
    pass is complete and readable as soon as the `with` block ends."""
    import threading

    from tic_trace.store import writer as fmt
    fmt.wait_for_disk()           # passes of earlier tests are not this test's
    synced: list[str] = []
    real_fsync = os.fsync

    def spy(fd):
        synced.append(threading.current_thread().name)
        return real_fsync(fd)

    monkeypatch.setattr(fmt.os, "fsync", spy)
    model = build_hf_model(hf_dense_config)
    with torch.no_grad(), tic_trace.trace(model, tmp_path / "t", adapter="hf", points_mode="full",
                                          durable=durable) as t:
        model(sample_tokens(1, 4))
    main = threading.current_thread().name
    if durable:
        assert synced == [main]
    else:
        assert main not in synced
        fmt.wait_for_disk()
        assert synced == ["tic-trace-fsync"]
        deadline = time.monotonic() + 10 * fmt._IDLE_EXIT_S      # idle, the thread ends (forking is safe again)
        while any(th.name == "tic-trace-fsync" for th in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(th.name == "tic-trace-fsync" for th in threading.enumerate())
    assert t.failed is None
    (p,) = list(open_trace(tmp_path / "t").passes())
    assert p.meta["complete"] and any(r.has_data for r in p.records)
    assert all(r.values().size == math.prod(r.shape) for r in p.records if r.has_data)


def test_a_process_forked_while_the_fsync_thread_runs_syncs_and_closes_its_own_passes(tmp_path):
    """A child forked right after a pass closed (the parent's fsync thread still alive) inherits no thread:
    its own passes are fsynced and closed (no descriptor left open) and `wait_for_disk` returns."""
    import threading

    from tic_trace.store import writer as fmt

    def one_pass(index: int) -> None:
        w = fmt.PassWriter(tmp_path, index, {})
        w.write_bytes(b"x" * 100)
        w.close()

    fmt.wait_for_disk()
    one_pass(0)                                   # starts the parent's fsync thread (idle exit after 0.5 s)
    assert any(th.name == "tic-trace-fsync" for th in threading.enumerate())
    pid = os.fork()
    if pid == 0:                                  # the child: no torch op, only the format's own code
        code = 1
        try:
            before = len(os.listdir("/proc/self/fd"))
            one_pass(1)
            waiter = threading.Thread(target=fmt.wait_for_disk, daemon=True)
            waiter.start()
            waiter.join(10)
            closed = len(os.listdir("/proc/self/fd")) == before
            code = 0 if not waiter.is_alive() and closed else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    fmt.wait_for_disk()
    assert sorted(p.name for p in tmp_path.glob("*.bin")) == [f"{fmt.pass_stem(i)}.bin" for i in (0, 1)]


def test_a_blob_whose_close_fails_neither_stops_the_fsync_thread_nor_blocks_wait_for_disk(tmp_path):
    """A file system that reports a write error at close (NFS does): `wait_for_disk` still returns, and the
    passes closed after it are fsynced and closed as usual."""
    import threading

    from tic_trace.store import writer as fmt

    class FailingClose:
        def __init__(self, f):
            self.f = f

        def fileno(self):
            return self.f.fileno()

        def close(self):
            self.f.close()
            raise OSError(5, "Input/output error")

    fmt.wait_for_disk()
    fmt._BACKGROUND_SYNC.fsync_and_close(FailingClose(open(tmp_path / "x", "wb")))
    w = fmt.PassWriter(tmp_path, 0, {})
    w.write_bytes(b"x" * 10)
    w.close()
    waiter = threading.Thread(target=fmt.wait_for_disk, daemon=True)
    waiter.start()
    waiter.join(10)
    assert not waiter.is_alive()
    assert w._blob.closed
