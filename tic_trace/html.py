"""A self-contained HTML page for a tic-trace JSON report (schema "tic-trace.report/1").

The page must open on an air-gapped cluster: no CDN, no external fonts, scripts or images. Styling is inline
CSS, plots are inline SVG drawn here, and nothing needs JavaScript (the "only points that are not ok" filter
is a CSS checkbox). Every string taken from the report is escaped: trace names come from other people's files.

Order of the page: the answer (verdict, first divergence), the error-growth plot through the layers, every
point in dataflow order, the per-token heatmap of the worst tokens, routing, the dispatcher ops of both sides
in the first-divergence region, what could not be compared, and the two sides' metadata.

    from tic_trace.html import render_html
    open("report.html", "w").write(render_html(report.to_json()))
"""
from __future__ import annotations

import html as _html
import math
import re
from collections import Counter
from pathlib import Path

from .canonical import BY_NAME, CURVE_POINTS, HEAD_POINTS, is_ids, order_key, parse_key
from .text import visible
from .report_schema import OpsRegion, architecture_refusal, op_differs, unverified_sides
from .report_schema import num as _decode

__all__ = ["render_html", "write_html"]

# Point kinds drawn as lines in the error-growth plot (those a report has): canonical.PointSpec.curve.
GROWTH_KINDS = CURVE_POINTS

STATUSES = ("ok", "over", "divergent", "not_comparable")
STATUS_LABEL = {"ok": "ok", "over": "over", "divergent": "divergent", "not_comparable": "not comparable"}
STATUS_COLOR = {"ok": "#1a7f37", "over": "#b35900", "divergent": "#cf222e", "not_comparable": "#6e7781"}

# Okabe-Ito (colour-blind safe); the residual stream ("output") is black.
SERIES_COLORS = {"attn_norm": "#56b4e9", "attn.core": "#0072b2", "attn.out": "#009e73", "mid": "#cc79a7",
                 "moe.router_logits": "#d55e00", "moe.experts_out": "#8c6d31", "mlp.out": "#e69f00",
                 "output": "#1f2328"}
EXTRA_COLORS = ("#d55e00", "#8c6d31", "#7b4fa0", "#5f8f2f", "#a0522d", "#2f6f8f")
HEAD_COLORS = {"embed": "#6e7781", "final_norm": "#8250df", "logits": "#bf3989", "logprobs": "#0a7b83"}
DIVERGE_RED = "#d1242f"
GRID_W = 900            # heatmap grid width (px) before cells hit their minimum width
MAX_HEAT_COLS = 300     # over this many points, the heatmap shows the plot's point kinds only

# Heatmap: light yellow (small error) to dark brown (large error); exact zeros in a separate cool grey.
HEAT_STOPS = ((0.0, "#fff7bc"), (0.25, "#fee391"), (0.45, "#fec44f"), (0.65, "#fe9929"),
              (0.82, "#d95f0e"), (1.0, "#8c2d04"))
HEAT_ZERO = "#e3e9f0"
HEAT_MISSING = "#ffffff"
HEAT_INF = "#4a0f0f"


# ------------------------------------------------------------------------------------------------
# small helpers: escaping, numbers
# ------------------------------------------------------------------------------------------------

def _e(x) -> str:
    # Control characters (ANSI escapes, bidi overrides) become visible escapes: the file is also `cat`ed.
    return _html.escape(visible(x, keep="\n\t"), quote=True)


def _num(x) -> float | None:
    """A numeric field as a float (the report's codec); NaN and anything unparsable become None (a dash)."""
    v = _decode(x)
    return None if v is None or math.isnan(v) else v


def _d(x) -> dict:
    return x if isinstance(x, dict) else {}


