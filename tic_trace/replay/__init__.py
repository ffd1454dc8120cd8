"""Exact replay: every canonical op recomputed in float64 from one side's own recorded inputs (`reference`, with
weights and model facts from an HF checkpoint, `checkpoint`), the intrinsic error of each side against it
(`intrinsic`) and the rule that turns two sides' intrinsic errors into a verdict (`intrinsic_verdict`); a float
dtype's rounding grid (`grid`), shared with the finder's measure step.

May import: store, graph, view.
"""
