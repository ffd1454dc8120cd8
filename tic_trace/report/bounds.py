"""What a renderer shows of a report: every list capped, and how much was left out, said in the output.

A report's lists grow with the model and the settings (`--worst-tokens 100000`) and a saved JSON can hold
anything: rendered in full, 100k worst tokens were 100k terminal lines (36 s, 650 MB) and 100k points a 63 MB
page. The JSON file always holds everything; the terminal and the HTML show at most `Bounds` of each list,
keep what the answer rests on (the first divergence, its inputs, its finding), and say
"… N more tokens not shown (see the JSON)" for each list they cut (`omitted_lines`). Inside what they keep, no
text is longer than `MAX_TEXT` characters and no list or map nested in an entry holds more than `MAX_NESTED`
items (a saved report's summary of 2 MB, or a first divergence with 200k inputs, was printed whole: a 27 MB
page); both cuts are counted and said the same way. So the size of every rendering is bounded whatever the
report holds, and its time with it (the JSON's own reading and re-judging are linear in its size).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bounds:
    points: int            # canonical points (the layer curve, the all-points table)
    worst_tokens: int      # worst tokens (and their per-token errors)
    not_comparable: int
    findings: int
    notes: int
    contract: int
    routing_layers: int
    ops: int               # dispatcher ops per side in the first-divergence region


# A 96-layer model has ~1,000 points: both keep every point of real models; the HTML has room for more rows.
TERMINAL = Bounds(points=2000, worst_tokens=50, not_comparable=200, findings=50, notes=20, contract=1000,
                  routing_layers=200, ops=200)
HTML = Bounds(points=5000, worst_tokens=200, not_comparable=2000, findings=500, notes=50, contract=1000,
              routing_layers=2000, ops=400)

MAX_TEXT = 4000           # characters of one text shown (a real report's longest summary is a few hundred)
MAX_NESTED = 500          # items of a list or map inside a report entry (real: a handful; the ops bound is 400)
# top-level fields whose nested maps `bounded` cuts by its own rule (token_errors: per kept point)
_OWN_RULE = ("token_errors", "routing")

# field -> the noun of its "… N more <noun> not shown" line
NOUNS = {"points": "points", "worst_tokens": "tokens", "not_comparable": "not-comparable entries",
         "findings": "findings", "notes": "notes", "contract": "contract differences",
         "routing_layers": "routing layers", "ops": "dispatcher ops", "characters": "characters of long texts",
         "nested": "nested entries"}
OMITTED = "omitted"        # the key of the counts in a bounded copy (never written to a JSON file)


def _list(x) -> list:
    return x if isinstance(x, list) else []


def bounded(report: dict, limits: Bounds) -> dict:
    """A shallow copy of `report` with each list cut to `limits`, and `omitted`: {field: count left out}
    (added to the counts of a copy bounded before). A report within the limits comes back as it is."""
    r = dict(report)
    omitted = dict(r.get(OMITTED) or {})

    def cut(name: str, items: list, keep: int, must=lambda x: False) -> list:
        if len(items) <= keep:
            return items
        out = [x for i, x in enumerate(items) if i < keep or must(x)]
        omitted[name] = omitted.get(name, 0) + len(items) - len(out)
        return out

    fd = r.get("first_divergence") if isinstance(r.get("first_divergence"), dict) else None
    needed = set()
    if fd:
        needed = {str(fd.get("key"))} | {str(k) for k in _list(fd.get("inputs"))}
    points = _list(r.get("points"))
    r["points"] = cut("points", points, limits.points, lambda p: isinstance(p, dict) and str(p.get("key")) in needed)
    r["worst_tokens"] = cut("worst_tokens", _list(r.get("worst_tokens")), limits.worst_tokens)
    te = r.get("token_errors")
    if isinstance(te, dict) and (len(te) > limits.worst_tokens or len(points) > len(r["points"])):
        labels = {f"{w.get('sample')}@{w.get('position')}" for w in r["worst_tokens"] if isinstance(w, dict)}
        keys = {str(p.get("key")) for p in r["points"] if isinstance(p, dict)}
        kept = [k for k in te if k in labels][:limits.worst_tokens]
        r["token_errors"] = {k: ({kk: vv for kk, vv in te[k].items() if kk in keys} if isinstance(te[k], dict)
                                 else te[k]) for k in kept}
    r["not_comparable"] = cut("not_comparable", _list(r.get("not_comparable")), limits.not_comparable)
    r["findings"] = cut("findings", _list(r.get("findings")), limits.findings,
                        lambda f: fd is not None and isinstance(f, dict) and f.get("key") == fd.get("key"))
    r["notes"] = cut("notes", _list(r.get("notes")), limits.notes)
    if "contract" in r:
        r["contract"] = cut("contract", _list(r.get("contract")), limits.contract)
    routing = r.get("routing")
    if isinstance(routing, dict) and isinstance(routing.get("layers"), dict) \
            and len(routing["layers"]) > limits.routing_layers:
        layers = list(routing["layers"].items())
        omitted["routing_layers"] = omitted.get("routing_layers", 0) + len(layers) - limits.routing_layers
        r["routing"] = {**routing, "layers": dict(layers[:limits.routing_layers])}
    if fd and isinstance(fd.get("ops"), dict):
        r["first_divergence"] = {**fd, "ops": _bounded_ops(fd["ops"], limits.ops, omitted)}
    for k in list(r):
        if k != OMITTED:
            r[k] = _capped(r[k], 0 if k in _OWN_RULE else 1, omitted)
    r[OMITTED] = {k: v for k, v in omitted.items() if v}
    return r


def _capped(x, depth: int, omitted: dict):
    """`x` with every text cut to MAX_TEXT characters and every list or map below the report's own fields
    (depth 2 on: a point's inputs, a finding's detail) cut to MAX_NESTED items, the cuts counted."""
    if isinstance(x, str):
        if len(x) <= MAX_TEXT:
            return x
        omitted["characters"] = omitted.get("characters", 0) + len(x) - (MAX_TEXT - 1)
        return x[:MAX_TEXT - 1] + "…"          # MAX_TEXT long: a copy bounded again is not cut again
    if isinstance(x, list):
        if depth >= 2 and len(x) > MAX_NESTED:
            omitted["nested"] = omitted.get("nested", 0) + len(x) - MAX_NESTED
            x = x[:MAX_NESTED]
        return [v if _plain(v) else _capped(v, depth + 1, omitted) for v in x]
    if isinstance(x, dict):
        items = list(x.items())
        if depth >= 2 and len(items) > MAX_NESTED:
            omitted["nested"] = omitted.get("nested", 0) + len(items) - MAX_NESTED
            items = items[:MAX_NESTED]
        return {_capped(k, depth, omitted) if isinstance(k, str) and len(k) > MAX_TEXT else k:
                (v if _plain(v) else _capped(v, depth + 1, omitted)) for k, v in items}
    return x


def _plain(v) -> bool:
    """A value the cut leaves as it is: a number, a bool, null or a short text."""
    return v is None or isinstance(v, (int, float)) or (isinstance(v, str) and len(v) <= MAX_TEXT)


def _bounded_ops(ops: dict, keep: int, omitted: dict) -> dict:
    a, b = _list(ops.get("a")), _list(ops.get("b"))
    if len(a) <= keep and len(b) <= keep:
        return ops
    pairs = []
    for pair in _list(ops.get("pairs")):          # in order: stop at the first pair past the kept ops
        if not (isinstance(pair, list) and len(pair) == 2):
            continue
        i, j = pair
        if (isinstance(i, int) and i >= keep) or (isinstance(j, int) and j >= keep):
            break
        pairs.append(pair)
    first = ops.get("first_differing")
    omitted["ops"] = omitted.get("ops", 0) + max(len(a) - keep, 0) + max(len(b) - keep, 0)
    return {**ops, "a": a[:keep], "b": b[:keep], "pairs": pairs,
            "first_differing": first if isinstance(first, int) and 0 <= first < len(pairs) else None}


def omitted_lines(report: dict, fields: tuple[str, ...] | None = None) -> list[str]:
    """'… N more <noun> not shown (see the JSON)' for each list a bounded copy cut (only `fields`, if given)."""
    om = report.get(OMITTED) or {}
    return [f"… {om[k]:,} more {NOUNS.get(k, k)} not shown (see the JSON)"
            for k in (fields or tuple(om)) if om.get(k)]
