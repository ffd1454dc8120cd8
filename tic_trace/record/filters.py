"""Which records to capture, and how: module globs/regexes, op names, layer ranges, passes, ranks."""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

MODES = ("stats", "full", "rows")
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$|#)")


def _compile(patterns: Iterable[str] | str | None) -> list[re.Pattern] | None:
    if patterns is None:
        return None
    if isinstance(patterns, str):
        patterns = [patterns]
    out = []
    for p in patterns:
        if p.startswith("re:"):
            out.append(re.compile(p[3:]))
        else:
            out.append(re.compile(fnmatch.translate(p)))
    return out


def layer_of(module_path: str) -> int | None:
    """Local layer index named in a module path (`...layers.3...`), or None."""
    m = _LAYER_RE.search(module_path)
    return int(m.group(1)) if m else None


def parse_range(spec: str | Sequence[int] | range | None) -> set[int] | None:
    """'0-3,7' -> {0,1,2,3,7}; a sequence or range is taken as is."""
    if spec is None:
        return None
    if isinstance(spec, (range, list, tuple, set, frozenset)):
        return set(spec)
    out: set[int] = set()
    for part in str(spec).split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-", 1)
            out.update(range(int(a), int(b) + 1))
        else:
            out.add(int(part))
    return out


@dataclass
class Filters:
    """Record selection. Globs match whole module paths; prefix a pattern with `re:` for a regex search."""
    modules: list[str] | None = None          # include only these module paths (ops inside them too)
    exclude_modules: list[str] | None = None
    ops: list[str] | None = None              # op-name globs, e.g. ["aten.mm", "aten.*softmax*"]
    layers: str | Sequence[int] | None = None
    passes: str | Sequence[int] | None = None
    ranks: str | Sequence[int] | None = None
    record_ops: bool = True                   # dispatcher ops (False: module boundaries only)
    full: list[str] | None = None             # record-name globs captured as full tensors
    rows: list[str] | None = None             # record-name globs captured as selected rows
    _c: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self._c = {
            "modules": _compile(self.modules), "exclude": _compile(self.exclude_modules),
            "ops": _compile(self.ops), "full": _compile(self.full), "rows": _compile(self.rows),
        }
        self._layers = parse_range(self.layers)
        self._passes = parse_range(self.passes)
        self._ranks = parse_range(self.ranks)
        for k in ("modules", "exclude", "ops", "full", "rows"):
            pats = self._c[k]
            if pats is not None:
                self._c[k] = [(p, p.pattern.startswith("(?s:")) for p in pats]

    @staticmethod
    def _match(pats, text: str) -> bool:
        return any((p.match(text) if is_glob else p.search(text)) for p, is_glob in pats)

    def want_pass(self, index: int) -> bool:
        return self._passes is None or index in self._passes

    def want_rank(self, rank: int) -> bool:
        return self._ranks is None or rank in self._ranks

    def want_module(self, path: str) -> bool:
        if self._c["modules"] is not None and not self._match(self._c["modules"], path):
            return False
        if self._c["exclude"] is not None and self._match(self._c["exclude"], path):
            return False
        if self._layers is not None:
            layer = layer_of(path)
            if layer is not None and layer not in self._layers:
                return False
        return True

    def want_op(self, op: str) -> bool:
        return self.record_ops and (self._c["ops"] is None or self._match(self._c["ops"], op))

    def mode_for(self, record_name: str, default: str) -> str:
        if self._c["full"] is not None and self._match(self._c["full"], record_name):
            return "full"
        if self._c["rows"] is not None and self._match(self._c["rows"], record_name):
            return "rows"
        return default
