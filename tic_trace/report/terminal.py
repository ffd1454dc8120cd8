"""Terminal rendering of a report (the JSON document of `schema.Report.to_json()`), answer first.

It only displays: the verdict, causes, op pairing and numbers all come from the report. Strings taken from
traces are printed as rich `Text`, never as markup.
"""
from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..graph.canonical import BY_NAME, CURVE_POINTS, EMBEDDING, HEAD_POINTS, parse_key
from .attribution_lines import attribution_lines
from .bounds import TERMINAL, bounded, omitted_lines
from .coverage import coverage_line
from .reconcile_lines import reconciliation_lines
from .lines import blocking_line, contract_line, identity_sentence, precision_caveat, side_hint, ulp_na, ulp_text
from .schema import USED_LOGPROB_MEANING, USED_LOGPROB_STAGE, architecture_refusal, num, unverified_sides
from .text import text, visible

_STATUS_STYLE = {"ok": "green", "over": "yellow", "divergent": "bold red", "not_comparable": "dim"}
_VERDICT_STYLE = {"divergent": "bold red", "consistent": "bold green"}


def _f(x: Any, digits: int = 2) -> str:
    x = num(x) if isinstance(x, str) else x
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        if x == 0:
            return "0"
        return f"{x:.{digits}e}"
    return str(x)


def headline(report: dict) -> str:
    """One line for logs and CI: the verdict, then what the rows and the models' structure say (rows that match
    no row of the other side, rows left out, ...), on every verdict; a side compared with an unverified mapping
    is named on it."""
    refused = architecture_refusal(report)
    if refused and report.get("verdict") == "not_comparable":
        d = [n.get("detail") or {} for n in refused]
        return ("NOT COMPARABLE: unverified architecture mapping ("
                + "; ".join(f"side {str(x.get('side')).upper()}: {x.get('architecture')}, {x.get('adapter')} adapter"
                            for x in d)
                + "): not in the adapter's table of verified architectures (why below); --allow-unverified "
                  "compares anyway")
    line = _identity_line(report)
    unverified = unverified_sides(report)
    if unverified:
        d = [n.get("detail") or {} for n in unverified]
        line += " [UNVERIFIED MAPPING: " + ", ".join(f"side {str(x.get('side')).upper()} {x.get('architecture')} "
                                                     f"({x.get('adapter')} adapter)" for x in d) + "]"
    return line


def _identity_line(report: dict) -> str:
    """The answer, led by what the rows and the structure say when they make the pair not comparable."""
    block = blocking_line(report)
    if block:
        return block
    ident = identity_sentence(report)
    return _answer_line(report) + ("; " + ident if ident else "")


def _answer_line(report: dict) -> str:
    fd = report.get("first_divergence")
    verdict = report.get("verdict")
    if verdict == "divergent" and fd:
        cause = fd.get("cause") or "operator"
        if cause in ("intrinsic", "precision") and isinstance(fd.get("intrinsic") or fd.get("dtypes"), dict):
            detail = _replay_headline(fd, cause)
        elif cause == "operator" and fd.get("decided_by_row"):
            row = next((r for r in fd.get("worst_rows") or [] if r.get("row") == fd["decided_by_row"]), {})
            ie = num(row.get("input_error"))
            grew = ("its own inputs agree exactly" if not ie else
                    f"{_f(num(row.get('growth')), 1)}x its own inputs' {_f(ie)}")
            detail = (f"token {fd['decided_by_row']}: rel error {_f(row.get('error'))} (tol {_f(fd.get('tol'))}; "
                      f"{grew}); over all {fd.get('rows')} rows {_f(fd.get('error'))}")
        elif cause == "operator":
            ie = num(fd.get("input_error"))
            grew = ("its inputs agree exactly" if not ie else
                    f"{_f(num(fd.get('growth')), 1)}x its inputs' {_f(ie)}")
            detail = f"rel error {_f(fd.get('error'))} (tol {_f(fd.get('tol'))}; {grew})"
        else:
            detail = (fd.get("summary") or "").split("; ")
            detail = "; ".join(detail[:2]) if len(detail) > 1 else detail[0]
        if cause == "operator":
            detail += "; " + _which_side(report, fd)
        return f"FIRST DIVERGENCE at {fd['key']} [{cause}]: {detail}"
    pts = report.get("points") or []
    n = sum(1 for p in pts if p.get("status") != "not_comparable")
    if verdict == "consistent":
        extra = []
        if any(f.get("cause") == "routing" for f in report.get("findings") or []):
            extra.append("routing flips on near ties shown below" + (
                " (accepted)" if (report.get("settings") or {}).get("accept_near_tie_routing") else ""))
        kinds = [n.get("kind") for n in report.get("notes") or []]
        if "nonfinite_shared" in kinds:
            extra.append("BOTH sides compute NaN/Inf at the same elements (noted below)")
        if "accumulated_noise" in kinds:
            extra.append("accumulated noise noted below")
        if "carried" in kinds:
            extra.append("differences carried through ill-conditioned ops noted below")
        caveat = precision_caveat(report)
        return (f"CONSISTENT: {n} canonical points compared on {(report.get('rows') or {}).get('matched')} rows, "
                "none diverges" + (f" — {caveat}" if caveat else "") + ("; " + "; ".join(extra) if extra else ""))
    if n:
        return (f"NOT COMPARABLE: {len(pts) - n} of {len(pts)} canonical points both sides record could not be "
                "compared (reasons below); no divergence among the others")
    return "NOT COMPARABLE: no canonical point could be compared (see the reasons below)"


