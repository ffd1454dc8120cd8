"""The record flow: the tracer and everything it needs to turn a forward into a trace.

`tracer` (the public `Tracer` and `trace()`) composes the dispatch mode, the module hooks, the capture of one
tensor and the pass lifecycle; `stats`/`host_kernels` compute statistics and bit-exact hashes where the tensor
lives, `stat_slots` holds them per pass, `alias` reuses them for tensors already captured, `odd_tensors` says how
unusual tensors are recorded, `host_copy` copies stored values to host memory and disk, `weights` hashes
parameters, `filters` chooses what to record, `version` is the version written into every manifest.

May import: store, and of graph only the adapter registry (`graph.adapter`) and the row subset rule
(`graph.row_subset`).
Never the answer flow (view, compare, replay, report). Importing this package imports nothing: torch loads with
the modules that need it.
"""
