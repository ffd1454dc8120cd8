"""Sections 7 and 8: what could not be compared and why, and the two sides' metadata (paths, ranks, reader
remarks, versions, model) with the settings the report was judged with."""
from __future__ import annotations

from .cells import _d, _e, _fmt_ranks, _gen, _key_sort, _l, _sci
from .context import Ctx


def nc_section(c: Ctx) -> str:
    head = ('<section id="not-comparable"><h2>Not comparable</h2><p class="sub">Points one side lacks, or that '
            'could not be compared, and why.</p>')
    nc = [x for x in _l(c.r.get("not_comparable")) if isinstance(x, dict)]
    if not nc:
        return head + '<p class="empty">Nothing: every point either side produces was compared.</p></section>'
    o = [head, '<table><thead><tr><th>Point</th><th>Reason</th></tr></thead><tbody>']
    for x in sorted(nc, key=lambda x: _key_sort(str(x.get("key")))):
        o.append(f'<tr><td class="mono">{_e(x.get("key"))}</td><td>{_e(x.get("reason"))}</td></tr>')
    o.append("</tbody></table></section>")
    return "".join(o)


def _kv_table(d: dict) -> str:
    if not d:
        return '<p class="empty">—</p>'
    rows = "".join(f'<tr><td>{_e(k)}</td><td class="mono">{_e(_scalar(v))}</td></tr>' for k, v in d.items())
    return f'<table class="kv"><tbody>{rows}</tbody></table>'


def _scalar(v) -> str:
    if isinstance(v, float):
        return _gen(v) if abs(v) >= 1e-3 or v == 0 else f"{v:.3g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(str(x) for x in v)
    if isinstance(v, dict):
        return ", ".join(f"{k}={x}" for k, x in v.items())
    return "—" if v is None else str(v)


def _reader_remarks(d: dict) -> str:
    """What the reader left out or merged against the model's declaration (the terminal prints the same)."""
    rows = {}
    for label, items in (("run incomplete", d.get("run_incomplete")),
                         ("incomplete passes skipped", d.get("skipped_passes")),
                         ("entries outside the trace layout", d.get("ignored_entries")),
                         ("tracer notes", d.get("tracer_notes"))):
        if isinstance(items, list) and items:
            rows[label] = "; ".join(str(x) for x in items[:20]) + (" …" if len(items) > 20 else "")
    notes = d.get("merge_notes")
    if isinstance(notes, dict) and notes:
        rows["rank merges against the declaration"] = "; ".join(f"{k}: {v}" for k, v in list(notes.items())[:20])
    return ('<h3 style="margin-top:10px">Reader remarks</h3>' + _kv_table(rows)) if rows else ""


def sides_section(c: Ctx) -> str:
    sides = _d(c.r.get("sides"))
    o = ['<section id="sides"><h2>Sides</h2><p class="sub">Side A is the reference; side B is judged against it.'
         '</p><div class="sides">']
    for s in ("a", "b"):
        d = _d(sides.get(s))
        o.append(f'<div class="side"><h3>Side {s.upper()} · {_e(d.get("framework", "?"))}</h3>')
        o.append(_kv_table({"path": d.get("path"), "ranks": _fmt_ranks(d.get("ranks")),
                            "unmapped module outputs": d.get("unmapped_module_outputs")}))
        o.append(_reader_remarks(d))
        o.append('<h3 style="margin-top:10px">Versions</h3>' + _kv_table(_d(d.get("versions"))))
        o.append('<h3 style="margin-top:10px">Model</h3>' + _kv_table(_d(d.get("model"))))
        o.append("</div>")
    o.append("</div>")
    tol = _d(_d(c.r.get("settings")).get("tolerance"))
    o.append('<h3 style="margin:14px 0 6px;font-size:14px">Settings</h3>')
    per_dtype = _d(tol.get("per_dtype"))
    per_point = _d(tol.get("per_point"))
    o.append(_kv_table({
        "growth factor": tol.get("growth"),
        "tolerance per dtype": ", ".join(f"{k} {_sci(v)}" for k, v in per_dtype.items()) or None,
        "tolerance per point": ", ".join(f"{k} {_sci(v)}" for k, v in per_point.items()) or "none",
        "rows": f"A {_gen(_d(c.r.get('rows')).get('a'))}, B {_gen(_d(c.r.get('rows')).get('b'))}, "
                f"matched {_gen(_d(c.r.get('rows')).get('matched'))}",
    }))
    o.append("</section>")
    return "".join(o)
