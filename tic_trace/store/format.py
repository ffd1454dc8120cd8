"""The on-disk trace format: a directory of framed msgpack files and raw blobs.

    <trace>/manifest.msgpack              shared facts: schema, framework, versions, model config, world layout
    <trace>/rank00003/rank.msgpack        this rank's parallel coordinates
    <trace>/rank00003/pass00012.idx       the records of one pass (msgpack, framed)
    <trace>/rank00003/pass00012.bin       their tensor bytes, little-endian, concatenated

Every msgpack file is framed: magic, schema version, kind, payload length, CRC32, payload. Nothing is ever
unpickled. Files are written under a temporary name and renamed, blob before index, so the presence of an
index means its pass was written whole, and a crash leaves earlier passes readable. A pass whose forward
raised is written as `pass00012.incomplete.idx`: kept for a post-mortem, never read as a result.

The reader trusts nothing in a trace (docs/security.md): only names matching the layout above are read
(anything else is listed in `Trace.ignored`), only regular files inside the trace directory (no FIFO, device or
symlink out of it), each with a byte limit checked before reading, and every decoded document is checked
against the typed schema of `schema.py` before any other code looks at it.

This module holds the framing, the record, the layout's names and the reader; `writer.py` writes traces.
"""
from __future__ import annotations

import os
import re
import secrets
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import msgpack
import numpy as np

from . import schema
from .dtypes import dtype_info, known_dtype, to_float
from .errors import TraceFormatError
from .untrusted import file_kind, read_upto

try:    # ISA-L's CRC-32 is the same checksum as zlib's (the format's), ~4x faster; optional
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - exercised by tests/test_checksum.py through a reload
    from zlib import crc32

SCHEMA_VERSION = 1
MAGIC = b"TICTRACE"
_HEADER = struct.Struct("<8sHHQI")  # magic, schema, kind, payload length, crc32
KIND_MANIFEST, KIND_RANK, KIND_INDEX, KIND_USED_LOGPROBS = 1, 2, 3, 4
_KIND_NAMES = {KIND_MANIFEST: "manifest", KIND_RANK: "rank", KIND_INDEX: "pass index", KIND_USED_LOGPROBS: "used log-probs"}
USED_LOGPROBS_DIR = "used_logprobs"     # beside the ranks: the log-probs the side used (store/used_logprobs.py)


# Byte limits per file kind, checked against the file's size before it is read: a manifest or rank file is a
# few KiB; a pass index grows with its records (about 300 bytes each) and its row table.
_MAX_FILE_BYTES = {KIND_MANIFEST: 16 << 20, KIND_RANK: 16 << 20, KIND_INDEX: 1 << 30, KIND_USED_LOGPROBS: 1 << 28}

_RANK_DIR = re.compile(r"rank([0-9]{5,9})", re.ASCII)
_PASS_INDEX = re.compile(r"pass([0-9]{5,9})(\.incomplete)?\.idx", re.ASCII)
INCOMPLETE = ".incomplete"


# ---------------------------------------------------------------- framed msgpack

def new_temp_file(directory: Path, stem: str, suffix: str = ".tmp") -> tuple[int, str]:
    """A new file `directory/.stem.<random>suffix`, opened for writing, with the mode the umask gives
    (`tempfile.mkstemp` forces 0600: traces and reports are meant to be shared)."""
    for _ in range(100):
        path = os.path.join(directory, f".{stem}.{secrets.token_hex(6)}{suffix}")
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), path
        except FileExistsError:
            continue
    raise FileExistsError(f"{directory}: could not create a temporary file")


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to a hidden temporary file beside `path` (mode from the umask) and rename it over `path`;
    nothing is left behind when anything fails."""
    fd, tmp = new_temp_file(path.parent, path.name)
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
    header = _HEADER.pack(MAGIC, SCHEMA_VERSION, kind, len(payload), crc32(payload))
    atomic_write(path, header + payload)


def read_framed(path: Path, kind: int, root: Path | None = None) -> Any:
    """Decode one framed file of `kind`, read only if it is a regular file inside `root` (default: its own
    directory) no larger than the kind's byte limit."""
    data = read_bounded(path, root if root is not None else path.parent, _MAX_FILE_BYTES[kind], _KIND_NAMES[kind])
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
    if crc32(payload) != crc:
        raise TraceFormatError(path, "checksum mismatch: the file is corrupted")
    try:
        # Limits stop a hostile length field from allocating beyond the file's own size.
        n = len(payload)
        return msgpack.unpackb(payload, raw=False, strict_map_key=True, max_str_len=n,
                               max_bin_len=n, max_array_len=n, max_map_len=n, max_ext_len=0)
    except Exception as e:  # msgpack raises several unrelated types
        raise TraceFormatError(path, f"undecodable msgpack payload: {type(e).__name__}: {e}") from None


