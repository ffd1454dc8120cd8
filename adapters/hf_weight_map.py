"""HF transformers parameters -> the checkpoint tensors they hold (`record/weight_pieces.py`): each parameter
is the checkpoint tensor of its own name, except transformers 5's fused expert parameters, which the
checkpoint stores per expert: `mlp.experts.gate_up_proj` [E, 2F, H] is per expert [gate_proj; up_proj] rows,
`mlp.experts.down_proj` [E, H, F] per expert down_proj (as `HFCheckpoint.parts` reads them). GPT-OSS's
checkpoint holds its fused experts as they are (another layout): those keep their own name."""
from __future__ import annotations

import re

from tic_trace.families import family_of
from tic_trace.record.weight_pieces import WeightPiece, rows, whole

_FUSED = re.compile(r"(.*\.mlp\.experts\.)(gate_up_proj|down_proj)")


def hf_weight_pieces(models: list, params: dict) -> dict[str, list[WeightPiece]]:
    out: dict[str, list[WeightPiece]] = {}
    for i, model in enumerate(models):
        per_expert = not _experts_fused_on_disk(model)
        for name, p in model.named_parameters():
            key = name if i == 0 else f"{i}:{name}"
            if key not in params:
                continue
            m = _FUSED.fullmatch(name)
            out[key] = _experts(m.group(1), m.group(2), p) if m and per_expert and p.dim() == 3 else whole(name, p)
    return out


def _experts_fused_on_disk(model) -> bool:
    """Whether the checkpoint keeps the fused expert tensors as they are (its family's HF table says so)."""
    own = family_of(str(getattr(getattr(model, "config", None), "model_type", ""))).names().get("hf")
    return bool(own and own.tables.get("checkpoint_fuses_experts"))


def _experts(stem: str, kind: str, p) -> list[WeightPiece]:
    n, a, b = (int(d) for d in p.shape)
    if kind == "down_proj":
        return [WeightPiece(f"{stem}{e}.down_proj.weight", (a, b), (0, 0), (e,)) for e in range(n)]
    f = a // 2
    return [pc for e in range(n) for pc in (rows(f"{stem}{e}.gate_proj.weight", (f, b), 0, (e, slice(0, f))),
                                            rows(f"{stem}{e}.up_proj.weight", (f, b), 0, (e, slice(f, a))))]