def _l(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else []


def _str_or_none(x) -> str | None:
    return x if x is None or isinstance(x, str) else str(x)


def _inf_text(v: float) -> str | None:
    if v == math.inf:
        return "∞"
    if v == -math.inf:
        return "−∞"
    return None


def _sci(x) -> str:
    v = _num(x)
    if v is None:
        return "—"
    if math.isinf(v):
        return _inf_text(v)
    if v == 0:
        return "0"
    return f"{v:.2e}"


def _pct(x) -> str:
    v = _num(x)
    if v is None or math.isinf(v):
        return "—" if v is None else _inf_text(v)
    if v == 1:
        return "100%"
    if v == 0:
        return "0%"
    return f"{100 * v:.1f}%"


def _cos(x) -> str:
    v = _num(x)
    if v is None or math.isinf(v):
        return "—" if v is None else _inf_text(v)
    return f"{v:.6f}"


def _gen(x) -> str:
    v = _num(x)
    if v is None or math.isinf(v):
        return "—" if v is None else _inf_text(v)
    if v == int(v) and abs(v) < 1e6:
        return f"{int(v):,}"
    return f"{v:.3g}"


def _growth(x) -> str:
    v = _num(x)
    if v is None:
        return "—"
    if math.isinf(v):
        return "×∞" if v > 0 else "—"
    return f"×{v:.3g}"


def _int(x) -> int | None:
    v = _num(x)
    if v is None or math.isinf(v):
        return None
    return int(v)


def _log10(v: float | None) -> float | None:
    if v is None or v <= 0 or math.isinf(v):
        return None
    return math.log10(v)


def _decades(vals, pad: int) -> tuple[int, int]:
    """Integer decades (lo, hi) spanning the positive finite values, at least `pad` decades apart; a value
    exactly on the lowest decade gets one decade of room under it."""
    pos = [v for v in vals if 0 < v < math.inf]
    if not pos:
        return -8, 0
    lo = math.floor(math.log10(min(pos)) + 1e-12)
    if min(pos) <= 10.0 ** lo * (1 + 1e-9):
        lo -= 1
    lo = max(lo, -40)
    hi = max(math.ceil(math.log10(max(pos)) - 1e-12), lo + pad)
    return lo, hi


def _anchor(key) -> str:
    return "pt-" + re.sub(r"[^A-Za-z0-9_.-]", "_", str(key))


def _pill(status) -> str:
    s = status if status in STATUSES else None
    cls = f"s-{s}" if s else "s-unknown"
    return f'<span class="pill {cls}">{_e(STATUS_LABEL.get(s, status) or "?")}</span>'


def _layer_of(p: dict) -> int | None:
    lay = p.get("layer")
    if isinstance(lay, bool):
        return None
    if isinstance(lay, int):
        return lay
    if lay is None:
        _, lay2 = parse_key(str(p.get("key", "")))
        return lay2
    return _int(lay)


def _point_of(p: dict) -> str:
    pt = p.get("point")
    if isinstance(pt, str) and pt:
        return pt
    return parse_key(str(p.get("key", "")))[0]


def _sort_key(p: dict):
    try:
        return order_key(_point_of(p), _layer_of(p))
    except Exception:  # noqa: BLE001 - a malformed point sorts last, it must not break the page
        return (9,)


def _key_sort(k: str):
    try:
        return order_key(*parse_key(k))
    except Exception:  # noqa: BLE001
        return (9,)


def _meaning(point) -> str:
    ps = BY_NAME.get(point) if isinstance(point, str) else None
    return ps.meaning if ps else ""


def _is_ids(point) -> bool:
    return isinstance(point, str) and is_ids(point)


def _lerp_color(stops, t: float) -> str:
    t = min(max(t, 0.0), 1.0)
    for (t0, c0), (t1, c1) in zip(stops, stops[1:]):
        if t <= t1:
            u = 0.0 if t1 == t0 else (t - t0) / (t1 - t0)
            a = [int(c0[i:i + 2], 16) for i in (1, 3, 5)]
            b = [int(c1[i:i + 2], 16) for i in (1, 3, 5)]
            return "#" + "".join(f"{round(x + (y - x) * u):02x}" for x, y in zip(a, b))
    return stops[-1][1]


def _fmt_shape(shape) -> str:
    if isinstance(shape, (list, tuple)):
        return "×".join(_e(s) for s in shape) or "scalar"
    return _e(shape) if shape is not None else "—"


def _fmt_hash(h) -> str:
    if h is None:
        return "—"
    if isinstance(h, bool):
        return _e(h)
    if isinstance(h, int):
        return format(h & 0xFFFFFFFFFFFFFFFF, "016x")[:8]
    return _e(str(h)[:8])


def _fmt_ranks(ranks) -> str:
    rs = _l(ranks)
    if not rs:
        return "—"
    ints = [r for r in rs if isinstance(r, int) and not isinstance(r, bool)]
    if len(ints) == len(rs) and len(rs) > 4 and sorted(ints) == list(range(min(ints), max(ints) + 1)):
        return f"{min(ints)}–{max(ints)} ({len(rs)} ranks)"
    return ", ".join(_e(r) for r in rs)


# ------------------------------------------------------------------------------------------------
# the page
# ------------------------------------------------------------------------------------------------

CSS = """
:root{--fg:#1f2328;--muted:#59636e;--line:#d1d9e0;--soft:#f6f8fa;--red:#cf222e;--green:#1a7f37;--amber:#b35900;
--grey:#6e7781;--mono:ui-monospace,SFMono-Regular,Menlo,Consolas,"Liberation Mono","DejaVu Sans Mono",monospace}
*{box-sizing:border-box}
html{background:#eef1f5}
body{margin:0;color:var(--fg);font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",
"Liberation Sans","DejaVu Sans",Arial,sans-serif}
.page{max-width:1240px;margin:0 auto;padding:20px 24px 40px}
header.top{display:flex;align-items:baseline;justify-content:space-between;gap:16px;flex-wrap:wrap;margin-bottom:12px}
header.top h1{font-size:20px;margin:0;letter-spacing:-.01em}
header.top h1 .brand{color:var(--muted);font-weight:500}
header.top .vs{color:var(--muted);font-size:13px}
header.top .vs b{color:var(--fg)}
nav.toc{display:flex;flex-wrap:wrap;gap:6px;margin:0 0 16px}
nav.toc a{font-size:12.5px;color:#0550ae;text-decoration:none;background:#fff;border:1px solid var(--line);
border-radius:999px;padding:2px 10px}
nav.toc a:hover{background:#ddf4ff}
section{background:#fff;border:1px solid var(--line);border-radius:10px;padding:16px 20px;margin:0 0 16px;
box-shadow:0 1px 2px rgba(31,35,40,.04)}
section h2{font-size:16px;margin:0 0 4px}
section .sub{color:var(--muted);font-size:12.5px;margin:0 0 12px}
.banner{border-radius:10px;padding:14px 20px;margin:0 0 0;color:#fff;display:flex;align-items:center;gap:16px}
.banner .verdict{font-size:13px;font-weight:700;letter-spacing:.08em;text-transform:uppercase;
background:rgba(255,255,255,.2);border-radius:6px;padding:3px 10px;white-space:nowrap}
.banner .msg{font-size:17px;line-height:1.35}
.banner .msg code{font-size:17px;background:rgba(255,255,255,.18);padding:1px 6px;border-radius:5px;color:#fff}
.v-divergent{background:linear-gradient(90deg,#b3141f,#d1242f)}
.v-consistent{background:linear-gradient(90deg,#116329,#1a7f37)}
.v-not_comparable,.v-unknown{background:linear-gradient(90deg,#4c5561,#6e7781)}
#answer{padding:0;overflow:hidden}
#answer .body{padding:16px 20px 18px}
.facts{display:grid;grid-template-columns:190px 1fr;gap:7px 18px;margin:0}
.facts dt{color:var(--muted);font-size:13px;padding-top:1px}
.facts dd{margin:0}
.big{font-size:26px;font-weight:650;font-family:var(--mono);letter-spacing:-.02em}
.meaning{color:var(--muted);margin-left:10px;font-size:14px}
.num{font-family:var(--mono);font-variant-numeric:tabular-nums;white-space:nowrap}
.over-x{color:var(--red);font-weight:600}
.cause{background:#fff8c5;border:1px solid #eed888;border-radius:6px;padding:4px 10px;display:inline-block}
code,.mono{font-family:var(--mono);font-size:12.5px}
a.k{color:#0550ae;text-decoration:none}
a.k:hover{text-decoration:underline}
.chips{display:flex;flex-wrap:wrap;gap:6px}
.chip{border:1px solid var(--line);border-radius:6px;padding:1px 8px;background:var(--soft);font-size:12.5px}
.pill{display:inline-block;border-radius:999px;padding:0 8px;font-size:11.5px;font-weight:600;line-height:18px;
white-space:nowrap;border:1px solid transparent}
.s-ok{background:#dafbe1;color:#116329;border-color:#aceebb}
.s-over{background:#fff1d6;color:#8a4600;border-color:#f5cf8c}
.s-divergent{background:#ffebe9;color:#a40e26;border-color:#ffc1bc}
.s-not_comparable,.s-unknown{background:#eaeef2;color:#424a53;border-color:#d1d9e0}
.note{color:var(--muted)}
.empty{color:var(--muted);font-style:italic;margin:4px 0}
svg text{font-family:inherit}
svg .ax{stroke:#8c959f;stroke-width:1}
svg .grid{stroke:#eaeef2;stroke-width:1}
svg .tick{font-size:11px;fill:#59636e}
.plotwrap{overflow-x:auto}
table{border-collapse:collapse;width:100%;font-size:12.5px}
th,td{padding:4px 6px;border-bottom:1px solid #eaeef2;text-align:left;vertical-align:top}
th{background:var(--soft);font-weight:600;color:#424a53;position:sticky;top:0;z-index:1;white-space:nowrap}
td.r,th.r{text-align:right}
table.pts td{white-space:nowrap}
table.pts td.note{white-space:normal;min-width:150px;font-size:11.5px;line-height:1.3}
table.pts tr.st-over td{background:#fffaf0}
table.pts tr.st-divergent td{background:#fff1f0}
table.pts tr.st-not_comparable td{background:#f6f8fa;color:#59636e}
table.pts tr.first td{background:#ffdcd7;font-weight:600}
table.pts tr.first td.key::after{content:" ◀ first";color:var(--red);font-weight:700;font-family:inherit}
table.pts tr.grp td{background:#f0f3f6;font-weight:650;color:#424a53;padding-top:6px;border-top:1px solid var(--line)}
.ebar{display:flex;align-items:center;gap:8px;justify-content:flex-end}
.ebar .bar{width:54px;height:7px;background:#eef1f4;border-radius:4px;overflow:hidden;flex:none}
.ebar .bar i{display:block;height:100%;border-radius:4px}
.flt{margin:0 6px 10px 0;vertical-align:middle}
.fltl{font-size:12.5px;color:var(--muted);vertical-align:middle}
#only-bad:checked ~ .tablewrap tr.st-ok,#only-bad:checked ~ .tablewrap tr.grp-allok{display:none}
.tablewrap{overflow-x:auto}
.legend{display:flex;flex-wrap:wrap;gap:14px;font-size:12px;color:var(--muted);margin-top:6px}
.ops td{font-size:12px}
.ops td.opn{min-width:190px}
.ops td.opn b{font-family:var(--mono);font-weight:600}
.ops td.ds{white-space:nowrap}
.ops td.opn small{display:block;color:var(--muted);font-family:var(--mono);font-size:11px;white-space:normal;
word-break:break-all}
.ops td.sep,.ops th.sep{border-left:2px solid var(--line)}
.ops tr.differs td{background:#fff1f0}
.ops tr.firstdiff td{background:#ffdcd7}
.ops tr.only td{background:#fff8e6}
.ops tr.only td.opn b{color:var(--amber)}
.badge{display:inline-block;background:var(--red);color:#fff;border-radius:4px;font-size:10.5px;font-weight:700;
padding:0 5px;margin-left:6px;vertical-align:1px}
.bar2{display:inline-block;height:9px;border-radius:3px;background:#e69f00;vertical-align:middle}
.bar2bg{display:inline-block;width:120px;height:9px;background:#eef1f4;border-radius:3px;vertical-align:middle;
margin-right:8px;overflow:hidden}
.sides{display:grid;grid-template-columns:1fr 1fr;gap:16px}
.side h3{margin:0 0 6px;font-size:14px}
.kv{width:100%;font-size:12.5px}
.kv td{padding:2px 8px 2px 0;border:none}
.kv td:first-child{color:var(--muted);width:40%;white-space:nowrap}
footer{color:var(--muted);font-size:12px;text-align:center;margin-top:8px}
@media print{html{background:#fff}section{box-shadow:none;break-inside:avoid}}
"""


def render_html(report: dict) -> str:
    """The HTML page of one report (the dict of `Report.to_json()`, or one loaded from its JSON file)."""
    from .report_bounds import HTML, bounded, omitted_lines
    r = bounded(dict(_d(report)), HTML)     # every list capped; what is left out is said at the top
    if not isinstance(r.get("verdict"), str):
        r["verdict"] = None if r.get("verdict") is None else str(r.get("verdict"))
    points = sorted(({**p, "status": _str_or_none(p.get("status"))} for p in _l(r.get("points"))
                     if isinstance(p, dict)), key=_sort_key)
    first = r.get("first_divergence") if isinstance(r.get("first_divergence"), dict) else None
    ctx = _Ctx(r, points, first)
    sides = _d(r.get("sides"))
    sa, sb = _d(sides.get("a")), _d(sides.get("b"))
    title = f"tic-trace: {r.get('verdict', '?')}"
    if first:
        title += f" at {first.get('key', '?')}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title>",
        f"<style>{CSS}</style></head><body><div class=\"page\">",
        '<header class="top"><h1><span class="brand">tic-trace</span> divergence report</h1>'
        f'<div class="vs">A: <b>{_e(sa.get("framework", "?"))}</b> <span class="mono">{_e(sa.get("path", ""))}</span>'
        f' &nbsp;vs&nbsp; B: <b>{_e(sb.get("framework", "?"))}</b> <span class="mono">{_e(sb.get("path", ""))}</span>'
        "</div></header>",
        '<nav class="toc"><a href="#contract">Contract</a><a href="#answer">Answer</a><a href="#growth">Error growth</a>'
        '<a href="#points">All points</a><a href="#tokens">Worst tokens</a><a href="#routing">Routing</a>'
        '<a href="#ops">Dispatcher ops</a><a href="#not-comparable">Not comparable</a>'
        '<a href="#sides">Sides</a></nav>',
        "".join(f'<p class="sub">{_e(line)}</p>' for line in omitted_lines(r)),
        *(_guarded(sec, ctx) for sec in (_contract_section, _answer, _growth_section, _points_section, _tokens_section,
                                          _routing_section, _ops_section, _nc_section, _sides_section)),
        f'<footer>schema {_e(r.get("schema", "?"))} · generated by tic-trace · self-contained page, '
        "no external resources</footer>",
        "</div></body></html>",
    ]
    return "\n".join(parts)


