"""After a traced rollout: one log line saying where its traces are and their size, and the disk budget.

Called by the Megatron side when its trace of a rollout closes (the SGLang side of that rollout was written
while it was generated, before training), on torch.distributed rank 0 only. `--tic-trace-disk-budget`: when
everything under `--tic-trace-dir` is over the budget, the oldest rollouts traced with values (`rows` /
`full`) are removed, both sides, oldest first, never the rollout just traced; then, if that was not enough, the
oldest `subset` rollouts (the periodic default: a few rows per sample, the drift timeline's numerics);
statistics-only rollouts are kept. A removed rollout keeps its directory with a `PRUNED` file saying why, so
`tic-trace drift` names it instead of dropping it silently."""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from tic_trace.integrations.slime.config import CHEAP_MODES, mode_for, rollout_dir, traced

log = logging.getLogger("tic_trace.slime")
PRUNED_MARK = "PRUNED"        # tic_trace.drift.timeline.PRUNED_MARK reads it
SIDES = ("megatron", "sglang")
ROUTING_REPLAY = "routing_replay"   # the rollout's routed experts (routing_replay.SUBDIR): pruned with the sides


def tree_size(p: Path) -> int:
    """Bytes of the regular files under `p` (links not followed)."""
    total = 0
    for root, _dirs, files in os.walk(p):
        for f in files:
            try:
                st = os.lstat(os.path.join(root, f))
            except OSError:
                continue
            total += st.st_size if not os.path.islink(os.path.join(root, f)) else 0
    return total


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def rollout_line(args: Any, rollout_id: int) -> str:
    d = rollout_dir(args.tic_trace_dir, rollout_id)
    parts = [f"{s} {d / s} {human(tree_size(d / s))}" if (d / s).is_dir() else f"{s} (none written)" for s in SIDES]
    return f"tic-trace: rollout {rollout_id} traced ({mode_for(args, rollout_id)}): " + ", ".join(parts)


def _rank0() -> bool:
    try:
        import torch
        d = torch.distributed
        return not (d.is_available() and d.is_initialized()) or d.get_rank() == 0
    except ImportError:
        return True


def _prune_rank(args: Any, rid: int) -> int | None:
    """In which round the budget removes rollout `rid`: 0 for `rows`/`full`, 1 for the cheap periodic modes,
    None (never) for statistics-only rollouts. A directory no rule traces (an earlier run's) counts as values."""
    mode = mode_for(args, rid) if traced(args, rid) else "rows"
    return None if mode == "stats" else 1 if mode in CHEAP_MODES else 0


def prune(args: Any, keep: int) -> list[int]:
    """Remove the oldest value-holding rollouts until the traces fit `args.tic_trace_disk_budget`: `rows` /
    `full` ones first, then `subset` ones, each oldest first."""
    budget = getattr(args, "tic_trace_disk_budget", None)
    base = Path(args.tic_trace_dir)
    if not budget or not base.is_dir():
        return []
    total = tree_size(base)
    removed = []
    dirs = [(int(p.name[8:]), p) for p in base.glob("rollout_*") if p.is_dir() and p.name[8:].isdigit()]
    ranked = [(r, rid, d) for rid, d in dirs if (r := _prune_rank(args, rid)) is not None]
    for _rank, rid, d in sorted(ranked):
        if total <= budget:
            break
        if rid == keep or (d / PRUNED_MARK).exists():
            continue
        size = tree_size(d)
        for s in (*SIDES, ROUTING_REPLAY):
            shutil.rmtree(d / s, ignore_errors=True)
        (d / PRUNED_MARK).write_text(f"--tic-trace-disk-budget {budget} bytes: {size} bytes of rollout {rid} "
                                     f"removed after rollout {keep}\n")
        total -= size
        removed.append(rid)
    if removed:
        log.warning("tic-trace: disk budget %s: removed the traces of rollouts %s (statistics-only rollouts kept)",
                    human(budget), ", ".join(map(str, removed)))
    return removed


def after_rollout_traced(args: Any, rollout_id: int) -> None:
    if not _rank0():
        return
    try:
        log.warning(rollout_line(args, rollout_id))
        prune(args, rollout_id)
    except Exception as e:  # noqa: BLE001 - bookkeeping never breaks training
        log.warning("tic-trace: after rollout %s: %s: %s", rollout_id, type(e).__name__, e)
