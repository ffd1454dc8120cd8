"""Small helpers every section uses: escaping, numbers as text, point keys and their order, colours, shapes,
hashes and ranks. Private to the HTML package (the leading underscores say so)."""
from __future__ import annotations

import html as _html
import math
import re

from ...graph.canonical import BY_NAME, is_ids, order_key, parse_key
from ..schema import USED_LOGPROB_MEANING, USED_LOGPROB_STAGE, num as _decode
from ..text import visible
from .style import STATUS_LABEL, STATUSES


def _e(x) -> str:
    # Control characters (ANSI escapes, bidi overrides) become visible escapes: the file is also `cat`ed.
    return _html.escape(visible(x, keep="\n\t"), quote=True)


def _num(x) -> float | None:
    """A numeric field as a float (the report's codec); NaN and anything unparsable become None (a dash)."""
    v = _decode(x)
    return None if v is None or math.isnan(v) else v


def _d(x) -> dict:
    return x if isinstance(x, dict) else {}


def _l(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else []


def _str_or_none(x) -> str | None:
    return x if x is None or isinstance(x, str) else str(x)


def _inf_text(v: float) -> str | None:
    if v == math.inf:
        return "∞"
    if v == -math.inf:
        return "−∞"
    return None


def _sci(x) -> str:
    v = _num(x)
    if v is None:
        return "—"
    if math.isinf(v):
        return _inf_text(v)
    if v == 0:
        return "0"
    return f"{v:.2e}"


def _pct(x) -> str:
    v = _num(x)
    if v is None or math.isinf(v):
        return "—" if v is None else _inf_text(v)
    if v == 1:
        return "100%"
    if v == 0:
        return "0%"
    return f"{100 * v:.1f}%"


def _cos(x) -> str:
    v = _num(x)
    if v is None or math.isinf(v):
        return "—" if v is None else _inf_text(v)
    return f"{v:.6f}"


def _gen(x) -> str:
    v = _num(x)
    if v is None or math.isinf(v):
        return "—" if v is None else _inf_text(v)
    if v == int(v) and abs(v) < 1e6:
        return f"{int(v):,}"
    return f"{v:.3g}"


def _growth(x) -> str:
    v = _num(x)
    if v is None:
        return "—"
    if math.isinf(v):
        return "×∞" if v > 0 else "—"
    return f"×{v:.3g}"


def _int(x) -> int | None:
    v = _num(x)
    if v is None or math.isinf(v):
        return None
    return int(v)


def _log10(v: float | None) -> float | None:
    if v is None or v <= 0 or math.isinf(v):
        return None
    return math.log10(v)


def _decades(vals, pad: int) -> tuple[int, int]:
    """Integer decades (lo, hi) spanning the positive finite values, at least `pad` decades apart; a value
    exactly on the lowest decade gets one decade of room under it."""
    pos = [v for v in vals if 0 < v < math.inf]
    if not pos:
        return -8, 0
    lo = math.floor(math.log10(min(pos)) + 1e-12)
    if min(pos) <= 10.0 ** lo * (1 + 1e-9):
        lo -= 1
    lo = max(lo, -40)
    hi = max(math.ceil(math.log10(max(pos)) - 1e-12), lo + pad)
    return lo, hi


def _anchor(key) -> str:
    return "pt-" + re.sub(r"[^A-Za-z0-9_.-]", "_", str(key))


def _pill(status) -> str:
    s = status if status in STATUSES else None
    cls = f"s-{s}" if s else "s-unknown"
    return f'<span class="pill {cls}">{_e(STATUS_LABEL.get(s, status) or "?")}</span>'


def _layer_of(p: dict) -> int | None:
    lay = p.get("layer")
    if isinstance(lay, bool):
        return None
    if isinstance(lay, int):
        return lay
    if lay is None:
        _, lay2 = parse_key(str(p.get("key", "")))
        return lay2
    return _int(lay)


def _point_of(p: dict) -> str:
    pt = p.get("point")
    if isinstance(pt, str) and pt:
        return pt
    return parse_key(str(p.get("key", "")))[0]


def _sort_key(p: dict):
    try:
        return order_key(_point_of(p), _layer_of(p))
    except Exception:  # noqa: BLE001 - a malformed point sorts last, it must not break the page
        return (9,)


def _key_sort(k: str):
    try:
        return order_key(*parse_key(k))
    except Exception:  # noqa: BLE001
        return (9,)


def _meaning(point) -> str:
    if point == USED_LOGPROB_STAGE:
        return USED_LOGPROB_MEANING
    ps = BY_NAME.get(point) if isinstance(point, str) else None
    return ps.meaning if ps else ""


def _is_ids(point) -> bool:
    return isinstance(point, str) and is_ids(point)


def _lerp_color(stops, t: float) -> str:
    t = min(max(t, 0.0), 1.0)
    for (t0, c0), (t1, c1) in zip(stops, stops[1:]):
        if t <= t1:
            u = 0.0 if t1 == t0 else (t - t0) / (t1 - t0)
            a = [int(c0[i:i + 2], 16) for i in (1, 3, 5)]
            b = [int(c1[i:i + 2], 16) for i in (1, 3, 5)]
            return "#" + "".join(f"{round(x + (y - x) * u):02x}" for x, y in zip(a, b))
    return stops[-1][1]


def _fmt_shape(shape) -> str:
    if isinstance(shape, (list, tuple)):
        return "×".join(_e(s) for s in shape) or "scalar"
    return _e(shape) if shape is not None else "—"


def _fmt_hash(h) -> str:
    if h is None:
        return "—"
    if isinstance(h, bool):
        return _e(h)
    if isinstance(h, int):
        return format(h & 0xFFFFFFFFFFFFFFFF, "016x")[:8]
    return _e(str(h)[:8])


def _fmt_ranks(ranks) -> str:
    rs = _l(ranks)
    if not rs:
        return "—"
    ints = [r for r in rs if isinstance(r, int) and not isinstance(r, bool)]
    if len(ints) == len(rs) and len(rs) > 4 and sorted(ints) == list(range(min(ints), max(ints) + 1)):
        return f"{min(ints)}–{max(ints)} ({len(rs)} ranks)"
    return ", ".join(_e(r) for r in rs)


def _fmt_f(x) -> str:
    v = _num(x)
    if v is None or math.isinf(v):
        return "—" if v is None else _inf_text(v)
    return f"{v:.4g}"
