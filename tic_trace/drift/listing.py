"""What a run directory holds: every entry is a rollout (compared later, or skipped with its reason) or another
entry named with why it is not one. Nothing is left out without a word (docs/drift.md, "Every entry").

A rollout is a directory whose name ends in digits (`rollout_00003`, `rollout_v2_00003`, `step_3`: the trailing
digits are its id). A symlink is followed when it resolves inside the run directory (a run that links its
rollouts to a store under it); one that leads out of the run or to nothing is a skipped rollout naming its
target, never read: a run directory cannot make drift read traces elsewhere (docs/security.md)."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

#: The file a disk-budget prune leaves in a rollout directory it emptied (integrations.slime.budget).
PRUNED_MARK = "PRUNED"
_NUMBERED = re.compile(r"^(.*?)(\d+)$")          # the trailing digits, whatever comes before them


@dataclass(frozen=True)
class RolloutDirs:
    rollout_id: int
    dir: Path
    a: Path
    b: Path
    skip: str | None = None                      # why it cannot be read at all (a symlink out, broken)


@dataclass(frozen=True)
class Other:
    """An entry of the run directory that is not a rollout, and why."""
    name: str
    reason: str


class RunDirError(ValueError):
    """The run directory itself is unusable (missing, not a directory, no numbered entry at all)."""


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def link_problem(p: Path, root: Path) -> str | None:
    """Why the symlink `p` is not followed (it leads out of `root`, the resolved run directory, or to nothing);
    None for a path that is no symlink or one that resolves inside the run."""
    if not p.is_symlink():
        return None
    target = os.readlink(p)
    real = p.resolve()
    if not real.exists():
        return f"broken symlink (to {target!r:.200}): not followed"
    if not _inside(real, root):
        return f"symlink leading out of the run directory (to {str(real)!r:.200}): not followed"
    return None


def _classify(p: Path, root: Path) -> tuple[int | None, str | None]:
    """(rollout id, why it is skipped) for a rollout entry; (None, why it is no rollout) for any other."""
    m = _NUMBERED.match(p.name)
    if m is None:
        return None, "not a rollout: its name does not end in a number"
    problem = link_problem(p, root)
    if problem is not None:
        return int(m.group(2)), problem
    if not p.is_dir():
        return None, "not a rollout: a file, not a directory"
    return int(m.group(2)), None


def list_run(run_dir: str | os.PathLike, sides: tuple[str, str]) -> tuple[list[RolloutDirs], list[Other]]:
    """Every rollout of `run_dir` by id, and every other entry named. A name used twice for one id (`step_3`,
    `step_03`) is refused: which of the two is the rollout is not for drift to guess."""
    base = Path(run_dir)
    if not base.is_dir():
        raise RunDirError(f"{base}: not a directory (give the --tic-trace-dir of the run)")
    root = base.resolve()
    out: dict[int, RolloutDirs] = {}
    others: list[Other] = []
    for p in sorted(base.iterdir()):
        rid, why = _classify(p, root)
        if rid is None:
            others.append(Other(p.name, str(why)))
            continue
        if rid in out:
            raise RunDirError(f"{base}: rollout {rid} is named twice ({out[rid].dir.name}, {p.name}); "
                              "move one of them out of the run directory")
        out[rid] = RolloutDirs(rid, p, p / sides[0], p / sides[1], skip=why)
    if not out:
        raise RunDirError(f"{base}: no numbered rollout directory (expected e.g. rollout_00000/"
                          f"{{{sides[0]},{sides[1]}}}/)")
    return [out[k] for k in sorted(out)], others


def missing(rd: RolloutDirs, sides: tuple[str, str], root: Path) -> str | None:
    """Why this rollout cannot be compared before any trace is read (None: both sides are there)."""
    if rd.skip is not None:
        return rd.skip
    mark = rd.dir / PRUNED_MARK
    if mark.is_file() and not mark.is_symlink():        # a regular file: no FIFO can hang the read
        with open(mark, "rb") as f:                     # bounded: the note is one line
            note = f.read(200).decode("utf-8", errors="replace").strip()
        return f"pruned by the disk budget ({note})"
    for name, p in zip(sides, (rd.a, rd.b)):
        problem = link_problem(p, root)
        if problem is not None:
            return f"{name} side: {p} is a {problem}"
        if not (p / "manifest.msgpack").is_file():
            state = "does not exist" if not p.exists() else "holds no trace (no manifest.msgpack)"
            return f"{name} side missing: {p} {state}"
    return None