def _guarded(section, ctx) -> str:
    """One section; a malformed report breaks only the section it malforms, never the page."""
    try:
        return section(ctx)
    except Exception as exc:  # noqa: BLE001
        sid = section.__name__.strip("_").replace("_section", "")
        return (f'<section><p class="empty">The {_e(sid)} section could not be drawn from this report '
                f"({_e(type(exc).__name__)}: {_e(exc)}).</p></section>")


def write_html(report: dict, path) -> Path:
    p = Path(path)
    p.write_text(render_html(report), encoding="utf-8")
    return p


class _Ctx:
    """What several sections share: the sorted points, lookups, the error scale."""

    def __init__(self, r: dict, points: list[dict], first: dict | None):
        self.r, self.points, self.first = r, points, first
        self.by_key = {}
        for p in points:
            self.by_key.setdefault(str(p.get("key")), p)
        self.first_key = str(first.get("key")) if first else None
        tolj = _d(_d(r.get("settings")).get("tolerance"))
        self.growth_factor = _num(tolj.get("growth"))
        errs = [_num(p.get("error")) for p in points if not _is_ids(_point_of(p))]
        pos = [v for v in errs if v is not None and 0 < v < math.inf]
        tols = [v for v in (_num(p.get("tol")) for p in points if not _is_ids(_point_of(p)))
                if v is not None and 0 < v < math.inf]
        vals = pos + tols
        self.lo, self.hi = _decades(vals, pad=2)
        self.first_op = _first_differing_op(_d(first.get("ops")) if first else {})


# ------------------------------------------------------------------------------------------------
# 1. the answer
# ------------------------------------------------------------------------------------------------

def _contract_section(c: _Ctx) -> str:
    """The contract (versions, config, numerics settings, point dtypes, weights), diffed before any tensor."""
    from .report import contract_line
    diffs = [d for d in _l(c.r.get("contract")) if isinstance(d, dict)]
    if "contract" not in c.r or (not diffs and architecture_refusal(c.r)):
        return ""       # a pair refused for its architecture: its points' dtypes and weights were not read
    if not diffs:
        return ('<section id="contract"><p class="note">Contract: versions, model config, numerics settings, '
                "point dtypes and weight hashes agree.</p></section>")
    items = "".join(f'<li class="mono">{_e(contract_line(d))}</li>' for d in diffs[:200])
    return (f'<section id="contract"><h2>Contract: {len(diffs)} difference(s)</h2><p class="note">What the two '
            "sides claim to compute, read from manifests and record headers before any tensor.</p>"
            f'<ul>{items}</ul></section>')


def _answer(c: _Ctx) -> str:
    r, first = c.r, c.first
    verdict = r.get("verdict")
    vcls = verdict if verdict in ("divergent", "consistent", "not_comparable") else "unknown"
    counts = Counter(p.get("status") for p in c.points)
    n = len(c.points)
    out = ['<section id="answer">']
    if first:
        fk = first.get("key", "?")
        msg = (f"The first point where B stops computing what A computes is <code>{_e(fk)}</code>"
               f" — {_e(_meaning(first.get('point')) or first.get('point', ''))}.")
    elif verdict == "consistent":
        msg = (f"No point diverges: {counts.get('ok', 0)} of {n} points are within tolerance"
               + (f"; {counts['over']} over it only carry error they inherited" if counts.get("over") else "")
               + (f"; {counts['not_comparable']} could not be compared" if counts.get("not_comparable") else "")
               + ".")
    elif verdict == "divergent":
        msg = "The report says the sides diverge, but names no first point."
    elif architecture_refusal(r):
        msg = "Not compared: " + " ".join(_e(n.get("summary")) for n in architecture_refusal(r))
    else:
        msg = "Nothing could be compared: see the list of points that are not comparable below."
    if unverified_sides(r):
        msg += (" <strong>Unverified mapping:</strong> "
                + " ".join(_e(n.get("summary")) for n in unverified_sides(r)))
    out.append(f'<div class="banner v-{vcls}"><span class="verdict">{_e(STATUS_LABEL.get(verdict, verdict) or "?")}'
               f'</span><span class="msg">{msg}</span></div>')
    out.append('<div class="body">')
    out.append(_causes_html(c))
    if first:
        out.append(_first_facts(c, first))
    else:
        out.append(_summary_facts(c, counts))
    out.append("</div></section>")
    return "\n".join(out)


def _causes_html(c: _Ctx) -> str:
    """The report's named causes (findings) and notes, first thing under the verdict."""
    items = []
    for f in _l(c.r.get("findings")):
        if not isinstance(f, dict):
            continue
        counted = "" if f.get("divergent") else ' <span class="note">(shown, not counted)</span>'
        remedy = f'<div class="note">what removes it: {_e(f.get("remedy"))}</div>' if f.get("remedy") else ""
        items.append(f'<li><span class="cause">{_e(f.get("cause"))}</span>{counted} at '
                     f'<a class="k mono" href="#{_e(_anchor(f.get("key")))}">{_e(f.get("key"))}</a>: '
                     f'{_e(f.get("summary"))}{remedy}</li>')
    for n in _l(c.r.get("notes")):
        if isinstance(n, dict):
            items.append(f'<li><span class="cause">note: {_e(str(n.get("kind")).replace("_", " "))}</span> '
                         f'{_e(n.get("summary"))}</li>')
    if not items:
        return ""
    return '<ul class="causes" style="margin:0 0 12px;padding-left:18px">' + "".join(items) + "</ul>"


def _summary_facts(c: _Ctx, counts: Counter) -> str:
    rows = []
    rows.append(("Points", " ".join(f'{_pill(s)} <span class="num">{counts.get(s, 0)}</span>&nbsp;'
                                    for s in STATUSES)))
    worst = None
    for p in c.points:
        v = _num(p.get("error"))
        if v is not None and not _is_ids(_point_of(p)) and (worst is None or v > _num(worst.get("error"))):
            worst = p
    if worst is not None and _num(worst.get("error")) == 0:
        rows.append(("Largest error", "0 — every compared point is bit-identical"))
    elif worst is not None:
        rows.append(("Largest error", f'<a class="k mono" href="#{_e(_anchor(worst.get("key")))}">'
                                      f'{_e(worst.get("key"))}</a> <span class="num">{_sci(worst.get("error"))}</span>'
                                      f' (tolerance <span class="num">{_sci(worst.get("tol"))}</span>)'))
    rows.append(("Rows", _rows_text(c.r)))
    return _facts(rows)


