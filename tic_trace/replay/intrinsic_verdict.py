"""The intrinsic rule: which side (if any) computes an op less exactly, from both sides' intrinsic errors.

The statistic is `IntrinsicError.excess`: a side's relative L2 error against the exact op on its own inputs,
in units of the error of the correctly rounded exact value (1.0 = correctly rounded; an op that rounds twice
sits near sqrt(2)). A side is *abnormal* at a point when its excess exceeds what clean implementations of
that op show (the point's envelope, measured, times a margin); it is *to blame* when it is abnormal and also
clearly worse than the other side (excess ratio over `ratio`). Where the sides record the point in different
dtypes, ULPs and excess are not comparable: that is a `precision` finding, blaming the side whose output is
further from exact in absolute terms (relative L2). Blame needs a difference (`clearly_worse`): a tie, an
infinite excess on both sides (the exact value is representable and both miss it: the checkpoint may not be
the run's) or non-finite values on both sides blames no one ("both sides alike"). The measurements behind
every number: docs/replay.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

from ..families import FAMILIES
from ..graph.canonical import key_name
from ..view.align import CanonicalView, common_points

if TYPE_CHECKING:   # the replay (and torch) load when a replay runs: the finder reads Margins with numpy only
    from .intrinsic import IntrinsicError, NotReplayed
    from .reference import ExactReference

# Largest excess measured on clean bf16 implementations per point (HF eager and SDPA attention, split-K
# o_proj, identical; Qwen3 MoE and dense, Qwen2-MoE; 2 x 16 tokens and 1 x 64 to 1024; 501 clean pairs:
# docs/replay.md), rounded up; ops that round once (GEMMs with fp32 accumulation, residual adds, embedding,
# identity) are correctly rounded, excess 1.0. Keys are points, or the op replayed where a point's op
# depends on the model (`reference.op_of`: a dense model's MLP and a shared expert are a `gated_mlp`).
ENVELOPE: dict[str, float] = {
    "attn_norm": 1.49, "mlp_norm": 1.48, "final_norm": 1.50,      # normalise, round, x weight, round
    "attn.q_norm": 1.52, "attn.k_norm": 1.58,
    "attn.q_rope": 1.66, "attn.k_rope": 1.67,                     # bf16 cos/sin tables, 3 roundings
    "attn.core": 2.00,                                            # eager: scores and probabilities rounded
    "moe.experts_out": 3.09,                                      # gate, up, act, product, down, weight, sum
    "gated_mlp": 2.66,                                            # gate, up, act, product, down
    "gated_shared_sum": 1.98,     # Qwen2-MoE mlp.out: gate GEMM, sigmoid, x shared, + experts
}
ENVELOPE.update({op: e for fam in FAMILIES for op, e in fam.envelopes.items()})     # the families' own ops
SINGLE_ROUNDING = 1.0
# The envelopes hold where the op's internal precision (fp32 accumulation, fp32 norm statistics) is far
# finer than its output's: 16-bit outputs. An fp32 output carries its own fp32 accumulation error, which
# grows with the reduction length (clean fp32 excess measured up to 10.6 with K = 64): there one allowance,
# FP32_ALLOWANCE, catches wrong weights or wrong ops (excess 10^4 and more) but no precision choice.
ENVELOPE_DTYPES = ("bfloat16", "float16")
# Where the op's clean variants ran on the side's own inputs (variants.py), the limit is the worst of them
# times this margin: real kernels differ from the emulations in their fp32 accumulation order and blocking,
# and the margin covers that (calibrated on one half of the clean pairs, validated on the other: docs/replay.md).
VARIANT_OVER = 1.12
FP32_ALLOWANCE = 1000.0


@dataclass(frozen=True)
class Margins:
    """The rule's thresholds. `over`: how far above its point's envelope a side must be to be abnormal;
    `ratio`: how much worse than the other side it must be to be blamed; `min_numel`: fewer elements than
    this on a side and no verdict is given (the excess of a handful of roundings is noise)."""
    over: float = 1.08
    variant_over: float = VARIANT_OVER
    fingerprints: bool = True      # blame a side reproduced by a known precision fault (variants.py)
    ratio: float = 1.15
    min_numel: int = 32
    ids_share: float = 0.05        # top-k: rows whose set differs from the exact choice on the side's own logits
    envelope: dict = field(default_factory=lambda: dict(ENVELOPE))

    def limit(self, key: str, dtype: str = "bfloat16") -> float:
        """Largest excess a clean implementation of this op may show (inf: no envelope known); `key`: a
        point, or the op replayed where it depends on the model (`IntrinsicError.envelope_key`)."""
        if dtype == "float32":
            return FP32_ALLOWANCE
        if dtype not in ENVELOPE_DTYPES:
            return math.inf
        return self.envelope.get(key, SINGLE_ROUNDING) * self.over

    def limit_of(self, e: IntrinsicError) -> float:
        """The limit of one side's point: the worst clean variant's excess on that side's own inputs times
        `variant_over` where variants ran (16-bit outputs of ops in variants.VARIANTS), else the constant
        table's (`limit`)."""
        if e.clean_excess > 0 and e.dtype in ENVELOPE_DTYPES:
            return max(e.clean_excess, SINGLE_ROUNDING) * self.variant_over * _to_all_rows(e)
        return self.limit(e.envelope_key, e.dtype)

    def to_json(self) -> dict:
        return {"over": self.over, "variant_over": self.variant_over, "fingerprints": self.fingerprints, "ratio": self.ratio, "min_numel": self.min_numel, "ids_share": self.ids_share,
                "envelope": dict(self.envelope)}

    @classmethod
    def from_json(cls, d: dict | None) -> "Margins":
        """Margins saved in a report's settings (missing keys: the defaults)."""
        d = d if isinstance(d, dict) else {}
        base = cls()
        env = d.get("envelope")
        return cls(over=float(d.get("over", base.over)),
                   variant_over=float(d.get("variant_over", base.variant_over)),
                   fingerprints=d["fingerprints"] if isinstance(d.get("fingerprints"), bool) else base.fingerprints,
                   ratio=float(d.get("ratio", base.ratio)),
                   min_numel=int(d.get("min_numel", base.min_numel)),
                   ids_share=float(d.get("ids_share", base.ids_share)),
                   envelope={str(k): float(v) for k, v in env.items()} if isinstance(env, dict) else base.envelope)


