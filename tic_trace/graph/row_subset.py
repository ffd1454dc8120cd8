"""A small subset of a pass's token rows, chosen from each row's identity alone (sample key, position).

Two frameworks batch the same samples differently (Megatron: one packed micro-batch; SGLang: a prefill and
one pass per decode step), so anything computed over a whole batch (statistics) covers different rows on each
side and cannot be compared. A row's identity does not depend on the batching: a rule that looks only at
(sample key, position) keeps the same rows on both sides, whatever passes they fall in, and the comparator
joins them as it joins any `rows` record. Used by slime's periodic traces (`--tic-trace-mode subset`,
docs/drift.md): values of a few rows per sample instead of every row. Pure Python (no torch): the tracer applies
the rule, and the row identity check (view/rows.py) reads it back from both manifests (`shared_subset`), so that
rows the rule drops are not taken for rows one side lost.

The rule keeps position p of sample k when

* p is 0 or a power of two (1, 2, 4, 8, ...): geometrically spaced context lengths, dense near the start,
  about log2(length) rows per sample; and
* (p + phase(k)) is a multiple of `stride`, phase(k) = CRC-32 of the key modulo `stride`: one row every
  `stride` positions, deep in long samples (responses, decode steps), at an offset that differs between samples
  so that together they see many residues of the position (RoPE) rather than one.

A sample of L rows keeps at most 1 + bit_length(L - 1) + ceil(L / stride) of them (`max_rows`; L = 3072: 19).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

RULE = "powers_of_two+stride"
DEFAULT_STRIDE = 512


@dataclass(frozen=True)
class RowSubset:
    """Which token rows to keep, from (sample key, position) only: the same rows on every side."""
    stride: int = DEFAULT_STRIDE

    def __post_init__(self) -> None:
        if not isinstance(self.stride, int) or isinstance(self.stride, bool) or self.stride < 1:
            raise ValueError(f"RowSubset: stride must be a positive integer, got {self.stride!r}")

    def phase(self, key: str) -> int:
        """This sample's offset of the strided rows (stable across processes and machines: not `hash()`)."""
        return zlib.crc32(str(key).encode("utf-8")) % self.stride

    def keeps(self, key: str | None, position: int) -> bool:
        """Whether row (key, position) is in the subset. Rows without a key (padding) never are."""
        if key is None:
            return False
        p = int(position)
        if p < 0:
            return False
        if p & (p - 1) == 0:              # 0, 1, 2, 4, 8, ...
            return True
        return (p + self.phase(key)) % self.stride == 0

    def max_rows(self, length: int) -> int:
        """An upper bound on the rows kept of one sample of `length` rows (positions 0 .. length-1)."""
        n = int(length)
        if n <= 0:
            return 0
        powers = 1 + (n - 1).bit_length()        # 0, and 1, 2, 4, ... up to n - 1
        return powers + -(-n // self.stride)

    def describe(self) -> dict:
        """What the manifest records (`tracer.row_subset`), so that a reader can say which rows were kept."""
        return {"rule": RULE, "stride": self.stride}


def subset_of_manifest(manifest: dict) -> RowSubset | None:
    """The rule a trace's manifest records (`tracer.row_subset`, already checked by store/schema.py), or None
    when there is none or it is a rule this reader does not know (then no row is taken for dropped by it)."""
    desc = (manifest.get("tracer") or {}).get("row_subset") if isinstance(manifest, dict) else None
    if not isinstance(desc, dict) or desc.get("rule") != RULE:
        return None
    try:
        return RowSubset(stride=desc.get("stride", DEFAULT_STRIDE))
    except ValueError:
        return None


def shared_subset(manifest_a: dict, manifest_b: dict) -> RowSubset | None:
    """The rule both traces kept their rows by, when they record the same one; None otherwise (one side traced
    every row: a row the other lacks is a lost row, whatever the rule says)."""
    a, b = subset_of_manifest(manifest_a), subset_of_manifest(manifest_b)
    return a if a is not None and a == b else None