def _which_side(report: dict, fd: dict) -> str:
    """The side an operator divergence points at where the report knows it, else that it does not."""
    hint = side_hint(fd)
    if hint:
        return hint
    return ("which side: neither is blamed by the replay" if (report.get("settings") or {}).get("reference")
            else "which side: not known without --reference CKPT")


_ROW_COUNTS = (("unmatched_a", "A-only"), ("unmatched_b", "B-only"), ("excluded", "left out"),
               ("duplicates_a", "A named twice"), ("duplicates_b", "B named twice"))


def _replay_headline(fd: dict, cause: str) -> str:
    """The answer's numbers for a replay finding: the side to blame and both sides against the exact op."""
    side = (fd.get("replay") or {}).get("side") or "?"
    i = fd.get("intrinsic") or {}
    ea, eb = i.get("a") if isinstance(i.get("a"), dict) else {}, i.get("b") if isinstance(i.get("b"), dict) else {}
    if cause == "precision":
        dt = fd.get("dtypes") or {}
        da, db = dt.get("a") or ea.get("dtype"), dt.get("b") or eb.get("dtype")
        rel = (f"; rel error vs exact A {_f(ea.get('rel_l2'))}, B {_f(eb.get('rel_l2'))}"
               if "rel_l2" in ea and "rel_l2" in eb else " (by dtype: no replay)")
        return f"side {side} computes it in the coarser precision: A {da}, B {db}{rel}"
    if "excess" not in ea or "excess" not in eb:
        return f"side {side} computes it less exactly than clean implementations"

    def one(e):
        lim = num(e.get("limit"))
        return (f"excess {_g(e.get('excess'))}" + (f"/{_g(lim)}" if lim is not None and math.isfinite(lim) else "")
                + f", {_g(e.get('mean_ulp'), 3)}/{_g(e.get('max_ulp'))} mean/max ULP, "
                  f"{100 * (num(e.get('share_rounded')) or 0):.0f}% correctly rounded" + _match(e))
    reason = str((fd.get("replay") or {}).get("reason") or "")
    if "(a known precision fault)" in reason:     # named by its fingerprint: "B's RMSNorm at L1 matches *...*"
        return f"{reason.split('; excess')[0]} — A {one(ea)}; B {one(eb)}"
    return f"side {side} is less exact than clean implementations of this op — A {one(ea)}; B {one(eb)}"


def _match(e: dict) -> str:
    """The implementation that reproduces a side (replay/variants.py): "matches *no fp32 upcast* (bit-equal 97%)"."""
    kind = e.get("match_kind")
    if kind == "none":
        return ", matches no known implementation"
    if kind not in ("clean", "fault") or not isinstance(e.get("match_what"), str):
        return ""
    return f", matches *{e['match_what']}* (bit-equal {100 * (num(e.get('match_equal')) or 0):.0f}%)"


