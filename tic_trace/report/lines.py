"""One-line plain-text forms of report parts that both renderers print (terminal and HTML): a contract
difference. Plain text: renderers print it as text, never as markup."""
from __future__ import annotations


def contract_line(d: dict) -> str:
    """One contract difference as plain text (renderers print it as text, never markup)."""
    sec, key, a, b = d.get("section"), d.get("key"), d.get("a"), d.get("b")
    if sec in ("reference", "hashes") and isinstance(d.get("note"), str) and d.get("note"):
        body = d["note"]          # what the replay used of the checkpoint, what no hash confirmed: said in words
    elif d.get("against") == "checkpoint":
        who = d.get("side") or "?"
        if sec == "weights":
            body = f"side {who}'s parameters differ from the checkpoint: {', '.join(map(str, a or []))}"
        else:
            body = f"side {who} {a!r}, checkpoint {b!r}"
    elif sec == "weights":
        body = f"parameters differ between A and B: {', '.join(map(str, a or []))}"
    else:
        body = f"A {a!r}, B {b!r}"
    kind = " [precision]" if d.get("kind") == "precision" else ""
    return f"{sec:<9} {key}{kind}: {body}"