def _rows_text(r: dict) -> str:
    rows = _d(r.get("rows"))
    return (f'<span class="num">{_gen(rows.get("matched"))}</span> tokens matched '
            f'(A has <span class="num">{_gen(rows.get("a"))}</span>, '
            f'B has <span class="num">{_gen(rows.get("b"))}</span>)')


def _facts(rows) -> str:
    return '<dl class="facts">' + "".join(f"<dt>{_e(k)}</dt><dd>{v}</dd>" for k, v in rows) + "</dl>"


def _first_facts(c: _Ctx, f: dict) -> str:
    rows = []
    key = f.get("key", "?")
    point = f.get("point")
    rows.append(("First divergence", f'<a class="k" href="#{_e(_anchor(key))}"><span class="big">{_e(key)}</span></a>'
                                     f'<span class="meaning">{_e(point)} · {_e(_meaning(point))}</span>'))
    lay = _layer_of(f)
    rows.append(("Layer", f'<span class="num">{lay}</span>' if lay is not None else "— (outside the layers)"))
    err, tol = _num(f.get("error")), _num(f.get("tol"))
    et = f'<span class="num">{_sci(err)}</span> vs tolerance <span class="num">{_sci(tol)}</span>'
    if err is not None and tol is not None:
        if tol > 0 and not math.isinf(err):
            ratio = err / tol
            rt = f"{ratio:,.0f}" if 10 <= ratio < 1e9 else f"{ratio:.3g}"
            et += f' &nbsp;<span class="over-x">{rt}× the tolerance</span>'
        elif tol == 0 and err > 0:
            et += ' &nbsp;<span class="over-x">(any difference counts)</span>'
    if f.get("dtype"):
        et += f' &nbsp;<span class="note">judged as {_e(f.get("dtype"))}</span>'
    if _is_ids(point) and isinstance(f.get("routing"), dict):
        rt = f["routing"]
        et += (f' &nbsp;<span class="note">{_gen(rt.get("flipped_rows"))} of {_gen(rt.get("rows"))} tokens '
               f'route differently, {_gen(rt.get("unexplained_flips"))} beyond router-logit noise</span>')
    rows.append(("Error vs tolerance", et))
    g, ie = _num(f.get("growth")), _num(f.get("input_error"))
    inputs = [str(k) for k in _l(f.get("inputs"))]
    gf = f" (a point diverges above ×{c.growth_factor:g})" if c.growth_factor else ""
    if ie == 0 and (err or 0) > 0:
        gt = (f'<span class="num over-x">×∞</span> — its inputs are bit-identical '
              f'(input error 0): the error is born here')
    elif g is not None:
        gt = (f'<span class="num over-x">{_growth(g)}</span> over its inputs\' error '
              f'<span class="num">{_sci(ie)}</span><span class="note">{_e(gf)}</span>')
    else:
        gt = f'<span class="num">—</span> (input error <span class="num">{_sci(ie)}</span>)'
    rows.append(("Growth over inputs", gt))
    worst = [r for r in _l(f.get("worst_rows")) if isinstance(r, dict)][:8]
    if worst:      # each judged on its own: its error, its growth over the same row's input error, its status
        by = f' <span class="note">(the point is judged on token {_e(f.get("decided_by_row"))})</span>' \
            if f.get("decided_by_row") else ""
        rows.append(("Worst rows", '<div class="chips">' + "".join(
            f'<span class="chip"><span class="mono">{_e(r.get("row"))}</span> <span class="num">'
            f'{_sci(_num(r.get("error")))}</span> {_growth(_num(r.get("growth")))} {_pill(r.get("status"))}</span>'
            for r in worst) + "</div>" + by))
    cause = f.get("cause") or "—"
    rows.append(("Cause", f'<span class="cause">{_e(cause)}</span> {_e(f.get("summary") or "")}'))
    if f.get("reason") and f.get("cause") and f.get("reason") != f.get("cause"):
        rows.append(("Note", _e(f.get("reason"))))
    chips = []
    for k in inputs:
        p = c.by_key.get(k, {})
        chips.append(f'<span class="chip"><a class="k mono" href="#{_e(_anchor(k))}">{_e(k)}</a> '
                     f'<span class="num">{_sci(p.get("error"))}</span> {_pill(p.get("status")) if p else ""}</span>')
    rows.append(("Inputs", f'<div class="chips">{"".join(chips)}</div>' if chips else
                 '<span class="note">none (a first point of the graph)</span>'))
    src = _d(f.get("sources"))
    st = []
    for side in ("a", "b"):
        names = ", ".join(_e(s) for s in _l(src.get(side)))
        if names:
            st.append(f'<div><b>{side.upper()}</b> <span class="mono">{names}</span></div>')
    if st:
        rows.append(("Records", "".join(st)))
    if c.first_op:
        i, oa, j, ob = c.first_op
        rows.append(("First differing op",
                     f'<a class="k" href="#ops"><span class="mono"><b>{_e(oa.get("op"))}</b></span></a> '
                     f'(A op #{i}, B op #{j} of the region: the same op on both sides, a different output) '
                     f'<span class="note mono">{_e(oa.get("name"))}</span>'))
    only = _only_ops(_d(f.get("ops")))
    txt = []
    for side in ("a", "b"):
        if only[side]:
            ops_txt = ", ".join(f'<b class="mono">{_e(op)}</b>' + (f" ×{n}" if n > 1 else "")
                                for op, n in only[side].most_common(6))
            txt.append(f"<div>only {side.upper()} runs {ops_txt}</div>")
    if txt:
        rows.append(("Ops one side only", "".join(txt)))
    wt = [w for w in _l(c.r.get("worst_tokens")) if isinstance(w, dict)]
    if wt:
        starts = Counter(str(w.get("divergence_starts")) for w in wt if w.get("divergence_starts"))
        if starts:
            txt = ", ".join(f'<a class="k mono" href="#{_e(_anchor(k))}">{_e(k)}</a> ({n})'
                            for k, n in starts.most_common(4))
            rows.append(("Worst tokens start at", f"{txt} <span class=\"note\">of the {len(wt)} tokens with the "
                                                  "largest |Δ log-prob|</span>"))
    rows.append(("Rows", _rows_text(c.r)))
    return _facts(rows)


# ------------------------------------------------------------------------------------------------
# 2. error growth through the layers
# ------------------------------------------------------------------------------------------------

def _growth_section(c: _Ctx) -> str:
    head = ('<section id="growth"><h2>Error growth through the layers</h2>'
            '<p class="sub">Relative L2 error of each point kind, per layer (log scale). Dashed: the tolerance; '
            'the shaded band is over it. Exact zeros sit on the bottom line. A jump between layers is where error '
            'is born; a flat high line is inherited error.</p>')
    svg = _growth_svg(c)
    return head + (f'<div class="plotwrap">{svg}</div>' if svg else
                   '<p class="empty">No numeric errors to plot.</p>') + "</section>"


