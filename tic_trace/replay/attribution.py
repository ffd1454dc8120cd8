"""Which difference explains how much of the log-prob gap: first-order attribution through the exact model.

For side X and canonical point p, the local error e_X,p is X's output at p minus the exact op applied to X's
own recorded inputs (the replay's `SideReplayer.exact_pair`). To first order, X's log-probs differ from the
exact model's by sum_p <g_p, e_X,p>, with g_p the gradient of the log-prob at p on the exact trajectory
(`exact_model`). With s_t the sign of the measured Δ logprob_t = lp_B,t - lp_A,t and the objective
sum_t s_t lp_t, the gap G = sum_t |Δ logprob_t| is then explained by

    c_p = <g_p, e_B,p - e_A,p>           (per point; per side <g_p, e_B,p> and <g_p, e_A,p>)

plus, for tokens whose top-k expert set differs between the sides (not a small perturbation), a routing term
per layer: the layer's exact MoE with B's choice minus with A's, at the exact inputs. `explained` = sum c / G
is the self-check: what first order, the canonical points and the rows attributed do not cover is the
residual, and the report says why when it is large. The method and its limits: docs/attribution.md.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable

import numpy as np
import torch

from ..graph.canonical import BY_NAME, EXPERT_IDS, LOGPROBS, is_ids, key_name, order_key
from ..view.align import CanonicalView, common_points
from .exact_model import ExactRun, backward, run_exact
from .grid import effective_dtype, round_to
from .clean_noise import clean_noise
from .intrinsic import SideReplayer
from .reference import F64, ExactReference, NotReplayable

RowId = tuple[str, int]
Key = tuple[str, "int | None"]

# A point whose share of the gap reaches this is significant: the report leads with the first such point in
# dataflow order. Half would make "the" cause unique but hide two equal causes; a quarter names at most four.
SIGNIFICANT_SHARE = 0.25
EXPLAINED_ENOUGH = 0.8        # below (or above 1/this), the report says the first-order account is incomplete
DEFAULT_TOKENS = 1024         # tokens run through the exact model's backward (worst samples first)
TOP = 5                       # top contributors shown beside the answer
# Where first order does not hold at all, the shares are not reported as shares (`Attribution.withheld`): the
# sum of the point terms outside [1/2, 2] of the gap, or one point's term over 4x the gap (huge terms that
# cancel: e.g. an fp32 RoPE position offset, a large rotation of q and k that attention, relative in positions,
# almost undoes: terms of 1e5x a gap of 3e-6). Between 80-125% and these bounds the shares stand, with a note.
WITHHOLD_EXPLAINED = (0.5, 2.0)
WITHHOLD_SHARE = 4.0
# What is credited to a finding beyond its own measured term, said with every answer (docs/attribution.md).
CREDIT_RULE = ("heuristic: each clean point's measured share is credited to the findings before it in dataflow "
               "order whose own |share| is 2% of the gap or more, in proportion to it; otherwise it stays noise")
CREDIT_FLOOR = 0.02           # a finding whose own term is under 2% of the gap is credited nothing (_credit)
CLEAN_NOISE_UNMEASURED = ("not measured: the report holds no clean pair of this model (e.g. eager vs SDPA "
                          "attention), so whether this gap is within clean-implementation noise is not known")


@dataclass
class Share:
    """One contributor: its share of the gap (and each side's), in units of G = sum_t |Δ logprob_t|."""
    key: str
    point: str
    layer: int | None
    share: float
    share_a: float = 0.0
    share_b: float = 0.0
    share_op: float = 0.0             # of `share`: the ops' own errors (what an implementation choice changes)
    share_rounding: float = 0.0       # of `share`: the rounding of the outputs to their dtypes
    rows: int = 0
    finding: bool = False             # the report names a difference here (a finding of any cause)
    share_downstream: float = 0.0     # clean ops' noise after this finding, credited to it (_credit)

    @property
    def share_total(self) -> float:
        return self.share + self.share_downstream


@dataclass
class Attribution:
    gap: float                                # G = sum over the attributed tokens of |Δ logprob|
    tokens: int                               # log-prob rows attributed
    tokens_total: int                         # log-prob rows both sides scored
    explained: float                          # sum of every share (points and routing)
    by_point: list[Share] = field(default_factory=list)       # dataflow order
    by_kind: list[dict] = field(default_factory=list)         # {kind, share, share_a, share_b, points}
    routing: list[Share] = field(default_factory=list)        # per layer with flipped tokens
    noise: float = 0.0                        # clean ops' noise before every finding: credited to none
    not_attributed: list[dict] = field(default_factory=list)  # {key, reason}
    first: str | None = None                  # the first significant contributor in dataflow order
    top: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    threshold: float = SIGNIFICANT_SHARE
    withheld: str | None = None               # why the shares are not reported as shares (first order fails)
    clean_noise: dict = field(default_factory=lambda: {"measured": False, "why": CLEAN_NOISE_UNMEASURED})

    @property
    def residual(self) -> float:
        return 1.0 - self.explained

    def share_of(self, key: str) -> float | None:
        """A finding's share of the gap: its own and the downstream noise credited to it."""
        for s in self.by_point + self.routing:
            if s.key == key:
                return s.share_total
        return None

    def to_json(self) -> dict:
        return {"gap": self.gap, "tokens": self.tokens, "tokens_total": self.tokens_total,
                "explained": self.explained, "residual": self.residual, "noise": self.noise,
                "threshold": self.threshold,
                "first": self.first, "top": list(self.top),
                "by_point": [_share_json(s) for s in self.by_point], "by_kind": list(self.by_kind),
                "routing": [_share_json(s) for s in self.routing], "not_attributed": list(self.not_attributed),
                "notes": list(self.notes), "withheld": self.withheld, "credit": CREDIT_RULE,
                "clean_noise": dict(self.clean_noise)}


def attribute(va: CanonicalView, vb: CanonicalView, reference: ExactReference, *, findings: Iterable[str] = (),
              max_tokens: int = DEFAULT_TOKENS) -> Attribution:
    """The attribution of B's log-prob gap to A over the canonical points both sides record. `findings`: the
    keys where the report names a difference (the judge's findings): the answer ranks those; every other
    point's share is the noise of clean ops, credited to the findings before it (`_credit`). Raises
    NotReplayable (with the reason) when no gap can be attributed: no log-probs, no tokens, no reference op."""
    delta = _measured_delta(va, vb)
    rows, tokens, lp_rows = _budget(va, vb, delta, max_tokens)
    gap = float(sum(abs(delta[r]) for r in lp_rows))
    if not gap:
        raise NotReplayable("the sides' log-probs are equal on every attributed token: no gap to attribute")
    both, _, _ = common_points(va, vb)
    both = [k for k in both if BY_NAME.get(k[0]) is not None]
    n_layers = va.n_layers or 0
    side_a = SideReplayer(va, reference)
    routing = _routing_of(va, both, rows)
    run = run_exact(side_a.ref, both, rows, tokens, n_layers, routing, side_a.has_qk_norm)
    backward(run, {r: math.copysign(1.0, delta[r]) for r in lp_rows if delta[r]})
    att = Attribution(gap=gap, tokens=len(lp_rows), tokens_total=len(delta), explained=0.0)
    side_b = SideReplayer(vb, reference)
    flipped = _flipped_rows(va, vb, both, run)
    dtypes: dict[Key, str] = {}               # the dtype side A computed each point in: the clean forwards'
    for key in both:
        if key[0] == LOGPROBS and _derived(va, vb):
            continue              # derived by tic-trace in float64 from the logits: no op of either side
        _point_share(att, key, run, side_a, side_b, flipped.get(key[1], set()) if key[0] == "moe.topk_weights" else set(),
                     dtypes)
    att.clean_noise = clean_noise(side_a, both, rows, tokens, n_layers, routing, lp_rows, dtypes)
    if att.clean_noise.get("measured"):
        att.clean_noise["within"] = gap <= att.clean_noise["gap"]
    for layer, rows in sorted(flipped.items()):
        _routing_share(att, layer, rows, run, side_a.ref, side_b.ref, vb)
    _summarise(att, set(findings))
    return att


# ---------------------------------------------------------------------------------------------- the measured gap

def _measured_delta(va: CanonicalView, vb: CanonicalView) -> dict[RowId, float]:
    """Δ logprob per row both sides scored (B - A)."""
    ta, tb = va.load(LOGPROBS, None), vb.load(LOGPROBS, None)
    if ta.values is None or tb.values is None:
        raise NotReplayable("a side has no log-prob values (stats only): nothing to attribute")
    ia = {r: i for i, r in enumerate(ta.rows)}
    out = {}
    for j, r in enumerate(tb.rows):
        i = ia.get(r)
        if i is not None:
            out[r] = float(np.asarray(tb.values[j], np.float64).reshape(-1)[0]
                           - np.asarray(ta.values[i], np.float64).reshape(-1)[0])
    if not out:
        raise NotReplayable("no token both sides scored: nothing to attribute")
    return out


def _budget(va: CanonicalView, vb: CanonicalView, delta: dict[RowId, float],
            max_tokens: int) -> tuple[list[RowId], dict[RowId, int], list[RowId]]:
    """The samples run through the exact model, worst first (largest |Δ logprob| of any of its tokens), at
    most `max_tokens` rows in all: each sample from position 0 (a causal model's row needs every earlier one)
    up to its last scored row, or the causal prefix of it that still fits. The tokens are side A's, every one
    of them recorded, and equal to B's wherever B recorded one. Returns (the rows, their tokens and the next
    ones, the log-prob rows attributed)."""
    if max_tokens < 1:
        raise NotReplayable(f"a token budget of {max_tokens} attributes nothing (--attribution-tokens is 1 or more)")
    worst: dict[str, float] = {}
    last: dict[str, int] = {}
    for (s, p), d in delta.items():
        worst[s] = max(worst.get(s, 0.0), abs(d))
        last[s] = max(last.get(s, 0), p)
    rows: list[RowId] = []
    tokens: dict[RowId, int] = {}
    end: dict[str, int] = {}                 # each sample's last row run
    for s in sorted(worst, key=lambda s: -worst[s]):
        n = min(last[s] + 1, max_tokens - len(rows))
        if n <= 0:
            break
        mine = {(s, p): va.tokens.get((s, p)) for p in range(n + 1)}     # + the last row's next token
        if any(t is None or vb.tokens.get(r, t) != t for r, t in mine.items()):
            continue             # a position missing on A, or another token on B: not attributable
        rows += [(s, p) for p in range(n)]
        tokens.update(mine)
        end[s] = n - 1
    lp_rows = [r for r in delta if r[0] in end and r[1] <= end[r[0]] and (r[0], r[1] + 1) in tokens]
    if not lp_rows and end:
        first = min(p for (_s, p) in delta)
        raise NotReplayable(f"no scored token within the first {max_tokens} positions of a sample (the token "
                            f"budget, --attribution-tokens {max_tokens}); the first scored one is at position "
                            f"{first}: a budget of {first + 1} or more reaches it")
    if not lp_rows:
        raise NotReplayable("no sample has every position 0..n with the same token on both sides "
                            "(the exact model runs whole samples from their first token)")
    return rows, tokens, lp_rows


def _derived(va: CanonicalView, vb: CanonicalView) -> bool:
    return any(all(s.endswith("(log_softmax)") for s in v.load(LOGPROBS, None, values=False).sources)
               for v in (va, vb))


# ---------------------------------------------------------------------------------------------- routing

def _routing_of(va: CanonicalView, both: list[Key], rows: list[RowId]) -> dict[int, torch.Tensor]:
    """Side A's recorded top-k ids per layer, in the exact model's row order: the choice it routes by."""
    out = {}
    for point, layer in both:
        if point != EXPERT_IDS:
            continue
        t = va.load(point, layer)
        where = {r: i for i, r in enumerate(t.rows)}
        if t.values is None or any(r not in where for r in rows):
            raise NotReplayable(f"side A's {key_name(point, layer)} lacks rows the exact model runs")
        out[layer] = torch.from_numpy(np.asarray(t.values[[where[r] for r in rows]], np.int64))
    return out


def _flipped_rows(va: CanonicalView, vb: CanonicalView, both: list[Key], run: ExactRun) -> dict[int, set]:
    """Per MoE layer, the exact model's rows whose expert set differs between the sides."""
    idx = run.index()
    out: dict[int, set] = {}
    for point, layer in both:
        if point != EXPERT_IDS:
            continue
        ta, tb = va.load(point, layer), vb.load(point, layer)
        wb = {r: i for i, r in enumerate(tb.rows)}
        for i, r in enumerate(ta.rows):
            j = wb.get(r)
            if r in idx and j is not None and set(np.asarray(ta.values[i]).tolist()) != set(np.asarray(tb.values[j]).tolist()):
                out.setdefault(layer, set()).add(r)
    return out


def _routing_share(att: Attribution, layer: int, rows: set, run: ExactRun, ref_a: ExactReference,
                   ref_b: ExactReference, vb: CanonicalView) -> None:
    """The flipped tokens' share at `layer`: <g at experts_out, MoE(B's choice) - MoE(A's choice)> on the
    exact inputs, each choice's weights computed exactly from the exact router logits."""
    idx = run.index()
    sel = [idx[r] for r in sorted(rows, key=idx.get)]
    ids_b = vb.load(EXPERT_IDS, layer)
    wb = {r: i for i, r in enumerate(ids_b.rows)}
    choice_b = torch.from_numpy(np.asarray(ids_b.values[[wb[run.rows[i]] for i in sel]], np.int64)).to(F64)
    choice_a = run.values[(EXPERT_IDS, layer)].detach()[sel]
    x = run.values[("mlp_norm", layer)].detach()[sel]
    logits = run.values[("moe.router_logits", layer)].detach()[sel]
    sub = [run.rows[i] for i in sel]

    def moe(ref: ExactReference, ids: torch.Tensor) -> torch.Tensor:
        w = ref.compute("moe.topk_weights", layer, {"moe.router_logits": logits, "moe.topk_ids": ids}, sub)
        return ref.compute("moe.experts_out", layer, {"mlp_norm": x, "moe.topk_ids": ids, "moe.topk_weights": w}, sub)
    g = run.grads[("moe.experts_out", layer)][sel]
    c = float((g * (moe(ref_b, choice_b) - moe(ref_a, choice_a))).sum())
    att.routing.append(Share(key_name(EXPERT_IDS, layer), EXPERT_IDS, layer, c / att.gap, share_op=c / att.gap, rows=len(sel)))


# ---------------------------------------------------------------------------------------------- points

def _point_share(att: Attribution, key: Key, run: ExactRun, side_a: SideReplayer, side_b: SideReplayer,
                 skip_b: set, dtypes: dict | None = None) -> None:
    point, layer = key
    if is_ids(point) or key not in run.grads:
        return
    g = run.grads[key]
    try:
        ca, na = _side_term(side_a, key, run, g, set(), dtypes)
        cb, nb = _side_term(side_b, key, run, g, skip_b)
    except NotReplayable as e:
        att.not_attributed.append({"key": key_name(point, layer), "reason": str(e)})
        return
    G = att.gap
    att.by_point.append(Share(key_name(point, layer), point, layer, (cb.total - ca.total) / G, ca.total / G,
                              cb.total / G, share_op=(cb.op - ca.op) / G,
                              share_rounding=(cb.rounding - ca.rounding) / G, rows=min(na, nb)))


def _side_term(side: SideReplayer, key: Key, run: ExactRun, g: torch.Tensor, skip: set,
               dtypes: dict | None = None) -> tuple[Term, int]:
    """<g_p, e_X,p> over the exact model's rows this side has at p (less `skip`), split into the op's own
    part (y - round(exact)) and the output rounding (round(exact) - exact), and how many rows. `dtypes`: where
    given, gets the dtype the side computed p in."""
    rows, y, exact, dtype = side.exact_pair(*key)
    idx = run.index()
    keep = [(i, idx[r]) for i, r in enumerate(rows) if r in idx and r not in skip]
    if not keep:
        raise NotReplayable("no row of the exact model recorded here")
    mine = np.array([i for i, _ in keep])
    theirs = torch.tensor([j for _, j in keep])
    gk = g[theirs].reshape(len(keep), -1).cpu().numpy()
    y, exact = np.asarray(y, np.float64)[mine].reshape(len(keep), -1), exact[mine].reshape(len(keep), -1)
    dtype = effective_dtype(y, dtype) if dtype != "float64" else dtype
    rounded = round_to(exact, dtype) if dtype != "float64" else exact
    if dtypes is not None:
        dtypes[key] = dtype
    return Term(float((gk * (y - rounded)).sum()), float((gk * (rounded - exact)).sum())), len(keep)


@dataclass(frozen=True)
class Term:
    """One side's <g_p, e_X,p>: the op's own part (what an implementation choice changes) and the rounding
    of its output to its dtype (what any implementation with that output dtype has)."""
    op: float
    rounding: float

    @property
    def total(self) -> float:
        return self.op + self.rounding


# ---------------------------------------------------------------------------------------------- the summary

def _summarise(att: Attribution, findings: set[str]) -> None:
    att.by_point.sort(key=lambda s: order_key(s.point, s.layer))
    att.noise = 0.0
    for s in att.by_point + att.routing:
        s.share_downstream = 0.0
    for s in att.by_point:
        s.finding = s.key in findings
    for s in att.routing:
        s.finding = True          # tokens on other experts are a difference by themselves
    att.explained = sum(s.share for s in att.by_point) + sum(s.share for s in att.routing)
    _credit(att)
    att.by_kind = _by_kind(att)
    answers = [s for s in att.by_point + att.routing if s.finding]
    ranked = sorted(answers, key=lambda s: -s.share_total)
    att.top = [s.key for s in ranked[:TOP] if s.share_total > 0]
    flow = sorted(answers, key=lambda s: order_key(s.point, s.layer))
    att.first = next((s.key for s in flow if s.share_total >= att.threshold), None)
    att.notes = _why_unexplained(att)
    att.withheld = _withheld(att)
    if att.withheld:          # the measured terms stay in by_point for reading; no answer is made of them
        att.first, att.top = None, []


def _withheld(att: Attribution) -> str | None:
    """Why first-order shares are not reported here (None: they are): far outside where first order holds."""
    lo, hi = WITHHOLD_EXPLAINED
    point_sum = sum(s.share for s in att.by_point)
    worst = max(att.by_point, key=lambda s: abs(s.share), default=None)
    if worst is not None and abs(worst.share) > WITHHOLD_SHARE:
        return (f"{worst.key}'s first-order term is {worst.share:.3g}x the gap (the point terms sum to "
                f"{point_sum:.3g}x): huge local errors that almost cancel in the log-probs, far outside where "
                "first order holds; no share is reported (the judge's findings stand; a finite step through the "
                "exact model would measure it)")
    if not lo <= att.explained <= hi:
        return (f"first order explains {100 * att.explained:.0f}% of the gap, outside {100 * lo:.0f}-"
                f"{100 * hi:.0f}%: the difference is too large or too non-linear for first-order shares; no "
                "share is reported (the judge's findings stand)")
    return None


def _credit(att: Attribution) -> None:
    """Credit each clean point's share to the findings before it in dataflow order, in proportion to their
    own |share|. Why: where both sides run clean ops, their outputs differ only because their inputs do (in
    bf16 every later rounding then differs too, and those terms outweigh a small fault's own one); without an
    earlier finding, the share stays `noise`. A finding whose own measured term is under CREDIT_FLOOR of the
    gap takes no credit: its difference moves the log-probs by next to nothing at first order, and the clean
    ops' noise after it says nothing of it. A heuristic of attribution, said as such in docs/attribution.md."""
    flow = sorted(att.by_point + att.routing, key=lambda s: order_key(s.point, s.layer))
    before: list[Share] = []
    for s in flow:
        if s.finding:
            if abs(s.share) >= CREDIT_FLOOR:
                before.append(s)
            continue
        weight = sum(abs(f.share) for f in before)
        if not weight:
            att.noise += s.share
            continue
        for f in before:
            f.share_downstream += s.share * abs(f.share) / weight


def _by_kind(att: Attribution) -> list[dict]:
    """The shares summed by the class of op (PointSpec.op) over every layer, each side's apart."""
    kinds: dict[str, dict] = {}
    for s in att.by_point:
        kind = BY_NAME[s.point].op or s.point
        k = kinds.setdefault(kind, {"kind": kind, "share": 0.0, "share_a": 0.0, "share_b": 0.0, "points": 0})
        k["share"] += s.share
        k["share_a"] += s.share_a
        k["share_b"] += s.share_b
        k["points"] += 1
    if att.routing:
        kinds["routing"] = {"kind": "routing", "share": sum(s.share for s in att.routing), "share_a": 0.0,
                            "share_b": 0.0, "points": len(att.routing)}
    return sorted(kinds.values(), key=lambda k: -k["share"])


def recredit(doc: dict, findings: Iterable[str]) -> dict:
    """A saved attribution (`Attribution.to_json`) with its answer recomputed for another set of findings (a
    re-judged report): the measured shares stay, what is credited to whom follows the findings."""
    att = from_json(doc)
    _summarise(att, set(findings))
    return att.to_json()


def from_json(d: dict) -> Attribution:
    """An Attribution from its JSON (numbers as saved; the answer fields are recomputed by `recredit`)."""
    names = {f for f in Share.__dataclass_fields__}

    def share(x: dict) -> Share:
        return Share(**{k: v for k, v in x.items() if k in names})
    return Attribution(gap=float(d.get("gap") or 0.0), tokens=int(d.get("tokens") or 0),
                       tokens_total=int(d.get("tokens_total") or 0), explained=float(d.get("explained") or 0.0),
                       by_point=[share(x) for x in d.get("by_point") or []],
                       routing=[share(x) for x in d.get("routing") or []],
                       not_attributed=list(d.get("not_attributed") or []),
                       threshold=float(d.get("threshold") or SIGNIFICANT_SHARE),
                       **({"clean_noise": dict(d["clean_noise"])} if isinstance(d.get("clean_noise"), dict) else {}))


def _share_json(s: Share) -> dict:
    return {**asdict(s), "share_total": s.share_total}


def _why_unexplained(att: Attribution) -> list[str]:
    if EXPLAINED_ENOUGH <= att.explained <= 1 / EXPLAINED_ENOUGH:
        return []
    why = [f"first order explains {100 * att.explained:.0f}% of the gap (residual {100 * att.residual:.0f}%)"]
    if att.not_attributed:
        why.append(f"{len(att.not_attributed)} point(s) not attributed (" + ", ".join(
            d["key"] for d in att.not_attributed[:4]) + "): their errors are in the residual")
    if att.routing:
        why.append("tokens route to other experts: the routing terms are one finite step, not first order")
    if att.gap / max(att.tokens, 1) > 0.05:
        why.append(f"the mean |Δ logprob| is {att.gap / max(att.tokens, 1):.3g}: large differences are not linear "
                   "in the local errors")
    if len(why) == 1:
        why.append("the sides may differ in something no canonical point holds (weights, ops between points)")
    return why
