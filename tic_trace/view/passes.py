"""Passes over the same rows: the same batch traced more than once in one trace (the actor and the reference
model in one training step, or two steps over one batch). Each such pass is its own set of rows, named by
the pass it belongs to, so that two traces are compared pass with pass instead of refused for rows named
twice (docs/report.md, "Passes over the same rows").

By order (the default): the r-th time a rank group traces a row is that row's round r; a pass is a repeat
when every row it names was traced exactly r times before it, with the same token, and it names no row twice.
Its rows are renamed `sample/pass{r+1}` (round 0 keeps the sample's own key), so round r of A meets round r of
B. A pass that mixes new and repeated rows, or repeats rows with other tokens (another batch under the same
default keys), is not a repeat: its rows stay named twice, not comparable, as before.
By tag (`passes_by="tag"`): every row of a pass the tracer tagged (`tracer.step(tag)`) is renamed
`sample/{tag}`, so passes meet by the key the user gave, in any order.
"""
from __future__ import annotations

import re
from typing import Callable

PASSES_BY = ("order", "tag")
_REPEAT = re.compile(r"^(?P<base>.*)/pass(?P<n>[0-9]+)$")


def repeat_key(sample: str, round_: int) -> str:
    """The sample key of a row in its `round_`-th repeat (0: the sample's own key)."""
    return sample if round_ == 0 else f"{sample}/pass{round_ + 1}"


def tag_key(sample: str, tag: str) -> str:
    return f"{sample}/{tag}"


def split_key(sample: str) -> tuple[str, int]:
    """(the sample's own key, its round) of a key `repeat_key` made; (key, 0) for any other key."""
    m = _REPEAT.match(sample)
    return (m.group("base"), int(m.group("n")) - 1) if m and int(m.group("n")) >= 2 else (sample, 0)


def pass_round(keys: list, positions: list, tokens: list | None, seen: dict, first_token: dict) -> int:
    """The round of one pass by order: r when every row it names was seen exactly r times before (`seen`:
    original row -> times) with the same token (`first_token`: original row -> token), 0 otherwise (a new pass,
    or one that is no clean repeat: its rows then stay named twice)."""
    named = [(k, int(p), None if tokens is None else tokens[i])
             for i, (k, p) in enumerate(zip(keys, positions)) if k is not None]
    if not named or len({(k, p) for k, p, _ in named}) != len(named):
        return 0
    before = {seen.get((k, p), 0) for k, p, _ in named}
    if len(before) != 1:
        return 0
    r = before.pop()
    if r and any(t is not None and first_token.get((k, p), t) != t for k, p, t in named):
        return 0
    return r


def pass_renamer(by: str, rows: dict, tag, seen: dict, first: dict) -> Callable[[str], str] | None:
    """The sample-key rename of one pass's rows (None: they keep their keys), passes matched `by` "order" or
    "tag"; counts the pass's rows in `seen` and their first tokens in `first` (its rank group's, in order)."""
    keys, positions, tokens = rows["keys"], rows["positions"], rows.get("tokens")
    rename = None
    if by == "tag":
        if isinstance(tag, str) and tag:
            rename = lambda k, t=tag: tag_key(k, t)          # noqa: E731
    else:
        r = pass_round(keys, positions, tokens, seen, first)
        if r:
            rename = lambda k, r=r: repeat_key(k, r)         # noqa: E731
    for i, (k, p) in enumerate(zip(keys, positions)):
        if k is not None:
            seen[(k, int(p))] = seen.get((k, int(p)), 0) + 1
            if tokens is not None:
                first.setdefault((k, int(p)), tokens[i])
    return rename


def pass_label(by: str, sample: str) -> str:
    """The pass a row's sample key belongs to: "1", "2", ... by order; the tag (or "untagged") by tag."""
    if by == "tag":
        return sample.rsplit("/", 1)[1] if "/" in sample else "untagged"
    return str(split_key(sample)[1] + 1)
