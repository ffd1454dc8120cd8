"""Gemma's canonical points: the sandwich norms, each branch normalised before its residual add. Data only
(`graph.point_spec`). Absent elsewhere: `mid` then reads attn.out, and `output` mlp.out, through `feeds_of`."""
from __future__ import annotations

from ...graph.point_spec import FamilyPoint, PointSpec

_L = True
POINTS: tuple[FamilyPoint, ...] = (
    FamilyPoint(PointSpec("attn.post_norm", _L, ("attn.out",), "H", meaning="attention branch's norm before the "
                          "residual add", op="rmsnorm"), after="attn.out", read_by=(("mid", "attn.out"),)),
    FamilyPoint(PointSpec("mlp.post_norm", _L, ("mlp.out",), "H", meaning="MLP branch's norm before the residual add "
                          "(Gemma)", op="rmsnorm"), after="mlp.out", read_by=(("output", "mlp.out"),)),
)
