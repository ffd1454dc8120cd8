"""What the rows, the models' structure and the runs say about a pair, as notes that lead the report and can
make it not comparable: rows named twice, tokens that differ, rows one side alone has, another number of
layers or experts, a run that ended early. Computed from the report's own fields, so `rejudge` gives the same
notes from a saved report (docs/report.md, "Rows and structure")."""
from __future__ import annotations

from typing import Any

from ..report.schema import INCOMPLETE_NOTE, Note

ALWAYS, UNLESS_DIVERGENT = "always", "unless_divergent"     # Note.detail["blocks"] (report.schema.IDENTITY_NOTES)
ROWS_IN_LINE = 3        # rows named in a headline sentence (the note's detail holds more)


def incomplete_run_notes(sides: dict) -> list[Note]:
    """One note per side whose trace says its run ended early (`sides.*.run_incomplete`, from the ranks' files:
    `Trace.incomplete_runs`). A fact of the traces: the finder and `rejudge` both derive it from the sides."""
    out = []
    for side, d in sorted((sides or {}).items()):
        lines = d.get("run_incomplete") if isinstance(d, dict) else None
        if isinstance(lines, list) and lines:
            more = f" (and {len(lines) - 1} more ranks)" if len(lines) > 1 else ""
            out.append(Note(INCOMPLETE_NOTE, f"side {side.upper()}'s run is incomplete: {lines[0]}{more}. Its "
                            "trace is not the whole run and what it lost is not compared: never consistent",
                            {"side": side, "ranks": [str(x) for x in lines[:64]]}))
    return out


def with_incomplete_runs(a: Any, notes: list[Note]) -> Any:
    """`a` (a verdict.Assessment, not imported: verdict imports this module): an incomplete side makes a
    consistent pair not comparable (a divergence found in what was recorded
    still stands); the notes lead the assessment's."""
    if notes:
        a.notes = notes + a.notes
        if a.verdict == "consistent":
            a.verdict = "not_comparable"
    return a


# ------------------------------------------------------------------------------------------------ rows, structure

def layers_text(la: int, lb: int) -> str:
    return f"side B has {lb} layers, side A {la}" if lb > la else f"side A has {la} layers, side B {lb}"


def _count(d: dict, key: str) -> int:
    v = d.get(key)
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def _listed(items: list, fmt, total: int) -> str:
    shown = [fmt(x) for x in items[:ROWS_IN_LINE]]
    return ", ".join(shown) + (" …" if total > len(shown) else "")


