"""The self-contained HTML report (`tic_trace.report.html.render_html`) on real reports of tiny HF models.

(a) Unit tests of the page text: the answer comes first, every string from the report is escaped, nothing
    is loaded from outside the page, the SVG is well formed, and odd reports (consistent, no token errors, no
    routing, "inf"/None numbers, re-judged, empty) render.
(b) A real headless browser (Debian's Chromium) renders the page: the DOM has the first divergence and the SVG
    plots, and the screenshot is a real picture (a valid PNG, not one flat colour, with the verdict banner's
    colour at the top).
"""
from __future__ import annotations

import copy
import json
import re
import struct
import subprocess
import xml.etree.ElementTree as ET
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

import transformers  # noqa: E402,F401 - a required test dependency: fail loudly if missing

import tic_trace  # noqa: E402
from tic_trace.testing import child  # noqa: E402
from tic_trace.graph.canonical import CURVE_POINTS  # noqa: E402
from tic_trace import find_divergence  # noqa: E402
from tic_trace.compare.diverge import Tolerance, rejudge, sort_points  # noqa: E402
from tic_trace.report.html import render_html, write_html  # noqa: E402
from tic_trace.testing.hf_models import build_hf_model, sample_tokens, tiny_qwen3_config  # noqa: E402

CHROMIUM = Path("/usr/bin/chromium")
SECTIONS = ("answer", "growth", "points", "tokens", "routing", "ops", "not-comparable", "sides")


def _trace(model, path: Path, ids) -> None:
    with tic_trace.trace(model, path, adapter="hf", points_mode="full"), torch.no_grad():
        model(ids)


@pytest.fixture(scope="module")
def divergent(tmp_path_factory) -> dict:
    """MoE model; side B has layer 1's input-norm epsilon raised to 0.1: first divergence L1.attn_norm."""
    d = tmp_path_factory.mktemp("html_div")
    cfg, ids = tiny_qwen3_config(moe=True), sample_tokens(2, 8)
    for side, fault in (("A", False), ("B", True)):
        m = build_hf_model(cfg)
        if fault:
            m.model.layers[1].input_layernorm.variance_epsilon = 1e-1
        _trace(m, d / side, ids)
    rep = find_divergence(d / "A", d / "B").to_json()
    assert rep["verdict"] == "divergent" and rep["first_divergence"]["key"] == "L1.attn_norm"
    return json.loads(json.dumps(rep))          # exactly what a saved JSON report holds


@pytest.fixture(scope="module")
def consistent(tmp_path_factory) -> dict:
    """Dense model (no routing), two clean traces: consistent, no first divergence."""
    d = tmp_path_factory.mktemp("html_cons")
    cfg, ids = tiny_qwen3_config(moe=False), sample_tokens(2, 8)
    for side in ("A", "B"):
        _trace(build_hf_model(cfg), d / side, ids)
    rep = find_divergence(d / "A", d / "B").to_json()
    assert rep["verdict"] == "consistent" and rep["first_divergence"] is None
    return json.loads(json.dumps(rep))


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------

VOID = {"meta", "br", "input", "link", "img", "hr", "wbr", "col", "area", "base", "source", "track", "embed"}


class _Balance(HTMLParser):
    """Checks that every non-void element is closed, in order."""

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:]}")
            if tag in self.stack:
                while self.stack.pop() != tag:
                    pass
        else:
            self.stack.pop()


def _check_page(html: str) -> None:
    assert html.startswith("<!DOCTYPE html>")
    p = _Balance()
    p.feed(html)
    p.close()
    assert not p.errors, p.errors[:5]
    assert not p.stack, p.stack
    for svg in re.findall(r"<svg\b.*?</svg>", html, flags=re.S):
        ET.fromstring(svg)                      # every inline SVG is well-formed XML
    _check_self_contained(html)


def _check_self_contained(html: str) -> None:
    assert "http://" not in html and "https://" not in html
    tags = re.findall(r"<[A-Za-z][^>]*>", html)          # text is escaped, so a raw "<" starts a real tag
    link = re.compile(r"\b(?:src|href|xlink:href|action|srcset|poster|data)\s*=\s*(?:\"(?!#)|'(?!#)|(?![\"'#]))",
                      flags=re.I)
    bad = [t for t in tags if link.search(t)]
    assert not bad, f"a resource or link that is not an anchor inside the page: {bad[:3]}"
    assert not re.search(r"url\(\s*(?:\"(?!#)|'(?!#)|(?![\"'#]))", html), "a CSS url() that is not a local reference"
    assert "@import" not in html
    assert "<script" not in html.lower()        # the page needs no JavaScript
    assert "<link" not in html.lower() and "<iframe" not in html.lower()


