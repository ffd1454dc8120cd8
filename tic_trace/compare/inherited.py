"""A row's inherited error measured where the op acts on it (docs/report.md, "Where the op acts").

The finder's rule compares a point's error with the error its inputs carry. Read as the inputs' own relative
error, that is the wrong number at two ops of a trained model:

- **log-softmax** (`logprobs`, unit nats): a log-prob near 0 has no relative scale, and the logits' relative
  error says nothing in nats. What the logits' A−B difference implies for the row is known exactly:
  `|lp(z_A)_t − lp(z_B)_t|`, the exact (float64) log-softmax of each side's own logits at the next token
  (to first order `Δz_t − Σ_j p_j Δz_j`). A recorded log-prob adds its log-softmax's rounding on top: a clean
  implementation (fp32 inside, the output rounded to its record's dtype) is within `logsoftmax_rounding`.
- **a norm** (RMSNorm: `attn_norm`, `mlp_norm`, `final_norm`, post-norms): it rescales the row by its RMS and
  weighs each channel by its gain. A massive channel (10^4x the median |x|) holds the row's norm, so the
  input's relative error is that channel's alone; a tiny gain (4e-4) then mutes it, and the ordinary channels'
  error shows at the output as a "jump" (or, the other way, a massive-channel error would excuse a fault).
  The inherited error is what the exact norm makes of the inputs' difference: `‖g⊙(x̂_A − x̂_B)‖ / ‖g⊙x̂_A‖`
  per row, x̂ = x / rms(x). The gain g is side A's own: fitted per channel from A's input and output (least
  squares over the rows), the gain A applied whatever its parameterisation (w or 1 + w) and with or without a
  checkpoint. Where the fit does not describe the op (a LayerNorm, a mean-subtracting or biased norm), nothing
  is returned and the inputs' own errors are read as before.

Each function returns one number per row (this point's rows, in order), inf where it cannot be known, or None
where the op's own inherited error does not apply.
"""
from __future__ import annotations

import math

import numpy as np

from ..graph.canonical import BY_NAME, feeds_of
from ..store.dtypes import dtype_info, known_dtype
from ..view.align import CanonicalView, RowId, next_token_logprobs

# A clean log-softmax's own error bound is multiplied by this: the bound counts one rounding per step, and real
# kernels (a blocked max, a pairwise or atomic sum) may take a few more.
ROUNDING_SAFETY = 4.0
# The norm's gain fit must reproduce side A's output to this relative L2 (bf16 output rounding: ~1e-3) for the
# op to be read as g ⊙ x / rms(x).
NORM_FIT = 2e-2
_U32 = 2.0 ** -24
_EPS = 1e-6
BLOCK_ELEMS = 1 << 18     # float64 values of one side's input rows widened at once


def _unit_roundoff(dtype: str | None) -> float:
    if dtype and known_dtype(dtype) and dtype_info(dtype).is_float:
        return 2.0 ** -(dtype_info(dtype).mantissa_bits + 1)
    return _U32


def logsoftmax_rounding(lp: np.ndarray, dtype: str | None, vocab: int) -> np.ndarray:
    """The error (nats) a clean log-softmax adds to log-probs `lp` recorded in `dtype`: computed in `dtype` — its
    sum of exponentials (a relative error u_d: u_d nats of log-sum-exp) and its output (u_d·|lp|) each rounded
    once to it, as torch's bf16 log_softmax does — on fp32-or-better internals (the shift by the max, the sum of
    V exponentials, the log, the subtraction): `u_d·(2|lp| + 2) + u_in·(2|lp| + 2 log2 V + 4)`, times
    ROUNDING_SAFETY. For fp32 log-probs it is ~1e-5 nats near lp = 0: a denominator rounded to bf16 (~4e-3
    nats) in an fp32 record is not within it; bf16 log-probs against fp32 ones are a precision difference
    (the effective dtypes differ), judged by the replay or by dtype."""
    u_d = _unit_roundoff(dtype)
    u_in = min(u_d, _U32)
    a = np.abs(np.asarray(lp, dtype=np.float64))
    return ROUNDING_SAFETY * (u_d * (2.0 * a + 2.0) + u_in * (2.0 * a + 2.0 * math.log2(max(vocab, 2)) + 4.0))


def logprob_inherited(va: CanonicalView, vb: CanonicalView, rows: list[RowId], lp_a: np.ndarray,
                      lp_b: np.ndarray, dtypes: tuple[str | None, str | None],
                      derived: tuple[bool, bool]) -> np.ndarray:
    """Per row (nats): what the logits' A−B difference implies through an exact log-softmax, plus each recorded
    side's clean log-softmax rounding (`logsoftmax_rounding`; a side whose log-probs tic-trace derived from its
    logits adds none). inf for a row whose logits or next token either side lacks."""
    lp_a, lp_b = (np.asarray(x, dtype=np.float64).reshape(-1) for x in (lp_a, lp_b))
    if all(derived):                  # both computed here from the logits in float64: nothing added
        return np.abs(lp_a - lp_b)
    out = np.full(len(rows), math.inf)
    za, zb = va.load("logits", None), vb.load("logits", None)
    if za.values is None or zb.values is None or za.values.shape[1:] != zb.values.shape[1:]:
        return out
    ia, ib = ({r: i for i, r in enumerate(t.rows)} for t in (za, zb))
    vocab = int(za.values.shape[-1])
    want = [(i, ia.get(r), ib.get(r), va.tokens.get((r[0], r[1] + 1))) for i, r in enumerate(rows)]
    ok = [w for w in want if None not in w and 0 <= int(w[3]) < vocab]
    if not ok:
        return out
    at, in_a, in_b, tok = (np.array([int(w[k]) for w in ok], dtype=np.int64) for k in range(4))
    implied = np.abs(next_token_logprobs(za.values, in_a, tok) - next_token_logprobs(zb.values, in_b, tok))
    for lp, dt, der in ((lp_a, dtypes[0], derived[0]), (lp_b, dtypes[1], derived[1])):
        if not der:
            implied = implied + logsoftmax_rounding(lp[at], dt, vocab)
    out[at] = implied
    return out


