"""The change-point rule: the first rollout after which a point's error leaves its own earlier range.

RULE (docs/drift.md): for each point key, over the compared rollouts in order, rollout i is a departure when
  * at least `MIN_BASELINE` (2) earlier compared rollouts hold that point's error (else: no baseline),
  * its error e_i > threshold = max(max(earlier errors) × factor, floor), and
  * every following compared rollout holding that point stays above the same threshold (a single spike that
    comes back is noise, not an onset).
The onset is the earliest rollout with a departure; of the points departing there, the first in dataflow
order is named (later ones inherit its error) and the rest are listed in `also`."""
from __future__ import annotations

import math

from ..graph.canonical import parse_key
from .schema import Onset, RolloutEntry, WeightSync

MIN_BASELINE = 2
DEFAULT_FACTOR = 3.0
DEFAULT_FLOOR = 1e-5


def departures(values: list[tuple[int, float]], factor: float, floor: float) -> list[tuple[int, float, float, float, int]]:
    """[(rollout id, error, baseline, threshold, confirmed_by)] for each rollout where this series departs."""
    out = []
    for i in range(MIN_BASELINE, len(values)):
        earlier = [v for _, v in values[:i]]
        if any(math.isnan(v) for v in earlier):
            continue
        baseline = max(earlier)
        threshold = max(baseline * factor, floor)
        rid, e = values[i]
        if not (e > threshold or math.isnan(e)):
            continue
        later = [v for _, v in values[i + 1:]]
        if all(v > threshold or math.isnan(v) for v in later):
            out.append((rid, e, baseline, threshold, len(later)))
    return out


def find_onset(series: dict[str, list[tuple[int, float]]], entries: list[RolloutEntry],
               weight_sync: WeightSync | None, factor: float = DEFAULT_FACTOR,
               floor: float = DEFAULT_FLOOR) -> tuple[Onset | None, str]:
    """The onset (None when no point departs) and a line saying why there is none."""
    compared = [e for e in entries if e.status == "compared"]
    if len(compared) <= MIN_BASELINE:
        return None, (f"no baseline: {len(compared)} compared rollouts; the rule needs {MIN_BASELINE} earlier "
                      "rollouts before one can depart")
    first: dict[int, list] = {}
    for key, values in series.items():         # dataflow order
        for d in departures(values, factor, floor)[:1]:
            first.setdefault(d[0], []).append((key, d))
    if not first:
        return None, (f"no onset: no point's error left max(earlier) × {factor:g} (floor {floor:g}) and stayed "
                      f"above over {len(compared)} compared rollouts")
    rid = min(first)
    (key, (_, err, base, thr, conf)), *rest = first[rid]
    point, layer = parse_key(key)
    changes = what_changed(rid, entries, weight_sync, key)
    summary = (f"onset at rollout {rid}: {key} error {err:.3g}, its earlier range up to {base:.3g} "
               f"(threshold {thr:.3g}), above it in the {conf} following traced rollouts"
               + ("; " + "; ".join(c["summary"] for c in changes) if changes else ""))
    return Onset(rid, key, point, layer, err, base, thr, conf, [k for k, _ in rest], changes, summary), ""


def what_changed(rid: int, entries: list[RolloutEntry], weight_sync: WeightSync | None, key: str) -> list[dict]:
    """What is different at rollout `rid` from the compared rollout before it: weights, routing, precision."""
    compared = [e for e in entries if e.status == "compared"]
    at = next(e for e in compared if e.rollout_id == rid)
    before = [e for e in compared if e.rollout_id < rid][-1:]
    prev = before[0] if before else None
    out = []
    if weight_sync is not None and weight_sync.from_rollout <= rid:
        out.append({"kind": "weights", "summary": f"weights no longer equal (out of sync from rollout "
                                                  f"{weight_sync.from_rollout} on: {weight_sync.how})"})
    for lay, f in sorted(at.flips.items(), key=lambda x: int(x[0]) if x[0].isdigit() else -1):
        was = prev.flips.get(lay, {}).get("share", 0.0) if prev else 0.0
        if f["share"] > was:
            out.append({"kind": "routing", "summary": f"layer {lay}: {f['flipped']}/{f['rows']} tokens route to "
                                                      f"other experts (share {f['share']:.3g}, was {was:.3g})"})
    new_prec = sorted(set(at.precision) - set(prev.precision if prev else []))
    if new_prec:
        out.append({"kind": "precision", "summary": "the sides compute in different precisions at "
                                                    + ", ".join(new_prec)})
    fd = at.first_divergence
    if fd and (prev is None or (prev.first_divergence or {}).get("key") != fd.get("key")):
        out.append({"kind": "first_divergence", "summary": f"first divergence {fd.get('key')} "
                                                           f"(cause {fd.get('cause')}), verdict {at.verdict}"})
    return out


def divergent_since(entries: list[RolloutEntry]) -> dict | None:
    """{rollout_id, rollouts, summary} when the last compared rollout is judged divergent: the first rollout of
    the stretch of divergent compared rollouts it ends (skipped ones neither break nor extend it). Why apart
    from the onset: the rule compares a point with its own history, so a run divergent from its first traced
    rollout has no onset (nothing grew), yet it is divergent and must not pass a gate on `drift`."""
    compared = [e for e in entries if e.status == "compared"]
    stretch = []
    for e in reversed(compared):
        if e.verdict != "divergent":
            break
        stretch.append(e)
    if not stretch:
        return None
    first = stretch[-1]
    fd = first.first_divergence or {}
    where = f"; first divergence there {fd.get('key')} (cause {fd.get('cause')})" if fd.get("key") else ""
    since_start = first is compared[0]
    summary = (f"divergent since rollout {first.rollout_id}: {len(stretch)} of {len(compared)} compared rollouts, "
               f"every one from {first.rollout_id} on, judged divergent"
               + (" (divergent from the first compared rollout: no earlier range to grow from, so no onset)"
                  if since_start else "") + where)
    return {"rollout_id": first.rollout_id, "rollouts": len(stretch), "summary": summary}