def _svg(html: str, cls: str) -> ET.Element:
    m = re.search(rf'<svg class="{cls}".*?</svg>', html, flags=re.S)
    assert m, f"no <svg class={cls!r}>"
    return ET.fromstring(m.group(0))


# ------------------------------------------------------------------------------------------------
# (a) the page text
# ------------------------------------------------------------------------------------------------

def test_divergent_page_answer_first(divergent):
    html = render_html(divergent)
    _check_page(html)
    pos = [html.index(f'<section id="{s}"') for s in SECTIONS]
    assert pos == sorted(pos), "sections out of order"
    first = divergent["first_divergence"]
    answer = html[pos[0]:pos[1]]
    # the answer: verdict, key, meaning, layer, error vs tolerance, growth, cause, inputs
    assert 'class="banner v-divergent"' in answer
    assert "L1.attn_norm" in answer and "input norm output" in answer
    err = f"{first['error']:.2e}"        # the row-relative error of a fault that moves every row a lot
    assert first["error"] > 0.1 and err in answer and "1.00e-05" in answer and "× the tolerance" in answer
    assert "×∞" in answer and "bit-identical" in answer   # inputs are exact: growth is infinite
    assert _esc(first["cause"]) in answer
    assert "L1.input" in answer
    assert "aten.add" in answer                         # the first differing dispatcher op
    # the answer comes before the full table
    assert html.index("L1.attn_norm") < html.index('<table class="pts"')


def _esc(s: str) -> str:
    import html as h
    return h.escape(s, quote=True)


def test_growth_plot(divergent):
    html = render_html(divergent)
    svg = _svg(html, "plot-growth")
    series = [e for e in svg.iter("path") if e.get("class") == "series"]
    # one series per curve point (canonical.PointSpec.curve) the report has
    assert len(series) == len(CURVE_POINTS) == 8
    texts = " ".join("".join(t.itertext()) for t in svg.iter("text"))
    for kind in CURVE_POINTS:
        assert kind in texts
    assert "tolerance 1.00e-05" in texts
    assert "first divergence: L1.attn_norm" in texts
    # one marker per (kind, layer) with its value in a tooltip
    tips = ["".join(t.itertext()) for c in svg.iter("circle") for t in c.iter("title")]
    err = f"{divergent['first_divergence']['error']:.2e}"
    assert any(t.startswith(f"L1.attn_norm: {err}") for t in tips)


def test_points_table_in_dataflow_order(divergent):
    html = render_html(divergent)
    table = html[html.index('<table class="pts"'):]
    table = table[:table.index("</table>")]
    ids = re.findall(r'<tr class="[^"]*" id="pt-([^"]+)"', table)
    keys = [p["key"] for p in divergent["points"]]
    assert ids == sort_points(keys)
    assert re.search(r'<tr class="st-divergent first" id="pt-L1.attn_norm">', table)
    assert table.count('class="pill s-over"') == sum(p["status"] == "over" for p in divergent["points"])
    # metrics columns: bitwise-equal fraction, cosine, max ULP
    row = re.search(r'id="pt-L1.attn_norm">(.*?)</tr>', table, flags=re.S).group(1)
    assert "0%" in row and "0.982585" in row and "1.32e+07" in row


def test_token_heatmap(divergent):
    html = render_html(divergent)
    svg = _svg(html, "heatmap")
    te = divergent["token_errors"]
    cols = {k for v in te.values() for k in v}
    cells = [r for r in svg.iter("rect") if r.find("title") is not None]
    assert len(cells) == len(te) * len(cols)
    label = next(iter(te))
    tip = f"{label} · L1.attn_norm: "
    assert any("".join(c.find("title").itertext()).startswith(tip) for c in cells)
    labels = ["".join(t.itertext()) for t in svg.iter("text")]
    assert all(lab in labels for lab in te)              # rows labelled sample@position
    # columns in dataflow order (the rotated labels)
    col_labels = [t for t in labels if t in cols]
    assert col_labels == sort_points(list(cols))


def test_routing_ops_sides(divergent):
    html = render_html(divergent)
    sec = lambda s: html[html.index(f'<section id="{s}"'):].split("</section>")[0]  # noqa: E731
    routing = sec("routing")
    assert "3 / 16" in routing and "18.8%" in routing
    ops = sec("ops")
    n_a, n_b = len(divergent["first_divergence"]["ops"]["a"]), len(divergent["first_divergence"]["ops"]["b"])
    assert f"({n_a} ops)" in ops and f"({n_b} ops)" in ops
    assert "first difference" in ops and "aten.rsqrt" in ops
    sides = sec("sides")
    assert "transformers" in sides and divergent["sides"]["a"]["versions"]["torch"] in sides
    assert "Nothing" in sec("not-comparable")