def identity_notes(rows: dict, identity: dict, structure: dict) -> list[Note]:
    """Notes on what the sides' rows and models are, from the report's `rows`, `identity` and `structure`
    (so a saved report re-judges the same). Each note's detail holds `short` (its headline sentence) and
    `blocks` (ALWAYS / UNLESS_DIVERGENT / absent: see report_schema.IDENTITY_NOTES)."""
    out = []
    layers = (structure.get("layers") if isinstance(structure, dict) else None) or {}
    la, lb = layers.get("a"), layers.get("b")
    if isinstance(la, int) and isinstance(lb, int) and la != lb:
        short = f"the models differ in structure: {layers_text(la, lb)}"
        out.append(Note("structure", short + ": the points after the layers (final norm, logits, log-probs) follow "
                        "another layer on each side and are not compared — compare models with the same number of "
                        "layers (num_hidden_layers, or the checkpoint each side loaded)",
                        {"short": short, "blocks": ALWAYS, "layers": {"a": la, "b": lb}}))
    experts = (structure.get("experts") if isinstance(structure, dict) else None) or {}
    ea, eb = experts.get("a"), experts.get("b")
    if isinstance(ea, int) and isinstance(eb, int) and ea != eb:
        short = (f"the models differ in structure: side A has {ea} routed experts per MoE layer, "
                 f"side B {eb}")
        out.append(Note("structure", short + ": the router and expert points cannot be compared and every other "
                        "point follows another model — compare models with the same experts (num_experts, or the "
                        "checkpoint each side loaded)", {"short": short, "blocks": ALWAYS,
                                                         "experts": {"a": ea, "b": eb}}))
    dup_named = identity.get("duplicates") if isinstance(identity.get("duplicates"), dict) else {}
    for side in ("a", "b"):
        n = _count(rows, f"duplicates_{side}")
        if not n:
            continue
        named = [d for d in dup_named.get(side) or [] if isinstance(d, dict)]
        listed = _listed(named, lambda d: f"{d.get('sample')}@{d.get('position')} ({d.get('times')} times)", n)
        short = f"side {side.upper()} holds {n} (sample, position) rows more than once: {listed}"
        out.append(Note("duplicate_rows", short + " — each row must be traced once: give every sample of every "
                        "pass its own key (tracer.sample_keys, set before each forward) and trace each forward "
                        "once; these rows are not compared", {"short": short, "blocks": ALWAYS, "side": side,
                                                             "rows": named}))
    out += _passes_note(identity)
    excluded, n_diff = _count(rows, "excluded"), _count(rows, "different_tokens")
    if n_diff:
        diff = [d for d in identity.get("different_tokens") or [] if isinstance(d, dict)]
        listed = _listed(diff, lambda d: f"{d.get('sample')}@{d.get('position')} (A {d.get('token_a')}, "
                                         f"B {d.get('token_b')})", n_diff)
        common = max(_count(rows, "a") - _count(rows, "unmatched_a"), 0)
        none_left = excluded >= common
        short = (f"no row is comparable: different tokens at {listed}" if none_left else
                 f"{excluded} rows left out: different tokens at {listed}")
        out.append(Note("different_tokens", short + f" ({n_diff} row(s) both sides have hold different tokens; "
                        "a causal model's later rows of such a sample are left out too) — the sides did not compute "
                        "the same rows: feed both the same tokens in the same order under the same sample keys (a "
                        "batch in another order, positions shifted, padding without its attention mask look like "
                        "this)", {"short": short, "blocks": ALWAYS if none_left else None, "rows": diff}))
    um = identity.get("unmatched") if isinstance(identity.get("unmatched"), dict) else {}
    inside_of = {s: _count(um.get(s) if isinstance(um.get(s), dict) else {}, "inside") for s in ("a", "b")}
    for side, other in (("b", "a"), ("a", "b")):
        n = _count(rows, f"unmatched_{side}")
        if not n:
            continue
        u = um.get(side) if isinstance(um.get(side), dict) else {}
        inside = _count(u, "inside")
        first = [str(x) for x in u.get("first") or []]
        short = f"{n} of {_count(rows, side)} rows of side {side.upper()} match no row of {other.upper()}"
        if inside:
            short += (f" ({inside} at positions inside those side {other.upper()} traced for their sample, e.g. "
                      f"{_listed(first, str, inside)}: the sides number these rows differently)")
            why = (" — check the positions each side's model ran these rows at (HF: position_ids, cache_position; "
                   "a decode step at the wrong position looks like this)")
        elif inside_of[other]:
            why = (f" — not compared; with side {other.upper()}'s rows inside this side's span, likely the same "
                   "rows numbered differently")
        else:
            parts = [f"{_count(u, 'other_samples')} of samples side {other.upper()} did not trace"
                     if _count(u, "other_samples") else "",
                     f"{_count(u, 'outside')} before or after the positions side {other.upper()} traced for their "
                     "sample (a cached prefix, a last token never fed back)" if _count(u, "outside") else ""]
            why = " — not compared: " + "; ".join(x for x in parts if x) if any(parts) else " — not compared"
        out.append(Note("unmatched_rows", short + why, {"short": short, "side": side,
                                                        "blocks": UNLESS_DIVERGENT if inside else None, **u}))
    return out


def _passes_note(identity: dict) -> list[Note]:
    """Per-pass coverage where a side traced the same rows in several passes (view/passes.py): compared pass
    with pass, never refused; a pass one side alone has is said (its rows are unmatched rows too)."""
    ps = identity.get("passes") if isinstance(identity.get("passes"), dict) else {}
    a, b, m = (ps.get(k) if isinstance(ps.get(k), dict) else {} for k in ("a", "b", "matched"))
    if not (a or b):
        return []
    labels = list(m) or sorted(set(a) | set(b))
    each = []
    for lab in labels[:ROWS_IN_LINE]:          # the sentence names a few; the detail holds every pass
        na, nb = _count(a, lab), _count(b, lab)
        if na and nb:
            each.append(f"pass {lab}: {_count(m, lab)} of {max(na, nb)} rows compared")
        else:
            each.append(f"pass {lab}: side {'A' if na else 'B'} only ({na or nb} rows, not compared)")
    how = "by the passes' tags" if ps.get("by") == "tag" else "in order"
    short = (f"rows traced in {len(a)} pass(es) on side A, {len(b)} on side B, compared pass with pass {how}: "
             + _listed(each, str, len(labels)))
    return [Note("passes", short + " — the same batch traced more than once (actor and reference model, or two "
                 "steps) is one set of rows per pass; --passes-by tag matches passes by tracer.step(tag) instead",
                 {"short": short, "by": ps.get("by"), "a": a, "b": b, "matched": m})]
