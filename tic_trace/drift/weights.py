"""Weight sync over rollouts, judged before any numerics: is the engine still running the trainer's weights?

Two sources, both from the traces' parameter hashes (record/weights.py):
* **across the sides** (the report's contract): where both sides hold a parameter under the same name, dtype
  and shape, differing bits mean different weights (same-framework pairs);
* **across rollouts, each side against itself**: the trainer's weights change between traced rollouts (a
  training step) and the engine's must change with them. A canonical point whose parameters changed on one side
  only since the previous compared rollout is out of sync from that rollout on: an engine that kept old weights
  (a stale or failed sync), or one that got weights the trainer does not hold. This works across frameworks
  (Megatron and SGLang name and fuse parameters differently), because each side is compared with itself."""
from __future__ import annotations

import re

from .schema import RolloutEntry, WeightCheck, WeightSync


def contract_weights(report: dict) -> WeightCheck:
    """What one rollout's report contract says of the sides' weights (compare/weight_coverage.py): `agree`
    False when a compared parameter differs, True when every compared one agrees (the `note` says how many of
    how many were compared and names the rest), None when none could be compared."""
    contract = [c for c in report.get("contract") or [] if isinstance(c, dict)]
    differing = sorted({str(n) for c in contract if c.get("section") == "weights" and c.get("against") == "B"
                        for n in (c.get("a") or [])})
    cov = next((c for c in contract if c.get("section") == "hashes"), None)
    if cov is None:                  # every parameter compared (the contract names none left out)
        note = next((str(c.get("note") or "") for c in contract if c.get("section") == "weights"
                     and c.get("against") == "B"), "")
        return WeightCheck(agree=not differing, differing=differing, note=note)
    note = str(cov.get("note") or "")
    compared = cov.get("a") if note.startswith("weight hashes:") and isinstance(cov.get("a"), int) else 0
    if differing or "differ between A and B" in note:
        return WeightCheck(agree=False, differing=differing, note=note)
    return WeightCheck(agree=True if compared else None, note=note)


def mark_changes(entries: list[RolloutEntry], digests: dict[int, tuple[dict, dict]]) -> None:
    """Fill each compared rollout's `weights.changed_a/changed_b/one_sided` against the previous compared one."""
    prev = None
    for e in entries:
        if e.status != "compared" or e.rollout_id not in digests:
            continue
        da, db = digests[e.rollout_id]
        e.weights.points_hashed = len(set(da) & set(db))
        if prev is not None:
            pa, pb = prev
            changed_a = sorted(k for k in da if k in pa and da[k][0] != pa[k][0])
            changed_b = sorted(k for k in db if k in pb and db[k][0] != pb[k][0])
            # only points both sides hash can be judged one-sided
            both = set(da) & set(db) & set(pa) & set(pb)
            e.weights.changed_a, e.weights.changed_b = changed_a, changed_b
            e.weights.one_sided = sorted(both & (set(changed_a) ^ set(changed_b)))
            e.weights.parameters = sorted(n for k in e.weights.one_sided
                                          for n in (da if k in changed_a else db)[k][1])
        prev = (da, db)


def weight_sync(entries: list[RolloutEntry], sides: list[str]) -> WeightSync | None:
    """The first compared rollout whose engine weights are not the trainer's, and where; None if none is."""
    for e in entries:
        if e.status != "compared":
            continue
        # one side changed and the other did not: the more precise finding (which side is stale) comes first
        if e.weights.one_sided:
            pts = e.weights.one_sided
            stale = [k for k in pts if k in e.weights.changed_a]
            who = (f"{sides[0]}'s weights changed since the previous traced rollout and {sides[1]}'s did not "
                   f"(a stale weight sync)" if stale else
                   f"{sides[1]}'s weights changed and {sides[0]}'s did not")
            also = (f"; {len(e.weights.differing)} parameters differ bit for bit between the sides"
                    if e.weights.agree is False else "")
            return WeightSync(e.rollout_id, pts, list(e.weights.parameters), "changed on one side only",
                              f"weights out of sync from rollout {e.rollout_id} on at {len(pts)} points "
                              f"({_few(pts)}): {who}{also}")
        if e.weights.agree is False:
            return WeightSync(e.rollout_id, [], list(e.weights.differing), "hashes differ",
                              f"rollout {e.rollout_id}: {len(e.weights.differing)} parameters differ bit for bit "
                              f"between {sides[0]} and {sides[1]}: {_few(e.weights.differing)}"
                              + _coverage(e.weights.note))
    return None


def _coverage(note: str) -> str:
    """" (N of M parameters compared)" from the contract's hashes line ('' when it has none)."""
    m = re.search(r"(\d+ of \d+ parameters compared)", note)
    return f" ({m.group(1)})" if m else ""


def _few(names: list[str], n: int = 6) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")
