"""The rollout's routed experts per traced sample, on disk (issue 37, routing replay / R3).

With slime's `--use-rollout-routing-replay`, SGLang returns, per request, the expert ids its router chose for every
token it computed (`meta_info["routed_experts"]`, int32 `[tokens - 1, layers, topk]` in SGLang's top-k slot order),
slime keeps them on the sample (`Sample.rollout_routed_experts`) and hands them to Megatron to replay. This file
keeps those ids for the traced samples, so the answer flow can check that the trainer applied them
(`compare/routing_replay.py`).

Row `i` of a sample's array holds the experts of the token at position `i` (the last token is sampled, never fed
back: it has no row). One msgpack document, never pickle:

    {"format": "tic-trace routed experts", "version": 1, "rollout_id": int, "source": str,
     "samples": [{"key": str, "shape": [rows, layers, topk], "ids": bytes (int32, little-endian),
                  "crc32": int (of the ids bytes)}, ...]}

numpy and msgpack only.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import zlib

import msgpack
import numpy as np

from .errors import TraceFormatError
from .format import atomic_write, read_bounded

FORMAT = "tic-trace routed experts"
VERSION = 1
SUFFIX = ".routed_experts.msgpack"
_MAX_BYTES = 1 << 32        # 4 GiB: 1k samples of 32k tokens x 64 layers x topk 8, with room
_MAX_RANK = 3               # [rows, layers, topk]


@dataclass(frozen=True)
class RoutedExperts:
    """The engine's expert ids of a rollout's traced samples, as the trainer received them to replay."""
    rollout_id: int | None
    source: str                          # where the ids were taken from
    samples: Mapping[str, np.ndarray]    # sample key -> int32 [rows, layers, topk], row i = position i


def write_routed_experts(path: os.PathLike | str, rec: RoutedExperts) -> None:
    """Write `rec` to `path` atomically (a reader never sees half a file)."""
    samples = []
    for key, ids in rec.samples.items():
        a = np.ascontiguousarray(np.asarray(ids), dtype="<i4")
        if a.ndim != _MAX_RANK:
            raise ValueError(f"sample {key!r}: routed experts must be [rows, layers, topk], got shape {list(a.shape)}")
        b = a.tobytes()
        samples.append({"key": str(key), "shape": [int(d) for d in a.shape], "ids": b, "crc32": zlib.crc32(b)})
    doc = {"format": FORMAT, "version": VERSION, "rollout_id": rec.rollout_id, "source": rec.source,
           "samples": samples}
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(p, msgpack.packb(doc, use_bin_type=True))


def read_routed_experts(path: os.PathLike | str) -> RoutedExperts:
    """Read one file written by :func:`write_routed_experts`; anything else is a TraceFormatError naming the
    file and what is wrong with it."""
    p = Path(path)
    data = read_bounded(p, p.parent, _MAX_BYTES, "routed experts")
    n = len(data)
    try:
        doc = msgpack.unpackb(data, raw=False, strict_map_key=True, max_str_len=n, max_bin_len=n,
                              max_array_len=n, max_map_len=n, max_ext_len=0)
    except Exception as e:  # msgpack raises several unrelated types
        raise TraceFormatError(p, f"undecodable msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise TraceFormatError(p, f"not a tic-trace routed-experts file (no format {FORMAT!r})")
    if doc.get("version") != VERSION:
        raise TraceFormatError(p, f"routed-experts version {doc.get('version')!r}, this tic-trace reads {VERSION}; "
                                  "read it with the tic-trace release that wrote it")
    rid, source, items = doc.get("rollout_id"), doc.get("source", ""), doc.get("samples")
    if rid is not None and type(rid) is not int or not isinstance(source, str) or not isinstance(items, list):
        raise TraceFormatError(p, "rollout_id must be an integer or nil, source a string and samples a list")
    samples: dict[str, np.ndarray] = {}
    for i, s in enumerate(items):
        key, arr = _sample(p, i, s)
        if key in samples:
            raise TraceFormatError(p, f"sample {key!r} appears twice")
        samples[key] = arr
    return RoutedExperts(rid, source, samples)


def _sample(p: Path, i: int, s: object) -> tuple[str, np.ndarray]:
    if not isinstance(s, dict) or not isinstance(s.get("key"), str) or not isinstance(s.get("ids"), bytes):
        raise TraceFormatError(p, f"samples[{i}]: needs a string key and the ids as bytes")
    shape = s.get("shape")
    if (not isinstance(shape, list) or len(shape) != _MAX_RANK
            or not all(type(d) is int and 0 <= d < 1 << 31 for d in shape)):
        raise TraceFormatError(p, f"samples[{i}] ({s['key']!r}): shape must be 3 non-negative integers "
                                  f"[rows, layers, topk], got {shape!r:.100}")
    want = 4 * shape[0] * shape[1] * shape[2]        # Python integers: a hostile shape cannot wrap around
    if len(s["ids"]) != want:
        raise TraceFormatError(p, f"samples[{i}] ({s['key']!r}): {len(s['ids'])} bytes of ids, shape {shape} "
                                  f"needs {want}")
    if s.get("crc32") != zlib.crc32(s["ids"]):
        raise TraceFormatError(p, f"samples[{i}] ({s['key']!r}): checksum mismatch: the file is corrupted")
    return s["key"], np.frombuffer(s["ids"], dtype="<i4").reshape(shape)


def merge_routed_experts(recs: list[RoutedExperts]) -> dict[str, np.ndarray]:
    """The samples of several files (one per train rank) in one map; a sample two ranks recorded with different
    ids is an error (both ranks received it from the same rollout)."""
    out: dict[str, np.ndarray] = {}
    for r in recs:
        for k, a in r.samples.items():
            if k in out and not np.array_equal(out[k], a):
                raise ValueError(f"sample {k!r}: two train ranks recorded different routed experts")
            out.setdefault(k, a)
    return out


def read_routed_experts_dir(directory: os.PathLike | str) -> list[RoutedExperts]:
    """Every `rank*.routed_experts.msgpack` in `directory` (one per train rank that held a traced sample), in
    name order; other names are ignored. An empty list when the directory does not exist."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return [read_routed_experts(p) for p in sorted(d.iterdir())
            if p.name.startswith("rank") and p.name.endswith(SUFFIX)]