def _to_all_rows(e: IntrinsicError) -> float:
    """Variants run on at most VARIANT_ROWS evenly spaced rows while a side's excess is over all its rows: the
    envelope is carried to all rows by the side's own ratio of the two (its excess over all rows / over the
    variant rows). The verdict is then the comparison on the same rows (a side bit-equal to a clean variant
    sits exactly at it), however unevenly the error spreads over rows (a trained model's few massive or
    sink rows: clean eager attention at 1.18x its subset envelope over 312 rows before). 1 when the variants
    ran on every row (and for reports saved before)."""
    s = getattr(e, "sampled_excess", 0.0)
    x = e.excess
    return x / s if s > 0 and math.isfinite(s) and math.isfinite(x) and x > 0 else 1.0


DEFAULT_MARGINS = Margins()


@dataclass(frozen=True)
class IntrinsicVerdict:
    point: str
    layer: int | None
    side: str | None               # "A" | "B" | None: the side whose op is the less exact one
    kind: str | None               # "intrinsic" | "precision" | "nonfinite" | None
    reason: str
    a: IntrinsicError | NotReplayed
    b: IntrinsicError | NotReplayed

    @property
    def key(self) -> str:
        return key_name(self.point, self.layer)


def abnormal(e: IntrinsicError, margins: Margins = DEFAULT_MARGINS) -> bool:
    """One side alone: is its intrinsic error beyond what clean implementations of this op show?"""
    if e.nonfinite:
        return True
    if e.kind == "ids":
        return 1.0 - e.share_rounded > margins.ids_share
    if undeclared_layout(e):    # a clean implementation at a TP degree the trace does not say: named instead
        return False
    return e.numel >= margins.min_numel and e.excess > margins.limit_of(e)


def undeclared_layout(e: IntrinsicError) -> bool:
    """The side is reproduced by a clean row-parallel split at a degree its trace does not declare (a model
    sharded by hand, an engine that does not record its TP degree): an implementation difference to name,
    not a fault, while its envelope stays the declared degree's (variant_fit.undeclared_layouts)."""
    return getattr(e, "match_layout", "") != "" and e.match_kind == "clean"


def clearly_worse(x: float, y: float, ratio: float) -> bool:
    """Is evidence x (an excess, a relative error) clearly larger than y: over `ratio` times it? Never for a
    tie, and never when neither is a finite number: an infinite excess on both sides (the exact value is
    representable and both miss it) or a NaN says nothing about which side is further from exact."""
    if math.isnan(x) or math.isnan(y) or (math.isinf(x) and math.isinf(y)):
        return False
    return x > ratio * y