def _g(x, digits: int = 2) -> str:
    v = num(x)
    return "-" if v is None else ("inf" if math.isinf(v) else f"{v:.{digits}f}")


def render_terminal(report: dict, console: Console | None = None, *, all_points: bool = False) -> None:
    c = console or Console()
    # the answer is line 0, whatever the width: CI logs grep it. It counts every point; the rest shows at
    # most bounds.TERMINAL of each list and says how many it left out.
    covered = coverage_line(report)       # what the verdict covered, on its line (report/coverage.py)
    c.print(text(headline(report) + (f" — {covered}" if covered else ""),
                 style=_VERDICT_STYLE.get(report.get("verdict"), "bold yellow")), soft_wrap=True)
    report = bounded(report, TERMINAL)
    fd = report.get("first_divergence")
    contract = [d for d in report.get("contract") or [] if isinstance(d, dict)]
    if contract:          # what the two sides claim to compute, diffed before any tensor: first of the details
        _contract(c, contract)
    _causes(c, report)
    for line in attribution_lines(report):
        c.print(text(line), soft_wrap=True)
    for line in reconciliation_lines(report):
        c.print(text(line), soft_wrap=True)
    if not contract and "contract" in report and not architecture_refusal(report):
        c.print(text("contract: versions, model config, numerics settings, point dtypes and weight hashes agree",
                     style="dim"))
    if fd and fd.get("point") == USED_LOGPROB_STAGE:
        c.print(text(f"  stage   {USED_LOGPROB_STAGE} — {USED_LOGPROB_MEANING}"))
    elif fd and fd.get("point") in BY_NAME:
        point, layer = fd["point"], fd["layer"]
        c.print(text(f"  point   {point} — {BY_NAME[point].meaning if point in BY_NAME else ''}"
                     + (f", layer {layer}" if layer is not None else "")))
        c.print(text(f"  inputs  {', '.join(fd.get('inputs') or []) or '(none)'} "
                     f"(max rel error {_f(fd.get('input_error'))})"))
        src = fd.get("sources") or {}
        c.print(text(f"  A: {', '.join(src.get('a', []))}"))
        c.print(text(f"  B: {', '.join(src.get('b', []))}"))
        m = fd.get("metrics") or {}
        if m:
            cos = num(m.get("cosine"))
            c.print(f"  max_abs {_f(m.get('max_abs'))}  rel_l2 {_f(m.get('rel_l2'))}  "
                    f"cos {'-' if cos is None else f'{cos:.6f}'}  max_ulp {ulp_text(m, lambda v: _f(v, 1))}"
                    + (f" ({ulp_na(m)} element(s) at an exact zero of A: ULP n/a)" if ulp_na(m) else "") + "  "
                    f"bit-equal {100 * (num(m.get('bitwise_equal')) or 0):.1f}%  rows {fd.get('rows')}")
    rows = report.get("rows", {})
    c.print(text(f"rows: A {rows.get('a')}  B {rows.get('b')}  matched {rows.get('matched')}"
                 + "".join(f"  {label} {rows[k]}" for k, label in _ROW_COUNTS if rows.get(k))))
    _skipped(c, report)
    c.print()
    _curve(c, report)
    if all_points:
        _points_table(c, report)          # ends with what it left out
    else:
        _more(c, report, "points")        # the curve's
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
    _more(c, report, "not_comparable", "characters", "nested")


def _contract(c: Console, contract: list[dict]) -> None:
    c.print(text(f"CONTRACT: {len(contract)} difference(s) between what the sides claim to compute "
                 "(versions, model config, numerics settings, point dtypes, weights; read before any tensor)",
                 style="bold yellow"), soft_wrap=True)
    for d in contract[:40]:
        c.print(text("  " + contract_line(d), limit=400), soft_wrap=True)
    if len(contract) > 40:
        c.print(text(f"  … {len(contract) - 40} more in the JSON report"))


