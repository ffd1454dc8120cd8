"""Model families: one folder per family (`tic_trace/families/<name>/`), and this module, the one registry of them
by config.json's `model_type`. The contract of a family folder is `base.Family` (docs/architecture.md, "Model
families"); the core (replay/) asks `family_of_config(model_type, c)` (config.json's facts) and
`family_for(spec)` (the ops), the adapters read every family's name tables with
`framework_names(framework)`, the canonical graph (graph/canonical.py) and the HF weight names
(graph/weight_points.py) read every family's points and rows from `FAMILIES`, and none names a family.

May import: store, graph, view, replay.

A family's model_types are written in its own `__init__` only; this registry lists the families (a family: its
folder's name in the import line and its `FAMILY` in `FAMILIES`, whose order orders the families' points after
one base point, their name tables and their weight rows) and refuses two that claim the same model_type. A
model_type no family owns is the base transformer's (`BASE`), unless a family claims what its config states
(`Family.claims_config` / `claims`: Kimi-K2's kv latent is DeepSeek's MLA): it is replayed with that family's
ops, else the base's, and its architecture is refused by the adapters unless `--allow-unverified`.
"""
from __future__ import annotations

from .base import FRAMEWORKS, Family, FrameworkNames
from . import deepseek, gemma, gpt_oss, phi3, qwen3_next, transformer

# The registry: one entry per family folder (and its name in the import above). BASE first (the plain dense / MoE
# transformer every family builds on).
FAMILIES: tuple[Family, ...] = (
    transformer.FAMILY,
    deepseek.FAMILY,
    gemma.FAMILY,
    phi3.FAMILY,
    gpt_oss.FAMILY,
    qwen3_next.FAMILY,
)
BASE: Family = transformer.FAMILY


def _by_model_type(families: tuple[Family, ...]) -> dict[str, Family]:
    out: dict[str, Family] = {}
    for fam in families:
        for mt in fam.model_types:
            if mt in out:
                raise ValueError(f"model_type {mt!r} is claimed by families {out[mt].name} and {fam.name}: "
                                 f"one family owns each model_type (tic_trace/families/)")
            out[mt] = fam
    return out


BY_MODEL_TYPE: dict[str, Family] = _by_model_type(FAMILIES)


def family_of(model_type: str | None) -> Family:
    """The family that owns config.json's `model_type` (the base transformer for one no family owns)."""
    return BY_MODEL_TYPE.get(model_type or "", BASE)


def family_of_config(model_type: str | None, c) -> Family:
    """The family whose facts read config.json (`c`: replay.model_spec's typed reader of it): its model_type's
    owner, else the first family that claims what the config states (`Family.claims_config`), else the base
    transformer."""
    fam = BY_MODEL_TYPE.get(model_type or "")
    if fam is not None:
        return fam
    return next((f for f in FAMILIES if f.claims_config is not None and f.claims_config(c)), BASE)


def family_for(spec) -> Family:
    """The family whose ops replay `spec` (a replay.model_spec.ModelSpec): its model_type's owner, else the first
    family that claims what the spec states (`Family.claims`), else the base transformer."""
    fam = BY_MODEL_TYPE.get(spec.model_type or "")
    if fam is not None:
        return fam
    return next((f for f in FAMILIES if f.claims is not None and f.claims(spec)), BASE)


def framework_names(framework: str) -> tuple[FrameworkNames, ...]:
    """Every family's name tables for one framework (FRAMEWORKS), in registry order: what its adapter reads."""
    return tuple(n for n in (fam.names().get(framework) for fam in FAMILIES) if n is not None)


def family_named(name: str) -> Family:
    """A family by its folder name (KeyError naming the known ones)."""
    for fam in FAMILIES:
        if fam.name == name:
            return fam
    raise KeyError(f"no family {name!r}; known: {', '.join(f.name for f in FAMILIES)}")


__all__ = ["BASE", "BY_MODEL_TYPE", "FAMILIES", "FRAMEWORKS", "Family", "FrameworkNames", "family_for",
           "family_named", "family_of", "family_of_config", "framework_names"]
