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


def note_short(note: dict) -> str:
    """A note's sentence for one-line forms: its `detail.short` when it has one, else its summary."""
    d = note.get("detail") if isinstance(note.get("detail"), dict) else {}
    return str(d.get("short") or note.get("summary") or "")


def identity_notes(report: dict) -> list[dict]:
    """The notes on the rows and the models' structure (schema.IDENTITY_NOTES), in report order."""
    from .schema import IDENTITY_NOTES
    notes = report.get("notes") if isinstance(report, dict) else None
    return [n for n in notes if isinstance(n, dict) and n.get("kind") in IDENTITY_NOTES] \
        if isinstance(notes, list) else []


def identity_sentence(report: dict) -> str:
    """What the rows and the structure say, as one sentence list ('' when nothing)."""
    return "; ".join(note_short(n) for n in identity_notes(report))


def blocking_line(report: dict) -> str | None:
    """The answer when the rows or the structure make the pair not comparable (None otherwise): those
    sentences first, then the first divergence among what could be compared, then the other row notes."""
    notes = identity_notes(report)
    blocking = [n for n in notes if (n.get("detail") or {}).get("blocks")]
    if report.get("verdict") != "not_comparable" or not blocking:
        return None
    line = "NOT COMPARABLE: " + "; ".join(note_short(n) for n in blocking)
    fd = report.get("first_divergence")
    if isinstance(fd, dict) and fd.get("key"):
        line += f"; among what could be compared, the first divergence is at {fd['key']} [{fd.get('cause') or 'operator'}]"
    return line + "".join("; " + note_short(n) for n in notes if n not in blocking)


def precision_caveat(report: dict) -> str | None:
    """The `precision_unchecked` note's sentence ("within bf16 noise by the A−B rule; precision faults need
    `--reference CKPT`"), which a consistent headline carries: None when the report has no such note."""
    notes = report.get("notes") if isinstance(report, dict) else None
    for n in notes if isinstance(notes, list) else []:
        if isinstance(n, dict) and n.get("kind") == "precision_unchecked" and isinstance(n.get("summary"), str):
            return n["summary"]
    return None


def ulp_na(metrics: dict) -> int:
    """Elements where A is exactly 0 and B is not (`metrics.ulp_na`): their ULP distance is not defined."""
    v = metrics.get("ulp_na") if isinstance(metrics, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def ulp_text(metrics: dict, fmt) -> str:
    """A point's max ULP for a table cell, `fmt` formatting the number: "n/a" where every differing element
    sits at an exact zero of A (no ULP at |a| = 0), the number with "+n/a" where some do."""
    n = ulp_na(metrics)
    v = metrics.get("max_ulp") if isinstance(metrics, dict) else None
    if n and not v:
        return "n/a"
    return fmt(v) + ("+n/a" if n else "")
