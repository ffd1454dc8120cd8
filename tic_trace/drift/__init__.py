"""Drift over a training run: every traced rollout's pair compared, one typed timeline (`timeline`), the
weight-sync check between the sides over rollouts (`weights`), the change-point rule that names the rollout
where a point's error leaves its own earlier range (`onset`), the `drift` JSON object (`schema`) and its
renderers (`terminal`, `html`). docs/drift.md.

May import: store, graph, view, compare, report.
Renderers only display what the `drift` object holds.
"""