def _growth_svg(c: _Ctx) -> str | None:
    pts = [p for p in c.points if not _is_ids(_point_of(p))]
    layered = [p for p in pts if _layer_of(p) is not None]
    layers = sorted({_layer_of(p) for p in layered})
    has_embed = any(_point_of(p) == "embed" and _layer_of(p) is None for p in pts)
    heads = [h for h in HEAD_POINTS if any(_point_of(p) == h and _layer_of(p) is None for p in pts)]
    if not layers and not has_embed and not heads:
        return None
    cols: list = (["emb"] if has_embed else []) + layers + (["head"] if heads else [])
    # x positions in layer units; embed and head sit a little apart from the layers
    gap = max(1.0, 0.04 * len(layers))
    xi: dict = {lay: float(i) for i, lay in enumerate(layers)}
    if has_embed:
        xi["emb"] = -gap
    if heads:
        xi["head"] = (len(layers) - 1 if layers else 0) + gap
    x_lo, x_hi = min(xi.values()), max(xi.values())

    present_kinds = {_point_of(p) for p in layered}
    kinds = [k for k in GROWTH_KINDS if k in present_kinds]
    fp = _point_of(c.first) if c.first else None
    if c.first and _layer_of(c.first) is not None and fp in present_kinds and fp not in kinds and not _is_ids(fp):
        kinds.append(fp)
    if not kinds:
        kinds = sorted(present_kinds, key=lambda k: order_key(k, 0))[:6]
    kinds.sort(key=lambda k: order_key(k, 0))
    colors, extra = {}, iter(EXTRA_COLORS * 4)
    for k in kinds:
        colors[k] = SERIES_COLORS.get(k) or next(extra)

    lo, hi = c.lo, c.hi
    W, H = 1160, 400
    ml, mr, mt, mb = 64, 190, 26, 46
    pw, ph = W - ml - mr, H - mt - mb
    zero_band = 22          # pixels under the lowest decade for exact zeros
    inf_band = 16           # pixels over the highest decade for infinities
    plot_top, plot_bottom = mt + inf_band, mt + ph - zero_band

    def X(col) -> float:
        if x_hi == x_lo:
            return ml + pw / 2
        return ml + 24 + (pw - 48) * (xi[col] - x_lo) / (x_hi - x_lo)

    def Y(v: float | None) -> float | None:
        if v is None or v < 0:
            return None
        if v == 0:
            return mt + ph
        if math.isinf(v):
            return mt
        lv = min(max(math.log10(v), lo), hi)
        return plot_bottom - (lv - lo) / (hi - lo) * (plot_bottom - plot_top)

    o = [f'<svg class="plot-growth" viewBox="0 0 {W} {H}" width="100%" role="img" '
         f'aria-label="relative error per layer, log scale" style="max-width:{W}px;font-size:12px">']
    # tolerance band(s)
    tols = Counter(_num(p.get("tol")) for p in pts if (_num(p.get("tol")) or 0) > 0
                   and not math.isinf(_num(p.get("tol"))))
    tol_vals = sorted(t for t, _ in tols.most_common(3))
    if tol_vals:
        ty = Y(tol_vals[0])
        o.append(f'<rect x="{ml}" y="{mt}" width="{pw}" height="{max(ty - mt, 0):.1f}" fill="#fff1f0"/>')
    # grid and y labels
    for d in range(lo, hi + 1):
        y = Y(10.0 ** d)
        o.append(f'<line class="grid" x1="{ml}" x2="{ml + pw}" y1="{y:.1f}" y2="{y:.1f}"/>')
        o.append(f'<text class="tick" x="{ml - 8}" y="{y + 4:.1f}" text-anchor="end">1e{d}</text>')
    o.append(f'<line class="grid" x1="{ml}" x2="{ml + pw}" y1="{mt + ph}" y2="{mt + ph}" '
             'stroke-dasharray="2 3"/>')
    o.append(f'<text class="tick" x="{ml - 8}" y="{mt + ph + 4}" text-anchor="end">0</text>')
    o.append(f'<text class="tick" x="{ml - 8}" y="{mt + 4}" text-anchor="end">∞</text>')
    # x axis
    step = next(s for s in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 10 ** 9) if len(layers) / s <= 25)
    for col in cols:
        x = X(col)
        if isinstance(col, str):
            lab = "embed" if col == "emb" else "head"
        elif col % step == 0:
            lab = f"{col}"
        else:
            lab = None
        if lab is not None or len(layers) <= 60:
            o.append(f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{mt}" y2="{mt + ph}" stroke-opacity=".6"/>')
        if lab is not None:
            o.append(f'<text class="tick" x="{x:.1f}" y="{mt + ph + 16}" text-anchor="middle">{_e(lab)}</text>')
    o.append(f'<line class="ax" x1="{ml}" x2="{ml + pw}" y1="{mt + ph}" y2="{mt + ph}"/>')
    o.append(f'<line class="ax" x1="{ml}" x2="{ml}" y1="{mt}" y2="{mt + ph}"/>')
    o.append(f'<text x="{ml + pw / 2:.1f}" y="{H - 6}" text-anchor="middle" fill="#59636e">layer</text>')
    o.append(f'<text x="14" y="{mt + ph / 2:.1f}" text-anchor="middle" fill="#59636e" '
             f'transform="rotate(-90 14 {mt + ph / 2:.1f})">relative error</text>')
    for t in tol_vals:
        y = Y(t)
        dts = sorted({str(p.get("dtype")) for p in pts if _num(p.get("tol")) == t})
        o.append(f'<line x1="{ml}" x2="{ml + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="{DIVERGE_RED}" '
                 'stroke-width="1.3" stroke-dasharray="6 4"/>')
        o.append(f'<text x="{ml + 6}" y="{y - 5:.1f}" font-size="11" fill="{DIVERGE_RED}" stroke="#fff" '
                 'stroke-width="3" paint-order="stroke" stroke-linejoin="round">'
                 f'tolerance {_e(_sci(t))} ({_e(", ".join(dts))})</text>')

    # first divergence: vertical marker
    fx = fy = None
    if c.first:
        fl = _layer_of(c.first)
        col = fl if fl is not None else ("emb" if fp == "embed" else "head")
        if col in xi:
            fx = X(col)
            o.append(f'<line x1="{fx:.1f}" x2="{fx:.1f}" y1="{mt}" y2="{mt + ph}" stroke="{DIVERGE_RED}" '
                     'stroke-width="1.5" stroke-opacity=".55"/>')
            if (fp in kinds and fl is not None) or (fl is None and fp in ("embed", *heads)):
                fy = Y(_num(c.first.get("error")))

    markers = len(cols) <= 48
    by_kind: dict = {}
    for p in layered:
        by_kind.setdefault(_point_of(p), {})[_layer_of(p)] = p
    for k in kinds:
        col = colors[k]
        seq = by_kind.get(k, {})
        d, pen = [], False
        for lay in layers:
            p = seq.get(lay)
            y = Y(_num(p.get("error"))) if p else None
            if y is None:
                pen = False
                continue
            d.append(f'{"L" if pen else "M"}{X(lay):.1f} {y:.1f}')
            pen = True
        w = 2.6 if k == "output" else 2
        if d:
            o.append(f'<path class="series" d="{" ".join(d)}" fill="none" stroke="{col}" stroke-width="{w}" '
                     'stroke-linejoin="round" stroke-linecap="round"/>')
        if markers:
            for lay in layers:
                p = seq.get(lay)
                y = Y(_num(p.get("error"))) if p else None
                if y is None:
                    continue
                o.append(f'<circle cx="{X(lay):.1f}" cy="{y:.1f}" r="3.2" fill="{col}" stroke="#fff" '
                         f'stroke-width="1"><title>{_e(p.get("key"))}: {_e(_sci(p.get("error")))} '
                         f'({_e(p.get("status"))})</title></circle>')
    # global points as markers
    glob = [("emb", "embed")] + [("head", h) for h in heads]
    for col, name in glob:
        if col not in xi:
            continue
        p = next((q for q in pts if _point_of(q) == name and _layer_of(q) is None), None)
        y = Y(_num(p.get("error"))) if p else None
        if y is None:
            continue
        x = X(col) + (0 if col == "emb" else (HEAD_POINTS.index(name) - 1) * 9)
        o.append(f'<rect x="{x - 4:.1f}" y="{y - 4:.1f}" width="8" height="8" fill="{HEAD_COLORS[name]}" '
                 f'stroke="#fff" stroke-width="1" transform="rotate(45 {x:.1f} {y:.1f})"><title>{_e(p.get("key"))}: '
                 f'{_e(_sci(p.get("error")))} ({_e(p.get("status"))})</title></rect>')
        if c.first and fp == name and _layer_of(c.first) is None:
            fx = x
    if fx is not None and fy is not None:
        o.append(f'<circle cx="{fx:.1f}" cy="{fy:.1f}" r="9" fill="none" stroke="{DIVERGE_RED}" stroke-width="2.5"/>')
    if fx is not None:
        lab = f"first divergence: {c.first.get('key', '?')}"
        anchor = "start" if fx < ml + pw * 0.7 else "end"
        tx = fx + 8 if anchor == "start" else fx - 8
        o.append(f'<text class="first-mark" x="{tx:.1f}" y="{mt + 12}" text-anchor="{anchor}" font-weight="700" '
                 f'fill="{DIVERGE_RED}">{_e(lab)}</text>')
    # legend
    lx, ly = ml + pw + 22, mt + 8
    o.append(f'<text x="{lx}" y="{ly}" font-weight="600" font-size="12">point kind</text>')
    ly += 18
    for k in kinds:
        o.append(f'<line x1="{lx}" x2="{lx + 22}" y1="{ly - 4}" y2="{ly - 4}" stroke="{colors[k]}" '
                 f'stroke-width="{2.6 if k == "output" else 2}"/><circle cx="{lx + 11}" cy="{ly - 4}" r="3" '
                 f'fill="{colors[k]}"/><text x="{lx + 30}" y="{ly}" font-size="12">{_e(k)}</text>')
        ly += 18
    for col, name in glob:
        if col in xi and any(_point_of(q) == name and _layer_of(q) is None for q in pts):
            o.append(f'<rect x="{lx + 7}" y="{ly - 8}" width="8" height="8" fill="{HEAD_COLORS[name]}" '
                     f'transform="rotate(45 {lx + 11} {ly - 4})"/><text x="{lx + 30}" y="{ly}" font-size="12">'
                     f'{_e(name)}</text>')
            ly += 18
    if tol_vals:
        ly += 4
        o.append(f'<line x1="{lx}" x2="{lx + 22}" y1="{ly - 4}" y2="{ly - 4}" stroke="{DIVERGE_RED}" '
                 f'stroke-width="1.3" stroke-dasharray="6 4"/><text x="{lx + 30}" y="{ly}" font-size="12">'
                 'tolerance</text>')
        ly += 18
    if fx is not None:
        o.append(f'<circle cx="{lx + 11}" cy="{ly - 4}" r="7" fill="none" stroke="{DIVERGE_RED}" stroke-width="2"/>'
                 f'<text x="{lx + 30}" y="{ly}" font-size="12">first divergence</text>')
    o.append("</svg>")
    return "".join(o)


# ------------------------------------------------------------------------------------------------
# 3. every point, in dataflow order
# ------------------------------------------------------------------------------------------------

def _points_section(c: _Ctx) -> str:
    counts = Counter(p.get("status") for p in c.points)
    summary = " ".join(f'{_pill(s)} <span class="num">{counts.get(s, 0)}</span>&nbsp;' for s in STATUSES)
    head = ('<section id="points"><h2>All points in dataflow order</h2>'
            '<p class="sub"><b>over</b>: above tolerance but carrying its inputs\' error; <b>divergent</b>: above '
            f'tolerance and grown more than the growth factor over its inputs. &nbsp; {summary}</p>')
    if not c.points:
        return head + '<p class="empty">The report has no points.</p></section>'
    o = [head, '<input type="checkbox" id="only-bad" class="flt"><label for="only-bad" class="fltl">'
               'show only points that are not ok</label>',
         '<div class="tablewrap"><table class="pts"><thead><tr><th>Point</th><th>Status</th><th>dtype</th>'
         '<th class="r">Error</th><th class="r">Tol</th><th class="r">Input err</th><th class="r">Growth</th>'
         '<th class="r">Rows</th><th class="r">Bit-equal</th><th class="r">Cosine</th><th class="r">Max ULP</th>'
         '<th>Note</th></tr></thead><tbody>']
    groups: dict = {}
    for p in c.points:
        groups.setdefault(_layer_of(p), []).append(p)
    seen_ids: set = set()
    cur = object()
    span = max(c.hi - c.lo, 1)
    for p in c.points:
        lay = _layer_of(p)
        grp = lay if lay is not None else ("embed" if _point_of(p) == "embed" else "head")
        if grp != cur:
            cur = grp
            members = groups.get(lay, []) if lay is not None else [
                q for q in groups.get(None, []) if (_point_of(q) == "embed") == (grp == "embed")]
            allok = all(q.get("status") == "ok" for q in members)
            label = f"Layer {lay}" if lay is not None else ("Embedding" if grp == "embed" else "Head")
            bad = Counter(q.get("status") for q in members)
            tail = ", ".join(f"{bad[s]} {STATUS_LABEL[s]}" for s in ("divergent", "over", "not_comparable") if bad[s])
            o.append(f'<tr class="grp{" grp-allok" if allok else ""}"><td colspan="12">{_e(label)}'
                     f'<span class="note" style="font-weight:400"> &nbsp;{_e(tail or "all ok")}</span></td></tr>')
        st = p.get("status")
        key = str(p.get("key"))
        aid = _anchor(key)
        id_attr = "" if aid in seen_ids else f' id="{_e(aid)}"'
        seen_ids.add(aid)
        cls = f"st-{st}" if st in STATUSES else "st-unknown"
        if c.first_key is not None and key == c.first_key:
            cls += " first"
        m = _d(p.get("metrics"))
        stt = _d(p.get("stats"))
        rt = _d(p.get("routing"))
        err = _num(p.get("error"))
        lv = _log10(err)
        if lv is not None:
            w = min(max((lv - c.lo) / span, 0.03), 1.0) * 100
        else:
            w = 100.0 if err is not None and math.isinf(err) else 0.0
        bar = (f'<span class="bar"><i style="width:{w:.0f}%;background:{STATUS_COLOR.get(st, "#6e7781")}"></i>'
               '</span>')
        if m:
            beq, cos, ulp = _pct(m.get("bitwise_equal")), _cos(m.get("cosine")), _gen(m.get("max_ulp"))
        elif stt:
            beq = "100%" if stt.get("bitwise_equal") is True else ("0%" if stt.get("bitwise_equal") is False else "—")
            cos = ulp = "—"
        else:
            beq = cos = ulp = "—"
        note = _str_or_none(p.get("reason")) or ""
        if rt and not note:
            note = f"set agreement {_pct(rt.get('set_agreement'))}"
        if m and (_num(m.get("nonfinite")) or 0) > 0:
            note = (note + "; " if note else "") + f"{_gen(m.get('nonfinite'))} non-finite"
        extra = ""
        if _int(p.get("only_a")) or _int(p.get("only_b")):
            extra = f' <span class="note">(+{_gen(p.get("only_a"))} A-only, +{_gen(p.get("only_b"))} B-only)</span>'
        inputs = ", ".join(str(k) for k in _l(p.get("inputs")))
        o.append(
            f'<tr class="{cls}"{id_attr}><td class="key mono" title="{_e(_meaning(_point_of(p)))}">{_e(key)}</td>'
            f"<td>{_pill(st)}</td><td class=\"mono\">{_e(p.get('dtype') or '—')}</td>"
            f'<td class="r num"><span class="ebar">{_sci(err)}{bar}</span></td>'
            f'<td class="r num">{_sci(p.get("tol"))}</td>'
            f'<td class="r num" title="inputs: {_e(inputs)}">{_sci(p.get("input_error"))}</td>'
            f'<td class="r num">{_growth(p.get("growth"))}</td>'
            f'<td class="r num">{_gen(p.get("rows"))}{extra}</td>'
            f'<td class="r num">{beq}</td><td class="r num">{cos}</td><td class="r num">{ulp}</td>'
            f'<td class="note">{_e(note)}</td></tr>')
    o.append("</tbody></table></div></section>")
    return "\n".join(o)


# ------------------------------------------------------------------------------------------------
# 4. per-token heatmap
# ------------------------------------------------------------------------------------------------

def _tokens_section(c: _Ctx) -> str:
    head = ('<section id="tokens"><h2>Worst tokens: per-token error at every point</h2>'
            '<p class="sub">Rows: the tokens with the largest |Δ log-prob| '
            '(<span class="mono">sample@position</span>),'
            ' worst first. Columns: points in dataflow order. Colour: relative error of that token\'s row (log '
            'scale); the outlined cell is where that token\'s divergence starts. Hover a cell for its value.</p>')
    te = _d(c.r.get("token_errors"))
    rows = [(str(k), _d(v)) for k, v in te.items()]
    worst = {}
    for w in _l(c.r.get("worst_tokens")):
        if isinstance(w, dict):
            worst.setdefault(f"{w.get('sample')}@{w.get('position')}", w)
    body = _heatmap_svg(c, rows, worst) if rows and any(v for _, v in rows) else (
        '<p class="empty">No per-token errors in this report (no log-probs were compared, or the traces '
        'hold statistics only).</p>')
    return head + body + _worst_table(worst) + "</section>"


def _heatmap_svg(c: _Ctx, rows, worst: dict) -> str:
    keys = sorted({k for _, v in rows for k in v}, key=_key_sort)
    n_all = len(keys)
    if n_all > MAX_HEAT_COLS:
        # a deep model: keep the plot's point kinds, the global points and every token's starting point
        keep = {str(w.get("divergence_starts")) for w in worst.values()} | {c.first_key}
        keys = [k for k in keys if k in keep or parse_key(k)[1] is None or parse_key(k)[0] in GROWTH_KINDS]
    vals = [_num(v.get(k)) for _, v in rows for k in keys]
    lo, hi = _decades([v for v in vals if v is not None], pad=1)
    n = len(keys)
    lw, rw = 74, 140
    cw = min(max(GRID_W / max(n, 1), 1.5), 30.0)
    ch = 22 if len(rows) <= 16 else 15
    label_fs = min(11.0, cw * 0.866 - 0.6)         # rotated -60°: the labels' spacing is cw·sin 60°
    label_cols = label_fs >= 7.5
    top = 28
    lab_h = 12 * label_fs if label_cols else 24
    gw = cw * n
    W = max(lw + gw + rw, 600)
    legend_y = top + ch * len(rows) + lab_h + 12
    H = legend_y + 44

    def color(v) -> str:
        x = _num(v)
        if x is None:
            return HEAT_MISSING
        if x == 0:
            return HEAT_ZERO
        if x < 0:
            return HEAT_MISSING
        if math.isinf(x):
            return HEAT_INF
        return _lerp_color(HEAT_STOPS, (math.log10(x) - lo) / (hi - lo))

    o = [f'<div class="plotwrap"><svg class="heatmap" viewBox="0 0 {W:.0f} {H:.0f}" width="{W:.0f}" '
         f'height="{H:.0f}" role="img" aria-label="per-token relative error" style="font-size:11px">']
    # layer bands over the columns
    prev, start = object(), 0
    bands = []
    for j, k in enumerate(keys):
        pt, lay = parse_key(k)
        g = lay if lay is not None else ("emb" if pt == "embed" else "head")
        if g != prev:
            if j:
                bands.append((prev, start, j))
            prev, start = g, j
    if keys:
        bands.append((prev, start, n))
    for bi, (g, s, e) in enumerate(bands):
        x0, x1 = lw + s * cw, lw + e * cw
        o.append(f'<rect x="{x0:.1f}" y="{top - 20}" width="{x1 - x0:.1f}" height="16" '
                 f'fill="{"#eef1f5" if bi % 2 == 0 else "#e1e7ee"}"/>')
    for g, s, e in bands:                       # labels after every band, so none is painted over
        x0, x1 = lw + s * cw, lw + e * cw
        lab = f"L{g}" if isinstance(g, int) else ("emb" if g == "emb" else "head")
        every = max(1, math.ceil(30 / max(x1 - x0, 1e-9)))
        step = next(k for k in (1, 2, 5, 10, 20, 50, 100, 10 ** 9) if k >= every)
        if x1 - x0 >= 26 or (isinstance(g, int) and g % step == 0):
            o.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{top - 8}" text-anchor="middle" font-weight="600" '
                     f'fill="#424a53">{_e(lab)}</text>')
    # cells
    for i, (label, v) in enumerate(rows):
        y = top + i * ch
        w = worst.get(label, {})
        o.append(f'<text x="{lw - 6}" y="{y + ch / 2 + 4:.1f}" text-anchor="end" font-family="monospace">'
                 f'{_e(label)}</text>')
        for j, k in enumerate(keys):
            x = lw + j * cw
            val = v.get(k)
            o.append(f'<rect x="{x:.2f}" y="{y}" width="{cw:.2f}" height="{ch}" fill="{color(val)}" '
                     f'stroke="#fff" stroke-width="{0.6 if cw >= 6 else 0}"><title>{_e(label)} · {_e(k)}: '
                     f'{_e(_sci(val))}</title></rect>')
        start_k = w.get("divergence_starts")
        if start_k in keys:
            j = keys.index(start_k)
            o.append(f'<rect x="{lw + j * cw + 1:.2f}" y="{y + 1}" width="{max(cw - 2, 1):.2f}" height="{ch - 2}" '
                     'fill="none" stroke="#1f2328" stroke-width="2"/>')
        if w:
            flip = " ⇄" if w.get("routing_flip") else ""
            o.append(f'<text x="{lw + gw + 8:.1f}" y="{y + ch / 2 + 4:.1f}" fill="#59636e">'
                     f'Δ log-prob {_e(_fmt_f(w.get("abs_dlogprob")))}{_e(flip)}</text>')
    gy = top + ch * len(rows)
    if c.first_key in keys:
        j = keys.index(c.first_key)
        x = lw + j * cw + cw / 2
        o.append(f'<path d="M{x - 5:.1f} {top - 3} L{x + 5:.1f} {top - 3} L{x:.1f} {top + 3} Z" '
                 f'fill="{DIVERGE_RED}"><title>first divergence: {_e(c.first_key)}</title></path>')
        o.append(f'<rect x="{lw + j * cw:.2f}" y="{top}" width="{cw:.2f}" height="{gy - top}" fill="none" '
                 f'stroke="{DIVERGE_RED}" stroke-width="1.2" stroke-dasharray="3 2"/>')
    if label_cols:
        for j, k in enumerate(keys):
            x = lw + j * cw + cw / 2 + label_fs * 0.3
            bold = ' font-weight="700" fill="#d1242f"' if k == c.first_key else ""
            o.append(f'<text x="{x:.1f}" y="{gy + 8}" text-anchor="end" font-size="{label_fs:.1f}" '
                     f'transform="rotate(-60 {x:.1f} {gy + 8})"{bold}>{_e(k)}</text>')
    # colour legend
    lx, lwid = lw, 300
    o.append('<defs><linearGradient id="heatgrad" x1="0" x2="1" y1="0" y2="0">' +
             "".join(f'<stop offset="{t:.2f}" stop-color="{col}"/>' for t, col in HEAT_STOPS) +
             "</linearGradient></defs>")
    o.append(f'<rect x="{lx}" y="{legend_y}" width="{lwid}" height="10" fill="url(#heatgrad)" stroke="#d1d9e0"/>')
    for d in range(lo, hi + 1):
        x = lx + (d - lo) / (hi - lo) * lwid
        o.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{legend_y + 10}" y2="{legend_y + 14}" stroke="#8c959f"/>'
                 f'<text class="tick" x="{x:.1f}" y="{legend_y + 26}" text-anchor="middle">1e{d}</text>')
    ex = lx + lwid + 30
    o.append(f'<rect x="{ex}" y="{legend_y}" width="14" height="10" fill="{HEAT_ZERO}" stroke="#d1d9e0"/>'
             f'<text x="{ex + 20}" y="{legend_y + 9}" fill="#59636e">0 (bit-identical)</text>')
    ex += 130
    o.append(f'<rect x="{ex}" y="{legend_y}" width="14" height="10" fill="none" stroke="#1f2328" stroke-width="2"/>'
             f'<text x="{ex + 20}" y="{legend_y + 9}" fill="#59636e">divergence starts</text>')
    ex += 130
    o.append(f'<text x="{ex}" y="{legend_y + 9}" fill="#59636e">⇄ routing flip</text>')
    o.append("</svg></div>")
    if n < n_all:
        o.append(f'<p class="note" style="font-size:12px;margin:0">Showing {n} of {n_all} points: the point '
                 "kinds of the error-growth plot, the "
                 "global points and where each token starts; the JSON report has every point.</p>")
    return "".join(o)


