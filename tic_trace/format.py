"""The on-disk trace format: a directory of framed msgpack files and raw blobs.

    <trace>/manifest.msgpack              shared facts: schema, framework, versions, model config, world layout
    <trace>/rank00003/rank.msgpack        this rank's parallel coordinates
    <trace>/rank00003/pass00012.idx       the records of one pass (msgpack, framed)
    <trace>/rank00003/pass00012.bin       their tensor bytes, little-endian, concatenated

Every msgpack file is framed: magic, schema version, kind, payload length, CRC32, payload. Nothing is ever
unpickled. Files are written under a temporary name and renamed, blob before index, so the presence of an
index means its pass is complete, and a crash leaves earlier passes readable.
"""
from __future__ import annotations

import os
import stat
import struct
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import msgpack
import numpy as np

from .dtypes import dtype_info, known_dtype, to_float

SCHEMA_VERSION = 1
MAGIC = b"TICTRACE"
_HEADER = struct.Struct("<8sHHQI")  # magic, schema, kind, payload length, crc32
KIND_MANIFEST, KIND_RANK, KIND_INDEX = 1, 2, 3
_KIND_NAMES = {KIND_MANIFEST: "manifest", KIND_RANK: "rank", KIND_INDEX: "pass index"}


class TraceFormatError(Exception):
    """A trace file is missing, truncated, corrupted or of an unsupported version."""

    def __init__(self, path: os.PathLike | str, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


# ---------------------------------------------------------------- framed msgpack

def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_framed(path: Path, kind: int, obj: Any) -> None:
    payload = msgpack.packb(obj, use_bin_type=True)
    header = _HEADER.pack(MAGIC, SCHEMA_VERSION, kind, len(payload), zlib.crc32(payload))
    _atomic_write(path, header + payload)


def read_framed(path: Path, kind: int) -> Any:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TraceFormatError(path, f"missing {_KIND_NAMES[kind]} file") from None
    except OSError as e:
        raise TraceFormatError(path, f"cannot read: {e}") from None
    if len(data) < _HEADER.size:
        raise TraceFormatError(path, f"truncated: {len(data)} bytes, shorter than the {_HEADER.size}-byte header")
    magic, schema, got_kind, length, crc = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise TraceFormatError(path, "not a tic-trace file (bad magic bytes)")
    if schema != SCHEMA_VERSION:
        raise TraceFormatError(
            path, f"schema version {schema}, this tic-trace reads version {SCHEMA_VERSION}; "
            "read it with the tic-trace release that wrote it")
    if got_kind != kind:
        raise TraceFormatError(path, f"expected a {_KIND_NAMES[kind]} file, found kind {got_kind}")
    payload = memoryview(data)[_HEADER.size:]
    if length != len(payload):
        raise TraceFormatError(path, f"truncated or padded: header says {length} payload bytes, file has {len(payload)}")
    if zlib.crc32(payload) != crc:
        raise TraceFormatError(path, "checksum mismatch: the file is corrupted")
    try:
        # Limits stop a hostile length field from allocating beyond the file's own size.
        n = len(payload)
        return msgpack.unpackb(payload, raw=False, strict_map_key=True, max_str_len=n,
                               max_bin_len=n, max_array_len=n, max_map_len=n, max_ext_len=0)
    except Exception as e:  # msgpack raises several unrelated types
        raise TraceFormatError(path, f"undecodable msgpack payload: {type(e).__name__}: {e}") from None


# ---------------------------------------------------------------- records

STAT_FIELDS = ("count", "sum", "sumsq", "absmax", "min", "max", "nan", "inf")


@dataclass
class Record:
    """One captured tensor. `data` methods read lazily from the pass's blob."""
    name: str
    module: str
    kind: str                 # "op" | "out" | "in" | "tap"
    op: str | None
    call: int
    seq: int
    phase: str
    dtype: str
    shape: tuple[int, ...]
    mode: str                 # "stats" | "full" | "rows"
    stats: dict | None
    hash: int | None
    offset: int = -1
    nbytes: int = 0
    crc: int | None = None
    row_index: list[int] | None = None   # rows mode: which pass rows the stored rows are
    ops_in_region: int | None = None     # module records: dispatcher ops seen inside the module call
    point: str | None = None
    extra: dict = field(default_factory=dict)
    _pass: "Pass | None" = field(default=None, repr=False, compare=False)

    @property
    def has_data(self) -> bool:
        return self.offset >= 0

    @property
    def stored_shape(self) -> tuple[int, ...]:
        if self.mode == "rows" and self.row_index is not None:
            dims = int(self.extra.get("row_dims", 1)) if isinstance(self.extra, dict) else 1
            return (len(self.row_index), *self.shape[max(1, min(dims, 2)):])
        return self.shape

    def raw(self, verify: bool = True) -> np.ndarray:
        """The stored bits as a read-only numpy array (a memmap view: no copy)."""
        if not self.has_data or self._pass is None:
            raise ValueError(f"record {self.name!r} holds statistics only (mode {self.mode!r}); "
                             "re-trace with mode='full' or 'rows' for values")
        return self._pass._array(self, verify)

    def values(self, verify: bool = True) -> np.ndarray:
        """Values as float32/float64 (bf16/fp8 decoded exactly)."""
        return to_float(self.raw(verify), self.dtype)

    def to_wire(self) -> dict:
        d = {"name": self.name, "module": self.module, "kind": self.kind, "op": self.op, "call": self.call,
             "seq": self.seq, "phase": self.phase, "dtype": self.dtype, "shape": list(self.shape),
             "mode": self.mode, "stats": self.stats, "hash": self.hash, "offset": self.offset,
             "nbytes": self.nbytes, "crc": self.crc, "row_index": self.row_index,
             "ops_in_region": self.ops_in_region, "point": self.point}
        if self.extra:
            d["extra"] = self.extra
        return d


_MAX_DIMS = 32           # numpy 1.x's limit; no real activation has more
_MAX_BYTES = 1 << 62     # a shape whose non-zero dims span more than this is not a tensor anyone wrote


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _record_from_wire(d: Any, path: Path, blob_size: int) -> Record:
    """Validate one wire record. Every field is type-checked here, so a hostile index fails with a
    TraceFormatError naming the file, never with a stray TypeError/OverflowError or a huge allocation."""
    def bad(problem: str):
        return TraceFormatError(path, f"record {d.get('name') if isinstance(d, dict) else '?'!r}: {problem}")

    if not isinstance(d, dict):
        raise TraceFormatError(path, "a record is not a map")
    try:
        name, dtype, shape = d["name"], d["dtype"], d["shape"]
    except KeyError as e:
        raise bad(f"missing field {e}") from None
    offset, nbytes, call, seq = d.get("offset", -1), d.get("nbytes", 0), d.get("call", 0), d.get("seq", 0)
    for field_name, v in (("offset", offset), ("nbytes", nbytes), ("call", call), ("seq", seq)):
        if not _is_int(v):
            raise bad(f"malformed field {field_name!r}: {v!r:.80}")
    if offset < -1 or nbytes < 0:
        raise bad(f"negative offset {offset} or byte length {nbytes}")
    if not isinstance(name, str):
        raise bad(f"record name is not a string: {name!r:.80}")
    if not isinstance(dtype, str) or not known_dtype(dtype):
        raise bad(f"unknown dtype {dtype!r:.80}")
    if not isinstance(shape, list) or len(shape) > _MAX_DIMS or not all(_is_int(s) and s >= 0 for s in shape):
        raise bad(f"malformed shape {shape!r:.200}")
    row_index = d.get("row_index")
    if row_index is not None and (not isinstance(row_index, list) or not all(_is_int(i) and i >= 0 for i in row_index)):
        raise bad("malformed row_index")
    stats = d.get("stats")
    if stats is not None and not (isinstance(stats, dict) and all(
            k in stats and isinstance(stats[k], (int, float)) for k in STAT_FIELDS)):
        raise bad("malformed stats")
    extra = d.get("extra") or {}
    if not isinstance(extra, dict) or ("row_dims" in extra and extra["row_dims"] not in (1, 2)):
        raise bad("malformed extra")
    for field_name in ("hash", "crc", "ops_in_region"):
        if d.get(field_name) is not None and not _is_int(d[field_name]):
            raise bad(f"malformed field {field_name!r}")
    for field_name in ("op", "point"):
        if d.get(field_name) is not None and not isinstance(d[field_name], str):
            raise bad(f"malformed field {field_name!r}")
    mode = d.get("mode", "stats")
    rec = Record(name=name, module=str(d.get("module", "")), kind=str(d.get("kind", "op")), op=d.get("op"),
                 call=call, seq=seq, phase=str(d.get("phase", "forward")),
                 dtype=dtype, shape=tuple(shape), mode=str(mode), stats=stats, hash=d.get("hash"),
                 offset=offset, nbytes=nbytes, crc=d.get("crc"), row_index=row_index,
                 ops_in_region=d.get("ops_in_region"), point=d.get("point"), extra=extra)
    itemsize = np.dtype(dtype_info(dtype).storage).itemsize
    stored = rec.stored_shape
    # Python ints: an int64 product of hostile dims would wrap (2**32 * 2**32 == 0) and pass the checks below.
    span = 1
    for s in stored:
        span *= max(s, 1)
    if span * itemsize > _MAX_BYTES:
        raise bad(f"shape {list(stored)} of {dtype} is too large to be a stored tensor")
    if offset >= 0:
        numel = 1
        for s in stored:
            numel *= s
        expect = numel * itemsize
        if nbytes != expect:
            raise bad(f"byte length {nbytes} does not match shape {list(stored)} of {dtype} ({expect})")
        if offset + nbytes > blob_size:
            raise bad(f"data [{offset}, {offset + nbytes}) lies beyond the blob's {blob_size} bytes (truncated blob?)")
    return rec


# ---------------------------------------------------------------- writing

def rank_dir_name(rank: int) -> str:
    return f"rank{rank:05d}"


def pass_stem(index: int) -> str:
    return f"pass{index:05d}"


class PassWriter:
    """Streams one pass: tensor bytes go to the blob as they arrive, the index is written at `close`."""

    def __init__(self, rank_dir: Path, index: int, meta: dict):
        self.rank_dir = rank_dir
        self.index = index
        self.meta = dict(meta)
        self.records: list[Record] = []
        self._blob_path = rank_dir / f"{pass_stem(index)}.bin"
        fd, self._tmp = tempfile.mkstemp(prefix=f".{pass_stem(index)}.", suffix=".bin.tmp", dir=rank_dir)
        self._blob = os.fdopen(fd, "wb")
        self._size = 0

    def write_bytes(self, data) -> tuple[int, int, int]:
        """Append `data` (bytes-like) to the blob; returns (offset, nbytes, crc32)."""
        mv = memoryview(data).cast("B")
        offset = self._size
        self._blob.write(mv)
        self._size += mv.nbytes
        return offset, mv.nbytes, zlib.crc32(mv)

    def add(self, rec: Record) -> None:
        self.records.append(rec)

    def close(self) -> Path:
        self._blob.flush()
        os.fsync(self._blob.fileno())
        self._blob.close()
        os.replace(self._tmp, self._blob_path)
        payload = dict(self.meta)
        payload.update(index=self.index, blob=self._blob_path.name, blob_nbytes=self._size,
                       records=[r.to_wire() for r in self.records])
        idx = self.rank_dir / f"{pass_stem(self.index)}.idx"
        write_framed(idx, KIND_INDEX, payload)
        return idx

    def abort(self) -> None:
        try:
            self._blob.close()
        finally:
            try:
                os.unlink(self._tmp)
            except OSError:
                pass


class TraceWriter:
    """Writes one rank's share of a trace directory. Several ranks may share one directory."""

    def __init__(self, out_dir: os.PathLike | str, rank: int, manifest: dict, rank_info: dict):
        self.root = Path(out_dir)
        self.rank = rank
        self.rank_dir = self.root / rank_dir_name(rank)
        self.rank_dir.mkdir(parents=True, exist_ok=True)
        m = {"schema": SCHEMA_VERSION, "format": "tic-trace", **manifest}
        # Every rank writes the same shared manifest atomically; rank-specific facts live in rank.msgpack.
        write_framed(self.root / "manifest.msgpack", KIND_MANIFEST, m)
        write_framed(self.rank_dir / "rank.msgpack", KIND_RANK, {"rank": rank, **rank_info})
        existing = [int(p.name[4:9]) for p in self.rank_dir.glob("pass*.idx") if p.name[4:9].isdigit()]
        self.next_index = max(existing) + 1 if existing else 0

    def begin_pass(self, meta: dict) -> PassWriter:
        w = PassWriter(self.rank_dir, self.next_index, meta)
        self.next_index += 1
        return w


# ---------------------------------------------------------------- reading

class Pass:
    """One pass of one rank: its metadata, rows and records. Arrays are memory-mapped on demand."""

    def __init__(self, index_path: Path, rank: int):
        self.path = index_path
        self.rank = rank
        meta = read_framed(index_path, KIND_INDEX)
        if not isinstance(meta, dict) or not isinstance(meta.get("records"), list):
            raise TraceFormatError(index_path, "pass index has no record list")
        self.meta = meta
        blob_name = meta.get("blob")
        if not isinstance(blob_name, str) or not blob_name or "/" in blob_name or "\\" in blob_name \
                or "\x00" in blob_name or blob_name.startswith(".") or len(blob_name) > 255:
            raise TraceFormatError(index_path, f"bad blob file name {blob_name!r:.300}")
        if not _is_int(meta.get("index", 0)):
            raise TraceFormatError(index_path, "malformed pass index number")
        if meta.get("tag") is not None and not isinstance(meta["tag"], str):
            raise TraceFormatError(index_path, "malformed pass tag")
        self.blob_path = index_path.parent / blob_name
        try:
            st = self.blob_path.stat()
        except FileNotFoundError:
            raise TraceFormatError(self.blob_path, "missing blob file for this pass index") from None
        except OSError as e:
            raise TraceFormatError(self.blob_path, f"cannot read blob: {e}") from None
        if not stat.S_ISREG(st.st_mode):
            raise TraceFormatError(self.blob_path, "blob is not a regular file")
        self.blob_size = st.st_size
        declared = meta.get("blob_nbytes")
        if declared != self.blob_size:
            raise TraceFormatError(self.blob_path, f"blob is {self.blob_size} bytes, its index declares {declared} (truncated?)")
        self.records = [_record_from_wire(d, index_path, self.blob_size) for d in meta["records"]]
        for r in self.records:
            r._pass = self
        self._by_name = {r.name: r for r in self.records}
        self._mm: np.memmap | None = None
        rows = meta.get("rows")
        if rows is not None:
            if not isinstance(rows, dict) or not all(isinstance(rows.get(k), list) for k in ("keys", "positions")):
                raise TraceFormatError(index_path, "malformed row identity table")
            if len(rows["keys"]) != len(rows["positions"]):
                raise TraceFormatError(index_path, "row identity table: keys and positions differ in length")
            tokens = rows.get("tokens")
            if not all(k is None or isinstance(k, str) for k in rows["keys"]) \
                    or not all(_is_int(p) for p in rows["positions"]) \
                    or (tokens is not None and (not isinstance(tokens, list) or len(tokens) != len(rows["keys"])
                                                or not all(_is_int(t) for t in tokens))):
                raise TraceFormatError(index_path, "malformed row identity table")
            n_rows = len(rows["keys"])
            for r in self.records:
                if r.row_index is not None and any(i >= n_rows for i in r.row_index):
                    raise TraceFormatError(index_path, f"record {r.name!r}: row_index beyond the {n_rows} rows of the pass")
        self.rows = rows

    @property
    def index(self) -> int:
        return int(self.meta.get("index", 0))

    @property
    def tag(self) -> str | None:
        return self.meta.get("tag")

    def record(self, name: str) -> Record:
        return self._by_name[name]

    def get(self, name: str) -> Record | None:
        return self._by_name.get(name)

    def _array(self, rec: Record, verify: bool) -> np.ndarray:
        if self._mm is None:
            if self.blob_size == 0:
                return np.zeros(rec.stored_shape, dtype=dtype_info(rec.dtype).storage)
            try:
                self._mm = np.memmap(self.blob_path, dtype=np.uint8, mode="r")
            except (OSError, ValueError) as e:
                raise TraceFormatError(self.blob_path, f"cannot map blob: {e}") from None
        if rec.offset + rec.nbytes > self._mm.shape[0]:
            raise TraceFormatError(self.blob_path, f"record {rec.name!r} lies beyond the end of the blob")
        buf = self._mm[rec.offset: rec.offset + rec.nbytes]
        if verify and rec.crc is not None and zlib.crc32(buf) != rec.crc:
            raise TraceFormatError(self.blob_path, f"record {rec.name!r}: checksum mismatch, the blob is corrupted")
        return buf.view(dtype_info(rec.dtype).storage).reshape(rec.stored_shape)


class Trace:
    """A trace directory opened for reading. Cheap: pass indices are parsed on demand."""

    def __init__(self, path: os.PathLike | str):
        self.path = Path(path)
        if not self.path.is_dir():
            raise TraceFormatError(self.path, "not a trace directory (does not exist or is not a directory)")
        self.manifest = read_framed(self.path / "manifest.msgpack", KIND_MANIFEST)
        if not isinstance(self.manifest, dict):
            raise TraceFormatError(self.path / "manifest.msgpack", "manifest is not a map")
        self._rank_info: dict[int, dict] = {}

    @property
    def ranks(self) -> list[int]:
        out = []
        for p in sorted(self.path.glob("rank*")):
            if p.is_dir() and p.name[4:].isdigit():
                out.append(int(p.name[4:]))
        return out

    def rank_info(self, rank: int) -> dict:
        if rank not in self._rank_info:
            info = read_framed(self.path / rank_dir_name(rank) / "rank.msgpack", KIND_RANK)
            if not isinstance(info, dict):
                raise TraceFormatError(self.path / rank_dir_name(rank) / "rank.msgpack", "rank info is not a map")
            self._rank_info[rank] = info
        return self._rank_info[rank]

    def pass_indices(self, rank: int) -> list[int]:
        d = self.path / rank_dir_name(rank)
        return sorted(int(p.name[4:9]) for p in d.glob("pass*.idx") if p.name[4:9].isdigit())

    def open_pass(self, rank: int, index: int) -> Pass:
        return Pass(self.path / rank_dir_name(rank) / f"{pass_stem(index)}.idx", rank)

    def passes(self, rank: int | None = None) -> Iterator[Pass]:
        """Passes in order, one rank (default: every rank, rank-major). Each is parsed when reached."""
        for r in ([rank] if rank is not None else self.ranks):
            for i in self.pass_indices(r):
                yield self.open_pass(r, i)


def open_trace(path: os.PathLike | str) -> Trace:
    """Open a trace directory for reading; raises TraceFormatError if its manifest is unreadable."""
    return Trace(path)
