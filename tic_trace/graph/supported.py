"""The README's supported-architectures tables, made from the adapters' own tables (tests/test_supported_archs.py
checks that the README holds exactly this text, so the two cannot drift).

Its own module, not `adapter`'s: it reads the canonical graph, which is assembled from the model families' points
(`canonical` reads the registry, whose name tables import `adapter`), so `adapter` importing `canonical` would
close an import circle."""
from __future__ import annotations

from typing import Sequence

from .adapter import get_adapter
from .canonical import BY_NAME

BUILTIN_ADAPTERS = ("hf", "megatron", "sglang")


def supported_architectures_markdown(adapters: Sequence[str] = BUILTIN_ADAPTERS) -> str:
    """The README's supported-architectures tables: families x frameworks, each verified entry (what is mapped,
    what the exact replay covers, the tests), and the architectures refused by name."""
    ads = [get_adapter(n) for n in adapters]
    families: list[str] = []
    for ad in ads:
        for arch in (ad.architectures or {}).values():
            families += [f for f in arch.families if f not in families]
    out = ["| family | " + " | ".join(ad.name for ad in ads) + " |", "|---" * (len(ads) + 1) + "|"]
    for fam in families:
        cells = []
        for ad in ads:
            names = [f"`{a.name}`" for a in (ad.architectures or {}).values() if fam in a.families]
            cells.append(", ".join(names) or "—")
        out.append(f"| {fam} | " + " | ".join(cells) + " |")
    out += ["", "| framework | architecture | mapped | exact replay (`--reference`) | verified by |",
            "|---|---|---|---|---|"]
    for ad in ads:
        for a in (ad.architectures or {}).values():
            moe = {p for p in BY_NAME if p.startswith("moe.")}
            shown = ([f"`{p}`" for p in a.lacks if p not in moe] + ["`moe.*`"] if moe <= set(a.lacks)
                     else [f"`{p}`" for p in a.lacks])
            lacks = f"; never has {', '.join(shown)}" if shown else ""
            replay = (f"every point but {', '.join(f'`{p}`' for p in a.replay_gaps)}: {a.replay}" if a.replay_gaps
                      else a.replay)
            out.append(f"| {ad.name} | `{a.name}` | {a.mapped}{lacks} | {replay} | {a.tests} |")
    out += ["", "| framework | refused by name | what the table would get wrong |", "|---|---|---|"]
    for ad in ads:
        for name, why in ad.refused.items():
            out.append(f"| {ad.name} | `{name}` | {why} |")
    return "\n".join(out) + "\n"
