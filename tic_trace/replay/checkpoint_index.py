"""Which *.safetensors files make up a checkpoint, and the check that they hold it whole.

A sharded checkpoint names its shards in `model.safetensors.index.json` (`weight_map`: tensor -> file). When
the index is there it is the checkpoint: every shard it names must be present, a plain file name inside the
directory (no path, no `..`, no symlink out of it), and every tensor must be in exactly the shard the index
says, once. Without an index, the files are globbed; numbered shards (`model-00002-of-00003.safetensors`) must
all be there, and no tensor may be in two files. A reference read from half a checkpoint would replay a model
nobody ran, so every gap is an error that names the file (never a verdict).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .model_spec import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
INDEX_MAX_BYTES = 64 << 20       # a 1T-parameter model's index is a few MB
_NUMBERED = re.compile(r"(.+)-(\d+)-of-(\d+)\.safetensors")


@dataclass(frozen=True)
class ShardPlan:
    files: list[Path]
    weight_map: dict[str, str] | None = None     # tensor -> shard file name, from the index (None: no index)
    notes: list[str] = field(default_factory=list)


def shard_plan(path: Path, read_json: Callable[[Path, int, str], Any]) -> ShardPlan:
    """The shard files of checkpoint directory `path` (`read_json(file, limit, what)`: a bounded JSON read)."""
    index = path / INDEX_NAME
    if index.is_symlink() or index.exists():
        wm = _weight_map(read_json(index, INDEX_MAX_BYTES, INDEX_NAME), index)
        names = sorted(set(wm.values()))
        files = [_listed_shard(path, n, index, wm) for n in names]
        unlisted = sorted(p.name for p in path.glob("*.safetensors") if p.name not in set(names))
        notes = ([f"{index}: not read, the index does not list them: {', '.join(unlisted[:6])}"
                  + (" …" if len(unlisted) > 6 else "")] if unlisted else [])
        return ShardPlan(files, wm, notes)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors file (pickled .bin checkpoints are not read; "
                              "convert with save_pretrained(safe_serialization=True))")
    _all_numbered_present(path, files)
    for f in files:
        inside(path, f)
    return ShardPlan(files)


def _weight_map(doc: Any, index: Path) -> dict[str, str]:
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise CheckpointError(f"{index}: no 'weight_map' object (tensor name -> shard file); a "
                              "model.safetensors.index.json names every tensor's shard")
    bad = [k for k, v in wm.items() if not isinstance(v, str)]
    if bad:
        raise CheckpointError(f"{index}: weight_map['{bad[0]}'] is not a file name")
    return dict(wm)


def _listed_shard(path: Path, name: str, index: Path, wm: dict[str, str]) -> Path:
    if (not name.endswith(".safetensors") or "/" in name or "\\" in name or name in (".", "..")
            or name.startswith(".") or "\x00" in name):
        raise CheckpointError(f"{index}: shard {name!r} is not a *.safetensors file name inside the checkpoint "
                              "directory (no paths: a checkpoint's shards sit beside its index)")
    p = path / name
    if not (p.is_symlink() or p.exists()):
        held = sorted(k for k, v in wm.items() if v == name)
        raise CheckpointError(f"{p}: shard missing: {index.name} maps {len(held)} tensor(s) to it "
                              f"({', '.join(held[:3])}{' …' if len(held) > 3 else ''}); the checkpoint is "
                              "incomplete: copy every shard the index names")
    inside(path, p)
    return p


def inside(base: Path, p: Path) -> None:
    """`p` (in `base`) is a file of the checkpoint: a symlink must lead inside `base`, or into the `blobs/` of
    the hub cache a snapshot directory (`…/snapshots/<rev>/`) belongs to. Anything else could make a reference
    read a file the checkpoint's owner never chose."""
    if not p.is_symlink() or not p.is_file():
        return          # not a link, or one to no regular file: the reader refuses that by what it is
    root = base.resolve()
    target = p.resolve()
    allowed = [root] + ([root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [])
    if not any(target == a or a in target.parents for a in allowed):
        raise CheckpointError(f"{p}: a symlink out of the checkpoint directory (to {target}); copy the file "
                              "into the checkpoint instead")


def _all_numbered_present(path: Path, files: list[Path]) -> None:
    """Numbered shards without an index: every one of `prefix-0000k-of-0000N` must be there."""
    groups: dict[tuple[str, str, int], set[int]] = {}
    for f in files:
        m = _NUMBERED.fullmatch(f.name)
        if m:
            groups.setdefault((m.group(1), m.group(3), int(m.group(3))), set()).add(int(m.group(2)))
    for (prefix, total_s, total), have in sorted(groups.items()):
        missing = [k for k in range(1, total + 1) if k not in have]
        if missing:
            width = len(total_s)
            names = [f"{prefix}-{k:0{width}d}-of-{total_s}.safetensors" for k in missing]
            raise CheckpointError(f"{path}: shard(s) missing: {', '.join(names[:4])}"
                                  f"{' …' if len(names) > 4 else ''} (the files are numbered 1 to {total}); the "
                                  "checkpoint is incomplete: copy every shard")


def check_tensors(held: dict[Path, list[str]], plan: ShardPlan, path: Path) -> None:
    """Every tensor in one file only; with an index, each in the shard the index names and every indexed
    tensor present."""
    where: dict[str, Path] = {}
    for f, keys in held.items():
        for k in keys:
            if k in where:
                raise CheckpointError(f"{path}: tensor {k} is in two files ({where[k].name}, {f.name}): which "
                                      "one the model loads is not defined; remove the stale file")
            where[k] = f
    if plan.weight_map is None:
        return
    index = path / INDEX_NAME
    for k, f in where.items():
        if k not in plan.weight_map:
            raise CheckpointError(f"{f}: tensor {k} is not listed in {INDEX_NAME}: the index and the shards are "
                                  "not of one save")
        if plan.weight_map[k] != f.name:
            raise CheckpointError(f"{f}: tensor {k} is here, but {INDEX_NAME} puts it in {plan.weight_map[k]}")
    absent = sorted(k for k in plan.weight_map if k not in where)
    if absent:
        raise CheckpointError(f"{index}: {len(absent)} tensor(s) it lists are in no shard "
                              f"({', '.join(absent[:4])}{' …' if len(absent) > 4 else ''}): the shards are "
                              "incomplete or from another save")
