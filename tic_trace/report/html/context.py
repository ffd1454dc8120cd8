"""What several sections share: the report's points sorted in dataflow order, lookups, the error scale, and
the op pairing of the first divergence read back from the report."""
from __future__ import annotations

import math
from collections import Counter

from ..schema import OpsRegion
from .cells import _d, _decades, _is_ids, _l, _num, _point_of


class Ctx:
    """What several sections share: the sorted points, lookups, the error scale."""

    def __init__(self, r: dict, points: list[dict], first: dict | None):
        self.r, self.points, self.first = r, points, first
        self.by_key = {}
        for p in points:
            self.by_key.setdefault(str(p.get("key")), p)
        self.first_key = str(first.get("key")) if first else None
        tolj = _d(_d(r.get("settings")).get("tolerance"))
        self.growth_factor = _num(tolj.get("growth"))
        errs = [_num(p.get("error")) for p in points if not _is_ids(_point_of(p))]
        pos = [v for v in errs if v is not None and 0 < v < math.inf]
        tols = [v for v in (_num(p.get("tol")) for p in points if not _is_ids(_point_of(p)))
                if v is not None and 0 < v < math.inf]
        vals = pos + tols
        self.lo, self.hi = _decades(vals, pad=2)
        self.first_op = _first_differing_op(_d(first.get("ops")) if first else {})


def _side_ops(ops: dict, side: str) -> list[dict]:
    return [x for x in _l(ops.get(side)) if isinstance(x, dict)]


def _region(ops: dict) -> OpsRegion:
    """The report's op pairing (made once by the finder; built the same way for a schema-1 report)."""
    a, b = _side_ops(ops, "a"), _side_ops(ops, "b")
    try:
        region = OpsRegion.from_json(ops)
    except (TypeError, ValueError):     # a malformed report: pair its ops the report's way
        return OpsRegion.build(a, b)
    region.a, region.b = a, b
    ok = all(isinstance(p, (list, tuple)) and len(p) == 2 for p in region.pairs)
    if not ok or any((i is not None and not (isinstance(i, int) and 0 <= i < len(region.a))) or
                     (j is not None and not (isinstance(j, int) and 0 <= j < len(region.b))) for i, j in region.pairs):
        region = OpsRegion.build(region.a, region.b)
    return region


def _first_differing_op(ops: dict):
    """(index in A, op A, index in B, op B) of the report's first differing op; None when there is none."""
    region = _region(ops)
    n = region.first_differing
    if not isinstance(n, int) or not 0 <= n < len(region.pairs):
        return None
    i, j = region.pairs[n]
    if i is None or j is None:
        return None
    return i, region.a[i], j, region.b[j]


def _only_ops(ops: dict) -> dict:
    """Ops only one side runs in the region: {"a": Counter(op), "b": Counter(op)}."""
    region = _region(ops)
    a, b = region.a, region.b
    out = {"a": Counter(), "b": Counter()}
    for i, j in region.pairs:
        if j is None and i is not None:
            out["a"][str(a[i].get("op"))] += 1
        elif i is None and j is not None:
            out["b"][str(b[j].get("op"))] += 1
        elif i is not None and a[i].get("op") != b[j].get("op"):
            out["a"][str(a[i].get("op"))] += 1
            out["b"][str(b[j].get("op"))] += 1
    return out