def intrinsic_verdict(a: IntrinsicError | NotReplayed, b: IntrinsicError | NotReplayed,
                      margins: Margins = DEFAULT_MARGINS) -> IntrinsicVerdict:
    """Which side, if any, computes this point's op less exactly. The one judging rule of the replay."""
    from .intrinsic import NotReplayed
    point, layer = a.point, a.layer

    def out(side, kind, reason):
        return IntrinsicVerdict(point, layer, side, kind, reason, a, b)

    if isinstance(a, NotReplayed) or isinstance(b, NotReplayed):
        why = "; ".join(f"{s}: {x.reason}" for s, x in (("A", a), ("B", b)) if isinstance(x, NotReplayed))
        return out(None, None, f"not replayed ({why})")
    # Blame needs a difference: equal evidence, or evidence that is not a number on both sides, blames no one.
    if a.nonfinite and b.nonfinite:
        return out(None, None, "both sides alike: both have non-finite values where the exact op has none")
    if bool(a.nonfinite) != bool(b.nonfinite):
        side = "A" if a.nonfinite else "B"
        return out(side, "nonfinite", f"{side} has non-finite values where the exact op has none")
    if a.dtype != b.dtype and a.kind != "ids":
        # Another dtype is a precision choice only while each side is as exact as clean implementations are
        # in its own dtype; a side beyond that computes another op (a missing renormalisation, a wrong
        # weight), whatever the other side's dtype: that is intrinsic, not precision.
        odd = [(x, side) for x, side in ((a, "A"), (b, "B")) if abnormal(x, margins)]
        if len(odd) == 1:
            x, side = odd[0]
            return out(side, "intrinsic", f"{side}'s error is {x.excess:.2f}x the rounding floor of its own dtype "
                                          f"{x.dtype} (limit {margins.limit_of(x):.2f}): beyond a "
                                          "precision choice (the sides record different dtypes)")
        worse, better, side = (a, b, "A") if a.rel_l2 > b.rel_l2 else (b, a, "B")
        said = f"computed in {a.dtype} on A and {b.dtype} on B; rel error vs exact {a.rel_l2:.2e} (A) vs {b.rel_l2:.2e} (B)"
        if not clearly_worse(worse.rel_l2, better.rel_l2, margins.ratio):
            return out(None, None, said + ": both alike (equally exact)")
        return out(side, "precision", said)
    if min(a.numel, b.numel) < margins.min_numel and a.kind != "ids":
        return out(None, None, f"too few elements to judge ({min(a.numel, b.numel)} < {margins.min_numel})")
    for x, y, side in ((a, b, "A"), (b, a, "B")):
        # A side reproduced by a known precision fault (and not by a clean implementation) computes that
        # fault, whatever the envelope says: named with its fingerprint. Both sides matching it: alike.
        # Its excess need not be the larger: a bf16 softmax or SiLU can land on or under clean eager's on some
        # inputs (measured: benchmarks/calibrate_variants.py), and it is still that fault's output bit for bit.
        if margins.fingerprints and x.kind == "float" and x.match_kind == "fault" and y.match != x.match:
            return out(side, "intrinsic", f"{fingerprint_text(x, side)}; excess {x.excess:.2f} (limit "
                                          f"{margins.limit_of(x):.2f}) vs {y.excess:.2f}")
    for x, y, side in ((a, b, "A"), (b, a, "B")):
        if not abnormal(x, margins):
            continue
        if x.kind == "ids":
            if (1 - x.share_rounded) >= 2 * (1 - y.share_rounded) + 1.0 / max(x.rows, 1):
                return out(side, "intrinsic", f"{side}'s top-k differs from the exact choice on its own logits "
                                              f"in {1 - x.share_rounded:.1%} of rows")
            continue
        if clearly_worse(x.excess, y.excess, margins.ratio):
            return out(side, "intrinsic", f"{side}'s error is {x.excess:.2f}x the rounding floor (limit "
                                          f"{margins.limit_of(x):.2f}), {x.excess / max(y.excess, 1e-12):.2f}x "
                                          f"the other side's" + (f"; {fingerprint_text(x, side)}" if x.match_kind else ""))
    if implementation_difference(a, b) or undeclared_layout(a) or undeclared_layout(b):
        return out(None, None, f"implementation difference, not a fault: {fingerprint_text(a, 'A')}; "
                               f"{fingerprint_text(b, 'B')}")
    return out(None, None, "both sides alike: within the clean envelope, or equally far from exact")


