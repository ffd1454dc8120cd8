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
        body = f"parameters differ between A and B: {', '.join(map(str, a or []))}" + _coverage(d.get("note"))
    else:
        body = f"A {a!r}, B {b!r}"
    kind = " [precision]" if d.get("kind") == "precision" else ""
    return f"{sec:<9} {key}{kind}: {body}"


def _coverage(note) -> str:
    """" (N of M parameters compared)" where a weights difference's note ends with it (compare/contract.py)."""
    if isinstance(note, str) and note.endswith(" parameters compared)") and " (" in note:
        return " (" + note.rsplit(" (", 1)[1]
    return ""


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


def side_hint(fd: dict) -> str | None:
    """Which side an operator divergence points at, where the report knows it without a replay's blame: the
    first op both sides run with a different output runs in a coarser dtype on one side, or only one side runs
    extra ops in the region (casts, another kernel). A phrase naming the side, or None: nothing in the report
    tells the sides apart (then only `--reference` does, by measuring each against the exact op)."""
    from ..store.dtypes import dtype_info, known_dtype
    ops = fd.get("ops") if isinstance(fd, dict) else None
    if not isinstance(ops, dict):
        return None
    a, b, pairs = ops.get("a"), ops.get("b"), ops.get("pairs")
    if not (isinstance(a, list) and isinstance(b, list) and isinstance(pairs, list)):
        return None
    k = ops.get("first_differing")

    def op(side: list, i) -> dict:
        return side[i] if isinstance(i, int) and 0 <= i < len(side) and isinstance(side[i], dict) else {}
    if isinstance(k, int) and 0 <= k < len(pairs) and isinstance(pairs[k], list) and len(pairs[k]) == 2:
        oa, ob = op(a, pairs[k][0]), op(b, pairs[k][1])
        da, db = oa.get("dtype"), ob.get("dtype")
        if (isinstance(da, str) and isinstance(db, str) and da != db and known_dtype(da) and known_dtype(db)
                and dtype_info(da).is_float and dtype_info(db).is_float):
            x, dx, dy = ("A", da, db) if dtype_info(da).mantissa_bits < dtype_info(db).mantissa_bits else ("B", db, da)
            return f"side {x}: its {oa.get('op')} computes in {dx}, the other side's in {dy}"
    only = {"A": [], "B": []}
    for pr in pairs:
        if isinstance(pr, list) and len(pr) == 2:
            if pr[1] is None and pr[0] is not None:
                only["A"].append(str(op(a, pr[0]).get("op")))
            elif pr[0] is None and pr[1] is not None:
                only["B"].append(str(op(b, pr[1]).get("op")))
    if bool(only["A"]) != bool(only["B"]):
        x = "A" if only["A"] else "B"
        names = sorted(set(only[x]))
        return f"side {x}: only it runs {', '.join(names[:3])}" + (" …" if len(names) > 3 else "") + " here"
    return None