def norm_feed(va: CanonicalView, vb: CanonicalView, point: str, layer: int | None) -> tuple | None:
    """The one float point both sides record that feeds the norm `point` (its input), or None: another op, a
    per-head norm, or more than one feed (the op's input is then not one recorded tensor)."""
    ps = BY_NAME.get(point)
    if ps is None or ps.op != "rmsnorm" or ps.per_head:
        return None
    present = set(va.entries) & set(vb.entries)
    layers = [x for x in (va.n_layers, vb.n_layers) if x]
    feeds = feeds_of(point, layer, present, min(layers) if layers else None)
    return feeds[0] if len(feeds) == 1 else None


def norm_inherited(va: CanonicalView, vb: CanonicalView, point: str, layer: int | None, rows: list[RowId],
                   out_a: np.ndarray) -> np.ndarray | None:
    """Per row: the relative error the exact norm makes of the inputs' difference, `‖g⊙(x̂_A − x̂_B)‖ /
    ‖g⊙x̂_A‖`, with side A's fitted per-channel gain g (module docstring). inf for a row either side's input
    lacks (or holds NaN/Inf); None where the point is not a norm of one recorded input, or the fit does not
    describe it. Rows are read a block at a time (float64 blocks of at most BLOCK_ELEMS values)."""
    feed = norm_feed(va, vb, point, layer)
    if feed is None:
        return None
    xa, xb = va.load(*feed), vb.load(*feed)
    if xa.values is None or xb.values is None:
        return None
    n = len(rows)
    y = np.asarray(out_a).reshape(n, -1)
    ia, ib = ({r: i for i, r in enumerate(t.rows)} for t in (xa, xb))
    at = np.array([i for i, r in enumerate(rows) if r in ia and r in ib], dtype=np.int64)
    if not at.size or xa.values.shape[1:] != xb.values.shape[1:] or int(np.prod(xa.values.shape[1:])) != y.shape[1]:
        return None
    pa = np.array([ia[rows[i]] for i in at], dtype=np.int64)
    pb = np.array([ib[rows[i]] for i in at], dtype=np.int64)

    def blocks():
        step = max(1, BLOCK_ELEMS // max(y.shape[1], 1))
        for s in range(0, at.size, step):
            sl = slice(s, s + step)
            ha = _normalised(xa.values[pa[sl]].reshape(len(pa[sl]), -1))
            hb = _normalised(xb.values[pb[sl]].reshape(len(pb[sl]), -1))
            yield sl, ha, hb, y[at[sl]].astype(np.float64)
    gain = _fit_gain(blocks)
    if gain is None:
        return None
    out = np.full(n, math.inf)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for sl, ha, hb, _ in blocks():
            num = np.linalg.norm(gain * (ha - hb), axis=1)
            den = np.linalg.norm(gain * ha, axis=1)
            e = np.where(den > 0, num / np.maximum(den, 1e-300), np.where(num > 0, math.inf, 0.0))
            out[at[sl]] = np.where(np.isfinite(ha).all(axis=1) & np.isfinite(hb).all(axis=1), e, math.inf)
    return out


def _normalised(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        return x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + _EPS)


def _fit_gain(blocks) -> np.ndarray | None:
    """The per-channel gain g minimising ‖y − g⊙x̂‖ over the finite rows of `blocks()` (least squares, per
    channel), or None where g⊙x̂ does not reproduce y to NORM_FIT (not an RMSNorm of this input)."""
    hy = hh = None
    for _, h, _, y in blocks():
        fin = np.isfinite(h).all(axis=1) & np.isfinite(y).all(axis=1)
        h, y = h[fin], y[fin]
        hy = (h * y).sum(axis=0) + (0.0 if hy is None else hy)
        hh = (h * h).sum(axis=0) + (0.0 if hh is None else hh)
    if hh is None:
        return None
    gain = np.where(hh > 0, hy / np.maximum(hh, 1e-300), 0.0)
    res = ref = 0.0
    for _, h, _, y in blocks():
        fin = np.isfinite(h).all(axis=1) & np.isfinite(y).all(axis=1)
        res += float(((y[fin] - gain * h[fin]) ** 2).sum())
        ref += float((y[fin] ** 2).sum())
    if ref == 0 or math.sqrt(res) > NORM_FIT * math.sqrt(ref):
        return None
    return gain
