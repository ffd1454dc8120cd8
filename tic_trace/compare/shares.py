"""The report's attribution: each finding's share of the log-prob gap (the method: replay/attribution.py)."""
from __future__ import annotations

from typing import Callable

from ..view.align import CanonicalView


def attribution_of(va: CanonicalView, vb: CanonicalView, ref, findings: list, tokens: int | None,
                 progress: Callable[[str], None] | None) -> dict:
    """The report's `attribution` (each finding's `share` set from it), or the reason it could not be made."""
    from ..replay.attribution import DEFAULT_TOKENS, attribute
    from ..replay.reference import NotReplayable
    check_attribution_tokens(tokens)
    if progress:
        progress("attribution: exact model forward and backward")
    try:
        att = attribute(va, vb, ref, findings=[f.key for f in findings],
                        max_tokens=DEFAULT_TOKENS if tokens is None else tokens)
    except NotReplayable as e:
        return {"unavailable": str(e)}
    set_shares(findings, att.to_json())
    return att.to_json()


def check_attribution_tokens(tokens: int | None) -> None:
    """SettingsError unless the token budget is None (the default) or a whole number of 1 or more: 0 would
    attribute nothing, and is never taken to mean the default."""
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        from ..replay.attribution import DEFAULT_TOKENS
        from .judge import SettingsError
        raise SettingsError(f"attribution_tokens (--attribution-tokens) must be a whole number, 1 or more "
                            f"(default {DEFAULT_TOKENS}), got {tokens!r}")


def set_shares(findings: list, attribution: dict | None) -> None:
    """Each finding's share of the gap from the attribution (None: not attributed)."""
    if not isinstance(attribution, dict) or "unavailable" in attribution or attribution.get("withheld"):
        return                # withheld: first order does not hold, no finding gets a share
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
