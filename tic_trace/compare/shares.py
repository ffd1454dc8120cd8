"""The report's attribution: each finding's share of the log-prob gap (the method: replay/attribution.py)."""
from __future__ import annotations

from typing import Callable

from ..view.align import CanonicalView


def attribution_of(va: CanonicalView, vb: CanonicalView, ref, findings: list, tokens: int | None,
                 progress: Callable[[str], None] | None) -> dict:
    """The report's `attribution` (each finding's `share` set from it), or the reason it could not be made."""
    from ..replay.attribution import DEFAULT_TOKENS, attribute
    from ..replay.reference import NotReplayable
    if progress:
        progress("attribution: exact model forward and backward")
    try:
        att = attribute(va, vb, ref, findings=[f.key for f in findings], max_tokens=tokens or DEFAULT_TOKENS)
    except NotReplayable as e:
        return {"unavailable": str(e)}
    set_shares(findings, att.to_json())
    return att.to_json()


def set_shares(findings: list, attribution: dict | None) -> None:
    """Each finding's share of the gap from the attribution (None: not attributed)."""
    if not isinstance(attribution, dict) or "unavailable" in attribution:
        return
    shares = {s.get("key"): s.get("share_total") for s in (attribution.get("by_point") or [])
              + (attribution.get("routing") or []) if isinstance(s, dict)}
    for f in findings:
        f.share = shares.get(f.key)


def recredited(attribution: dict, findings: list) -> dict:
    """A saved attribution re-credited to a re-judged report's findings, their shares set from it."""
    from ..replay.attribution import recredit
    out = recredit(attribution, [f.key for f in findings])
    set_shares(findings, out)
    return out
