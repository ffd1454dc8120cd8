"""Weight sync, side against side, over every parameter: each side's hashes in the checkpoint's layout
(view/canonical_weights.py) compared tensor by tensor, and what could not be compared named with the reason.

The claim carries its coverage: "N of M parameters compared", the ones that differ, and the K not compared
(a parameter the adapter cannot map, a tensor one side does not hold or holds only in part, values that no
common dtype holds on both). "Agree" is said only of what was compared. A trace without checkpoint-layout
hashes (older, or an adapter without a weight map) is read by parameter name, as before: same-framework pairs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..view.canonical_weights import CanonicalWeights, canonical_weights


@dataclass
class WeightCoverage:
    compared: int = 0
    total: int = 0
    differing: list[str] = field(default_factory=list)
    not_compared: dict[str, str] = field(default_factory=dict)     # name -> why

    @property
    def agree(self) -> bool:
        return self.compared > 0 and not self.differing

    def sentence(self) -> str:
        if self.total == 0:
            return "no parameter hash compared between A and B (neither side recorded parameter hashes)"
        head = f"weight hashes: {self.compared} of {self.total} parameters compared"
        head += (f", {len(self.differing)} differ between A and B: {few(self.differing)}" if self.differing else
                 ", all agree" if self.compared else "")
        if not self.not_compared:
            return head
        groups: dict[str, list[str]] = {}
        for name, why in self.not_compared.items():
            groups.setdefault(why, []).append(name)
        parts = [f"{why}: {few(sorted(names))}" for why, names in sorted(groups.items(), key=lambda g: -len(g[1]))]
        return f"{head}; {len(self.not_compared)} not compared ({'; '.join(parts)})"


def few(names: list[str], n: int = 6) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def side_weights(view: Any) -> CanonicalWeights:
    """One side's checkpoint-layout hashes; by parameter name where the trace recorded none."""
    cw = canonical_weights(view)
    if cw.recorded:
        return cw
    from ..view.weight_map import recorded_weights
    return CanonicalWeights(tensors={n: ({v[1]: v[0]}, tuple(v[2])) for n, v in recorded_weights(view).items()})


def compare_weights(a: CanonicalWeights, b: CanonicalWeights) -> WeightCoverage:
    """Every checkpoint tensor either side holds, compared where both hold it whole in one shape and a common
    dtype; every parameter either side could not map counted and named."""
    cov = WeightCoverage()
    names = set(a.tensors) | set(a.partial) | set(b.tensors) | set(b.partial)
    for side, cw in (("A", a), ("B", b)):
        for n in cw.unmapped:
            cov.not_compared[f"{side}:{n}"] = f"not mappable to a checkpoint tensor on {side}"
    for n in sorted(names):
        why = _why_not(n, a, b)
        if why is not None:
            cov.not_compared[n] = why
            continue
        (ha, _), (hb, _) = a.tensors[n], b.tensors[n]
        cov.compared += 1
        if any(ha[dt] != hb[dt] for dt in set(ha) & set(hb)):
            cov.differing.append(n)
    cov.total = cov.compared + len(cov.not_compared)
    return cov


def _why_not(n: str, a: CanonicalWeights, b: CanonicalWeights) -> str | None:
    for side, cw in (("A", a), ("B", b)):
        if n in cw.partial:
            return f"not whole on {side} ({cw.partial[n]})"
    if n not in a.tensors or n not in b.tensors:
        return f"held by {'A' if n in a.tensors else 'B'} only"
    (ha, sa), (hb, sb) = a.tensors[n], b.tensors[n]
    if sa != sb:
        return "another shape on each side"
    if not set(ha) & set(hb):
        return (f"no common dtype holds both sides' values exactly (A {'/'.join(sorted(ha))}, "
                f"B {'/'.join(sorted(hb))})")
    return None
