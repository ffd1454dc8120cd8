"""The README's family table, made from the families' own `Family` rows (tests/test_family_boundaries.py fails
when README.md holds anything else between its `families` markers). The adapters read the families' name tables
with `families.framework_names`."""
from __future__ import annotations

from . import FAMILIES
from .base import FRAMEWORKS


def families_markdown() -> str:
    """One row per family: its folder, the config.json model_types it owns, what it is, and what is verified per
    framework ("—": not verified there)."""
    out = ["| family | folder | `model_type` | what it is | " + " | ".join(FRAMEWORKS) + " |",
           "|---" * (4 + len(FRAMEWORKS)) + "|"]
    for fam in FAMILIES:
        types = ", ".join(f"`{t}`" for t in fam.model_types)
        verified = " | ".join(fam.verified.get(f) or "—" for f in FRAMEWORKS)
        out.append(f"| {fam.title} | `tic_trace/families/{fam.name}/` | {types} | {fam.description} | {verified} |")
    return "\n".join(out) + "\n"
