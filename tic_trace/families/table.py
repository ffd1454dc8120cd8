"""Tables made from every family's own: the name tables one framework's adapter reads (`framework_names`), and the
README's family table (`families_markdown`; tests/test_family_boundaries.py fails when README.md holds anything
else between its `families` markers)."""
from __future__ import annotations

from functools import cache
from typing import Any

from . import FAMILIES
from .base import FRAMEWORKS, FrameworkNames


@cache
def framework_names(framework: str) -> FrameworkNames:
    """Every family's name tables for `framework` (one of FRAMEWORKS), in the registry's order: point rows and
    architectures concatenated, refusals merged, each named table merged (mappings by key; tuples, sets and
    frozensets joined). Two families giving the same key of a mapping is an error naming both."""
    if framework not in FRAMEWORKS:
        raise KeyError(f"no framework {framework!r}; known: {', '.join(FRAMEWORKS)}")
    points: tuple = ()
    archs: tuple = ()
    refused: dict[str, str] = {}
    tables: dict[str, Any] = {}
    owner: dict[tuple[str, str], str] = {}
    for fam in FAMILIES:
        own = fam.names().get(framework)
        if own is None:
            continue
        points += tuple(own.points)
        archs += tuple(own.architectures)
        for k, v in own.refused.items():
            _claim(owner, ("refused", k), fam.name)
            refused[k] = v
        for name, t in own.tables.items():
            tables[name] = _join(tables.get(name), t, name, fam.name, owner)
    return FrameworkNames(points=points, architectures=archs, refused=refused, tables=tables)


def _claim(owner: dict, key: tuple[str, str], fam: str) -> None:
    if key in owner:
        raise ValueError(f"{key[0]} {key[1]!r} is given by families {owner[key]} and {fam}: one family owns it")
    owner[key] = fam


def _join(have: Any, add: Any, name: str, fam: str, owner: dict) -> Any:
    """Mappings merged by key, tuples joined, sets unioned; any other value (a function, a string) is one
    family's alone."""
    if isinstance(add, dict):
        for k in add:
            _claim(owner, (name, k), fam)
        return {**(have or {}), **add}
    if isinstance(add, tuple):
        return (have or ()) + add
    if isinstance(add, (set, frozenset)):
        return type(add)((have or frozenset()) | add)
    _claim(owner, (name, ""), fam)
    return add


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
