"""Terminal rendering of a report (the JSON document of `diverge.Report.to_json()`), answer first."""
from __future__ import annotations

import difflib
import json
import math
import os
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .canonical import BY_NAME, parse_key
from .text import text, visible

_STATUS_STYLE = {"ok": "green", "over": "yellow", "divergent": "bold red", "not_comparable": "dim"}
_CURVE_POINTS = ("input", "attn_norm", "attn.q_rope", "attn.core", "attn.out", "mid", "mlp_norm",
                 "moe.router_logits", "moe.experts_out", "mlp.out", "output")


def _f(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, float):
        if math.isinf(x):
            return "inf"
        if x == 0:
            return "0"
        return f"{x:.{digits}e}"
    return str(x)


def _num(x):
    return math.inf if x == "inf" else x


def headline(report: dict) -> str:
    """One line for logs and CI."""
    fd = report.get("first_divergence")
    if report["verdict"] == "divergent" and fd:
        ie = fd.get("input_error")
        grew = ("its inputs agree exactly" if not ie else
                f"{_f(_num(fd.get('growth')), 1)}x its inputs' {_f(ie)}")
        return f"FIRST DIVERGENCE at {fd['key']}: rel error {_f(_num(fd['error']))} (tol {_f(fd['tol'])}; {grew})"
    if report["verdict"] == "consistent":
        n = sum(1 for p in report["points"] if p["status"] != "not_comparable")
        return f"CONSISTENT: {n} canonical points compared, none diverges"
    return "NOT COMPARABLE: no canonical point could be compared (see the reasons below)"


def render_terminal(report: dict, console: Console | None = None, *, all_points: bool = False) -> None:
    c = console or Console()
    fd = report.get("first_divergence")
    style = "bold red" if report["verdict"] == "divergent" else ("bold green" if report["verdict"] == "consistent" else "bold yellow")
    # Every string below may come from a trace or a saved JSON: printed as Text (text/visible), never markup.
    c.print(text(headline(report), style=style))
    if fd:
        point, layer = fd["point"], fd["layer"]
        c.print(text(f"  point   {point} — {BY_NAME[point].meaning if point in BY_NAME else ''}"
                     + (f", layer {layer}" if layer is not None else "")))
        c.print(text(f"  cause   {fd.get('cause', '')}"))
        c.print(text(f"  inputs  {', '.join(fd.get('inputs') or []) or '(none)'} (max rel error {_f(fd.get('input_error'))})"))
        src = fd.get("sources") or {}
        c.print(text(f"  A: {', '.join(src.get('a', []))}"))
        c.print(text(f"  B: {', '.join(src.get('b', []))}"))
        m = fd.get("metrics") or {}
        if m:
            c.print(text(f"  max_abs {_f(m.get('max_abs'))}  rel_l2 {_f(m.get('rel_l2'))}  cos {m.get('cosine', 0):.6f}  "
                         f"max_ulp {_f(m.get('max_ulp'), 1)}  bit-equal {100 * (m.get('bitwise_equal') or 0):.1f}%  rows {fd.get('rows')}"))
    rows = report.get("rows", {})
    c.print(text(f"rows: A {rows.get('a')}  B {rows.get('b')}  matched {rows.get('matched')}"))
    _skipped(c, report)
    c.print()
    _curve(c, report)
    if all_points:
        _points_table(c, report)
    _ops(c, fd)
    _worst(c, report)
    _routing(c, report)
    nc = report.get("not_comparable") or []
    if nc:
        t = Table(title="not comparable", title_justify="left", show_edge=False)
        t.add_column("point")
        t.add_column("why")
        seen = set()
        for x in nc:
            if (x["key"], x["reason"]) in seen:
                continue
            seen.add((x["key"], x["reason"]))
            t.add_row(text(x["key"]), text(x["reason"] or ""))
        c.print(t)


def _curve(c: Console, report: dict) -> None:
    """Error-growth table: layers down, point kinds across; the first divergence is highlighted."""
    by = {}
    layers = set()
    for p in report["points"]:
        if p["layer"] is not None:
            layers.add(p["layer"])
        by[(p["point"], p["layer"])] = p
    if not layers:
        return
    kinds = [k for k in _CURVE_POINTS if any((k, lay) in by for lay in layers)]
    t = Table(title="relative error through the layers (red: first divergence, yellow: over tolerance)",
              title_justify="left", show_edge=False, pad_edge=False)
    t.add_column("layer", justify="right")
    for k in kinds:
        t.add_column(k, justify="right")
    fd = report.get("first_divergence") or {}
    for lay in sorted(layers):
        cells = []
        for k in kinds:
            p = by.get((k, lay))
            if p is None:
                cells.append("")
                continue
            style = _STATUS_STYLE.get(p["status"], "")
            if fd and p["key"] == fd.get("key"):
                style = "bold white on red"
            elif p["status"] == "divergent":
                style = "red"
            cells.append(Text(_f(_num(p.get("error")), 1), style=style))
        t.add_row(str(lay), *cells)
    c.print(t)
    head = [by[(k, None)] for k in ("embed", "final_norm", "logits", "logprobs") if (k, None) in by]
    if head:
        c.print(text("  " + "   ".join(f"{p['key']} {_f(_num(p.get('error')), 1)} [{p['status']}]" for p in head)))
    c.print()


