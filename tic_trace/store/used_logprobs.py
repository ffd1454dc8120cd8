"""The log-probs a side actually used, per token, with what it says it applied to compute them (issue 37).

slime's `train_rollout_logprob_abs_diff` compares two such lists: the log-probs SGLang *returned*
(`meta_info.output_token_logprobs`, computed under the request's sampling parameters) and the log-probs the
trainer computed (`compute_log_prob`: logits / `rollout_temperature`, then log-softmax). A trace's own Δ logprob
is its log-softmax of each side's traced logits; these records let the comparison reconcile the two numbers.

Rows are keyed like the trace's rows: the sample key (`f"{rollout_id}-{sample.index}"`, SGLang's request id and
Megatron's packed-segment key) and the position, in the sample's token sequence, of the token whose log-prob it
is (its logits are the row at `position - 1`).

numpy (and, to read and write the parts, the trace format's msgpack framing) only: both the record flow
(writing, integrations/slime/used_logprobs.py) and the answer flow (reading, tools/slime_reconcile.py) use it.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Sampling:
    """What a side says it applied to the logits before taking the log-prob it used. `None`: not known (the
    comparison then names it unknown, never assumes the default)."""
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = -1          # -1 or 0: off
    min_p: float | None = 0.0
    source: str = ""                # where the numbers came from, e.g. "sglang meta_info.output_token_logprobs"
    extra: dict = field(default_factory=dict)   # other stated parameters (str -> str | float | int | bool)


@dataclass(frozen=True)
class UsedLogprobs:
    """One sample's used log-probs on one side."""
    sample: str                     # the sample key, as the trace's rows
    positions: np.ndarray           # int64 [n]: the position of each token whose log-prob this is
    tokens: np.ndarray              # int64 [n]: its token id
    logprobs: np.ndarray            # float64 [n]: the log-prob the side used
    sampling: Sampling
    mask: np.ndarray | None = None  # float64 [n]: the loss mask the side weighed it with (None: not recorded)

    def __post_init__(self) -> None:
        n = len(self.positions)
        if len(self.tokens) != n or len(self.logprobs) != n or (self.mask is not None and len(self.mask) != n):
            raise ValueError(f"sample {self.sample!r}: {n} positions, {len(self.tokens)} tokens, "
                             f"{len(self.logprobs)} log-probs and {'no' if self.mask is None else len(self.mask)} "
                             "mask values; one of each per token")


# ================================================================== on disk
#
#   <side trace>/used_logprobs/part-<writer>.msgpack    one framed msgpack document per write (a request's answer,
#                                                        a micro-batch's log-probs): {"version": 1, "entries":
#                                                        [{"sample", "positions", "tokens", "logprobs", "sampling",
#                                                        optional "mask"}]}
#
# The arrays are raw little-endian bytes (int64, int64, float64; the optional loss mask float64) in msgpack bin
# fields: nothing is unpickled.
# Each part is written under a temporary name and renamed (format.write_framed): a reader sees whole parts only.
# Several writers (the rollout process, every train rank) write their own parts; the reader merges them.

VERSION = 1
_PART = re.compile(r"part-[0-9a-z][0-9a-z-]{0,99}\.msgpack", re.ASCII)
_MAX_PARTS = 1 << 16
_SAMPLING_NUMBERS = ("temperature", "top_p", "min_p")


def part_name(writer: str) -> str:
    """The file name of one part (`writer`: lower-case letters, digits and dashes)."""
    name = f"part-{writer}.msgpack"
    if not _PART.fullmatch(name):
        raise ValueError(f"part name {name!r}: the writer id must be lower-case letters, digits and dashes")
    return name


def write_part(trace_dir: str | os.PathLike, writer: str, entries: list[UsedLogprobs]) -> Path:
    """Write one part of a side's used log-probs into ``trace_dir/used_logprobs/`` (made if missing)."""
    from .format import KIND_USED_LOGPROBS, USED_LOGPROBS_DIR, write_framed
    d = Path(trace_dir) / USED_LOGPROBS_DIR
    d.mkdir(parents=True, exist_ok=True)
    path = d / part_name(writer)
    write_framed(path, KIND_USED_LOGPROBS, {"version": VERSION, "entries": [_to_wire(e) for e in entries]})
    return path