def _worst_table(worst: dict) -> str:
    if not worst:
        return ""
    o = ['<table style="margin-top:10px"><thead><tr><th>Token</th><th class="r">|Δ log-prob|</th>'
         '<th class="r">log-prob A</th><th class="r">log-prob B</th><th>Divergence starts</th>'
         '<th>Routing flip</th></tr></thead><tbody>']
    for label, w in worst.items():
        ds = w.get("divergence_starts")
        dst = (f'<a class="k mono" href="#{_e(_anchor(ds))}">{_e(ds)}</a>' if ds else
               '<span class="note">no divergence in this token</span>')
        o.append(f'<tr><td class="mono">{_e(label)}</td><td class="r num">{_fmt_f(w.get("abs_dlogprob"))}</td>'
                 f'<td class="r num">{_fmt_f(w.get("logprob_a"))}</td><td class="r num">{_fmt_f(w.get("logprob_b"))}'
                 f'</td><td>{dst}</td><td>{"yes" if w.get("routing_flip") else "no"}</td></tr>')
    o.append("</tbody></table>")
    return "".join(o)


def _fmt_f(x) -> str:
    v = _num(x)
    if v is None or math.isinf(v):
        return "—" if v is None else _inf_text(v)
    return f"{v:.4g}"


# ------------------------------------------------------------------------------------------------
# 5. routing
# ------------------------------------------------------------------------------------------------

