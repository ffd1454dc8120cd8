"""The canonical view of a trace, and row alignment between two views.

`CanonicalView` indexes a trace (all ranks, all passes) by canonical point and layer without reading any
tensor; `load()` materialises one point: rank shards merged, laid out as `[rows, ...]`, rows named by
`(sample key, position)` and concatenated over passes (SGLang's prefill + decode steps meet Megatron's one
packed pass here). Memory stays O(one point), never O(trace).
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from ..graph.adapter import Adapter, PointMap, TransformContext, UnknownAdapter, get_adapter, load_adapter, merge, transform
from ..graph.canonical import BY_NAME, key_name, order_key
from ..store.format import Pass, Record, Trace, TraceFormatError, open_trace
from .passes import PASSES_BY, pass_label, pass_renamer

RowId = tuple[str, int]
_CALL_SUFFIX = re.compile(r"#\d+")   # the tracer's scope of a module's second, third, ... call in one pass


@dataclass
class _Entry:
    group: int
    pass_index: int
    layer: int | None
    pm: PointMap
    names: dict[int, str]              # rank -> record name


@dataclass
class CanonicalTensor:
    point: str
    layer: int | None
    rows: list[RowId]
    values: np.ndarray | None          # [rows, ...features]; None when only statistics were recorded
    dtype: str                         # dtype the framework computed in
    stats: list[dict] = field(default_factory=list)   # per source record (stats-only comparison)
    hashes: list[int | None] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # record names, for the report
    duplicates: int = 0                # rows seen more than once (kept: the first)
    notes: list[str] = field(default_factory=list)    # the adapter's remarks on merging the rank shards

    @property
    def key(self) -> str:
        return key_name(self.point, self.layer)


class CanonicalView:
    """One side of a comparison: a trace seen through its adapter."""

    def __init__(self, trace: Trace | str, adapter: Adapter | str | None = None, *, include_recompute: bool = False,
                 passes_by: str = "order"):
        if passes_by not in PASSES_BY:
            raise ValueError(f"passes_by must be one of {', '.join(PASSES_BY)}, not {passes_by!r}")
        self.trace = trace if isinstance(trace, Trace) else open_trace(trace)
        self.passes_by = passes_by
        # (rank, pass index) -> the sample-key rename of that pass's rows (view/passes.py): a repeated pass over
        # the same rows is its own set of rows, compared with the same pass of the other side
        self._pass_key: dict[tuple[int, int], object] = {}
        self.passes: dict[str, int] = {}    # pass label ("1", "2", ... or a tag) -> distinct rows it names
        # An adapter the caller named may be 'module:Class'; the manifest's name only looks up the registry.
        self.adapter = load_adapter(adapter) if adapter is not None else _adapter_of(self.trace)
        self.config = dict(self.trace.manifest.get("model") or {})
        self.skipped = self.trace.skipped()   # incomplete passes: never compared, always reported
        self.include_recompute = include_recompute
        self._passes: dict[tuple[int, int], Pass] = {}
        self._pass_rows: dict[tuple[int, int], tuple[list[RowId | None], bool]] = {}
        self.entries: dict[tuple[str, int | None], list[_Entry]] = defaultdict(list)
        self.notes: dict[str, str] = {}     # point key -> the adapter's remark on merging its rank shards
        self.unmapped: list[str] = []      # module-output records no table row claimed
        self.tokens: dict[RowId, int] = {}
        self.row_ids: set[RowId] = set()    # every named row of the compared passes
        self.duplicate_rows: dict[RowId, int] = {}   # rows named more than once where one point reads them
        self.rows_total = 0
        self.tracer_notes: list[str] = []   # what the tracer said of the passes it wrote (distinct, in order)
        self.repeated_calls = 0            # point records of further calls of the model within one pass
        self._identity: tuple | None = None  # (other view, RowIdentity), see row_identity()
        self._index()

    # ------------------------------------------------------------ indexing
    def _pass(self, rank: int, index: int) -> Pass:
        key = (rank, index)
        if key not in self._passes:
            self._passes[key] = self.trace.open_pass(rank, index)
        return self._passes[key]

    def _index(self) -> None:
        ranks = self.trace.ranks
        infos = {r: self.trace.rank_info(r) for r in ranks}
        groups = self.adapter.rank_groups(ranks, infos)
        compiled = [(pm, pm.regex()) for pm in self.adapter.points if self.adapter.applies(pm, self.config)]
        seen_rows: set[RowId] = set()
        # How often each row is named, per rank group (all its passes), and which points each group feeds:
        # for the duplicate check at the end.
        group_rows: dict[int, dict[RowId, int]] = defaultdict(lambda: defaultdict(int))
        group_points: dict[int, set] = defaultdict(set)
        group_seen: dict[int, dict] = defaultdict(dict)      # original row -> times traced (passes by order)
        group_first: dict[int, dict] = defaultdict(dict)     # original row -> its first token
        for gi, group in enumerate(groups):
            lead = group[0]
            for pidx in self.trace.pass_indices(lead):
                per_rank = {r: self._pass(r, pidx) for r in group if pidx in self.trace.pass_indices(r)}
                lead_pass = per_rank[lead]
                for n in (n for p in per_rank.values() for n in p.meta.get("notes") or []):
                    if n not in self.tracer_notes and len(self.tracer_notes) < 50:    # bounded: shown as is
                        self.tracer_notes.append(n)
                rows = lead_pass.rows
                if rows is not None:
                    toks = rows.get("tokens")
                    counts = group_rows[gi]
                    rename = self._pass_rename(group, pidx, lead_pass, group_seen[gi], group_first[gi])
                    for i, (k, p) in enumerate(zip(rows["keys"], rows["positions"])):
                        if k is None:
                            continue
                        k = rename(k) if rename is not None else k
                        seen_rows.add((k, p))
                        counts[(k, p)] += 1
                        if toks is not None:
                            self.tokens.setdefault((k, p), toks[i])
                claimed: set[str] = set()
                for rec in lead_pass.records:
                    if rec.phase != "forward" and not self.include_recompute:
                        continue
                    if rec.kind == "op":
                        continue
                    # One record may feed several points (a fused QKV output -> q, k, v); per point, the
                    # first matching row of the table wins.
                    got: set[str] = set()
                    for pm, rx in compiled:
                        if pm.point in got:
                            continue
                        m = rx.match(rec.name)
                        if not m:
                            continue
                        layer = None
                        if "layer" in rx.groupindex and m.group("layer") is not None:
                            info = infos[lead]
                            if "chunk" in rx.groupindex and m.group("chunk") is not None:
                                info = {**info, "chunk": int(m.group("chunk"))}   # virtual-pipeline chunk
                            layer = self.adapter.global_layer(int(m.group("layer")), info, self.config)
                        layer = _table_layer(pm, layer, self.config)
                        if layer is not None and layer < 0:
                            continue
                        if not self.adapter.keeps(pm, layer, self.config):
                            continue
                        names = {r: rec.name for r, p in per_rank.items() if p.get(rec.name) is not None}
                        self.entries[(pm.point, layer)].append(_Entry(gi, pidx, layer, pm, names))
                        group_points[gi].add((pm.point, layer))
                        claimed.add(rec.name)
                        got.add(pm.point)
                unclaimed = [r.name for r in lead_pass.records if r.kind == "out" and r.name not in claimed]
                self.unmapped.extend(unclaimed)
                # A point's module called again in the same pass (`name#1`): a further forward of the model
                # (generate() without auto_step, or forwards without tracer.step()). Its rows are not in the
                # pass's row table, so it cannot be compared: counted, so that the report says so.
                self.repeated_calls += sum(1 for n in unclaimed if "#" in n
                                           and any(rx.match(_CALL_SUFFIX.sub("", n)) for _, rx in compiled))
        self.rows_total = len(seen_rows)
        self.row_ids = seen_rows
        labels = defaultdict(set)
        for k, p in seen_rows:
            labels[pass_label(self.passes_by, k)].add((k, p))
        self.passes = {lab: len(r) for lab, r in sorted(labels.items())}
        self.duplicate_rows = _duplicates(group_rows, group_points)

    def _pass_rename(self, group: list[int], pidx: int, lead_pass: Pass, seen: dict, first: dict):
        """The sample-key rename of one pass's rows (view/passes.py), recorded for every rank of its group so
        that `load()` names the rows of its records the same way."""
        rename = pass_renamer(self.passes_by, lead_pass.rows, lead_pass.tag, seen, first)
        for r in group:
            self._pass_key[(r, pidx)] = rename
        return rename

    # ------------------------------------------------------------ queries
    def points(self) -> list[tuple[str, int | None]]:
        keys = set(self.entries)
        if ("logprobs", None) not in keys and ("logits", None) in keys and self.tokens:
            keys.add(("logprobs", None))
        return sorted(keys, key=lambda k: order_key(*k))

    @property
    def n_layers(self) -> int | None:
        n = self.config.get("num_layers")
        if n:
            return int(n)
        layers = [lay for (_, lay) in self.entries if lay is not None]
        return max(layers) + 1 if layers else None

    def load(self, point: str, layer: int | None, *, values: bool = True) -> CanonicalTensor:
        """One point of this side as [rows, ...]. A point recorded once with distinct row ids (the usual case)
        is the adapter's layout of the record itself (a memory-mapped view where no layout changes it):
        no row-by-row walk, no copy."""
        if point == "logprobs" and ("logprobs", None) not in self.entries:
            return self._derived_logprobs()
        out_rows: list[RowId] = []
        chunks: list[np.ndarray] = []
        ct = CanonicalTensor(point, layer, out_rows, None, dtype="float32")
        seen: set[RowId] | None = None      # built only when a second chunk of rows arrives
        for e in self.entries.get((point, layer), []):
            ranks = sorted(e.names)
            recs = [self._pass(r, e.pass_index).record(e.names[r]) for r in ranks]
            lead = recs[0]
            ct.dtype = lead.dtype
            if lead.name not in ct.sources:   # one name per record, however many passes hold it
                ct.sources.append(lead.name)
            ct.stats.append(lead.stats or {})
            ct.hashes.append(lead.hash)
            if not values or not all(r.has_data for r in recs):
                continue
            p = self._pass(ranks[0], e.pass_index)
            rows, distinct = self._rows(ranks[0], e.pass_index, p, lead)
            if not rows:         # a record that holds none of the pass's rows (all left out when traced)
                continue
            try:
                arr, note = self._layout(e, recs, ranks, rows, point, layer)
            except (ValueError, IndexError, KeyError, TypeError) as x:
                # A layout the adapter's table cannot produce: the trace disagrees with its own description.
                raise TraceFormatError(p.path, f"{key_name(point, layer)} from record {lead.name!r:.100}: "
                                               f"{type(x).__name__}: {x}") from None
            if note and note not in ct.notes:
                ct.notes.append(note)
                self.notes.setdefault(key_name(point, layer), note)
            if distinct and not out_rows:
                out_rows.extend(rows)
                chunks.append(arr)
                continue
            if seen is None:
                seen = set(out_rows)
            keep = []
            for i, rid in enumerate(rows):
                if rid is None:
                    continue
                if rid in seen:
                    ct.duplicates += 1
                    continue
                seen.add(rid)
                keep.append(i)
                out_rows.append(rid)
            chunks.append(arr[keep] if len(keep) != len(rows) else arr)
        if chunks:
            shapes = {c.shape[1:] for c in chunks}
            if len(shapes) > 1:
                raise TraceFormatError(self.trace.path, f"{key_name(point, layer)}: passes disagree on its feature "
                                                        f"shape ({' vs '.join(str(list(s)) for s in shapes)})")
            ct.values = chunks[0] if len(chunks) == 1 else np.concatenate(chunks, axis=0)
        return ct

    def _rows(self, rank: int, pass_index: int, p: Pass, rec: Record) -> tuple[list[RowId | None], bool]:
        """`_rows_of(p, rec)` and whether its ids are all present and distinct; kept per pass for records that
        hold every row of the pass (a list shared by every caller: never modified)."""
        if rec.row_index is None and p.rows is not None:
            kept = self.adapter.kept_rows(rec.name, tuple(rec.stored_shape), len(p.rows["keys"]))
            if kept is not None:    # a record of some rows only (e.g. logits_to_keep): the adapter says which
                keys, pos = p.rows["keys"], p.rows["positions"]
                if any(not 0 <= i < len(keys) for i in kept):
                    raise TraceFormatError(p.path, f"record {rec.name!r:.100}: the adapter maps it beyond the "
                                                   f"{len(keys)} rows of the pass")
                rows = self._renamed(rank, pass_index, [None if keys[i] is None else (keys[i], int(pos[i]))
                                                        for i in kept])
                return rows, None not in rows and len(set(rows)) == len(rows)
        if rec.row_index is not None or p.rows is None:
            rows = self._renamed(rank, pass_index, _rows_of(p, rec))
            return rows, None not in rows and len(set(rows)) == len(rows)
        key = (rank, pass_index)
        got = self._pass_rows.get(key)
        if got is None:
            rows = self._renamed(rank, pass_index, _rows_of(p, rec))
            got = self._pass_rows[key] = (rows, None not in rows and len(set(rows)) == len(rows))
        return got

    def _renamed(self, rank: int, pass_index: int, rows: list) -> list:
        """Rows of a repeated (or tagged) pass under their pass's sample keys (`_pass_rename`)."""
        rename = self._pass_key.get((rank, pass_index))
        if rename is None:
            return rows
        return [None if r is None else (rename(r[0]), r[1]) for r in rows]

    def _layout(self, e: _Entry, recs: list[Record], ranks: list[int], rows: list, point: str,
                layer: int | None) -> tuple[np.ndarray, str | None]:
        """One entry's shards merged and laid out as [rows, ...] by the adapter's table, and the adapter's note
        where the shards contradicted what the model declares."""
        lead = recs[0]
        arr, note = self.adapter.merge_shards(e.pm, layer, [r.values() for r in recs], self.config)
        extra = {}
        for name, tmpl in e.pm.also.items():
            rn = tmpl.format(**_name_fields(lead.name, e.pm))
            xs = [self._pass(r, e.pass_index).get(rn) for r in ranks]
            if any(x is None or not x.has_data for x in xs):
                raise KeyError(f"{point}: companion record {rn!r} missing or stats-only")
            extra[name] = merge(e.pm.merge, [x.values() for x in xs], self.config)
        ctx = TransformContext(n_rows=len(rows), config=self.config, opts=e.pm.opts, layer=layer, extra=extra)
        out = transform(e.pm.transform)(arr, ctx)
        if out.ndim == 0 or out.shape[0] != len(rows):
            raise ValueError(f"laid out as {list(out.shape)}, not one entry per each of the {len(rows)} rows")
        return out, note

    def _derived_logprobs(self) -> CanonicalTensor:
        """log-prob of the next token, from logits in float64, where the trace knows the next token."""
        lg = self.load("logits", None)
        ct = CanonicalTensor("logprobs", None, [], None, dtype=lg.dtype,
                             sources=[s + " (log_softmax)" for s in lg.sources])
        if lg.values is None:
            return ct
        keep, nxt, outside = [], [], []
        width = int(lg.values.shape[-1]) if lg.values.ndim > 1 else 0
        for i, (k, p) in enumerate(lg.rows):
            t = self.tokens.get((k, p + 1))
            if t is None:
                continue
            if not 0 <= int(t) < width:     # a padding -1 or an id past the logits: never read as another entry
                outside.append(f"{k}@{p} (next token {int(t)})")
                continue
            keep.append(i)
            nxt.append(t)
        if outside:
            self.notes.setdefault("logprobs", f"{len(outside)} row(s) left out: the next token is outside the "
                                              f"{width} logits ({', '.join(outside[:4])})")
        if not keep:
            return ct
        ct.values = next_token_logprobs(lg.values, np.asarray(keep), np.asarray(nxt))[:, None]
        ct.rows = [lg.rows[i] for i in keep]
        return ct

    def ops_between(self, point: str, layer: int | None, after_seq: int | None = None) -> list[Record]:
        """Dispatcher ops of the first pass that produced this point, from `after_seq` up to the point's record."""
        es = self.entries.get((point, layer))
        if not es:
            return []
        e = es[0]
        rank = sorted(e.names)[0]
        p = self._pass(rank, e.pass_index)
        rec = p.record(e.names[rank])
        lo = after_seq if after_seq is not None else -1
        return [r for r in p.records if r.kind == "op" and lo < r.seq < rec.seq]

    def seq_of(self, point: str, layer: int | None) -> int | None:
        es = self.entries.get((point, layer))
        if not es:
            return None
        e = es[0]
        rank = sorted(e.names)[0]
        return self._pass(rank, e.pass_index).record(e.names[rank]).seq


