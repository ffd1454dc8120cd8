"""What both flows agree a model computes, framework-free: the canonical op graph of a decoder-only transformer
(`canonical`: points, their feeds, dataflow order) and the adapter base (`adapter`: the table from a
framework's record names to canonical points, the transforms and merges, the adapter registry), and the row
subset rule (`row_subset`: which (sample, position) rows a `subset` trace keeps; the tracer applies it, row
identity reads it).

Pure Python and numpy, never a framework: adapters import theirs inside their own methods. The record flow uses
only the adapter registry (the tracer resolves `adapter="hf"`) and the row subset; the answer flow uses all of it.

May import: families (their registry `tic_trace.families` only, never a family folder: the canonical graph and the
HF weight names assemble the base transformer's with every registered family's points and rows).
"""