def _routing_section(c: _Ctx) -> str:
    head = ('<section id="routing"><h2>Routing</h2><p class="sub">Top-k expert choice per MoE layer. A flip is '
            'a token whose selected expert set differs; a flip is <i>explained</i> when its router-logit margin is '
            'within the router-logit error (a near tie).</p>')
    rt = _d(c.r.get("routing"))
    layers = _d(rt.get("layers"))
    if not layers:
        return head + '<p class="empty">No routing in this report (a dense model, or the router was not traced).' \
                      '</p></section>'
    share = _num(rt.get("share_tokens_with_flip"))
    o = [head, f'<p><b class="num">{_gen(rt.get("tokens_with_flip"))}</b> tokens '
               f'(<b class="num">{_pct(share)}</b> of the matched tokens) have a routing flip in at least one '
               'layer.</p>']
    margins = {}
    for p in c.points:
        if _is_ids(_point_of(p)) and isinstance(p.get("routing"), dict):
            margins[str(_layer_of(p))] = [f"{_fmt_f(x.get('margin'))} (err {_fmt_f(x.get('logit_error'))})"
                                          for x in _l(p["routing"].get("flips")) if isinstance(x, dict)]

    def lk(k):
        v = _int(k)
        return (0, v) if v is not None else (1, str(k))

    o.append('<table><thead><tr><th>Layer</th><th>Flipped tokens</th><th class="r">Share</th>'
             '<th class="r">Near tie</th><th class="r">Unexplained</th><th class="r">Near tie to output</th>'
             '<th class="r">Share of |Δ log-prob|</th><th class="r">Set agreement</th>'
             '<th>Flip margins (router-logit error)</th></tr></thead><tbody>')
    for k in sorted(layers, key=lk):
        v = _d(layers[k])
        fl, rows = _num(v.get("flipped")), _num(v.get("rows"))
        sh = (fl / rows) if fl is not None and rows else None
        w = 0 if sh is None else min(max(sh, 0), 1) * 100
        un = _int(v.get("unexplained"))
        mg = ", ".join(margins.get(str(k), [])[:12])
        o.append(f'<tr><td class="num">{_e(k)}</td><td><span class="bar2bg"><span class="bar2" '
                 f'style="width:{w:.0f}%"></span></span><span class="num">{_gen(fl)} / {_gen(rows)}</span></td>'
                 f'<td class="r num">{_pct(sh)}</td>'
                 f'<td class="r num">{_gen(v.get("near_tie"))}</td>'
                 f'<td class="r num"{" style=color:#cf222e;font-weight:700" if un else ""}>{_gen(un)}</td>'
                 f'<td class="r num">{_gen(v.get("near_tie_to_output"))}</td>'
                 f'<td class="r num">{_pct(v.get("dlogprob_share"))}</td>'
                 f'<td class="r num">{_pct(v.get("set_agreement"))}</td><td class="num note">{mg or "—"}</td></tr>')
    o.append("</tbody></table></section>")
    return "".join(o)


