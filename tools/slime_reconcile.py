"""The reconciliation of slime's ``train_rollout_logprob_abs_diff`` in ``tic-trace slime-report`` (issue 37).

Reads the log-probs each side used (``<side>/used_logprobs/``, recorded by ``tic_trace.integrations.slime``), each
side's traced logits rows for those tokens, the rollout's routed experts when routing replay was recorded
(``rollout_NNNNN/routing_replay/``), and hands them to ``tic_trace.compare.reconcile``: the report's
``reconciliation`` field. A side whose record is unreadable makes the reconciliation unavailable, with the file and
the problem; the rest of the report is unchanged.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

#: The trainer is side A (the reference), the engine side B, as in the rest of the report.
SIDES = (("megatron", "trainer (Megatron)"), ("sglang", "engine (SGLang)"))


def reconciliation(rdir: Path, sides: Mapping[str, Path], views: Mapping[str, Any], finder: Mapping | None,
                   recorded: float | None = None) -> dict:
    """The report's ``reconciliation``: slime's metric over the traced samples split into its parts."""
    from tic_trace.compare.reconcile import Side, SlimeReduction, reconcile
    from tic_trace.store.errors import TraceFormatError
    from tic_trace.store.used_logprobs import read
    try:
        used = {name: read(sides[name]) for name, _ in SIDES}
    except TraceFormatError as e:
        return {"unavailable": f"the used log-probs cannot be read: {e.path}: {e.problem}", "recorded": recorded}
    a, b = (Side(label, used[name].entries, _logits_rows(views[name], used[name].entries)) for name, label in SIDES)
    r3, r3_note = routing_replay(rdir, views)
    out = reconcile(a, b, r3=r3, finder=finder, reduction=_reduction(views["megatron"], used["megatron"].entries),
                    recorded=recorded, r3_state=r3_state(rdir, views["megatron"], r3, r3_note))
    notes = [f"{name}: {n}" for name, _ in SIDES for n in used[name].notes]
    notes += [f"{name}: {used[name].ignored} in used_logprobs/ are no part of the record (not read)"
              for name, _ in SIDES if used[name].ignored]
    if r3_note:
        notes.append(r3_note)
    if r3 is not None:      # which layers, rows and kinds differ: what the routing-replay part stands on
        notes.append(r3.summary)
        out["routing_replay"] = r3.as_dict()
    if notes:
        out["notes"] = list(out.get("notes") or []) + notes
    out["files"] = {name: used[name].files for name, _ in SIDES}
    return out


def _logits_rows(view, used) -> dict[str, tuple[np.ndarray, np.ndarray]] | None:
    """sample -> (row positions, logits rows) of the rows that score a used token (row p - 1 for the token at p);
    None when the side traced no logits values."""
    want = {(u.sample, int(p) - 1) for u in used for p in np.asarray(u.positions).tolist()}
    if not want or ("logits", None) not in view.entries:
        return None
    lg = view.load("logits", None)
    if lg.values is None:
        return None
    by: dict[str, list[int]] = {}
    for i, rid in enumerate(lg.rows):
        if rid in want:
            by.setdefault(rid[0], []).append(i)
    return {s: (np.asarray([lg.rows[i][1] for i in idx], dtype=np.int64), np.asarray(lg.values[idx]))
            for s, idx in by.items()}


def _reduction(megatron_view, trainer_used):
    """slime's reduction of the metric: the run's flag as the Megatron side's manifest records it, and the loss
    masks the trainer's batches carried (where recorded; else every token weighs 1)."""
    from tic_trace.compare.reconcile import SlimeReduction
    slime = megatron_view.trace.manifest.get("slime")
    per_token = slime.get("calculate_per_token_loss") if isinstance(slime, dict) else None
    masks = {(u.sample, int(p)): float(m) for u in trainer_used if u.mask is not None
             for p, m in zip(np.asarray(u.positions).tolist(), np.asarray(u.mask).tolist())}
    return SlimeReduction(per_token=per_token is True, loss_mask=masks or None)


def routing_replay(rdir: Path, views: Mapping[str, Any]) -> tuple[Any, str | None]:
    """The routing-replay check (compare/routing_replay.check_rollout) when the rollout's routed experts were
    recorded (``--use-rollout-routing-replay``), else None; and a note when they could not be read."""
    from tic_trace.compare.routing_replay import check_rollout
    from tic_trace.store.errors import TraceFormatError
    try:
        return check_rollout(rdir, views["megatron"], views["sglang"]), None
    except (TraceFormatError, ValueError) as e:
        return None, f"routing replay not checked: {e}"


def r3_state(rdir: Path, megatron_view, r3: Any, note: str | None) -> Any:
    """Why there is no routing-replay check (compare.reconcile_parts.R3State): R3 off for the run, as the Megatron
    side's manifest records slime's flag, or on with nothing recorded or readable. None with a check, or where
    the manifest does not say (a trace recorded before the flag was)."""
    from tic_trace.compare.reconcile_parts import R3State
    slime = megatron_view.trace.manifest.get("slime")
    on = slime.get("use_rollout_routing_replay") if isinstance(slime, dict) else None
    if r3 is not None or not isinstance(on, bool):
        return None
    if not on:
        return R3State(False)
    if note:
        return R3State(True, f"its record cannot be read ({note.removeprefix('routing replay not checked: ')})")
    return R3State(True, f"no routed experts were recorded under {Path(rdir).name}/routing_replay/ (did a traced "
                         "sample reach slime's fill_routing_replay?)")
