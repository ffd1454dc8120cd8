"""Exact replay: every canonical op recomputed in float64 from one side's own recorded inputs (`reference`, with
weights from an HF checkpoint, `checkpoint`, and model facts from its config.json, `model_spec`), the intrinsic
error of each side against it (`intrinsic`) and the rule that turns two sides' intrinsic errors into a verdict
(`intrinsic_verdict`); a float dtype's rounding grid (`grid`), shared with the finder's measure step.

May import: store, graph, view, families (the registry of model families, `family_of_config`, `family_for`); of
record only `record.stats` (a checkpoint tensor hashed as the tracer hashes a parameter); of compare only
`compare.contract` (`check_reference`, run before a replay).
"""