# ------------------------------------------------------------------------------------------------
# 6. dispatcher ops in the first-divergence region
# ------------------------------------------------------------------------------------------------

def _side_ops(ops: dict, side: str) -> list[dict]:
    return [x for x in _l(ops.get(side)) if isinstance(x, dict)]


def _region(ops: dict) -> OpsRegion:
    """The report's op pairing (made once by the finder; built the same way for a schema-1 report)."""
    a, b = _side_ops(ops, "a"), _side_ops(ops, "b")
    try:
        region = OpsRegion.from_json(ops)
    except (TypeError, ValueError):     # a malformed report: pair its ops the report's way
        return OpsRegion.build(a, b)
    region.a, region.b = a, b
    ok = all(isinstance(p, (list, tuple)) and len(p) == 2 for p in region.pairs)
    if not ok or any((i is not None and not (isinstance(i, int) and 0 <= i < len(region.a))) or
                     (j is not None and not (isinstance(j, int) and 0 <= j < len(region.b))) for i, j in region.pairs):
        region = OpsRegion.build(region.a, region.b)
    return region


def _first_differing_op(ops: dict):
    """(index in A, op A, index in B, op B) of the report's first differing op; None when there is none."""
    region = _region(ops)
    n = region.first_differing
    if not isinstance(n, int) or not 0 <= n < len(region.pairs):
        return None
    i, j = region.pairs[n]
    if i is None or j is None:
        return None
    return i, region.a[i], j, region.b[j]


def _only_ops(ops: dict) -> dict:
    """Ops only one side runs in the region: {"a": Counter(op), "b": Counter(op)}."""
    region = _region(ops)
    a, b = region.a, region.b
    out = {"a": Counter(), "b": Counter()}
    for i, j in region.pairs:
        if j is None and i is not None:
            out["a"][str(a[i].get("op"))] += 1
        elif i is None and j is not None:
            out["b"][str(b[j].get("op"))] += 1
        elif i is not None and a[i].get("op") != b[j].get("op"):
            out["a"][str(a[i].get("op"))] += 1
            out["b"][str(b[j].get("op"))] += 1
    return out


def _n_ops(n: int) -> str:
    return f"{n} op" if n == 1 else f"{n} ops"


def _ops_section(c: _Ctx) -> str:
    sides = _d(c.r.get("sides"))
    fa, fb = _d(sides.get("a")).get("framework", "A"), _d(sides.get("b")).get("framework", "B")
    head = ('<section id="ops"><h2>Dispatcher ops in the first-divergence region</h2>'
            '<p class="sub">The aten ops each side ran between the first divergent point\'s inputs and its output, '
            'aligned on the op names. Red: the same op on both sides with a different output (hash or RMS); '
            'amber: an op only one side runs.</p>')
    if not c.first:
        return head + '<p class="empty">No first divergence, so no region to show.</p></section>'
    region = _region(_d(c.first.get("ops")))
    a, b = region.a, region.b
    if not a and not b:
        return head + ('<p class="empty">No dispatcher ops recorded in this region (the traces did not capture '
                       'ops, or the report was re-judged from saved metrics).</p></section>')
    o = [head, '<div class="plotwrap"><table class="ops"><thead>'
               f'<tr><th colspan="6">Side A · {_e(fa)} ({_n_ops(len(a))})</th>'
               f'<th colspan="6" class="sep">Side B · {_e(fb)} ({_n_ops(len(b))})</th></tr><tr>'
               + ('<th class="r{}">#</th><th>op / record</th><th>dtype · shape</th><th class="r">RMS</th>'
                  '<th class="r">abs max</th><th>hash</th>').format("")
               + ('<th class="r{}">#</th><th>op / record</th><th>dtype · shape</th><th class="r">RMS</th>'
                  '<th class="r">abs max</th><th>hash</th>').format(" sep")
               + "</tr></thead><tbody>"]
    fd = (c.first_op[0], c.first_op[2]) if c.first_op else None

    def cells(i: int | None, x: dict | None, sep: bool, badge: str = "") -> str:
        s = " sep" if sep else ""
        if x is None:
            return f'<td class="r num{s}"></td><td class="opn"><span class="note">—</span></td>' + "<td></td>" * 4
        return (f'<td class="r num{s}">{i}</td><td class="opn"><b>{_e(x.get("op"))}</b>{badge}'
                f'<small>{_e(x.get("name"))}</small></td>'
                f'<td class="mono ds">{_e(x.get("dtype") or "—")}<br>{_fmt_shape(x.get("shape"))}</td>'
                f'<td class="r num">{_sci(x.get("rms"))}</td><td class="r num">{_sci(x.get("absmax"))}</td>'
                f'<td class="mono">{_fmt_hash(x.get("hash"))}</td>')

    for i, j in region.pairs:
        oa = a[i] if i is not None else None
        ob = b[j] if j is not None else None
        cls, badge = "", ""
        if oa is None or ob is None or oa.get("op") != ob.get("op"):
            cls = "only"
        elif op_differs(oa, ob):
            cls = "differs"
        if fd == (i, j):
            cls += " firstdiff"
            badge = '<span class="badge">first difference</span>'
        o.append(f'<tr class="{cls.strip()}">{cells(i, oa, False, badge)}{cells(j, ob, True, badge)}</tr>')
    o.append("</tbody></table></div></section>")
    return "\n".join(o)


# ------------------------------------------------------------------------------------------------
# 7. not comparable, 8. sides
# ------------------------------------------------------------------------------------------------

def _nc_section(c: _Ctx) -> str:
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
    for label, items in (("incomplete passes skipped", d.get("skipped_passes")),
                         ("entries outside the trace layout", d.get("ignored_entries"))):
        if isinstance(items, list) and items:
            rows[label] = "; ".join(str(x) for x in items[:20]) + (" …" if len(items) > 20 else "")
    notes = d.get("merge_notes")
    if isinstance(notes, dict) and notes:
        rows["rank merges against the declaration"] = "; ".join(f"{k}: {v}" for k, v in list(notes.items())[:20])
    return ('<h3 style="margin-top:10px">Reader remarks</h3>' + _kv_table(rows)) if rows else ""


def _sides_section(c: _Ctx) -> str:
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
