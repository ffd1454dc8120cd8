"""Error metrics between two aligned canonical tensors.

Metrics stay linear in the relative error (relative L2, max-abs over scale, ULP distance): `1 - cosine`
squares small errors, so a 0.5% systematic error reads as ~1e-5 and slips under thresholds. Cosine is
reported for familiarity, never judged on.

Memory and speed: `compare_values` streams a point in blocks of whole rows (a row longer than a block is cut
into column pieces) of at most `BLOCK_ELEMS` elements, widened to float64 into three reused buffers; every
metric is accumulated per block in one pass of vectorised kernels, so the heap peak is about three float64
blocks (3 x 512 KiB) plus 24 bytes per row, whatever the tensor's size, and memory-mapped inputs are read
once, block by block. Totals are sums of per-row sums, so they do not depend on the block size (except
for rows cut into pieces).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

from ..store.dtypes import dtype_info, known_dtype

_TINY = 1e-30
# A row's judged error is relative to its own norm (docs/report.md, "The worst rows"), except that a row whose
# reference norm is under ROW_FLOOR x the median row's is measured against that floor: a row that holds
# (almost) nothing has a relative error of rounding residue over nothing, which says nothing of the op. The
# median, not the mean or the global norm: a few massive-activation rows 1000x the rest do not move it.
ROW_FLOOR = 1e-3
# The all-rows error the judge reads (docs/report.md, "Row-relative errors"): this quantile of the rows' own
# relative errors, not one relative L2 over every row. A relative L2 over all rows weighs each row by its
# squared norm, so a few massive-activation rows (BOS, delimiters: 10^3-10^4x the median) make it the error
# of those rows alone, and the next RMSNorm, which rescales every row, shows the ordinary rows' error as a
# 20-70x "jump". A quantile weighs every row alike, ignores the few largest (one bad token is the worst-row
# rule's to find, at any batch size) and is monotone in the rows: if no row's error grows more than g-fold
# over its own inputs' error, neither does the quantile (so the all-rows rule never fires where no row does).
# 0.9 and not the median: a fault that hits a tenth of the rows or more moves it.
ROW_QUANTILE = 0.9
# float64 elements per block: 512 KiB per buffer, the three in a 2 MiB L2, so the ~15 passes over a block hit
# the cache (measured on the benchmark machine, compare_values of 1024x4096 / 8192x512 float32: 64 Ki blocks
# 10-15 % faster than 256 Ki, 32 Ki no better: per-block overhead).
BLOCK_ELEMS = 1 << 16
_EXP_MASK = np.int64(0x7FF0000000000000)
_MIN_NORMAL = 2.0 ** -126


@dataclass
class Metrics:
    rows: int
    numel: int
    max_abs: float
    mean_abs: float
    rel_l2: float                # ||a-b|| / ||a|| over all rows  (a = reference side)
    cosine: float
    max_ulp: float               # largest |a-b| in units of the last place of `dtype` at |a| (a != 0)
    mean_ulp: float              # over the elements whose ULP is defined (all but `ulp_na`)
    bitwise_equal: float         # fraction of elements exactly equal
    ref_rms: float
    nonfinite: int = 0           # elements NaN/Inf on exactly one side
    nonfinite_shared: int = 0    # elements NaN (or the same Inf) on both sides: equal, and unusable
    per_row_rel: list[float] = field(default_factory=list)   # per-row relative L2 error
    per_row_max: list[float] = field(default_factory=list)
    # the per-row error the judge reads: per_row_rel, with rows under the floor (ROW_FLOOR) measured against
    # it; None where no row is under it (then it is per_row_rel)
    per_row_judged: list[float] | None = None
    # the ROW_QUANTILE quantile of the judged per-row errors: the all-rows error the finder judges
    rel_rows: float = 0.0
    # where a row scale was given (compare_values' row_scale): the per-row errors against each row's own norm
    # (floored as above), the relative errors later points inherit; None otherwise
    per_row_own: list[float] | None = None
    # elements where A is exactly 0 and B is not: a ULP "at |a|" is none there (the ULP of zero is the smallest
    # subnormal, which made one such element read 1e36-1e38 ULP), so they are left out of max_ulp / mean_ulp and
    # counted; renderers say "n/a" where every differing element is one of them (report.lines.ulp_text)
    ulp_na: int = 0

    @property
    def error(self) -> float:
        """The one number the finder judges: the row-relative error (`row_aggregate` of the rows' own relative
        errors; inf if one side has NaN/Inf the other lacks)."""
        return math.inf if self.nonfinite else self.rel_rows

    def to_json(self, per_row: bool = False) -> dict:
        skip = () if per_row else ("per_row_rel", "per_row_max", "per_row_judged", "per_row_own")
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        return {k: ([_finite(x) for x in v] if isinstance(v, list) else _finite(v)) for k, v in d.items()}


@dataclass
class RoutingMetrics:
    rows: int
    k: int
    set_agreement: float         # mean |A ∩ B| / max(k, k_b) over rows
    flipped_rows: int            # rows whose expert sets differ
    flipped_index: list[int]     # row indices (into the aligned rows) that flipped
    flip_margins: list[float]    # router-logit margin (k-th minus (k+1)-th, side A) at each flip, if known
    unexplained_flips: int       # flips whose margin exceeds the router-logit error at that row
    k_b: int = 0                 # side B's top-k, where it differs from A's every row is an unexplained flip

    @property
    def error(self) -> float:
        return self.flipped_rows / max(self.rows, 1)

    def to_json(self) -> dict:
        return {"rows": self.rows, "k": self.k, "set_agreement": self.set_agreement,
                "flipped_rows": self.flipped_rows, "flipped_index": list(self.flipped_index[:64]),
                "flip_margins": [_finite(x) for x in self.flip_margins[:64]],
                "unexplained_flips": self.unexplained_flips, "share_flipped": self.error}


def _finite(v):
    from ..report.schema import encode   # the report's one codec for NaN/Inf
    return encode(v)


def _mantissa_bits(dtype: str) -> int:
    return dtype_info(dtype).mantissa_bits if known_dtype(dtype) and dtype_info(dtype).is_float else 23


class _Acc:
    """Per-row sums and global sums of one comparison, filled block by block."""

    def __init__(self, n: int, block: int):
        self.na2, self.nd2, self.rmax = np.zeros(n), np.zeros(n), np.zeros(n)
        self.nb2 = self.dot = self.abs_sum = self.ulp_sum = 0.0
        self.ulp_max = 0.0
        self.ulp_na = 0
        self.equal = self.nonfinite = self.shared = 0
        self.row_nonfinite = np.zeros(n, dtype=bool)     # rows with NaN/Inf on one side only
        self.buf = [np.empty(block) for _ in range(3)]

    def views(self, shape: tuple[int, int]) -> list[np.ndarray]:
        m = shape[0] * shape[1]
        return [b[:m].reshape(shape) for b in self.buf]

    def block(self, a: np.ndarray, b: np.ndarray, rows: slice, mant: int) -> None:
        A, B, D = self.views(a.shape)
        np.copyto(A, a, casting="unsafe")
        if a.flat[0] == b.flat[0] and np.array_equal(a, b) and self._equal(A, rows):   # cheap test first
            return
        np.copyto(B, b, casting="unsafe")
        na2, nb2 = np.einsum("ij,ij->i", A, A), np.einsum("ij,ij->i", B, B)
        if not (np.isfinite(na2).all() and np.isfinite(nb2).all()):
            self._masked(A, B, D, rows, mant)      # NaN/Inf (or squares over float64's range) present
            return
        self.na2[rows] += na2
        self.nb2 += float(nb2.sum())
        self.dot += float(np.einsum("ij,ij->", A, B))
        np.subtract(A, B, out=D)
        self.nd2[rows] += np.einsum("ij,ij->i", D, D)
        self.equal += D.size - int(np.count_nonzero(D))    # finite a, b: a - b == 0 exactly when a == b
        self._abs_and_ulp(A, D, rows, mant)

    def _equal(self, A: np.ndarray, rows: slice) -> bool:
        """A block equal on both sides (no NaN: NaN != NaN): no difference, one sum of squares. False when it
        holds Inf (then the general path leaves non-finite values out of the moments)."""
        na2 = np.einsum("ij,ij->i", A, A)
        if not np.isfinite(na2).all():
            return False
        self.na2[rows] += na2
        total = float(na2.sum())
        self.nb2 += total
        self.dot += total
        self.equal += A.size
        return True

    def _abs_and_ulp(self, A: np.ndarray, D: np.ndarray, rows: slice, mant: int) -> None:
        """D: a - b (zero where not compared) -> |a - b| -> |a - b| / 2**floor(log2|a|); A is overwritten."""
        np.abs(D, out=D)
        np.maximum(self.rmax[rows], D.max(axis=1), out=self.rmax[rows])
        self.abs_sum += float(D.sum())
        at_zero = (A == 0) & (D > 0)            # no ULP at |a| = 0: counted, left out (Metrics.ulp_na)
        n_zero = int(np.count_nonzero(at_zero))
        if n_zero:
            self.ulp_na += n_zero
            D[at_zero] = 0.0
        np.bitwise_and(A.view(np.int64), _EXP_MASK, out=A.view(np.int64))    # A := 2**floor(log2|a|) (no sign)
        np.maximum(A, _MIN_NORMAL, out=A)       # zero and subnormals: the ULP of fp32's smallest normal
        np.divide(D, A, out=D)
        self.ulp_max = max(self.ulp_max, math.ldexp(float(D.max()), mant))
        self.ulp_sum += math.ldexp(float(D.sum()), mant)

    def _masked(self, A: np.ndarray, B: np.ndarray, D: np.ndarray, rows: slice, mant: int) -> None:
        """The general path: values non-finite on either side are left out of the moments and counted."""
        fa, fb = np.isfinite(A), np.isfinite(B)
        nan_both = np.isnan(A) & np.isnan(B)
        one_sided = (fa != fb) | ((~fa & ~fb) & ~nan_both & (A != B))
        self.nonfinite += int(one_sided.sum())
        self.shared += int((~fa & ~fb).sum()) - int(((~fa & ~fb) & one_sided).sum())
        self.row_nonfinite[rows] |= one_sided.any(axis=1)
        self.equal += int(((A == B) | nan_both).sum())
        both = fa & fb
        np.subtract(A, B, out=D, where=both)
        D[~both] = 0.0
        A[~both] = 0.0
        B[~both] = 0.0
        self.na2[rows] += np.einsum("ij,ij->i", A, A)
        self.nb2 += float(np.einsum("ij,ij->", B, B))
        self.dot += float(np.einsum("ij,ij->", A, B))
        self.nd2[rows] += np.einsum("ij,ij->i", D, D)
        self._abs_and_ulp(A, D, rows, mant)


def _blocks(n: int, cols: int, block: int):
    """(row slice, column slice) pieces of an [n, cols] array, each at most `block` elements."""
    if cols <= block:
        step = max(1, block // max(cols, 1))
        for r in range(0, n, step):
            yield slice(r, min(n, r + step)), slice(0, cols)
    else:
        for r in range(n):
            for c in range(0, cols, block):
                yield slice(r, r + 1), slice(c, min(cols, c + block))


def compare_values(a: np.ndarray, b: np.ndarray, dtype: str, row_scale: np.ndarray | None = None) -> Metrics:
    """Compare aligned arrays [rows, ...]; `a` is the reference side. Streams both in row blocks (see the
    module docstring): memory-mapped inputs are never loaded whole. `row_scale`: per row, a scale the row's
    error is measured against where it exceeds ‖a_row‖ (a point that mixes rows, compare/mixture.py; NaN:
    none), for the per-row errors and the judged error; `rel_l2` stays against ‖a‖."""
    n = a.shape[0] if a.ndim else 1
    cols = int(np.prod(a.shape[1:], dtype=np.int64)) if a.ndim else 1
    a2, b2 = a.reshape(n, cols), b.reshape(n, -1 if n else cols)
    if a2.shape != b2.shape:
        raise ValueError(f"compare_values: shapes differ after alignment: {a.shape} vs {b.shape}")
    numel = n * cols
    acc = _Acc(n, min(BLOCK_ELEMS, max(numel, 1)))
    mant = _mantissa_bits(dtype)
    for rs, cs in (_blocks(n, cols, BLOCK_ELEMS) if numel else ()):
        acc.block(a2[rs, cs], b2[rs, cs], rs, mant)
    norm_a2 = float(acc.na2.sum())
    norm_a, norm_d, nb = math.sqrt(norm_a2), math.sqrt(float(acc.nd2.sum())), math.sqrt(acc.nb2)
    row_na, row_nd = np.sqrt(acc.na2), np.sqrt(acc.nd2)
    own = None
    if row_scale is not None:
        own = _row_relative(row_na, row_nd, acc.row_nonfinite)
        floored = _floored(own, row_na, row_nd, acc.row_nonfinite)
        own = own if floored is None else floored
        scale = np.asarray(row_scale, dtype=np.float64).reshape(-1)
        row_na = np.where(np.isfinite(scale) & (scale > row_na), scale, row_na)
    per_row_rel = _row_relative(row_na, row_nd, acc.row_nonfinite)
    judged = _floored(per_row_rel, row_na, row_nd, acc.row_nonfinite)
    return Metrics(
        rel_rows=row_aggregate(per_row_rel if judged is None else judged),
        rows=n, numel=numel,
        max_abs=float(acc.rmax.max()) if numel else 0.0,
        mean_abs=acc.abs_sum / numel if numel else 0.0,
        rel_l2=norm_d / norm_a if norm_a > _TINY else (0.0 if norm_d == 0 else math.inf),
        cosine=acc.dot / (norm_a * nb) if norm_a > _TINY and nb > _TINY else (1.0 if norm_d == 0 else 0.0),
        max_ulp=acc.ulp_max if numel else 0.0,
        mean_ulp=acc.ulp_sum / (numel - acc.ulp_na) if numel > acc.ulp_na else 0.0,
        ulp_na=acc.ulp_na,
        bitwise_equal=acc.equal / numel if numel else 1.0,
        ref_rms=norm_a / math.sqrt(max(numel, 1)),
        nonfinite=acc.nonfinite, nonfinite_shared=acc.shared,
        per_row_rel=per_row_rel.tolist(),
        per_row_max=np.where(acc.row_nonfinite, np.inf, acc.rmax).tolist() if numel else [],
        per_row_judged=judged.tolist() if judged is not None else None,
        per_row_own=None if own is None else own.tolist(),
    )


def _row_relative(row_na: np.ndarray, row_nd: np.ndarray, nonfinite: np.ndarray) -> np.ndarray:
    """‖a_row − b_row‖ / scale per row; inf where the scale is ~0 and the row differs, or NaN/Inf is on one side
    only (such a row is not "bit-identical")."""
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(row_na > _TINY, row_nd / np.maximum(row_na, _TINY), np.where(row_nd > 0, np.inf, 0.0))
    return np.where(nonfinite, np.inf, rel)


def row_aggregate(per_row) -> float:
    """The all-rows error from per-row relative errors: their ROW_QUANTILE quantile, read as an order statistic
    (the smallest row error at or above the quantile's rank: a row's own error, so inf rows need no
    arithmetic); 0 for no rows."""
    e = np.asarray(per_row, dtype=np.float64)
    if not e.size:
        return 0.0
    e = np.where(np.isnan(e), np.inf, e)
    k = int(math.ceil(ROW_QUANTILE * (e.size - 1)))
    return float(np.partition(e, k)[k])


def _floored(per_row_rel: np.ndarray, row_na: np.ndarray, row_nd: np.ndarray, nonfinite: np.ndarray):
    """Per-row relative errors with each row's scale max(||a_row||, ROW_FLOOR x median ||a_row||); None when
    no row is under the floor (the common case: the errors are per_row_rel)."""
    if not row_na.size:
        return None
    floor = ROW_FLOOR * float(np.median(row_na))
    low = row_na < floor
    if floor <= _TINY or not low.any():
        return None
    out = per_row_rel.copy()
    out[low] = np.where(nonfinite[low], np.inf, row_nd[low] / floor)
    return out


def compare_routing(ids_a: np.ndarray, ids_b: np.ndarray, logits_a: np.ndarray | None = None,
                    logit_err: np.ndarray | None = None) -> RoutingMetrics:
    """Top-k expert sets per row. A flip is explained (near-tie) when the reference's router-logit margin
    between the k-th and (k+1)-th expert is within twice that row's router-logit error. Vectorised: the
    set intersection of each row from a [rows, k, k] equality table, in row blocks."""
    n, k = ids_a.shape[0], int(np.prod(ids_a.shape[1:], dtype=np.int64))
    k_b = int(np.prod(ids_b.shape[1:], dtype=np.int64))   # another top-k on side B: no row's set can agree
    A = ids_a.reshape(n, k).astype(np.int64)
    B = ids_b.reshape(n, k_b).astype(np.int64)
    inter = np.empty(n, dtype=np.int64)
    step = max(1, BLOCK_ELEMS // max(k * k, 1))
    earlier = np.tri(k, k, -1, dtype=bool)          # [i, j]: j < i
    for r in range(0, n, step):
        a, b = A[r:r + step], B[r:r + step]
        first = ~((a[:, :, None] == a[:, None, :]) & earlier).any(axis=2)   # first copy of each id in a
        in_b = (a[:, :, None] == b[:, None, :]).any(axis=2)
        inter[r:r + step] = (first & in_b).sum(axis=1)
    flipped = np.flatnonzero(inter < k) if k_b == k else np.arange(n)
    margins = np.full(flipped.size, np.nan)
    if logits_a is not None and logits_a.shape[-1] > k and flipped.size:
        srt = -np.sort(-logits_a[flipped].reshape(flipped.size, -1), axis=1)
        margins = (srt[:, k - 1] - srt[:, k]).astype(np.float64)
    tol = 2.0 * np.asarray(logit_err, dtype=np.float64)[flipped] if logit_err is not None else 0.0
    with np.errstate(invalid="ignore"):
        unexplained = int((~(margins <= tol)).sum()) if k_b == k else int(flipped.size)
    return RoutingMetrics(rows=n, k=k, k_b=k_b, set_agreement=float(inter.mean() / max(k, k_b)) if n else 1.0,
                          flipped_rows=int(flipped.size), flipped_index=flipped.tolist(),
                          flip_margins=margins.tolist(), unexplained_flips=unexplained)


def compare_stats(sa: list[dict], sb: list[dict], ha: list, hb: list) -> dict:
    """What statistics alone can say: equal hashes (bit-exact) and the relative difference of the RMS,
    mean and abs-max (lower bounds on the relative error)."""
    def agg(ss):
        c = sum(s.get("count", 0) for s in ss)
        tot = sum(s.get("sum", 0.0) for s in ss)
        sq = sum(s.get("sumsq", 0.0) for s in ss)
        amax = max((s.get("absmax", 0.0) for s in ss), default=0.0)
        nonf = sum(s.get("nan", 0) + s.get("inf", 0) for s in ss)
        return c, tot, sq, amax, nonf

    ca, ta, qa, ma, na = agg(sa)
    cb, tb, qb, mb, nb = agg(sb)
    rms_a, rms_b = math.sqrt(qa / max(ca, 1)), math.sqrt(qb / max(cb, 1))
    rel = lambda x, y, s: abs(x - y) / s if s > _TINY else (0.0 if x == y else math.inf)  # noqa: E731
    return {
        "comparable": ca == cb,
        "count": [ca, cb],
        "bitwise_equal": bool(ha) and ha == hb and None not in ha,
        "rel_rms": rel(rms_a, rms_b, rms_a),
        "rel_mean": rel(ta / max(ca, 1), tb / max(cb, 1), rms_a),
        "rel_absmax": rel(ma, mb, ma),
        "nonfinite": [na, nb],
    }
