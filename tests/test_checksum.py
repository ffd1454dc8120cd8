"""The format's CRC-32 (tic_trace/store/format.py): ISA-L's when installed, the same checksum as zlib's."""
from __future__ import annotations

import zlib

import numpy as np

from tic_trace.store import format as fmt


def test_format_crc_is_zlibs_crc32_on_every_buffer_kind_it_is_given(tmp_path):
    """Bytes, a byte-cast memoryview of an array (what the writer hashes), a memory-mapped slice (what the
    reader verifies) and empty input: the same value as zlib.crc32, so traces written before stay valid."""
    rng = np.random.default_rng(0)
    arr = rng.standard_normal(100_003).astype(np.float32)
    path = tmp_path / "blob.bin"
    path.write_bytes(arr.tobytes())
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    for buf in (arr.tobytes(), memoryview(arr).cast("B"), mm[12:400_000], mm[0:0], b""):
        assert fmt.crc32(buf) == zlib.crc32(buf)


def test_isal_is_installed_and_used():
    """isal is pinned (requirements/base.txt): the fast checksum is the one the tests exercise."""
    import isal.isal_zlib
    assert fmt.crc32 is isal.isal_zlib.crc32
