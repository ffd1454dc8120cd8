"""The plain transformer's config facts (no torch): `ModelSpec.extra` is its sliding windows only (Mistral,
Mixtral, Qwen2/3 with `use_sliding_window`); the ModelSpec fields its model code fixes are in `__init__`
(`defaults`, `fixed`)."""
from __future__ import annotations

from typing import Any

from ...replay.layer_types import windows


def facts(c: Any, model_type: str, hidden: int) -> dict:
    """`extra` of a plain transformer's config: which layers attend within a window (none: {})."""
    return windows(c, typed=False)
