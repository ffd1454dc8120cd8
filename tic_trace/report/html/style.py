"""The page's look: status labels and colours, series and heatmap colours, plot sizes, and the inline CSS
(no external stylesheet or font: the page opens on an air-gapped cluster)."""
from __future__ import annotations

from ...graph.canonical import CURVE_POINTS


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
