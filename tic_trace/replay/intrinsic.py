"""Intrinsic error: how far one side's output of an op is from the exact op applied to that side's own inputs.

For every canonical point a side recorded, `replay_side` loads the point and the points that feed it (from
the same side), recomputes the op in float64 (`reference.ExactReference`) and measures the recorded output
against it in the side's own dtype: mean and max ULP, the share of elements equal to the correctly rounded
exact value, and relative L2. Unlike A-B, this error does not inherit upstream noise, and it names a side.
The rule that turns two sides' numbers into a verdict is `intrinsic_verdict.intrinsic_verdict`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch

from ..graph.canonical import BY_NAME, key_name, order_key
from ..store.dtypes import dtype_info, known_dtype
from ..view.align import CanonicalTensor, CanonicalView
from .grid import (effective_dtype, grid_spacing, round_to, row_relative_excess,  # noqa: F401 - public here too
                   row_relative_excess_sq, row_sq)
from .exact_model import feed_key
from .reference import ExactReference, NotReplayable
from .replay_rows import EVERYTHING, Sample
from .variant_fit import fingerprint, frame, run_variants, undeclared_layouts
from .fact_variants import FACT_VARIANTS
from .variants import DTYPES, VARIANTS, VariantInput, tp_degrees, variant_rows

# attention's every key/value row: not row-selected (and a family's own, `Family.kv_points`)
_KV_FEEDS = ("attn.k_rope", "attn.v", "__kv_rows__")
#: Norms a fused add + norm feeds with the residual sum (the trace's `fused_add_norm_fp32` says it reads the
#: unrounded sum of the addends: _unrounded_sum).
SUM_NORMS = ("attn_norm", "mlp_norm", "final_norm")

RowId = tuple[str, int]
DERIVED = "derived by tic-trace from the logits in float64, not computed by the side"


@dataclass(frozen=True)
class IntrinsicError:
    """One side's output at one point against the exact op on that side's own inputs."""
    point: str
    layer: int | None
    dtype: str                 # the dtype the side computed this point's output in: ULPs are of this dtype
    rows: int
    numel: int
    mean_ulp: float            # float points: mean |y - exact| / ulp(exact); ids points: 0
    max_ulp: float
    share_rounded: float       # share of elements equal to the correctly rounded exact value (ids: rows equal)
    rel_l2: float              # ||y - exact|| / ||exact||
    rel_floor: float = 0.0     # rel L2 of the correctly rounded exact value: the error no output in `dtype` avoids
    scale_err: float = 0.0     # RMS over rows of the error's component along the exact row, (e.r)/(r.r)
    scale_floor: float = 0.0   # the same for the correctly rounded exact value
    head_scale_err: float = 0.0    # the same over (row, head) segments of a per-head point (0: not per head)
    head_scale_floor: float = 0.0  # the same for the correctly rounded exact value
    nonfinite: int = 0         # elements non-finite in y but not in the exact value
    kind: str = "float"        # canonical PointSpec.kind
    recorded_dtype: str = ""   # the dtype of the record, when wider than `dtype` (fp32 holding bf16 values)
    op: str = ""               # the op replayed where the point's op depends on the model (reference.op_of)
    # The clean variants on this side's inputs and the fingerprint (variants.py; 0 / "": none ran, old reports)
    clean_excess: float = 0.0  # worst excess of the clean variants on these inputs: the point's envelope
    clean_worst: str = ""      # which clean variant that is
    match: str = ""            # the variant (clean or a known fault) that reproduces this side's output best
    match_what: str = ""       # that variant in words
    match_kind: str = ""       # "clean" | "fault" | "none" (no variant reproduces it)
    match_equal: float = 0.0   # share of this side's elements bit-equal to that variant's
    match_dist: float = 0.0    # this side's distance from it, in units of the rounding floor
    clean_dist: float = 0.0    # this side's distance from the nearest clean variant, same units
    row_excess: float = 0.0    # the excess measured per row against its own floor, RMS over rows
                               # (grid.row_relative_excess; 0: not measured, old reports)
    match_layout: str = ""     # the match is a clean variant at a TP layout the trace does not declare:
                               # the layout the trace declares ("TP 1"); the side is named, not blamed
    sampled_excess: float = 0.0  # this side's excess on the rows its variants ran on, where those are a subset
                                 # (over VARIANT_ROWS rows): carries the envelope to all rows (Margins.limit_of)
    rows_total: int = 0        # the rows this side has at the point, where only `rows` of them were replayed
                               # (the finder's sample, replay_rows.py; 0: every row)
    columns: int = 0           # the columns replayed of a wide point's rows (the logits' vocabulary; 0: all)
    columns_total: int = 0     # of that many

    @property
    def excess(self) -> float:
        """The error in units of the unavoidable rounding error: 1.0 = correctly rounded, ~1.4 = two roundings.
        Row-relative where measured (`row_excess`), else rel_l2 / rel_floor over all elements."""
        if self.kind == "ids":
            return 1.0 if self.rel_l2 == 0 else math.inf
        if self.row_excess > 0:
            return self.row_excess
        if self.rel_floor > 0:
            return self.rel_l2 / self.rel_floor
        return 1.0 if self.rel_l2 == 0 else math.inf

    @property
    def envelope_key(self) -> str:
        """The key of the clean envelope that applies (intrinsic_verdict.ENVELOPE): the op, else the point."""
        return self.op or self.point

    @property
    def head_scale_excess(self) -> float:
        """head_scale_err in units of the correctly rounded value's (0: no head segments). Diagnostic only:
        it does not separate a bf16 softmax from clean eager attention (docs/replay.md)."""
        return self.head_scale_err / self.head_scale_floor if self.head_scale_floor > 0 else 0.0

    @property
    def key(self) -> str:
        return key_name(self.point, self.layer)

    @property
    def stderr_ulp(self) -> float:
        """Standard error of mean_ulp, taking per-element ULP errors as roughly uniform on [0, max]: a
        conservative bound used only to keep tiny samples from deciding a verdict."""
        return self.max_ulp / math.sqrt(12 * max(self.numel, 1))


@dataclass(frozen=True)
class NotReplayed:
    point: str
    layer: int | None
    reason: str

    @property
    def key(self) -> str:
        return key_name(self.point, self.layer)


def intrinsic_error(point: str, layer: int | None, y: np.ndarray, exact: np.ndarray, dtype: str,
                    head_dim: int | None = None, op: str = "") -> IntrinsicError:
    """Measure a side's recorded output `y` against the exact values (float64), in ULPs of `dtype`; with
    `head_dim`, also the scale error per (row, head) segment of that length."""
    kind = BY_NAME[point].kind if point in BY_NAME else "float"
    n = y.shape[0] if y.ndim else 1
    y2 = np.asarray(y.reshape(n, -1), dtype=np.float64)         # no copy where already float64: read only
    r2 = np.asarray(exact.reshape(n, -1), dtype=np.float64)
    if kind == "ids":
        same = (y2 == r2).all(axis=1)
        share = float(same.mean()) if n else 1.0
        return IntrinsicError(point, layer, dtype, n, int(y2.size), mean_ulp=0.0, max_ulp=0.0, share_rounded=share,
                              rel_l2=1.0 - share, kind=kind)
    if not (known_dtype(dtype) and dtype_info(dtype).is_float):
        dtype = "float32"
    recorded, dtype = dtype, effective_dtype(y2, dtype)
    fin = np.isfinite(r2)
    bad = fin & ~np.isfinite(y2)
    ok = fin & ~bad
    if ok.all():        # the usual case, without the masked copies (the same numbers: every where() is a no-op)
        d = y2 - r2
        sp = grid_spacing(r2, dtype)
        ulps = np.abs(d) / sp
        rr = np.rint(r2 / sp) * sp                                  # round_to(r2, dtype), sp computed once
        rounded = y2 == rr
        r0, f0 = r2, rr - r2
    else:
        d = np.where(ok, y2 - r2, 0.0)
        ulps = np.abs(d) / grid_spacing(np.where(ok, r2, 1.0), dtype)
        rr = round_to(np.where(fin, r2, 0.0), dtype)
        rounded = (y2 == rr) & ok
        r0, f0 = np.where(ok, r2, 0.0), np.where(ok, rr - r2, 0.0)     # the exact value; the rounding floor's error
    dd, ff, rr2 = row_sq(d), row_sq(f0), row_sq(r0)      # per row, one pass each: every norm below reads them
    nf, nr, nd = (float(np.sqrt(v.sum())) for v in (ff, rr2, dd))
    m = int(ok.sum())
    scale_err, scale_floor = _row_scales(r0, rr2, d, f0)
    head_err, head_floor = _head_scales(r0, head_dim, d, f0)
    return IntrinsicError(
        point, layer, dtype, n, m,
        mean_ulp=_masked(ulps, ok, m, np.mean), max_ulp=_masked(ulps, ok, m, np.max),
        share_rounded=float(rounded.sum() / m) if m else 1.0,
        rel_l2=nd / nr if nr > 0 else (0.0 if nd == 0 else math.inf), rel_floor=nf / nr if nr > 0 else 0.0,
        scale_err=scale_err, scale_floor=scale_floor, head_scale_err=head_err, head_scale_floor=head_floor,
        nonfinite=int(bad.sum()), kind=kind, recorded_dtype=recorded if recorded != dtype else "", op=op,
        row_excess=row_relative_excess_sq(dd, ff, d.shape[1]))


def _masked(a: np.ndarray, ok: np.ndarray, m: int, fn) -> float:
    """fn over the elements of `a` where `ok` (0.0 when none), without the masked copy when all are."""
    if not m:
        return 0.0
    return float(fn(a.reshape(-1) if m == a.size else a[ok]))


def _row_scales(r: np.ndarray, rr: np.ndarray, *ds: np.ndarray) -> tuple[float, ...]:
    """For each d: RMS over rows of its projection on the exact row r (`rr`: r's rows' squared norms). A per-row
    scale error (a normalisation's denominator rounded, e.g.) shows here at full size, independent rounding
    noise only at ~1/sqrt(row length)."""
    ok = rr > 0
    if not ok.any():
        return tuple(0.0 for _ in ds)
    full = bool(ok.all())
    out = []
    for d in ds:
        s = np.einsum("ij,ij->i", d, r) if full else np.einsum("ij,ij->i", d[ok], r[ok])
        s = s / (rr if full else rr[ok])
        out.append(float(np.sqrt((s * s).mean())))
    return tuple(out)


def _head_scales(r: np.ndarray, head_dim: int | None, *ds: np.ndarray) -> tuple[float, ...]:
    """`_row_scales` over (row, head) segments of head-major rows [n, heads*head_dim]: a scale error shared
    by one head's outputs (a softmax normaliser rounded, e.g.) shows at full size; 0 without head segments."""
    if not head_dim or r.shape[1] % head_dim:
        return tuple(0.0 for _ in ds)
    rh = r.reshape(-1, head_dim)
    return _row_scales(rh, row_sq(rh), *(d.reshape(-1, head_dim) for d in ds))


# ---------------------------------------------------------------- replaying one side

class SideReplayer:
    """Replays the points of one side (a CanonicalView) against the exact reference, loading each point of
    the current layer once; memory stays O(one layer's points)."""

    def __init__(self, view: CanonicalView, reference: ExactReference):
        self.view = view
        # this side's weights: the checkpoint's rounded to the dtypes this side held them in
        self.ref = reference.for_view(view)
        self._cache: dict[tuple[str, int | None], CanonicalTensor] = {}
        self._layer: object = object()
        self.present = set(view.points())
        # The side's own trace says whether it ran QK-norm (it recorded attn.q_norm): RoPE reads what the side
        # computed, whatever tensor the checkpoint lacks.
        self.has_qk_norm = reference.has_qk_norm or any(p == "attn.q_norm" for p, _ in self.present)
        self.tp = tp_degrees(view.trace.manifest)    # the row-parallel shard counts its clean variants try
        self.kv_feeds = (*_KV_FEEDS, *self.ref.family.kv_points)

    def _load(self, point: str, layer: int | None) -> CanonicalTensor:
        key = (point, layer)
        if key not in self._cache:
            self._cache[key] = self.view.load(point, layer)
        return self._cache[key]

    def _enter(self, layer: int | None) -> None:
        if layer != self._layer:      # keep the previous layer's output: the next layer's input reads it
            prev = self._layer
            self._cache = {k: v for k, v in self._cache.items()
                           if k[1] == layer or k == ("output", prev) or k == ("embed", None)}
            self._layer = layer

    def _feed_key(self, feed: str, layer: int | None) -> tuple[str, int | None]:
        return feed_key(feed, layer, self.view.n_layers)

    def replay(self, point: str, layer: int | None, sample: Sample = EVERYTHING) -> IntrinsicError | NotReplayed:
        """This side's point against the exact op, on the rows (and columns) of `sample` it has (the finder's:
        replay_rows.py; every row by default)."""
        self._enter(layer)
        if self.derived(point, layer):
            return NotReplayed(point, layer, DERIVED)
        out = self.recorded(point, layer)
        if sample.columns is not None and not (out is not None and out.values.ndim == 2
                                               and out.values.shape[1] == sample.columns_total):
            sample = dataclasses.replace(sample, columns=None)      # this side's rows are another width
        try:
            with self.ref.vocab_entries(sample.columns):
                return self._replay(point, layer, sample)
        except NotReplayable as e:
            return NotReplayed(point, layer, str(e))

    def _replay(self, point: str, layer: int | None, sample: Sample) -> IntrinsicError:
        rows, y, exact, dtype, x, (rows_total, columns) = self._exact(point, layer, sample)
        op = self.ref.op_of(point, layer)
        err = intrinsic_error(point, layer, y, exact, judged_dtype(op, dtype, self.view.config.get("dtype"),
                                                                   self.ref.family.judged_in_compute),
                              head_dim=self.ref.spec.head_dim if BY_NAME[point].per_head else None, op=op)
        if rows_total or columns:
            err = dataclasses.replace(err, rows_total=rows_total, columns=columns,
                                      columns_total=sample.columns_total if columns else 0)
        return self._with_variants(err, layer, x, rows, y, exact)

    def derived(self, point: str, layer: int | None) -> bool:
        """Log-probs the view derives from the logits (the side recorded none): nothing of the side to replay,
        said without computing them (a float64 log-softmax over every row's vocabulary)."""
        return point == "logprobs" and (point, layer) not in self.view.entries

    def recorded(self, point: str, layer: int | None) -> CanonicalTensor | None:
        """This side's record of (point, layer) where it holds values (loaded once: its replay reads it again)."""
        if (point, layer) not in self.present:
            return None
        t = self._load(point, layer)
        return t if t.values is not None else None

    def exact_pair(self, point: str, layer: int | None) -> tuple[list[RowId], np.ndarray, np.ndarray, str]:
        """(rows, this side's output at them, the exact op on this side's own inputs, the output's dtype):
        the output shaped like the exact value. Raises NotReplayable with the reason."""
        return self._exact(point, layer)[:4]

    def _exact(self, point: str, layer: int | None,
               sample: Sample = EVERYTHING) -> tuple[list[RowId], np.ndarray, np.ndarray, str, dict, tuple]:
        """exact_pair, the side's inputs as the exact op read them (float64 tensors by feed name), and what of
        the point `sample` kept: (rows it had where fewer were kept, else 0; columns kept, else 0)."""
        self._enter(layer)
        self._check_not_rank_partials(point, layer)
        out = self._load(point, layer)
        if out.values is None:
            raise NotReplayable("no values recorded (stats only)")
        if point == "logprobs" and all(s.endswith("(log_softmax)") for s in out.sources):
            raise NotReplayable(DERIVED)
        feeds = {}
        for f in self.ref.inputs_of(point, self.has_qk_norm, layer):
            k = self._feed_key(f, layer)
            if k not in self.present and f in self.ref.family.optional_inputs.get(point, ()):
                continue
            if k not in self.present:
                raise NotReplayable(f"input {key_name(*k)} not recorded")
            feeds[k[0] if f[0] != "<" else f] = t = self._load(*k)
            if t.values is None:
                raise NotReplayable(f"input {key_name(*k)} has no values recorded (stats only)")
            if point in SUM_NORMS and self.view.config.get("fused_add_norm_fp32"):
                feeds[k[0] if f[0] != "<" else f] = self._unrounded_sum(t, k)
        # Attention reads every earlier key/value row of a sample, not the query's row: those are gathered apart.
        aligned = {f: t for f, t in feeds.items() if point != "attn.core" or f not in self.kv_feeds}
        rows, idx = _common_rows(out, list(aligned.values()))
        rows, idx, rows_total = sample.keep(rows, idx)
        if not rows:
            raise NotReplayable("no row recorded in both the point and its inputs"
                                + (" among the rows replayed" if rows_total else ""))
        dev = self.ref.device
        x = {f: _tensor(t.values[idx[i + 1]], dev) for i, (f, t) in enumerate(aligned.items())}
        if point == "attn.core":
            own = self.ref.family.kv_rows(feeds, _common_rows, lambda a: _tensor(a, dev))
            x.update(own if own is not None else _kv_feeds(
                *(feeds[f] for f in _KV_FEEDS if f in feeds), dev, names=[f for f in _KV_FEEDS if f in feeds]))
        try:
            exact = self.ref.compute(point, layer, x, rows, self.view.tokens).cpu().numpy()
        except (RuntimeError, ValueError) as e:    # the side's inputs do not fit the checkpoint's op
            raise NotReplayable(f"the exact op does not accept this side's inputs ({type(e).__name__}: "
                                f"{str(e)[:160]}): the side computes another op than the checkpoint's config "
                                "says") from None
        if not np.isfinite(exact).all():
            raise NotReplayable(self._nonfinite_reason(exact, x))
        y, columns = out.values[idx[0]], 0
        if sample.columns is not None:          # replay() checked this side's width
            y, columns = y[:, sample.columns], len(sample.columns)
        if y.size != exact.size:
            raise NotReplayable(f"this side's output has {list(y.shape[1:])} per row where the checkpoint's "
                                f"config gives {list(exact.shape[1:])}: the side computes another op (another "
                                "top-k, head count or size)")
        return rows, y.reshape(exact.shape), exact, out.dtype, x, (rows_total, columns)

    def _with_variants(self, err: IntrinsicError, layer, x: dict, rows: list, y: np.ndarray,
                       exact: np.ndarray) -> IntrinsicError:
        """The clean variants and known faults of the op, on (at most VARIANT_ROWS of) this side's own
        inputs: the point's envelope and this side's fingerprint (variants.py). 16-bit outputs only."""
        key = err.envelope_key
        variants = self.ref.family.variants().get(key) or FACT_VARIANTS.get(key) or VARIANTS.get(key)
        if err.dtype not in DTYPES or err.kind != "float" or not variants:
            return err
        # an op over each sample's earlier rows (the linear attention's) runs on all of them, not a subset
        whole = err.envelope_key in self.ref.family.whole_sample_ops
        sel = list(range(len(rows))) if whole else variant_rows(len(rows))
        t = torch.tensor(sel, device=self.ref.device)
        feeds = x if len(sel) == len(rows) else {f: (v[t] if isinstance(v, torch.Tensor) and f not in self.kv_feeds
                                                     else v) for f, v in x.items()}
        vin = VariantInput(self.ref, layer, feeds, [rows[i] for i in sel], DTYPES[err.dtype], self.tp, point=err.point)
        fr = frame(y[sel], exact[sel], err.dtype)
        results = run_variants(err.envelope_key, vin, fr, variants)
        fp = fingerprint(results)
        if fp.match_kind != "clean":    # not what the trace declares: is it a clean implementation it does not say?
            results += undeclared_layouts(err.envelope_key, vin, fr, variants)
            results += self._fused_sum_results(err, layer, [rows[i] for i in sel], vin, fr, variants)
            fp = fingerprint(results)
        if not fp.match:
            return err
        sampled = fr.side_excess() if len(sel) < len(rows) else 0.0    # fr is set: a variant was measured
        return dataclasses.replace(err, **dataclasses.asdict(fp), sampled_excess=sampled)

    def _fused_sum_results(self, err: IntrinsicError, layer, rows: list, vin: VariantInput, fr, variants) -> list:
        """A residual norm's clean variants on the *unrounded* sum of the residual's two addends, for a side
        whose trace does not say it fuses the add into the norm (SGLang's `RMSNorm(x, residual)` says it:
        `fused_add_norm_fp32`, and is then replayed on that sum): they may name the side, never widen its
        envelope. Empty where the point is no residual norm or an addend was not recorded."""
        if err.point not in SUM_NORMS or self.view.config.get("fused_add_norm_fp32"):
            return []
        feed = self.ref.inputs_of(err.point, self.has_qk_norm, layer)
        k = self._feed_key(feed[0], layer) if len(feed) == 1 else None
        if k is None or k not in self.present:
            return []
        t = self._load(*k)
        u = self._unrounded_sum(t, k)
        at = {r: i for i, r in enumerate(u.rows)}
        if u is t or u.values is None or any(r not in at for r in rows):
            return []
        x = _tensor(u.values[[at[r] for r in rows]], self.ref.device)
        vin2 = dataclasses.replace(vin, feeds={k[0] if feed[0][0] != "<" else feed[0]: x})
        out = run_variants(err.envelope_key, vin2, fr, [v for v in variants if v.clean], envelope=False,
                           says="an unfused residual add")
        return [dataclasses.replace(r, name=f"fused_add_{r.name}", what=f"residual add fused into the norm ({r.what})")
                for r in out]

    def _check_not_rank_partials(self, point: str, layer: int | None) -> None:
        """A MoE block's output that is the sum over TP ranks of each rank's own (experts + shared) partial
        (SGLang's blocks at TP > 1: `tp_partial`, whether the block or the next norm all-reduces it) went
        through per-rank roundings the canonical view does not hold (it holds the merged experts and shared
        outputs): no exact op on the side's own inputs reproduces it, so it is said, not judged by the replay."""
        tp = int(self.view.config.get("tensor_model_parallel_size") or 1)
        partial = (self.view.config.get("tp_partial") or {}).get(point) or []
        if point == "mlp.out" and tp > 1 and layer in partial and self.ref.spec.at_layer(layer).num_experts:
            raise NotReplayable(f"the MoE block's output at TP {tp} is a sum over the ranks of each one's (experts "
                                "+ shared) partial, rounded per rank: its addends are not in the trace")

    def _unrounded_sum(self, recorded: CanonicalTensor, key: tuple[str, int | None]) -> CanonicalTensor:
        """A residual sum as a fused add + norm reads it: the exact sum of the two addends the residual stream
        adds there (the reference's own inputs of that point), not its copy rounded to the stream's dtype
        (SGLang's RMSNorm(x, residual) adds in fp32, normalises that, and stores the residual rounded). The
        recorded sum where an addend is not recorded (layer 0's input is the embedding: no sum)."""
        if key[0] == "input" and key[1]:            # a layer's input is the stream leaving the layer before
            key = ("output", key[1] - 1)
        names = self.ref.inputs_of(key[0], self.has_qk_norm, key[1]) if key[0] in ("mid", "output") else ()
        parts = [self._load(*self._feed_key(a, key[1])) for a in names
                 if self._feed_key(a, key[1]) in self.present]
        if len(names) != 2 or len(parts) != 2 or any(t.values is None for t in parts):
            return recorded
        rows, idx = _common_rows(recorded, parts)
        # each addend as the norm received it, in its dtype: a TP partial sum merged here in float is the
        # engine's all-reduced tensor, rounded (a no-op for an addend recorded whole)
        a, b = (round_to(np.asarray(t.values[i], dtype=np.float64), t.dtype) if t.dtype in DTYPES
                else np.asarray(t.values[i], dtype=np.float64) for t, i in zip(parts, idx[1:]))
        total = a + b
        return dataclasses.replace(recorded, rows=rows, values=total.reshape((len(rows),) + recorded.values.shape[1:]))

    def _nonfinite_reason(self, exact: np.ndarray, feeds: dict) -> str:
        """Why the exact op is non-finite: a tensor of the checkpoint, this side's own inputs, or the config.
        Measuring against it would count every such element as "correctly rounded"."""
        n, m = int((~np.isfinite(exact)).sum()), int(exact.size)
        head = f"the exact op is non-finite at {n} of {m} element(s)"
        weights = self.ref.nonfinite_weights()
        if weights:
            return f"{head}: {'; '.join(weights)} (fix or replace the checkpoint)"
        bad = [f for f, t in feeds.items() if isinstance(t, torch.Tensor) and not bool(torch.isfinite(t).all())]
        if bad:
            return f"{head}: this side's recorded input(s) {', '.join(bad)} hold NaN/Inf (judged where they first appear)"
        return f"{head}: the checkpoint's config (rms_norm_eps, RoPE) or weights overflow float64 here"

    def replay_all(self, layers: Iterable[int] | None = None) -> list[IntrinsicError | NotReplayed]:
        keep = set(layers) if layers is not None else None
        return [self.replay(p, lay) for p, lay in self.view.points()
                if keep is None or lay in keep]


def judged_dtype(op: str, recorded: str, compute: str | None, in_compute: frozenset = frozenset()) -> str:
    """The dtype a point is judged in. An op of `in_compute` (a family's `judged_in_compute`: logits soft-capped
    in fp32 from a 16-bit lm_head GEMM, as SGLang's LogitsProcessor does) recorded in fp32 is fp32 values off the
    16-bit grid whose precision is the GEMM's: judged in fp32 ULPs every clean run would be blamed."""
    if op in in_compute and recorded == "float32" and compute in DTYPES:
        return compute
    return recorded


def _common_rows(out: CanonicalTensor, feeds: list[CanonicalTensor]) -> tuple[list[RowId], list[list[int]]]:
    """Rows of `out` present in every feed, in `out`'s order, with each tensor's index of them."""
    if all(t.rows == out.rows for t in feeds):     # the usual case: every feed recorded the same rows
        return list(out.rows), [list(range(len(out.rows)))] * (len(feeds) + 1)
    where = [{r: i for i, r in enumerate(t.rows)} for t in feeds]
    rows, idx = [], [[] for _ in range(len(feeds) + 1)]
    for i, r in enumerate(out.rows):
        js = [w.get(r) for w in where]
        if any(j is None for j in js):
            continue
        rows.append(r)
        idx[0].append(i)
        for n, j in enumerate(js):
            idx[n + 1].append(j)
    return rows, idx


def _tensor(a: np.ndarray, dev: str) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, dtype=np.float64)).to(dev)


def _kv_feeds(k: CanonicalTensor, v: CanonicalTensor, dev: str, names=("attn.k_rope", "attn.v")) -> dict:
    """Every recorded key/value row (all passes), for attention over a sample's earlier positions."""
    if k.values is None or v.values is None:
        raise NotReplayable(f"{' or '.join(names)} has no values")
    rows, idx = _common_rows(k, [v])
    kt, vt = _tensor(k.values[idx[0]], dev), _tensor(v.values[idx[1]], dev)
    return {names[0]: kt, names[1]: vt, "__kv_rows__": {r: i for i, r in enumerate(rows)}}


def replay_side(view: CanonicalView | str, reference: ExactReference,
                layers: Iterable[int] | None = None) -> list[IntrinsicError | NotReplayed]:
    """Every point of one trace against the exact reference, in dataflow order (the checkpoint checked first:
    `contract.check_reference`)."""
    from ..compare.contract import check_reference
    v = view if isinstance(view, CanonicalView) else CanonicalView(view)
    check_reference(reference.ckpt, {"the trace": v})     # raises ReferenceMismatch: not this trace's model
    out = SideReplayer(v, reference).replay_all(layers)
    return sorted(out, key=lambda r: order_key(r.point, r.layer))