def test_escaping(divergent):
    r = copy.deepcopy(divergent)
    evil = '<script>alert("x")</script>'
    attr = 'q" onmouseover="alert(1)'
    f = r["first_divergence"]
    f["sources"]["a"] = [evil]
    f["cause"] = evil
    f["inputs"] = [attr]
    f["ops"]["a"][0]["name"] = evil
    f["ops"]["b"][0]["op"] = '<img src=x onerror=alert(1)>'
    r["points"][3]["reason"] = evil
    r["points"][4]["inputs"] = [attr]
    r["points"][5]["dtype"] = evil
    r["not_comparable"].append({"key": evil, "reason": "<b>bold</b>"})
    r["sides"]["a"]["framework"] = evil
    r["sides"]["b"]["path"] = evil
    r["sides"]["a"]["versions"][evil] = evil
    label = next(iter(r["token_errors"]))
    r["token_errors"] = {evil: r["token_errors"][label], **r["token_errors"]}
    r["token_errors"][evil][evil] = 0.5
    r["worst_tokens"][0]["divergence_starts"] = evil
    r["routing"]["layers"][evil] = {"flipped": 1, "rows": 2, "unexplained": 0, "set_agreement": 0.5}
    html = render_html(r)
    _check_page(html)
    assert "<script" not in html and "<img" not in html and "<b>bold</b>" not in html
    assert 'onmouseover="alert' not in html
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html
    assert "q&quot; onmouseover=&quot;alert(1)" in html


def test_no_external_resources(divergent, consistent):
    for rep in (divergent, consistent):
        _check_self_contained(render_html(rep))


def test_consistent_page(consistent):
    html = render_html(consistent)
    _check_page(html)
    answer = html[:html.index('<section id="growth"')]
    assert 'class="banner v-consistent"' in answer and "No point diverges" in answer
    assert "bit-identical" in answer
    assert not re.search(r'<tr class="[^"]*\bfirst\b', html)
    assert 'class="first-mark"' not in html
    assert "No routing in this report" in html              # dense model
    assert "No first divergence, so no region to show" in html
    svg = _svg(html, "plot-growth")
    assert len([e for e in svg.iter("path") if e.get("class") == "series"]) == 6


def test_missing_sections_and_odd_numbers(divergent):
    r = copy.deepcopy(divergent)
    del r["token_errors"]
    r["worst_tokens"] = []
    r["routing"] = {}
    html = render_html(r)
    _check_page(html)
    assert "No per-token errors in this report" in html and "No routing in this report" in html

    r = copy.deepcopy(divergent)
    f = r["first_divergence"]
    f["error"], f["growth"], f["input_error"], f["tol"] = "inf", "inf", None, None
    f["ops"] = {}
    for p in r["points"][20:]:
        p["error"], p["growth"], p["input_error"] = "inf", "inf", "-inf"
        p["tol"], p["metrics"], p["rows"] = None, None, None
    r["points"][-1]["metrics"] = {"cosine": None, "max_ulp": "inf", "bitwise_equal": None, "nonfinite": 3}
    label = next(iter(r["token_errors"]))
    r["token_errors"][label] = {k: (None if i % 3 == 0 else "inf") for i, k in enumerate(r["token_errors"][label])}
    r["worst_tokens"][0]["abs_dlogprob"] = None
    r["routing"]["share_tokens_with_flip"] = "inf"
    html = render_html(r)
    _check_page(html)
    assert "∞" in html and "3 non-finite" in html
    assert "No dispatcher ops recorded in this region" in html


def test_rejudged_and_minimal_reports(divergent):
    # rejudge: the saved report re-judged with a looser norm tolerance (no ops for a moved first point)
    rj = rejudge(divergent, Tolerance(per_point={"attn_norm": 10.0}))
    _check_page(render_html(rj))
    html = render_html({})
    _check_page(html)
    assert "The report has no points" in html
    nc = {"verdict": "not_comparable", "points": [
        {"key": "L0.attn.q", "point": "attn.q", "layer": 0, "status": "not_comparable", "reason": "rows differ"}],
        "not_comparable": [{"key": "L0.attn.q", "reason": "rows differ"}]}
    html = render_html(nc)
    _check_page(html)
    assert 'class="banner v-not_comparable"' in html and "rows differ" in html


