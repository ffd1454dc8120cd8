"""Which log-prob semantics a side's used log-probs follow, fingerprinted on its own traced logits (issue 37).

A side's used log-prob (SGLang's returned `output_token_logprobs`, the trainer's `compute_log_prob`) is a
function of the logits it saw and of what it applied to them. Recomputing it from the side's traced logits
under each known semantics and comparing names the one the side used, like the ops' fingerprints
(replay/variants.py): a match must be clearly better than every other candidate, or the answer is
"ambiguous" (the rows cannot tell the candidates apart) or "none" (no candidate reproduces the side).

The semantics, as SGLang's sampler computes them (`sglang/srt/layers/sampler.py`, `Sampler.forward` and
`top_k_top_p_min_p_sampling_from_probs_torch`, the same in 0.5.15.post1 and 0.5.23):

- `raw`: log-softmax of the logits as they are (SGLang with `SGLANG_RETURN_ORIGINAL_LOGPROB=1`, or a greedy
  batch: "original" log-probs; the trainer with `--rollout-temperature 1`);
- `temperature`: log-softmax of logits / T (SGLang's default return: `torch.log(probs)` with
  `probs = softmax(logits / T)`, the full distribution, *before* top-k/top-p/min-p: "processed" by the
  temperature only; slime's `get_log_probs_and_entropy`: `logits / rollout_temperature`);
- `temperature_bf16`: the same on bf16 logits, bf16 output (SGLang's `--rl-on-policy-target` path:
  `log_softmax(logits.bfloat16().div(T).bfloat16())`);
- filters after the temperature, in SGLang's order, renormalised over the kept tokens: `top_k` (the k most
  probable), `top_p` (sorted descending, a token is kept unless the cumulative probability *before* it is
  > p: `probs_sort[(probs_sum - probs_sort) > top_p] = 0`), `min_p` (kept unless below min_p x the largest
  probability); a renormalised log-prob is `log p_t - log sum(kept p)` (slime's rollout top-p replay on the
  trainer: the keep-mask applied to logits / T before the log-softmax; SGLang 0.5.23's sampling-mask output:
  `log(selected_weight / support_mass)`).

Candidates whose stated parameters make them the same (T = 1, top_p = 1, top_k off) are one candidate, never
a distinction. Ties in the sort follow a stable order; a token at the top-p boundary may fall either way on
a side whose sort or sums round differently: it shows as that row's |Δ|, never hidden.

numpy only (tests/test_architecture.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import combinations
from typing import Sequence

import numpy as np

from ..store.used_logprobs import Sampling

MATCH_TOL = 1e-3       # nats: mean |Δ| under which a candidate reproduces a side (its own rounding is ~1e-6)
SEPARATION = 10.0      # the runner-up's mean |Δ| must be this many times the best's (and over MATCH_TOL)
_BLOCK = 1 << 22       # float64 elements of logits widened at once
_FILTERS = ("top_k", "top_p", "min_p")     # SGLang's order


@dataclass(frozen=True)
class Semantics:
    """One way to turn a logits row into the log-prob of a token. `temperature` None: not divided."""
    temperature: float | None = None
    top_k: int = 0                   # 0: off
    top_p: float = 1.0               # 1: off
    min_p: float = 0.0               # 0: off
    bf16: bool = False               # SGLang's on-policy path: bf16 logits / T, bf16 log-softmax

    @property
    def name(self) -> str:
        parts = ["temperature" if self.temperature is not None else "raw"]
        parts += [f for f in _FILTERS if self._on(f)]
        return "+".join(parts) + ("_bf16" if self.bf16 else "")

    @property
    def filters(self) -> bool:
        """Some of top-k, top-p, min-p is on: the log-prob is renormalised over the kept tokens."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def _on(self, f: str) -> bool:
        return {"top_k": self.top_k > 0, "top_p": self.top_p < 1.0, "min_p": self.min_p > 0.0}[f]

    def describe(self) -> str:
        """A phrase for the report: "after top-p renormalisation at p = 0.9 (logits / T, T = 0.7)"."""
        t = f"logits / T, T = {self.temperature:g}" if self.temperature is not None else "the raw logits, no temperature"
        filt = [("top-k", f"k = {self.top_k}") if f == "top_k" else ("top-p", f"p = {self.top_p:g}") if f == "top_p"
                else ("min-p", f"{self.min_p:g}") for f in _FILTERS if self._on(f)]
        bf = ", in bf16" if self.bf16 else ""
        if len(filt) == 1:
            return f"after {filt[0][0]} renormalisation at {filt[0][1]} ({t}{bf})"
        if filt:
            return f"after {' then '.join(f'{a} at {b}' for a, b in filt)} renormalisation ({t}{bf})"
        return f"over the full distribution ({t}{bf})"

    def to_json(self) -> dict:
        return {"name": self.name, "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "min_p": self.min_p, "bf16": self.bf16, "describe": self.describe()}


def _normal(temperature: float | None, top_k: int | None, top_p: float | None, min_p: float | None,
            vocab: int, bf16: bool = False) -> Semantics:
    """A candidate with its off parameters in one form: T = 1 is no temperature, k >= V no top-k, ..."""
    t = None if temperature is None or float(temperature) == 1.0 else float(temperature)
    k = int(top_k) if top_k is not None and 0 < int(top_k) < vocab else 0
    p = float(top_p) if top_p is not None and float(top_p) < 1.0 else 1.0
    m = float(min_p) if min_p is not None and float(min_p) > 0.0 else 0.0
    return Semantics(t, k, p, m, bf16)


def _filter_on(f: str, v: float | int, vocab: int) -> bool:
    return {"top_k": lambda: 0 < int(v) < vocab, "top_p": lambda: float(v) < 1.0, "min_p": lambda: float(v) > 0.0}[f]()


def candidates(stated: Sequence[Sampling], vocab: int) -> tuple[list[Semantics], list[str]]:
    """The distinct semantics the stated parameters make (each side's own, and the other side's: a side may
    follow the other's), and notes on what could not be tried (a parameter stated as unknown)."""
    out: dict[Semantics, None] = {_normal(None, 0, 1.0, 0.0, vocab): None}
    notes: list[str] = []
    for s in stated:
        temps = [None] + ([s.temperature] if s.temperature is not None else [])
        if s.temperature is None:
            notes.append(f"temperature not stated ({s.source or 'a side'}): scaled candidates not tried")
        on = {"top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p}
        for f in _FILTERS:
            if on[f] is None:
                notes.append(f"{f} not stated ({s.source or 'a side'}): its candidates not tried")
        active = [f for f in _FILTERS if on[f] is not None and _filter_on(f, on[f], vocab)]
        for t in temps:
            out.setdefault(_normal(t, 0, 1.0, 0.0, vocab))
            for n in range(1, len(active) + 1):
                for fs in combinations(active, n):
                    out.setdefault(_normal(t, on["top_k"] if "top_k" in fs else 0,
                                           on["top_p"] if "top_p" in fs else 1.0,
                                           on["min_p"] if "min_p" in fs else 0.0, vocab))
        if s.temperature is not None:
            out.setdefault(_normal(s.temperature, 0, 1.0, 0.0, vocab, bf16=True))
    return list(out), notes


def bf16_round(x: np.ndarray) -> np.ndarray:
    """Round to bfloat16 (nearest even), returned as float64: what `.bfloat16()` keeps of a float32."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    out = r.view(np.float32).astype(np.float64)
    return np.where(np.isfinite(x), out, np.asarray(x, dtype=np.float64))


def recompute(logits: np.ndarray, tokens: np.ndarray, sem: Semantics) -> np.ndarray:
    """The log-prob of each row's token under `sem`, in float64 (-inf: the token is filtered out)."""
    return recompute_many(logits, tokens, [sem])[0]


def recompute_many(logits: np.ndarray, tokens: np.ndarray, sems: Sequence[Semantics]) -> list[np.ndarray]:
    """`recompute` under each of `sems`, sharing each temperature's softmax and sort among its filters (a
    150k vocabulary is sorted once per row and temperature, not once per candidate)."""
    z_all = np.asarray(logits)
    toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if z_all.ndim != 2 or len(z_all) != len(toks):
        raise ValueError(f"logits {z_all.shape} and {len(toks)} tokens: one logits row [V] per token")
    if len(toks) and (toks.min() < 0 or toks.max() >= z_all.shape[1]):
        raise ValueError(f"a token id is outside the logits' vocabulary of {z_all.shape[1]}")
    out = [np.empty(len(toks)) for _ in sems]
    step = max(1, _BLOCK // max(z_all.shape[1], 1))
    for i in range(0, len(toks), step):
        for j, lp in enumerate(_block(z_all[i:i + step], toks[i:i + step], sems)):
            out[j][i:i + step] = lp
    return out


def _block(z_in: np.ndarray, toks: np.ndarray, sems: Sequence[Semantics]) -> list[np.ndarray]:
    rows = np.arange(len(toks))
    out: list[np.ndarray | None] = [None] * len(sems)
    for t in dict.fromkeys(s.temperature for s in sems if not s.bf16):
        z = np.asarray(z_in, dtype=np.float64)
        z = z / t if t is not None else z
        lse = _logsumexp(z)
        lp = z[rows, toks] - lse[:, 0]
        filters = [j for j, s in enumerate(sems) if s.temperature == t and not s.bf16 and s.filters]
        sorted_p = _sorted_probs(np.exp(z - lse), toks) if filters else None
        for j, s in enumerate(sems):
            if s.temperature == t and not s.bf16:
                out[j] = _filtered_lp(lp, s, *sorted_p) if j in filters else lp
    for j, s in enumerate(sems):
        if s.bf16:
            z = bf16_round(bf16_round(z_in) / (s.temperature or 1.0))
            out[j] = bf16_round((z - _logsumexp(z))[rows, toks])
    return out


def _logsumexp(z: np.ndarray) -> np.ndarray:
    m = np.max(z, axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    return m + np.log(np.sum(np.exp(z - m), axis=1, keepdims=True))


def _sorted_probs(p: np.ndarray, toks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row's probabilities sorted descending, their running sums, and the token's rank in that order
    (ties in vocabulary order, as a stable sort puts them)."""
    ps = -np.sort(-p, axis=1)
    pt = p[np.arange(len(toks)), toks][:, None]
    rank = (p > pt).sum(axis=1) + ((p == pt) & (np.arange(p.shape[1])[None, :] < toks[:, None])).sum(axis=1)
    return ps, np.cumsum(ps, axis=1), rank


def _filtered_lp(lp: np.ndarray, sem: Semantics, ps: np.ndarray, cum: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """SGLang's kept tokens (`top_k_top_p_min_p_sampling_from_probs_torch`) are a prefix of the sorted order:
    rank < k; the cumulative probability before the token <= p (`(probs_sum - probs_sort) > top_p` is
    dropped); probability >= min_p x the largest (`probs_sort < min_p_thresholds` dropped). The log-prob is
    renormalised over that prefix; a token outside it is -inf."""
    n = np.full(len(lp), ps.shape[1])
    if sem.top_k:
        n = np.minimum(n, sem.top_k)
    if sem.top_p < 1.0:
        n = np.minimum(n, ((cum - ps) <= sem.top_p).sum(axis=1))
    if sem.min_p > 0.0:
        n = np.minimum(n, (ps >= ps[:, :1] * sem.min_p).sum(axis=1))
    n = np.maximum(n, 1)
    mass = cum[np.arange(len(lp)), n - 1]
    return np.where(rank < n, lp - np.log(mass), -math.inf)


@dataclass
class Fit:
    """How well one candidate reproduces a side's used log-probs on the measured rows (nats)."""
    semantics: Semantics
    mean: float
    max: float
    worst: int                       # index of the row of largest |Δ|

    def to_json(self) -> dict:
        return {**self.semantics.to_json(), "mean_abs": self.mean, "max_abs": self.max}


@dataclass
class SemanticsMatch:
    """The fingerprint of one side: the semantics its used log-probs follow, and how clearly."""
    side: str
    verdict: str                     # match | ambiguous | none | not_measured
    best: Fit | None
    runner_up: Fit | None
    fits: list[Fit] = field(default_factory=list)
    rows: int = 0                    # rows measured (used log-prob with a traced logits row)
    missing: int = 0                 # used log-probs without a traced logits row: not measured
    tol: float = MATCH_TOL
    notes: list[str] = field(default_factory=list)
    # the temperatures the side's own requests state (T = 1 as None): a match at another says so
    stated_temperatures: tuple = ()

    @property
    def semantics(self) -> Semantics | None:
        """The semantics the split uses for this side: the match, else the closest (said in `summary`)."""
        return self.best.semantics if self.best else None

    @property
    def summary(self) -> str:
        b, r = self.best, self.runner_up
        if b is None:
            return f"{self.side}: not measured ({self.missing} used log-probs, none with a traced logits row)"
        head = (f"{self.side}'s log-probs are {b.semantics.describe()}: mean |Δ| {b.mean:.2g}, max {b.max:.2g} "
                f"nats on {self.rows} rows")
        other = f"; next best {r.semantics.name} mean {r.mean:.2g}, max {r.max:.2g}" if r else ""
        if self.verdict == "match":
            return head + self._against_stated() + other
        if self.verdict == "ambiguous":
            return (f"{self.side}: ambiguous between {b.semantics.name} (mean |Δ| {b.mean:.2g}) and "
                    f"{r.semantics.name} (mean {r.mean:.2g}): these rows do not tell them apart")
        return (f"{self.side}'s log-probs match no known semantics: the closest, {b.semantics.name}, is off by "
                f"mean {b.mean:.2g}, max {b.max:.2g} nats (over {self.tol:g})")

    def _against_stated(self) -> str:
        """ ", though it states T = 0.9" where the matched temperature is none its requests state."""
        temps = self.stated_temperatures
        if not temps or self.best is None or self.best.semantics.temperature in temps:
            return ""
        said = ", ".join("1" if t is None else f"{t:g}" for t in temps)
        return f", though it states T = {said}"

    def to_json(self) -> dict:
        return {"side": self.side, "verdict": self.verdict, "summary": self.summary, "rows": self.rows,
                "missing": self.missing, "tol": self.tol, "best": self.best.to_json() if self.best else None,
                "runner_up": self.runner_up.to_json() if self.runner_up else None,
                "candidates": [f.to_json() for f in self.fits], "notes": list(self.notes)}


def fingerprint(side: str, logits: np.ndarray, tokens: np.ndarray, used: np.ndarray,
                stated: Sequence[Sampling], *, missing: int = 0, tol: float = MATCH_TOL) -> SemanticsMatch:
    """Name the semantics that `used` (one log-prob per row) follows, recomputed from this side's own traced
    `logits` rows (row i: the logits the side computed for `tokens[i]`) under every candidate the `stated`
    sampling parameters make (this side's and the other's). `missing`: used log-probs without a logits row."""
    z = np.asarray(logits)
    used = np.asarray(used, dtype=np.float64).reshape(-1)
    if len(used) == 0:
        return SemanticsMatch(side, "not_measured", None, None, missing=missing, tol=tol)
    cands, notes = candidates(stated, int(z.shape[1]))
    fits = []
    for sem, lp in zip(cands, recompute_many(z, tokens, cands)):
        d = np.abs(lp - used)
        d = np.where(np.isnan(d), math.inf, d)
        fits.append(Fit(sem, float(np.mean(d)), float(np.max(d)), int(np.argmax(d))))
    fits.sort(key=lambda f: (f.mean, f.max))
    best, runner = fits[0], (fits[1] if len(fits) > 1 else None)
    if not best.mean <= tol:
        verdict = "none"
    elif runner is not None and runner.mean <= max(tol, SEPARATION * best.mean):
        verdict = "ambiguous"
    else:
        verdict = "match"
    return SemanticsMatch(side, verdict, best, runner, fits, len(used), missing, tol, notes)