# ---------------------------------------------------------------- fingerprints in words

_OP_WORDS = {"attn_norm": "RMSNorm", "mlp_norm": "RMSNorm", "final_norm": "RMSNorm", "attn.q_norm": "Q-norm",
             "attn.k_norm": "K-norm", "attn.q_rope": "RoPE", "attn.k_rope": "RoPE", "attn.core": "attention",
             "attn.q": "q_proj", "attn.k": "k_proj", "attn.v": "v_proj", "attn.out": "o_proj",
             "moe.router_logits": "router GEMM", "moe.topk_weights": "top-k weights", "moe.experts_out": "experts",
             "gated_mlp": "gated MLP", "logits": "lm_head",
             # the ops config facts name (reference._generic_op_of)
             "attention_ext": "attention", "gated_mlp_act": "gated MLP"}
_OP_WORDS.update({op: w for fam in FAMILIES for op, w in fam.op_words.items()})    # the families' own ops


def fingerprint_text(e: IntrinsicError, side: str) -> str:
    """"B's RMSNorm at L1 matches *no fp32 upcast* (bit-equal 97%)": the variant that reproduces the side."""
    where = f"{_OP_WORDS.get(e.envelope_key, e.point)}" + (f" at L{e.layer}" if e.layer is not None else "")
    if e.match_kind == "none":
        return (f"{side}'s {where} matches no known implementation (nearest: *{e.match_what}*, "
                f"{e.match_dist:.2f} rounding floors away)")
    layout = f"; the trace says {e.match_layout}" if undeclared_layout(e) else ""
    return (f"{side}'s {where} matches *{e.match_what}*" + (" (a known precision fault)" if e.match_kind == "fault"
                                                          else "") + f" (bit-equal {e.match_equal:.0%}){layout}")


def implementation_difference(a: IntrinsicError, b: IntrinsicError) -> bool:
    """Both sides reproduced by clean implementations, different ones: named, never a fault."""
    return (getattr(a, "match_kind", "") == "clean" == getattr(b, "match_kind", "")
            and a.match != b.match)


# ---------------------------------------------------------------- walking two traces

@dataclass(frozen=True)
class IntrinsicFinding:
    point: str
    layer: int | None
    side: str                      # "A" | "B"
    kind: str                      # "intrinsic" | "precision" | "nonfinite"
    reason: str
    a: IntrinsicError
    b: IntrinsicError

    @property
    def key(self) -> str:
        return key_name(self.point, self.layer)


def intrinsic_walk(view_a: CanonicalView, view_b: CanonicalView, reference: ExactReference,
                   layers: Iterable[int] | None = None, margins: Margins = DEFAULT_MARGINS,
                   stop_at_first: bool = False) -> list[IntrinsicVerdict]:
    """The verdict at every point both sides recorded, in dataflow order (global points only without
    `layers`). Each side is replayed from its own inputs."""
    from ..compare.contract import check_reference
    from .intrinsic import SideReplayer
    check_reference(reference.ckpt, {"A": view_a, "B": view_b})     # raises ReferenceMismatch
    keep = set(layers) if layers is not None else None
    ra, rb = SideReplayer(view_a, reference), SideReplayer(view_b, reference)
    both, _, _ = common_points(view_a, view_b)
    out = []
    for point, layer in both:
        if keep is not None and layer not in keep:
            continue
        v = intrinsic_verdict(ra.replay(point, layer), rb.replay(point, layer), margins)
        out.append(v)
        if stop_at_first and v.side is not None:
            break
    return out


def first_intrinsic_divergence(view_a: CanonicalView | str, view_b: CanonicalView | str,
                               reference: ExactReference, layers: Iterable[int] | None = None,
                               margins: Margins = DEFAULT_MARGINS) -> IntrinsicFinding | None:
    """The first point in dataflow order where one side's op is intrinsically (or by precision) less exact."""
    va = view_a if isinstance(view_a, CanonicalView) else CanonicalView(view_a)
    vb = view_b if isinstance(view_b, CanonicalView) else CanonicalView(view_b)
    for v in intrinsic_walk(va, vb, reference, layers, margins, stop_at_first=True):
        if v.side is not None:
            return IntrinsicFinding(v.point, v.layer, v.side, v.kind, v.reason, v.a, v.b)
    return None
