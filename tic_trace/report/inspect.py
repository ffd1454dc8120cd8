"""What a trace holds: passes, records, sizes, and the canonical points its adapter finds."""
from __future__ import annotations

import fnmatch
import re

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..store.format import open_trace
from ..view.model_facts import shown_model_facts
from .text import text, visible


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _matcher(pattern: str | None):
    """A predicate over record names: a glob, or `re:` and a regex (ValueError naming it if it is not one)."""
    if not pattern:
        return lambda name: True
    if pattern.startswith("re:"):
        try:
            rx = re.compile(pattern[3:])
        except re.error as e:
            raise ValueError(f"--filter {pattern!r}: not a regular expression ({e})") from None
        return lambda name: rx.search(name) is not None
    return lambda name: fnmatch.fnmatchcase(name, pattern)


def inspect_trace(path: str, console: Console, *, rank: int | None = None, pass_index: int | None = None,
                  pattern: str | None = None, records: bool = False, points: bool = False, limit: int = 200) -> None:
    match = _matcher(pattern)
    tr = open_trace(path)
    m = tr.manifest
    model = shown_model_facts(m.get("model") or {})
    if rank is not None and rank not in tr.ranks:
        raise ValueError(f"--rank {rank}: this trace has ranks {tr.ranks}")
    if pass_index is not None and not any(pass_index in tr.pass_indices(r) for r in ([rank] if rank is not None
                                                                                      else tr.ranks)):
        raise ValueError(f"--pass {pass_index}: no such complete pass"
                         + (f" of rank {rank}" if rank is not None else "") + " in this trace")
    # Everything below comes from the trace: printed as Text, never as markup.
    console.print(Text.assemble((visible(tr.path), "bold"), "  framework ", (visible(m.get("framework")), "cyan"),
                                f"  schema {m.get('schema')}  ranks {tr.ranks}"))
    versions = m.get("versions") or {}
    console.print(text("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items())))
    if model:
        console.print(text("model: " + ", ".join(f"{k}={v}" for k, v in model.items() if v not in (None, "", 0))))
    _architecture(tr, console)
    for line in tr.incomplete_runs():
        console.print(text(f"RUN INCOMPLETE (the tracer stopped recording; never consistent): {line}",
                           style="bold red"), soft_wrap=True)
    for line in tr.skipped():
        console.print(text(f"skipped (incomplete, never compared): {line}", style="yellow"))
    if tr.ignored:
        console.print(text(f"ignored (not part of the trace layout): {', '.join(tr.ignored[:10])}", style="yellow"))
    t = Table(title="passes", title_justify="left", show_edge=False)
    for col in ("rank", "pass", "tag", "rows", "records", "ops", "module", "full/rows", "bytes", "notes"):
        t.add_column(col, justify="right" if col not in ("tag", "notes") else "left")
    shown = []
    for p in tr.passes(rank):
        if pass_index is not None and p.index != pass_index:
            continue
        recs = [r for r in p.records if match(r.name)]
        n_rows = len(p.rows["keys"]) if p.rows else 0
        notes = list(p.meta.get("notes") or [])
        blind = p.meta.get("blind_regions") or []
        if blind:
            notes.append(f"{len(blind)} module calls with no visible op")
        t.add_row(str(p.rank), str(p.index), text(p.tag or ""), str(n_rows), str(len(recs)),
                  str(sum(r.kind == "op" for r in recs)), str(sum(r.kind != "op" for r in recs)),
                  str(sum(r.has_data for r in recs)), _size(p.blob_size), text("; ".join(notes), limit=80))
        shown.append((p, recs))
    console.print(t)
    if records:
        for p, recs in shown:
            rt = Table(title=f"rank {p.rank} pass {p.index} records", title_justify="left", show_edge=False)
            for col in ("#", "name", "dtype", "shape", "mode", "mean", "rms", "absmax", "nan/inf"):
                rt.add_column(col, justify="left" if col in ("name", "dtype", "mode") else "right")
            for r in recs[:limit]:
                s = r.stats or {}
                c = max(s.get("count", 0), 1)
                rt.add_row(str(r.seq), text(r.name), r.dtype, "x".join(map(str, r.shape)), text(r.mode),
                           f"{s.get('sum', 0) / c:.4g}", f"{(s.get('sumsq', 0) / c) ** 0.5:.4g}",
                           f"{s.get('absmax', 0):.4g}", f"{s.get('nan', 0)}/{s.get('inf', 0)}")
            if len(recs) > limit:
                rt.caption = f"{len(recs) - limit} more (use --limit or --filter)"
            console.print(rt)
    if points:
        from ..view.align import CanonicalView
        from ..graph.canonical import key_name
        v = CanonicalView(tr)
        pt = Table(title=f"canonical points ({v.adapter.name} adapter)", title_justify="left", show_edge=False)
        pt.add_column("point")
        pt.add_column("passes", justify="right")
        pt.add_column("first source record")
        for point, layer in v.points():
            es = v.entries.get((point, layer), [])
            src = next(iter(es[0].names.values())) if es else "(derived from logits)"
            pt.add_row(key_name(point, layer), str(len(es)), text(src))
        console.print(pt)
        missing = [p for p in v.adapter.promised_points(v.config) if p not in {q for q, _ in v.points()}]
        if missing:
            console.print(Text.assemble(("promised by the adapter but absent: ", "yellow"), visible(", ".join(missing))))


def _architecture(tr, console: Console) -> None:
    """Whether the trace's architecture is one its adapter's table maps (the reader's table decides)."""
    from ..graph.adapter import UnknownAdapter, get_adapter
    try:
        check = get_adapter(tr.manifest.get("framework", "hf")).check_architecture(tr.manifest.get("model") or {})
    except UnknownAdapter:
        return
    if check.verified:
        console.print(text(f"architecture: {check.name} (verified mapping of the {check.adapter} adapter)"))
    else:
        console.print(text(f"UNVERIFIED MAPPING: architecture {check.describe()}. Comparing this trace is refused "
                           "(exit 3) unless --allow-unverified", style="bold red"), soft_wrap=True)