def test_malformed_reports_never_break_the_page(divergent, consistent):
    """Fields replaced by junk of every type: the page still renders, and no section gives up."""
    import random
    junk = [None, "inf", "-inf", "nan", "x", [], {}, 1e308, -1, 0, True, "<u>junk</u>", [1, "a"], {"a": 1},
            float("nan")]
    rng = random.Random(0)

    def mutate(o):
        items = list(o.items()) if isinstance(o, dict) else list(enumerate(o)) if isinstance(o, list) else []
        for k, v in items:
            if rng.random() < 0.1:
                o[k] = rng.choice(junk)
            else:
                mutate(v)

    for i in range(40):
        r = copy.deepcopy(divergent if i % 2 else consistent)
        mutate(r)
        html = render_html(r)
        assert "could not be drawn" not in html
        assert "<u>junk" not in html


def test_write_html(divergent, tmp_path):
    p = write_html(divergent, tmp_path / "r.html")
    assert p.read_text(encoding="utf-8") == render_html(divergent)


# ------------------------------------------------------------------------------------------------
# (b) a real headless browser
# ------------------------------------------------------------------------------------------------

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
W, H = 1280, 2000


def _chromium(tmp_path: Path, url: str, *extra: str) -> subprocess.CompletedProcess:
    prof = tmp_path / "chromium-profile"
    prof.mkdir(exist_ok=True)
    return child.run([str(CHROMIUM), *CHROMIUM_FLAGS, f"--user-data-dir={prof}", *extra, url],
                     capture_output=True, text=True)


def _png_rows(path: Path, n_rows: int) -> tuple[int, int, list[bytes]]:
    """A tiny PNG decoder (8-bit RGB/RGBA, not interlaced): (width, height, the first n_rows as raw pixels)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, ihdr = 8, [], None
    while pos < len(data):
        (length,), ctype = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        assert zlib.crc32(ctype + body) == struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0]
        if ctype == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif ctype == b"IDAT":
            idat.append(body)
        elif ctype == b"IEND":
            break
        pos += 12 + length
    assert ihdr is not None and idat
    w, h, depth, color, _, _, interlace = ihdr
    assert depth == 8 and color in (2, 6) and interlace == 0, ihdr
    bpp = 3 if color == 2 else 4
    stride = w * bpp
    n_rows = min(n_rows, h)
    raw = zlib.decompressobj().decompress(b"".join(idat), n_rows * (stride + 1))
    rows, prev = [], bytearray(stride)
    for y in range(n_rows):
        ft, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            if ft == 1:
                line[i] = (line[i] + a) & 255
            elif ft == 2:
                line[i] = (line[i] + b) & 255
            elif ft == 3:
                line[i] = (line[i] + ((a + b) >> 1)) & 255
            elif ft == 4:
                c = prev[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return w, h, [b"".join(r[i:i + 3] for i in range(0, stride, bpp)) for r in rows]   # RGB, alpha dropped


def _pixels(rows: list[bytes]):
    for r in rows:
        for i in range(0, len(r), 3):
            yield r[i], r[i + 1], r[i + 2]


@pytest.mark.skipif(not CHROMIUM.exists(), reason="Chromium not installed: apt-get install -y chromium")
def test_chromium_renders_page(divergent, consistent, tmp_path):
    page = write_html(divergent, tmp_path / "report.html")
    url = page.resolve().as_uri()

    dom = _chromium(tmp_path, url, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert "L1.attn_norm" in html
    answer = html[html.index('id="answer"'):html.index('id="growth"')]
    assert "L1.attn_norm" in answer
    growth = re.search(r'<svg class="plot-growth".*?</svg>', html, flags=re.S)
    heat = re.search(r'<svg class="heatmap".*?</svg>', html, flags=re.S)
    assert growth and heat
    assert len(re.findall(r'<path class="series"', growth.group(0))) == len(CURVE_POINTS)
    assert len(re.findall(r"<circle\b", growth.group(0))) >= 6
    assert len(re.findall(r"<rect\b", heat.group(0))) >= len(divergent["token_errors"]) * 20

    for rep, name, banner in ((divergent, "div", "red"), (consistent, "cons", "green")):
        src = write_html(rep, tmp_path / f"{name}.html")
        png = tmp_path / f"{name}.png"
        shot = _chromium(tmp_path, src.resolve().as_uri(), f"--screenshot={png}", f"--window-size={W},{H}")
        assert shot.returncode == 0 and png.exists(), shot.stderr[-2000:]
        assert png.stat().st_size > 30_000, png.stat().st_size
        w, h, rows = _png_rows(png, 260)
        assert (w, h) == (W, H)
        colours = set(_pixels(rows))
        assert len(colours) > 100, "the top of the page is (nearly) one flat colour"
        if banner == "red":
            hit = sum(1 for r, g, b in _pixels(rows) if r > 150 and g < 70 and b < 80)
        else:
            hit = sum(1 for r, g, b in _pixels(rows) if g > 100 and r < 60 and b < 90)
        assert hit > 20_000, f"the {banner} verdict banner is not at the top of the page ({hit} pixels)"