def _causes(c: Console, report: dict) -> None:
    """The named causes (findings) and notes, right under the headline."""
    for f in report.get("findings") or []:
        style = "red" if f.get("divergent") else "yellow"
        mark = "" if f.get("divergent") else " (not counted)"
        summary = str(f.get("summary") or "")
        if summary.startswith(f"{f.get('key')}: "):      # the key is already on the line
            summary = summary[len(str(f.get("key"))) + 2:]
        c.print(text(f"  cause [{f.get('cause')}]{mark} at {f.get('key')}: ", style=style) + text(summary),
                soft_wrap=True)
        if f.get("remedy"):
            c.print(text(f"      what removes it: {f['remedy']}", style="dim"), soft_wrap=True)
    for n in report.get("notes") or []:
        c.print(text(f"  note [{str(n.get('kind')).replace('_', ' ')}]: ", style="yellow") + text(n.get("summary") or ""),
                soft_wrap=True)
        curve = (n.get("detail") or {}).get("curve") or []
        if curve:
            c.print(text("      curve: " + "  ".join(f"{k} {_f(e, 1)}" for k, e in curve), style="dim"), soft_wrap=True)
    _more(c, report, "findings", "notes")
    if report.get("findings") or report.get("notes"):
        c.print()


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
    kinds = [k for k in CURVE_POINTS if any((k, lay) in by for lay in layers)]
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
            cells.append(Text(_f(p.get("error"), 1), style=style))
        t.add_row(str(lay), *cells)
    c.print(t)
    head = [by[(k, None)] for k in (EMBEDDING, *HEAD_POINTS) if (k, None) in by]
    if head:
        c.print(text("  " + "   ".join(f"{p['key']} {_f(p.get('error'), 1)} [{p['status']}]" for p in head)))
    c.print()


def _points_table(c: Console, report: dict) -> None:
    t = Table(title="all points (dataflow order)", title_justify="left", show_edge=False)
    for col in ("point", "status", "rel err", "tol", "input err", "growth", "max abs", "cos", "max ulp", "bit-eq", "rows"):
        t.add_column(col, justify="right" if col not in ("point", "status") else "left")
    for p in report["points"]:
        m = p.get("metrics") or {}
        cos, beq = num(m.get("cosine")), num(m.get("bitwise_equal"))
        t.add_row(text(p["key"]), text(p["status"], style=_STATUS_STYLE.get(p["status"], "")), _f(p.get("error")),
                  _f(p.get("tol")), _f(p.get("input_error")), _f(p.get("growth"), 1), _f(m.get("max_abs")),
                  "-" if cos is None else f"{cos:.6f}", ulp_text(m, lambda v: _f(v, 1)),
                  "-" if beq is None else f"{100 * beq:.0f}%", str(p.get("rows", "")))
    c.print(t)
    _more(c, report, "points")
    c.print()


def _ops(c: Console, fd: dict | None) -> None:
    ops = (fd or {}).get("ops") or {}
    if not fd or not ops or fd.get("point") not in BY_NAME:     # the used-log-prob stage runs no op
        return
    a, b = ops.get("a") or [], ops.get("b") or []
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
    first = ops.get("first_differing")
    for n, (i, j) in enumerate((ops.get("pairs") or [])[:40]):
        oa = a[i] if i is not None else None
        ob = b[j] if j is not None else None
        mark = ""
        if oa and ob and oa.get("hash") is not None:
            mark = "=" if oa["hash"] == ob.get("hash") else Text("≠", style="red")
        if n == first:
            mark = Text("≠ first difference", style="bold red")
        t.add_row(str(n), text(oa["op"]) if oa else "", _f(oa.get("rms")) if oa else "",
                  text(ob["op"]) if ob else "", _f(ob.get("rms")) if ob else "", mark)
    c.print(t)
    c.print()


def _worst(c: Console, report: dict) -> None:
    render_worst_tokens(c, report)


