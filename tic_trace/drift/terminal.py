"""The terminal rendering of a `drift` object, answer first: weight sync, then the onset, then one line per
rollout. Bounded (`MAX_ROLLOUTS` lines; the rest is counted and left to the JSON). Only displays."""
from __future__ import annotations

import re
from typing import Any

from rich.console import Console

from ..graph.canonical import unit_of
from ..report.schema import num
from ..report.text import text
from .schema import coverage_text

MAX_ROLLOUTS = 200        # rollout lines shown; a 10k-rollout run's JSON holds every one
MAX_OTHERS = 20           # other entries of the run directory named; the JSON holds every one


def _fmt(v: Any) -> str:
    x = num(v)
    return "-" if x is None else f"{x:.3g}"


def _agree_text(note: str) -> str:
    """"weights agree", with how many were compared when not all were (the contract's hashes line)."""
    m = re.match(r"weight hashes: (\d+) of (\d+) parameters compared", note)
    return f"weights agree ({m.group(1)} of {m.group(2)} parameters compared)" if m else "weights agree"


def rollout_line(r: dict) -> str:
    """One rollout: its verdict, first divergence, weights, worst |Δ logprob|, largest error and flips."""
    if r["status"] != "compared":
        return f"rollout {r['rollout_id']:>5}  SKIPPED  {r.get('reason', '')}"
    fd = r.get("first_divergence") or {}
    w = r.get("weights") or {}
    weights = ("weights differ" if w.get("agree") is False else "weights out of sync" if w.get("one_sided") else
               _agree_text(str(w.get("note") or "")) if w.get("agree") else
               "weights moved together" if w.get("changed_a") or w.get("changed_b") else
               "weights: not comparable across sides")
    errs = [(num(e), f"L{lay}.{k}" if lay != "-" else k) for k, by in (r.get("errors") or {}).items()
            for lay, e in by.items() if num(e) is not None and unit_of(k) != "nats"]   # not the nats of logprobs
    worst = max(errs, default=None)
    flips = sum(int(f.get("flipped") or 0) for f in (r.get("flips") or {}).values())
    return (f"rollout {r['rollout_id']:>5}  {str(r.get('verdict')):<14} first {str(fd.get('key') or '-'):<22} "
            f"|Δlogprob| {_fmt(r.get('dlogprob')):<9} max error {_fmt(worst[0]) if worst else '-'}"
            f"{' at ' + worst[1] if worst else ''}  flips {flips}  {weights}")


def render_drift(doc: dict, console: Console) -> None:
    sync, onset = doc.get("weight_sync"), doc.get("onset")
    console.print(text(f"drift over {doc['dir']}: A = {doc['sides'][0]}, B = {doc['sides'][1]}", style="bold"))
    if sync:
        console.print(text("WEIGHT SYNC: " + sync["summary"], style="bold red"), soft_wrap=True)
    else:
        console.print(text("weight sync: no rollout shows engine weights other than the trainer's "
                           "(where hashes could be compared)"), soft_wrap=True)
    if onset:
        console.print(text("ONSET: " + onset["summary"], style="bold red"), soft_wrap=True)
        if onset.get("also"):
            console.print(text(f"  also departing at rollout {onset['rollout_id']}: {len(onset['also'])} later "
                               f"points ({', '.join(onset['also'][:6])}{' ...' if len(onset['also']) > 6 else ''})"),
                          soft_wrap=True)
    else:
        console.print(text(doc.get("onset_note") or "no onset"), soft_wrap=True)
    since = doc.get("divergent_since")
    if since:
        console.print(text("DIVERGENT: " + since["summary"], style="bold red"), soft_wrap=True)
    if coverage_text(doc):                # what the verdict covered, under it (schema.rollout_coverage)
        console.print(text(coverage_text(doc)), soft_wrap=True)
    rollouts = doc.get("rollouts") or []
    for r in rollouts[:MAX_ROLLOUTS]:
        console.print(text(rollout_line(r), style="red" if r["status"] != "compared" else ""), soft_wrap=True)
    if len(rollouts) > MAX_ROLLOUTS:
        console.print(text(f"… {len(rollouts) - MAX_ROLLOUTS} more rollouts not shown (see the JSON)", style="dim"))
    skipped = [r for r in rollouts if r["status"] != "compared"]
    if skipped:
        console.print(text(f"{len(skipped)} rollouts skipped: " + ", ".join(str(r["rollout_id"]) for r in skipped[:20])
                           + (" ..." if len(skipped) > 20 else ""), style="yellow"), soft_wrap=True)
    for line in others_lines(doc.get("others") or []):
        console.print(text(line, style="yellow"), soft_wrap=True)


def others_lines(others: list[dict]) -> list[str]:
    """The run directory's entries that are no rollout, named (at most `MAX_OTHERS`, the rest counted)."""
    if not others:
        return []
    lines = [f"{len(others)} other entries of the run directory are no rollout, not compared:"]
    lines += [f"  {o.get('name')}: {o.get('reason')}" for o in others[:MAX_OTHERS]]
    if len(others) > MAX_OTHERS:
        lines.append(f"  … {len(others) - MAX_OTHERS} more not shown (see the JSON)")
    return lines