def _to_wire(e: UsedLogprobs) -> dict:
    s = e.sampling
    mask = {} if e.mask is None else {"mask": np.ascontiguousarray(e.mask, dtype="<f8").tobytes()}
    return {**mask, "sample": e.sample,
            "positions": np.ascontiguousarray(e.positions, dtype="<i8").tobytes(),
            "tokens": np.ascontiguousarray(e.tokens, dtype="<i8").tobytes(),
            "logprobs": np.ascontiguousarray(e.logprobs, dtype="<f8").tobytes(),
            "sampling": {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p,
                         "source": s.source, "extra": dict(s.extra)}}


@dataclass
class UsedLogprobsRead:
    """What a side's trace directory holds of used log-probs: one entry per (sample, sampling) with its tokens
    in position order, the part files read, and notes (conflicting duplicates, files not read)."""
    entries: list[UsedLogprobs] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def present(self) -> bool:
        return bool(self.files)

    def by_sample(self) -> dict[str, list[UsedLogprobs]]:
        out: dict[str, list[UsedLogprobs]] = {}
        for e in self.entries:
            out.setdefault(e.sample, []).append(e)
        return out


def read(trace_dir: str | os.PathLike) -> UsedLogprobsRead:
    """The used log-probs of one side's trace directory (empty when it recorded none). Every part is checked
    before use: a corrupt, truncated or hostile part raises `TraceFormatError` naming the file and the problem;
    names that are no part (``.tmp`` files, strays) are listed in ``ignored``, never read."""
    from .errors import TraceFormatError
    from .format import USED_LOGPROBS_DIR, check_inside
    root = Path(trace_dir)
    d = root / USED_LOGPROBS_DIR
    out = UsedLogprobsRead()
    if not os.path.lexists(d):
        return out
    real = check_inside(d, root)
    if not real.is_dir():
        raise TraceFormatError(d, "is not a directory: the used log-probs are a directory of parts")
    try:
        names = sorted(os.listdir(real))
    except OSError as e:
        raise TraceFormatError(d, f"cannot list: {e.strerror or e}") from None
    parts = [n for n in names if _PART.fullmatch(n)]
    out.ignored = [n for n in names if not _PART.fullmatch(n) and not n.startswith(".")]
    if len(parts) > _MAX_PARTS:
        raise TraceFormatError(d, f"{len(parts)} parts, over the {_MAX_PARTS} a side writes")
    pieces: list[UsedLogprobs] = []
    for n in parts:
        pieces.extend(_read_part(d / n, root))
        out.files.append(f"{USED_LOGPROBS_DIR}/{n}")
    out.entries, out.notes = _merge(pieces)
    return out


def _read_part(path: Path, root: Path) -> list[UsedLogprobs]:
    from .errors import TraceFormatError
    from .format import KIND_USED_LOGPROBS, read_framed
    doc = read_framed(path, KIND_USED_LOGPROBS, root)
    if not isinstance(doc, dict) or doc.get("version") != VERSION or not isinstance(doc.get("entries"), list):
        raise TraceFormatError(path, f"not a version-{VERSION} used log-probs document (a map with 'version' "
                                     f"{VERSION} and a list 'entries')")
    return [_entry(d, path, i) for i, d in enumerate(doc["entries"])]