_MAX_ANONYMOUS_ROWS = 1 << 24
_LOGPROB_BLOCK = 1 << 18     # float64 elements of logits widened at once


def next_token_logprobs(logits: np.ndarray, rows: np.ndarray, nxt: np.ndarray) -> np.ndarray:
    """[len(rows)]: log_softmax(logits[rows[i]])[nxt[i]] in float64, a block of rows at a time (each row's
    numbers are computed alone, so the block size changes none of them; the heap holds one block)."""
    out = np.empty(rows.size)
    step = max(1, _LOGPROB_BLOCK // max(int(np.prod(logits.shape[1:], dtype=np.int64)), 1))
    for r in range(0, rows.size, step):
        x = logits[rows[r:r + step]].reshape(min(step, rows.size - r), -1).astype(np.float64)
        x -= x.max(axis=-1, keepdims=True)
        lse = np.log(np.exp(x).sum(axis=-1))
        out[r:r + step] = x[np.arange(x.shape[0]), nxt[r:r + step]] - lse
    return out


def _rows_of(p: Pass, rec: Record) -> list[RowId | None]:
    """The row ids of a record with values. Only called for records whose bytes are in the blob, so the row
    count is bounded by the file, never by a shape claim alone."""
    if p.rows is None:
        # No row table: rows are positions of one anonymous sample, in order.
        shape = rec.stored_shape
        n = shape[0] if shape else 1
        if n > _MAX_ANONYMOUS_ROWS and n > rec.nbytes:
            raise TraceFormatError(p.path, f"record {rec.name!r:.100} claims {n} rows but holds {rec.nbytes} bytes")
        return [("?", i) for i in range(n)]
    keys, pos = p.rows["keys"], p.rows["positions"]
    idx = rec.row_index if rec.row_index is not None else range(len(keys))
    return [None if keys[i] is None else (keys[i], int(pos[i])) for i in idx]


def _duplicates(group_rows: dict[int, dict[RowId, int]], group_points: dict[int, set]) -> dict[RowId, int]:
    """Rows named more than once where one point reads them: twice in one rank group's passes (one pass, or
    two), or in two groups that feed the same point (two data-parallel ranks given the same sample keys).
    Groups feeding different points (pipeline stages) name the same rows legitimately. Row -> times named."""
    parent = {g: g for g in group_rows}

    def root(g):
        while parent[g] != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g
    owner: dict = {}
    for g in group_rows:
        for key in group_points.get(g, ()):
            if key in owner:
                parent[root(g)] = root(owner[key])
            else:
                owner[key] = g
    merged: dict[int, dict[RowId, int]] = {}
    for g, counts in group_rows.items():
        r = root(g)
        if r not in merged:
            merged[r] = dict(counts)
            continue
        into = merged[r]
        for row, n in counts.items():
            into[row] = into.get(row, 0) + n
    out: dict[RowId, int] = {}
    for counts in merged.values():
        for row, n in counts.items():
            if n > 1:
                out[row] = max(out.get(row, 0), n)
    return out


def _adapter_of(trace: Trace) -> Adapter:
    name = trace.manifest.get("framework", "hf")
    try:
        return get_adapter(name)
    except UnknownAdapter as e:
        raise TraceFormatError(trace.path / "manifest.msgpack", f"framework: {e}") from None


def _table_layer(pm: PointMap, layer: int | None, config: dict) -> int | None:
    """The canonical layer of a record matched by `pm`, from the (global) layer its regex captured and two
    optional table opts: `layer_offset` (added: a record that belongs to the previous layer, e.g. SGLang's
    residual stream leaving layer N-1 is an output of layer N's input norm) and `layer` (a fixed layer for a
    record without a layer group; negative counts from the model's last layer, e.g. -1: SGLang's final
    norm's residual output is the stream leaving the last layer). A result below 0 means "no such layer"."""
    if layer is None and "layer" in pm.opts:
        layer = int(pm.opts["layer"])
        if layer < 0:
            n = config.get("num_layers")
            if not n:
                return -1
            layer += int(n)
    if layer is not None and pm.opts.get("layer_offset"):
        layer += int(pm.opts["layer_offset"])
    return layer


def _local_layer_text(name: str, pm: PointMap) -> str:
    m = re.match(pm.record, name)
    return m.group("layer") if m and "layer" in m.re.groupindex else ""


def _name_fields(name: str, pm: PointMap) -> dict[str, str]:
    """Named groups of the row's regex in this record name (`layer`, and e.g. a wrapper `prefix`), for
    formatting `PointMap.also` templates; unmatched groups are empty strings."""
    m = re.match(pm.record, name)
    fields = {k: (v or "") for k, v in m.groupdict().items()} if m else {}
    fields.setdefault("layer", "")
    return fields


@dataclass
class AlignedPair:
    a: np.ndarray | None
    b: np.ndarray | None
    rows: list[RowId]
    only_a: int
    only_b: int


def align_rows(ta: CanonicalTensor, tb: CanonicalTensor, exclude: frozenset | set = frozenset()) -> AlignedPair:
    """Rows present on both sides, in side A's order, less the rows in `exclude` (not the same rows on both
    sides: RowIdentity). Rows on one side only (or excluded) are counted, never compared. Sides holding the
    same rows in the same order (the usual case) are passed through as they are: no gather, no copy
    (memory-mapped values stay memory-mapped)."""
    if ta.values is None or tb.values is None:
        return AlignedPair(None, None, [], len(ta.rows), len(tb.rows))
    if ta.rows == tb.rows and not exclude:
        return AlignedPair(ta.values, tb.values, list(ta.rows), 0, 0)
    where_b = {r: i for i, r in enumerate(tb.rows)}
    ia, ib, rows = [], [], []
    for i, r in enumerate(ta.rows):
        j = where_b.get(r)
        if j is not None and r not in exclude:
            ia.append(i)
            ib.append(j)
            rows.append(r)
    return AlignedPair(_take(ta.values, ia), _take(tb.values, ib), rows, len(ta.rows) - len(rows),
                       len(tb.rows) - len(rows))


def _take(values: np.ndarray, idx: list[int]) -> np.ndarray:
    """values[idx], without a copy where idx is every row in order."""
    return values if len(idx) == values.shape[0] and idx == list(range(len(idx))) else values[idx]


def common_points(va: CanonicalView, vb: CanonicalView) -> tuple[list, list, list]:
    """(both, only in A, only in B) canonical point keys, in dataflow order."""
    pa, pb = set(va.points()), set(vb.points())
    key = lambda k: order_key(*k)  # noqa: E731
    return sorted(pa & pb, key=key), sorted(pa - pb, key=key), sorted(pb - pa, key=key)


def known_point(point: str) -> bool:
    return point in BY_NAME


def iter_loaded(va: CanonicalView, vb: CanonicalView, keys: Iterable[tuple[str, int | None]]):
    for point, layer in keys:
        yield point, layer, va.load(point, layer), vb.load(point, layer)