def _points_table(c: Console, report: dict) -> None:
    t = Table(title="all points (dataflow order)", title_justify="left", show_edge=False)
    for col in ("point", "status", "rel err", "tol", "input err", "growth", "max abs", "cos", "max ulp", "bit-eq", "rows"):
        t.add_column(col, justify="right" if col not in ("point", "status") else "left")
    for p in report["points"]:
        m = p.get("metrics") or {}
        t.add_row(text(p["key"]), text(p["status"], style=_STATUS_STYLE.get(p["status"], "")), _f(_num(p.get("error"))),
                  _f(p.get("tol")), _f(p.get("input_error")), _f(_num(p.get("growth")), 1), _f(m.get("max_abs")),
                  f"{m['cosine']:.6f}" if m.get("cosine") is not None else "-", _f(m.get("max_ulp"), 1),
                  f"{100 * m['bitwise_equal']:.0f}%" if m.get("bitwise_equal") is not None else "-", str(p.get("rows", "")))
    c.print(t)
    c.print()


def _ops(c: Console, fd: dict | None) -> None:
    if not fd or not fd.get("ops"):
        return
    a, b = fd["ops"].get("a", []), fd["ops"].get("b", [])
    if not a and not b:
        c.print("dispatcher ops in the region: none visible on either side (fused kernel or module-level record)")
        return
    t = Table(title=text(f"dispatcher ops between {fd['key']}'s inputs and its output"), title_justify="left",
              show_edge=False)
    t.add_column("#", justify="right")
    t.add_column("A op")
    t.add_column("A rms", justify="right")
    t.add_column("B op")
    t.add_column("B rms", justify="right")
    t.add_column("")
    for i, (oa, ob) in enumerate(pair_ops(a, b)[:40]):
        mark = ""
        if oa and ob and oa.get("hash") is not None:
            mark = "=" if oa["hash"] == ob.get("hash") else Text("≠", style="red")
        t.add_row(str(i), text(oa["op"] if oa else ""), _f(oa.get("rms")) if oa else "", text(ob["op"] if ob else ""),
                  _f(ob.get("rms")) if ob else "", mark)
    c.print(t)
    c.print()


def _worst(c: Console, report: dict) -> None:
    w = report.get("worst_tokens") or []
    if not w:
        return
    t = Table(title="tokens with the largest |Δ logprob|", title_justify="left", show_edge=False)
    for col in ("sample", "pos", "|Δlogp|", "logp A", "logp B", "divergence starts", "routing flip"):
        t.add_column(col)
    for x in w:
        t.add_row(text(x["sample"]), text(x["position"]), _f(x["abs_dlogprob"]), f"{x['logprob_a']:.4f}",
                  f"{x['logprob_b']:.4f}", text(x.get("divergence_starts") or "-"), "yes" if x.get("routing_flip") else "")
    c.print(t)
    c.print()


def _routing(c: Console, report: dict) -> None:
    r = report.get("routing") or {}
    layers = r.get("layers") or {}
    if not layers:
        return
    parts = [f"L{k}: {v['flipped']}/{v['rows']}" + (f" ({v['unexplained']} unexplained)" if v.get("unexplained") else "")
             for k, v in sorted(layers.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else -1)]
    c.print(text(f"routing flips per layer: {'  '.join(parts)}"))
    c.print(f"tokens with at least one flipped layer: {r.get('tokens_with_flip', 0)} "
            f"({100 * r.get('share_tokens_with_flip', 0):.1f}%)")
    c.print()


def pair_ops(a: list[dict], b: list[dict]) -> list[tuple[dict | None, dict | None]]:
    """Line up the two sides' op lists by op name (longest common subsequence), gaps where one side has
    an op the other lacks: an extra cast or a fused kernel shows up as a one-sided row."""
    sm = difflib.SequenceMatcher(a=[o["op"] for o in a], b=[o["op"] for o in b], autojunk=False)
    out: list[tuple[dict | None, dict | None]] = []
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            out.extend(zip(a[i1:i2], b[j1:j2]))
        else:
            out.extend((x, None) for x in a[i1:i2])
            out.extend((None, y) for y in b[j1:j2])
    return out


def write_reports(report: dict, console: Console, json_path: str | None = None, html_path: str | None = None) -> None:
    """Write the JSON and/or HTML report where asked, and say where."""
    if json_path:
        write_json(report, json_path)
        console.print(text(f"JSON report: {json_path}"))
    if html_path:
        from .html import render_html
        Path(html_path).write_text(render_html(report), encoding="utf-8")
        console.print(text(f"HTML report: {html_path}"))


def write_json(report: dict, path: os.PathLike | str) -> None:
    """Write atomically: a hidden temporary file beside `path` (mode from the umask), renamed over it, and
    removed if anything fails (nothing is left behind)."""
    from .format import new_temp_file
    p = Path(path)
    fd, tmp = new_temp_file(p.parent, p.name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(report, indent=1))
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _skipped(c: Console, report: dict) -> None:
    """What each side's reader left out: incomplete passes (never compared) and entries outside the layout."""
    for side, d in sorted((report.get("sides") or {}).items()):
        if not isinstance(d, dict):
            continue
        for what, items in (("incomplete pass skipped", d.get("skipped_passes")),
                            ("entry outside the trace layout ignored", d.get("ignored_entries"))):
            if isinstance(items, list) and items:
                shown = "; ".join(visible(x, 120) for x in items[:5]) + (" …" if len(items) > 5 else "")
                c.print(text(f"side {side.upper()}: {len(items)} {what}: {shown}", style="yellow"))


def point_label(key: str) -> str:
    point, layer = parse_key(key)
    return f"{point} (layer {layer})" if layer is not None else point
