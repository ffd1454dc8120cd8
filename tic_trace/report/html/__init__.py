"""A self-contained HTML page for a tic-trace JSON report (schema "tic-trace.report/1"), one module per page
section.

The page must open on an air-gapped cluster: no CDN, no external fonts, scripts or images. Styling is inline
CSS, plots are inline SVG drawn here, and nothing needs JavaScript (the "only points that are not ok" filter
is a CSS checkbox). Every string taken from the report is escaped: trace names come from other people's files.

Order of the page: the answer (verdict, first divergence), the error-growth plot through the layers, every
point in dataflow order, the per-token heatmap of the worst tokens, routing, the dispatcher ops of both sides
in the first-divergence region, what could not be compared, and the two sides' metadata.

    from tic_trace.report.html import render_html
    open("report.html", "w").write(render_html(report.to_json()))

Modules: `page` (the document, each section guarded: a malformed report breaks only its section), `answer`
(contract and answer), `growth`, `points`, `tokens`, `routing`, `ops`, `sides` (not comparable and sides), over
`context` (what sections share), `cells` (escaping and number formats) and `style` (colours and CSS).

May import: report.schema, report.text, report.lines, graph.
"""
from .page import render_html, write_html

__all__ = ["render_html", "write_html"]