def _entry(d, path: Path, i: int) -> UsedLogprobs:
    from .errors import TraceFormatError

    def bad(problem: str) -> TraceFormatError:
        return TraceFormatError(path, f"entry {i}: {problem}")
    if not isinstance(d, dict):
        raise bad("not a map")
    sample = d.get("sample")
    if not isinstance(sample, str) or not 0 < len(sample) <= 256:
        raise bad("field 'sample' must be a string of 1 to 256 characters")
    arrays = {}
    for name, dt in (("positions", "<i8"), ("tokens", "<i8"), ("logprobs", "<f8"), ("mask", "<f8")):
        b = d.get(name)
        if name == "mask" and b is None:
            arrays[name] = None
            continue
        if not isinstance(b, bytes) or len(b) % 8:
            raise bad(f"field {name!r} must be raw 8-byte little-endian values (bytes, a multiple of 8 long)")
        arrays[name] = np.frombuffer(b, dtype=dt).astype(dt[1:])
    n, mask = len(arrays["positions"]), arrays["mask"]
    if not n == len(arrays["tokens"]) == len(arrays["logprobs"]) or (mask is not None and len(mask) != n):
        masks = "" if mask is None else f" and {len(mask)} mask values"
        raise bad(f"{n} positions, {len(arrays['tokens'])} tokens, {len(arrays['logprobs'])} log-probs{masks}: "
                  "one of each per token")
    if arrays["mask"] is not None and not np.isfinite(arrays["mask"]).all():
        raise bad("a mask value that is not a finite number")
    if (arrays["positions"] < 0).any() or (arrays["positions"] >= 2**31).any():
        raise bad("a position outside [0, 2**31)")
    if (arrays["tokens"] < 0).any():
        raise bad("a negative token id")
    return UsedLogprobs(sample, arrays["positions"], arrays["tokens"], arrays["logprobs"],
                        _sampling(d.get("sampling"), bad), arrays["mask"])


def _sampling(s, bad) -> Sampling:
    if not isinstance(s, dict):
        raise bad("field 'sampling' must be a map")
    got = {}
    for k in _SAMPLING_NUMBERS:
        v = s.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise bad(f"field 'sampling.{k}' must be a number or null, not {v!r:.80}")
        got[k] = None if v is None else float(v)
    top_k = s.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or abs(top_k) >= 2**63):
        raise bad(f"field 'sampling.top_k' must be an integer or null, not {top_k!r:.80}")
    source, extra = s.get("source", ""), s.get("extra", {})
    if not isinstance(source, str) or len(source) > 4096:
        raise bad("field 'sampling.source' must be a string of at most 4096 characters")
    if not isinstance(extra, dict) or len(extra) > 256 or not all(
            isinstance(k, str) and len(k) <= 256 and (v is None or isinstance(v, (str, int, float, bool)))
            for k, v in extra.items()):
        raise bad("field 'sampling.extra' must be a map of at most 256 names to strings, numbers or booleans")
    return Sampling(temperature=got["temperature"], top_p=got["top_p"], top_k=top_k, min_p=got["min_p"],
                    source=source, extra=dict(extra))


def _merge(pieces: list[UsedLogprobs]) -> tuple[list[UsedLogprobs], list[str]]:
    """One entry per (sample, sampling), sorted by position; a (sample, position) written twice with the same
    token (tensor-parallel ranks, a repeated turn) is kept once; with another token, the first is kept and said."""
    groups: list[list[UsedLogprobs]] = []
    for p in pieces:
        for g in groups:
            if g[0].sample == p.sample and g[0].sampling == p.sampling:
                g.append(p)
                break
        else:
            groups.append([p])
    out, notes = [], []
    seen: dict[tuple[str, int], int] = {}
    for g in groups:
        pos = np.concatenate([p.positions for p in g])
        tok = np.concatenate([p.tokens for p in g])
        lp = np.concatenate([p.logprobs for p in g])
        mask = None if any(p.mask is None for p in g) else np.concatenate([p.mask for p in g])
        keep = []
        for j in np.argsort(pos, kind="stable"):
            key = (g[0].sample, int(pos[j]))
            if key in seen:
                if seen[key] != int(tok[j]):
                    notes.append(f"sample {key[0]!r} position {key[1]}: recorded with tokens {seen[key]} and "
                                 f"{int(tok[j])}; the first is kept")
                continue
            seen[key] = int(tok[j])
            keep.append(j)
        idx = np.asarray(keep, dtype=np.int64)
        out.append(UsedLogprobs(g[0].sample, pos[idx], tok[idx], lp[idx], g[0].sampling,
                                None if mask is None else mask[idx]))
    out.sort(key=lambda e: (e.sample, int(e.positions[0]) if len(e.positions) else -1))
    return out, notes
