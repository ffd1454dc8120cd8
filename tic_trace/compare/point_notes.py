"""Notes on what the compared points say that are not causes (compare/verdict.py leads the report with
them): both sides NaN/Inf alike, low-precision points judged without a replay, points the replay could not
judge, points where the sides run different clean implementations (docs/report.md, "notes")."""
from __future__ import annotations

from ..report.schema import Note, Point
from ..store.dtypes import dtype_info, known_dtype
from .judge import NOT_COMPARABLE


def implementations_note(points: list[Point]) -> Note | None:
    """Points where the sides are reproduced by different clean implementations (eager vs SDPA attention, a
    TP-split GEMM, fused silu x up): a difference, named, never a fault."""
    out = {}
    for p in points:
        ea, eb = ((p.intrinsic or {}).get(s) for s in ("a", "b"))
        if (isinstance(ea, dict) and isinstance(eb, dict) and ea.get("match_kind") == "clean" == eb.get("match_kind")
                and ea.get("match") != eb.get("match")):
            out[p.key] = {"a": ea.get("match_what"), "b": eb.get("match_what")}
    if not out:
        return None
    shown = "; ".join(f"{k}: A {v['a']}, B {v['b']}" for k, v in list(out.items())[:4])
    return Note("implementations", f"{len(out)} point(s) where the sides run different clean implementations "
                                   f"(not a fault): {shown}" + (" …" if len(out) > 4 else ""), {"points": out})


def shared_nonfinite_note(points: list[Point]) -> Note | None:
    """Points where both sides hold NaN/Inf at the same elements: the sides agree there (no finding), but
    the values are unusable; a pair whose log-probs are NaN on both sides must not read as plainly clean."""
    hit = [(p.key, int((p.metrics or {}).get("nonfinite_shared") or 0)) for p in points]
    hit = [(k, n) for k, n in hit if n]
    if not hit:
        return None
    return Note("nonfinite_shared", f"{len(hit)} point(s) hold NaN/Inf on both sides at the same elements (first "
                                    f"{hit[0][0]}: {hit[0][1]} element(s)): the sides agree there, but both "
                                    "compute non-finite values", {"points": dict(hit)})


LOW_PRECISION_BITS = 10        # float16 and coarser: the A-B rule's tolerance there hides precision faults


def precision_unchecked_note(points: list[Point]) -> Note | None:
    """Low-precision points judged by the A-B rule alone (no replay facts anywhere: no `--reference`). In bf16
    a precision fault (RMSNorm without its fp32 upcast, ...) differs from a clean pair by no more than clean
    op-order noise, so "none diverges" there means "within that noise", said as such (docs/report.md). Made
    only where nothing diverges (a divergence found needs no caveat of what could not be seen)."""
    if any(p.intrinsic is not None for p in points):
        return None
    low = sorted({p.dtype for p in points if p.status != NOT_COMPARABLE and isinstance(p.dtype, str)
                  and known_dtype(p.dtype) and 0 < dtype_info(p.dtype).mantissa_bits <= LOW_PRECISION_BITS})
    if not low:
        return None
    names = "/".join(d.replace("bfloat16", "bf16").replace("float16", "fp16") for d in low)
    return Note("precision_unchecked", f"within {names} noise by the A−B rule; precision faults need "
                                       "`--reference CKPT`", {"dtypes": low})


def not_replayed_note(points: list[Point]) -> Note | None:
    """Points the exact replay could not judge (no weights, rows or inputs, an op outside the reference):
    the A-B rule alone decides there."""
    out = {}
    for p in points:
        for side in ("a", "b"):
            e = (p.intrinsic or {}).get(side)
            if isinstance(e, dict) and "not_replayed" in e and not str(e["not_replayed"]).startswith("derived"):
                out.setdefault(p.key, f"{side.upper()}: {e['not_replayed']}")
    if not out:
        return None
    shown = "; ".join(f"{k} ({v})" for k, v in list(out.items())[:4])
    return Note("not_replayed", f"{len(out)} point(s) not replayed against the reference, judged by the A-B rule "
                                f"alone: {shown}" + (" …" if len(out) > 4 else ""), {"points": out})
