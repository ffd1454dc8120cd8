"""The answer flow's comparator: the first-divergence finder (`diverge.find_divergence`) and its stages.

`contract` diffs what both sides claim to compute; `measure` (over `metrics`, the error metrics, and run over
worker processes by `measure_workers` on top of `parallel`) measures every canonical point; `judge` holds the one
rule that decides a point's status; `verdict` walks the points in dataflow order, names the causes and decides
the verdict. The finder builds a `report.schema.Report`.

May import: store, graph, view, replay, report.schema; and of record only `record.stats` (the contract hashes
checkpoint weights with the tracer's own hash).
"""