def render_worst_tokens(c: Console, report: dict, title: str = "tokens with the largest |Δ logprob|") -> bool:
    """The worst-tokens table (every renderer of the terminal report, slime-report too); False when the report
    has no per-token log-probabilities."""
    w = report.get("worst_tokens") or []
    if not w:
        return False
    if len(w) > TERMINAL.worst_tokens:       # slime-report passes the whole report
        report = bounded(report, TERMINAL)
        w = report["worst_tokens"]
    t = Table(title=title, title_justify="left", show_edge=False)
    for col in ("sample", "pos", "|Δlogp|", "logp A", "logp B", "divergence starts", "routing flip"):
        t.add_column(col)
    for x in w:
        flips = ", ".join(f"L{k} {v}" for k, v in sorted((x.get("flips") or {}).items()))
        t.add_row(text(x["sample"]), text(x["position"]), _f(x["abs_dlogprob"]), _f4(x["logprob_a"]),
                  _f4(x["logprob_b"]), text(x.get("divergence_starts") or "-"), text(flips) if flips else ("yes" if x.get("routing_flip") else ""))
    c.print(t)
    _more(c, report, "worst_tokens")
    c.print()
    return True


def _f4(x) -> str:
    v = num(x)
    return "-" if v is None else f"{v:.4f}"


def _routing(c: Console, report: dict) -> None:
    r = report.get("routing") or {}
    layers = r.get("layers") or {}
    if not layers:
        return
    t = Table(title="routing (top-k expert choice) per MoE layer", title_justify="left", show_edge=False)
    for col in ("layer", "flipped", "near tie", "unexplained", "near-tie to output", "router diverges",
                "share of |Δ logprob|"):
        t.add_column(col, justify="right")
    for k, v in sorted(layers.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else -1):
        share = num(v.get("dlogprob_share"))
        t.add_row(str(k), f"{v.get('flipped')}/{v.get('rows')}", str(v.get("near_tie") or 0),
                  Text(str(v.get("unexplained") or 0), style="red" if v.get("unexplained") else ""),
                  str(v.get("near_tie_to_output") or 0), "yes" if v.get("router_divergent") else "",
                  "-" if share is None else f"{100 * share:.1f}%")
    c.print(t)
    share = num(r.get("dlogprob_share"))
    c.print(f"tokens with at least one flipped layer: {r.get('tokens_with_flip', 0)} "
            f"({100 * (num(r.get('share_tokens_with_flip')) or 0):.1f}%)"
            + ("" if share is None else f"; they carry {100 * share:.1f}% of the final |Δ logprob|"))
    _more(c, report, "routing_layers")
    c.print()


def _skipped(c: Console, report: dict) -> None:
    """What each side's reader left out (incomplete passes, never compared; entries outside the layout) and rank
    merges that contradicted the model's declaration (docs/sglang.md)."""
    for side, d in sorted((report.get("sides") or {}).items()):
        if not isinstance(d, dict):
            continue
        for what, items in (("rank whose run is incomplete", d.get("run_incomplete")),
                            ("incomplete pass skipped", d.get("skipped_passes")),
                            ("entry outside the trace layout ignored", d.get("ignored_entries")),
                            ("tracer note", d.get("tracer_notes"))):
            if isinstance(items, list) and items:
                shown = "; ".join(visible(x, 240) for x in items[:5]) + (" …" if len(items) > 5 else "")
                c.print(text(f"side {side.upper()}: {len(items)} {what}: {shown}", style="yellow"))
        calls = d.get("repeated_calls")
        if isinstance(calls, int) and calls > 0:
            c.print(text(f"side {side.upper()}: {calls} record(s) of points from further calls of the model within "
                         "one pass, not compared (their rows are not in the pass's row table): trace generate() "
                         "with auto_step=True, or call tracer.step() between forwards", style="yellow"),
                    soft_wrap=True)
        notes = d.get("merge_notes")
        if isinstance(notes, dict) and notes:
            shown = "; ".join(f"{visible(k, 40)}: {visible(v, 160)}" for k, v in list(notes.items())[:3])
            c.print(text(f"side {side.upper()}: {len(notes)} rank merge(s) disagree with what the model declares "
                         f"(taken by the records): {shown}" + (" …" if len(notes) > 3 else ""), style="yellow"))


def _more(c: Console, report: dict, *fields: str) -> bool:
    """The '… N more … not shown (see the JSON)' lines of these fields of a bounded report."""
    lines = omitted_lines(report, fields)
    for line in lines:
        c.print(text(f"  {line}", style="dim"))
    return bool(lines)


def point_label(key: str) -> str:
    point, layer = parse_key(key)
    return f"{point} (layer {layer})" if layer is not None else point
