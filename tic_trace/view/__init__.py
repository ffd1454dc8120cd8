"""A trace seen through its adapter (answer flow, stage 1): the canonical view, which indexes a trace by
canonical point and materialises one point at a time, and row alignment between two views (`align`); the
recorded parameter hashes grouped by canonical point (`weight_map`).

May import: store, graph.
"""