def check_inside(path: Path, root: Path) -> Path:
    """`path` with symlinks resolved, if that lies inside `root`; else TraceFormatError."""
    real, top = os.path.realpath(path), os.path.realpath(root)
    if real != top and not real.startswith(top.rstrip(os.sep) + os.sep):
        raise TraceFormatError(path, f"is a symlink leading out of the trace directory (to {real!r:.200})")
    return Path(real)


def read_bounded(path: Path, root: Path, limit: int, what: str) -> bytes:
    """The bytes of a regular file inside `root`, at most `limit` of them. Opened non-blocking, so a FIFO
    cannot hang the reader, and checked with fstat before reading, so /dev/zero cannot fill memory."""
    real = check_inside(path, root)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise TraceFormatError(path, f"missing {what} file") from None
    except OSError as e:
        raise TraceFormatError(path, f"cannot open: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TraceFormatError(path, f"{what} is not a regular file ({file_kind(st.st_mode)})")
        if st.st_size > limit:
            raise TraceFormatError(path, f"{what} is {st.st_size} bytes, over the {limit}-byte limit for such a file")
        data = read_upto(fd, st.st_size + 1, 1 << 24)   # one byte more: a file that grows while read is refused
    except OSError as e:
        raise TraceFormatError(path, f"cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > st.st_size:
        raise TraceFormatError(path, "changed size while being read")
    return data


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


def _record_from_wire(d: Any, path: Path, blob_size: int) -> Record:
    """Validate one wire record: field types by `schema.RecordWire`, then what the types cannot say (known
    dtype, sizes against the blob), so a hostile index fails with a TraceFormatError naming the file, never
    with a stray TypeError/OverflowError or a huge allocation."""
    name = d.get("name") if isinstance(d, dict) else None
    schema.validate(d, schema.RecordWire, path, f"record {name!r:.100}" if isinstance(name, str) else "a record")

    def bad(problem: str):
        return TraceFormatError(path, f"record {name!r:.100}: {problem}")

    dtype, shape = d["dtype"], d["shape"]
    offset, nbytes = d.get("offset", -1), d.get("nbytes", 0)
    if offset < -1 or nbytes < 0:
        raise bad(f"negative offset {offset} or byte length {nbytes}")
    if not known_dtype(dtype):
        raise bad(f"unknown dtype {dtype!r:.80}")
    if len(shape) > _MAX_DIMS or any(s < 0 for s in shape):
        raise bad(f"malformed shape {shape!r:.200}")
    row_index = d.get("row_index")
    if row_index is not None and any(i < 0 for i in row_index):
        raise bad("malformed row_index")
    extra = d.get("extra") or {}
    if "row_dims" in extra and extra["row_dims"] not in (1, 2):
        raise bad("malformed extra")
    rec = Record(name=name, module=d.get("module", ""), kind=d.get("kind", "op"), op=d.get("op"),
                 call=d.get("call", 0), seq=d.get("seq", 0), phase=d.get("phase", "forward"),
                 dtype=dtype, shape=tuple(shape), mode=d.get("mode", "stats"), stats=d.get("stats"),
                 hash=d.get("hash"), offset=offset, nbytes=nbytes, crc=d.get("crc"), row_index=row_index,
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


# ---------------------------------------------------------------- the layout's names

def rank_dir_name(rank: int) -> str:
    return f"rank{rank:05d}"


def pass_stem(index: int) -> str:
    return f"pass{index:05d}"


def pass_index_name(index: int, complete: bool = True) -> str:
    return f"{pass_stem(index)}{'' if complete else INCOMPLETE}.idx"


def _rank_of_dir(name: str) -> int | None:
    """The rank a directory name stands for, if it is exactly `rank_dir_name(rank)` (ASCII digits only:
    `rank²` and `rank٣` are not ranks, and `rank000001` is not a second spelling of rank 1)."""
    m = _RANK_DIR.fullmatch(name)
    return int(m.group(1)) if m and rank_dir_name(int(m.group(1))) == name else None


def _pass_of_index(name: str) -> tuple[int, bool] | None:
    """(pass index, complete) of a pass index file name in the canonical spelling; None for anything else
    (`pass00000.bak.idx`, `pass0.idx`, editor backups)."""
    m = _PASS_INDEX.fullmatch(name)
    if not m:
        return None
    i, complete = int(m.group(1)), m.group(2) is None
    return (i, complete) if pass_index_name(i, complete) == name else None


def list_passes(rank_dir: Path) -> tuple[dict[int, bool], list[str]]:
    """{pass index: complete} of the pass index files in a rank directory, and the names of other entries
    (besides blobs, rank.msgpack and temporary files) that are no part of the layout."""
    passes: dict[int, bool] = {}
    ignored: list[str] = []
    try:
        names = sorted(os.listdir(rank_dir))
    except FileNotFoundError:
        return passes, ignored
    except OSError as e:
        raise TraceFormatError(rank_dir, f"cannot list the rank directory: {e.strerror or e}") from None
    for name in names:
        got = _pass_of_index(name)
        if got is None:
            if not (name == "rank.msgpack" or name.startswith(".") or re.fullmatch(r"pass[0-9]{5,9}\.bin", name)):
                ignored.append(name)
            continue
        i, complete = got
        if i in passes:   # pass00003.idx and pass00003.incomplete.idx: the index is taken once, complete wins
            ignored.append(name)
        passes[i] = passes.get(i, False) or complete
    return passes, ignored


# ---------------------------------------------------------------- reading

class Pass:
    """One pass of one rank: its metadata, rows and records. Arrays are memory-mapped on demand."""

    def __init__(self, index_path: Path, rank: int, root: Path | None = None):
        self.path = index_path
        self.rank = rank
        root = root if root is not None else index_path.parent
        meta = read_framed(index_path, KIND_INDEX, root)
        self.meta = schema.validate(meta, schema.PassMeta, index_path, "pass index")
        self.complete = bool(meta.get("complete", True))
        self.incomplete_reason: str | None = meta.get("incomplete")
        self.blob_path = index_path.parent / meta["blob"]
        real = check_inside(self.blob_path, root)
        try:
            st = real.stat()
        except FileNotFoundError:
            raise TraceFormatError(self.blob_path, "missing blob file for this pass index") from None
        except OSError as e:
            raise TraceFormatError(self.blob_path, f"cannot read blob: {e}") from None
        if not stat.S_ISREG(st.st_mode):
            raise TraceFormatError(self.blob_path, f"blob is not a regular file ({file_kind(st.st_mode)})")
        self.blob_size = st.st_size
        declared = meta["blob_nbytes"]
        if declared != self.blob_size:
            raise TraceFormatError(self.blob_path, f"blob is {self.blob_size} bytes, its index declares {declared} (truncated?)")
        self.records = [_record_from_wire(d, index_path, self.blob_size) for d in meta["records"]]
        for r in self.records:
            r._pass = self
        self._by_name = {r.name: r for r in self.records}
        self._mm: np.memmap | None = None
        self._verified: set[tuple] = set()    # (offset, nbytes, crc) of records whose bytes matched
        self.rows = _checked_rows(meta.get("rows"), self.records, index_path)

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
        """A read-only view of one record's bytes (the blob was checked regular, inside the trace, and as
        long as its index says, when the pass was opened)."""
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
        if verify and rec.crc is not None and (rec.offset, rec.nbytes, rec.crc) not in self._verified:
            if crc32(buf) != rec.crc:
                raise TraceFormatError(self.blob_path, f"record {rec.name!r}: checksum mismatch, the blob is corrupted")
            self._verified.add((rec.offset, rec.nbytes, rec.crc))   # per Pass object: once is enough
        return buf.view(dtype_info(rec.dtype).storage).reshape(rec.stored_shape)


def _checked_rows(rows: dict | None, records: list[Record], path: Path) -> dict | None:
    """The row table, if its lists agree in length and every record's row_index points into it."""
    if rows is None:
        return None
    n_rows = len(rows["keys"])
    tokens = rows.get("tokens")
    if len(rows["positions"]) != n_rows or (tokens is not None and len(tokens) != n_rows):
        raise TraceFormatError(path, "row identity table: keys, positions and tokens differ in length")
    for r in records:
        if r.row_index is not None and any(i >= n_rows for i in r.row_index):
            raise TraceFormatError(path, f"record {r.name!r:.100}: row_index beyond the {n_rows} rows of the pass")
    return rows


class Trace:
    """A trace directory opened for reading. Cheap: pass indices are parsed on demand. The layout is listed
    once, when first needed: a trace is read as the snapshot it was then."""

    def __init__(self, path: os.PathLike | str):
        self.path = Path(path)
        if not self.path.is_dir():
            raise TraceFormatError(self.path, "not a trace directory (does not exist or is not a directory)")
        mpath = self.path / "manifest.msgpack"
        self.manifest = schema.validate(read_framed(mpath, KIND_MANIFEST, self.path), schema.Manifest, mpath, "manifest")
        self._rank_info: dict[int, dict] = {}
        self._ranks: list[int] | None = None
        self._passes: dict[int, dict[int, bool]] = {}
        self._ignored: list[str] = []

    def _list_ranks(self) -> list[int]:
        if self._ranks is None:
            ranks = []
            try:
                names = sorted(os.listdir(self.path))
            except OSError as e:
                raise TraceFormatError(self.path, f"cannot list the trace directory: {e.strerror or e}") from None
            for name in names:
                rank = _rank_of_dir(name)
                if rank is None:
                    if name not in ("manifest.msgpack", USED_LOGPROBS_DIR) and not name.startswith("."):
                        self._ignored.append(name)
                    continue
                p = self.path / name
                check_inside(p, self.path)
                if p.is_dir():
                    ranks.append(rank)
                else:
                    self._ignored.append(name)
            self._ranks = ranks
        return self._ranks

    def _list_passes(self, rank: int) -> dict[int, bool]:
        if rank not in self._passes:
            if rank not in self._list_ranks():
                raise TraceFormatError(self.path, f"no rank {rank} in this trace (ranks: {self._list_ranks()})")
            passes, ignored = list_passes(self.path / rank_dir_name(rank))
            self._ignored.extend(f"{rank_dir_name(rank)}/{n}" for n in ignored)
            self._passes[rank] = passes
        return self._passes[rank]

    @property
    def ranks(self) -> list[int]:
        return list(self._list_ranks())

    @property
    def ignored(self) -> list[str]:
        """Entries that are no part of the layout (not read): stray files, `rank²`, `pass00000.bak.idx`."""
        for r in self._list_ranks():
            self._list_passes(r)
        return list(self._ignored)

    def rank_info(self, rank: int) -> dict:
        if rank not in self._rank_info:
            path = self.path / rank_dir_name(rank) / "rank.msgpack"
            if not os.path.lexists(path):
                raise TraceFormatError(path, "missing: the run is incomplete (its tracer failed and could not "
                                             "even write how it ended, e.g. a full disk)")
            self._rank_info[rank] = schema.validate(read_framed(path, KIND_RANK, self.path), schema.RankInfo,
                                                    path, "rank file")
        return self._rank_info[rank]

    def pass_indices(self, rank: int) -> list[int]:
        """The complete passes of a rank, in order (incomplete ones: `incomplete_pass_indices`)."""
        return sorted(i for i, complete in self._list_passes(rank).items() if complete)

    def incomplete_pass_indices(self, rank: int) -> list[int]:
        """Passes whose forward raised or that ended inside a forward: kept for a post-mortem, never compared."""
        return sorted(i for i, complete in self._list_passes(rank).items() if not complete)

    def skipped(self) -> list[str]:
        """One line per incomplete pass (with why), for reports: what the reader did not use."""
        out = []
        for r in self._list_ranks():
            for i in self.incomplete_pass_indices(r):
                try:
                    why = self.open_pass(r, i).incomplete_reason or "incomplete"
                except TraceFormatError as e:
                    why = f"incomplete, and unreadable: {e.problem}"
                out.append(f"rank {r} pass {i}: {why}")
        return out

    def incomplete_runs(self) -> list[str]:
        """One line per rank whose run ended early (its tracer failed: a write, or its own code): passes after
        the failure are missing, so the trace is not the whole run. A missing rank file says the same."""
        out = []
        for r in self._list_ranks():
            try:
                got = self.rank_info(r).get("incomplete")
            except TraceFormatError as e:
                out.append(f"rank {r}: {e.problem}")
                continue
            if got is not None:
                lost = "" if got.get("lost_pass") is None else f"; pass {got['lost_pass']} lost"
                out.append(f"rank {r}: {got['reason']}{lost}; {got.get('passes_written', '?')} passes written, "
                           f"{got.get('forwards_not_recorded', '?')} later forwards not recorded")
        return out

    def open_pass(self, rank: int, index: int) -> Pass:
        complete = self._list_passes(rank).get(index, True)
        return Pass(self.path / rank_dir_name(rank) / pass_index_name(index, complete), rank, self.path)

    def passes(self, rank: int | None = None) -> Iterator[Pass]:
        """Complete passes in order, one rank (default: every rank, rank-major). Each is parsed when reached."""
        for r in ([rank] if rank is not None else self.ranks):
            for i in self.pass_indices(r):
                yield self.open_pass(r, i)


def open_trace(path: os.PathLike | str) -> Trace:
    """Open a trace directory for reading; raises TraceFormatError if its manifest is unreadable."""
    return Trace(path)
