"""Clean implementations and known precision faults of each canonical op, run on one side's own inputs.

An op's rounding error depends on its inputs (attention's on the size of the scores, a reduction's on how it
is split, a norm's on its gains), so one constant envelope fitted to one distribution of weights either
misses faults or blames clean implementations on the next. Instead each point is judged against what the
implementations real engines use give *on the same inputs*: every `Variant` below recomputes the op from the
side's recorded inputs in torch, in the side's dtype, rounding where that implementation rounds (a bf16
tensor op on CPU accumulates in fp32 and rounds its result once, as the engines' kernels do).

Two uses (`intrinsic.SideReplayer`):
- the **envelope** of a point: the largest excess of its *clean* variants on those inputs (times
  `Margins.variant_over`, intrinsic_verdict.py);
- the **fingerprint** of a side: the variant, clean or a known fault, that reproduces the side's output best,
  with the share of bit-equal elements and the distance (measured in variant_fit.py: `run_variants`,
  `fingerprint`).

Cost: variants run on at most `VARIANT_ROWS` rows of the point (evenly spaced; attention reads every key row),
once per side and point. Ops without variants (residual adds, embedding, identity, a MoE `mlp.out` sum) are
judged against the constant table `intrinsic_verdict.ENVELOPE` (docs/replay.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from contextvars import ContextVar
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from . import attention_kernels as K
from .act_bf16 import gated_forms
from .attention_ops import each_sample, spans_heads

F64 = torch.float64
VARIANT_ROWS = 256          # rows a variant is computed on: bounds its cost whatever the trace's length
TP_UNKNOWN = (2, 4, 8)      # row-parallel shard counts tried where the trace does not record its TP degree
TP_TRIED = (2, 4, 8)        # shard counts every fingerprint may try: an undeclared split is named, not blamed
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class VariantInput:
    """What a variant reads: the side's own recorded inputs (float64 holding the recorded values), the
    side's weights (float64 holding them rounded to the dtype it ran), its output dtype and TP degree."""
    ref: object                 # reference.ExactReference (this side's)
    layer: int | None
    feeds: dict
    rows: list
    dtype: torch.dtype
    tp: tuple[int, ...]         # the row-parallel shard counts the trace allows (its declared TP degree)
    point: str = ""             # the canonical point (an op shared by several points reads its own weight)

    def w(self, *names: str, optional: bool = False):
        return self.ref.weights(self.layer).get(*names, optional=optional)

    @property
    def spec(self):
        return self.ref.spec


@dataclass(frozen=True)
class Renderings:
    """An implementation whose output is known up to a choice, per segment of `seg` elements, among a few
    renderings. torch's CPU bf16 `rsqrt` computes in fp32 and rounds once in its vectorised body, and as
    1/sqrt with two bf16 roundings on the scalar path (tensors under 32 elements, and the remainder after the
    vectorised blocks): which one a normalised row gets depends on the shape of the tensor it ran in (the
    batch, prefill or decode), which the trace does not record. `run_variants` takes, per segment, the
    rendering nearest the side's output; a clean implementation is still 2x further (FAULT_SEPARATION)."""
    choices: tuple
    seg: int

    def nearest(self, y: np.ndarray) -> torch.Tensor:
        cands = np.stack([c.to(F64).cpu().numpy().reshape(-1, self.seg) for c in self.choices])
        pick = ((cands - y.reshape(1, -1, self.seg)) ** 2).sum(-1).argmin(0)
        return torch.from_numpy(cands[pick, np.arange(cands.shape[1])].reshape(self.choices[0].shape))


@dataclass(frozen=True)
class Variant:
    name: str                   # "eager", "no_upcast", ...
    what: str                   # in words, for the report: "no fp32 upcast"
    clean: bool                 # a clean implementation (True) or a known precision fault (False)
    fn: Callable[[VariantInput], torch.Tensor]
    layouts: bool = False       # its output depends on the TP degree (`_tp_worst`): rerun at undeclared degrees


# ---------------------------------------------------------------- GEMMs

class _Run:
    """What one `run_variants` call shares between its variants: the weights' fp32 copies (kept for the layer
    by the reference's WeightStore) and the GEMMs several variants compute alike (a gated MLP's gate and up
    GEMMs on the same input are the same for its unfused, fused, row-parallel and bf16-SiLU variants)."""

    def __init__(self, store) -> None:
        self.store, self.memo = store, {}

    def f32(self, w: torch.Tensor) -> torch.Tensor:
        # a view (a slice of a fused expert tensor) is a new object at every call: not worth keeping
        return self.store.cast(w, torch.float32) if self.store is not None and w._base is None else w.float()


_RUN: ContextVar[_Run | None] = ContextVar("tic_trace_variant_run", default=None)


def _gemm(x: torch.Tensor, w: torch.Tensor, dt: torch.dtype, b: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T with fp32 accumulation, one rounding to dt (the bias added before it)."""
    run = _RUN.get()
    if run is None:
        y = x.float() @ w.float().T
        return (y + b.float() if b is not None else y).to(dt)
    key = (id(x), id(w), id(b), dt)
    hit = run.memo.get(key)
    if hit is not None and hit[0] is x and hit[1] is w and hit[2] is b:
        return hit[3]
    y = x.float() @ run.f32(w).T
    out = (y + b.float() if b is not None else y).to(dt)
    run.memo[key] = (x, w, b, out)
    return out


def _row_parallel(x: torch.Tensor, w: torch.Tensor, dt: torch.dtype, k: int) -> torch.Tensor:
    """A row-parallel layer over k shards of the reduction: each shard's partial GEMM rounded to dt, the
    partials summed in dt one after another (a bf16 all-reduce rounds at every step)."""
    n = x.shape[-1]
    if n % k:
        raise ValueError(f"reduction of {n} does not split into {k} shards")
    s = n // k
    out = None
    for i in range(k):
        p = _gemm(x[..., i * s:(i + 1) * s], w[:, i * s:(i + 1) * s], dt)
        out = p if out is None else out + p
    return out


def _proj_variants(which: str, feed: str, row_parallel: bool) -> list[Variant]:
    def single(v: VariantInput) -> torch.Tensor:
        return _gemm(v.feeds[feed], v.w(f"self_attn.{which}_proj.weight"), v.dtype,
                     v.w(f"self_attn.{which}_proj.bias", optional=True))
    out = [Variant("fp32_accumulate", "fp32 accumulation", True, single)]

    def bias_after(v: VariantInput) -> torch.Tensor:    # megatron's local linear: matmul, then `output + bias`
        b = v.w(f"self_attn.{which}_proj.bias", optional=True)
        if b is None:
            raise ValueError("no bias")         # run_variants: this implementation does not apply
        return _gemm(v.feeds[feed], v.w(f"self_attn.{which}_proj.weight"), v.dtype) + b.to(v.dtype)
    out.append(Variant("bias_after_rounding", "the bias added after the GEMM's rounding", True, bias_after))
    if row_parallel:
        def parallel(v: VariantInput, k: int) -> torch.Tensor:
            y = _row_parallel(v.feeds[feed], v.w(f"self_attn.{which}_proj.weight"), v.dtype, k)
            b = v.w(f"self_attn.{which}_proj.bias", optional=True)      # GPT-OSS: added after the reduction
            return y if b is None else (y.float() + b.float()).to(v.dtype)
        out.append(Variant("row_parallel", "row-parallel, bf16 partials summed", True,
                           lambda v: _tp_worst(v, lambda k: parallel(v, k)), layouts=True))
    return out


def _tp_worst(v: VariantInput, fn: Callable[[int], torch.Tensor]) -> dict:
    """One output per TP degree tried, {"tp2": ..., "tp4": ...}: each is measured as its own variant
    (`run_variants`), so the envelope takes the worst and the fingerprint names the degree that matches."""
    out = {}
    for k in v.tp:
        try:
            out[f"tp{k}"] = fn(k)
        except ValueError:
            continue
    return out


def _plain_gemm(feed: str, weight: str) -> list[Variant]:
    return [Variant("fp32_accumulate", "fp32 accumulation", True,
                    lambda v: _gemm(v.feeds[feed], v.w(weight), v.dtype))]


def _logits(v: VariantInput) -> torch.Tensor:
    head = v.w("lm_head.weight", optional=True)
    if head is None:
        head = v.w("model.embed_tokens.weight")
    return _gemm(v.feeds["final_norm"], head, v.dtype)[:, :v.spec.vocab_size]


# ---------------------------------------------------------------- RMSNorm

def _norm_variants(feed: str | None, weight: Callable[[VariantInput], torch.Tensor],
                   eps: Callable[[VariantInput], float] = lambda v: v.spec.rms_norm_eps) -> list[Variant]:
    def fed(v):
        return v.feeds[feed] if feed else next(iter(v.feeds.values()))

    def x_of(v):
        x = fed(v)
        return x.reshape(*x.shape[:-2], -1) if spans_heads(x, weight(v)) else x

    def variant(fn):             # a norm over the whole projection (OLMoE's QK-norm) back in the heads' layout
        def run(v):
            x = fed(v)
            y = fn(v)
            if isinstance(y, Renderings):
                return Renderings(tuple(c.reshape(x.shape) for c in y.choices), y.seg)
            return y.reshape(x.shape)
        return run

    def gain_after(v):           # HF: normalise in fp32, round, x weight in dt, round
        x, e = x_of(v).float(), eps(v)
        h = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + e)).to(v.dtype)
        return weight(v).to(v.dtype) * h

    def gain_before(v):          # Megatron/TE/SGLang: everything in fp32, one rounding
        x, e = x_of(v).float(), eps(v)
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + e) * weight(v).float()).to(v.dtype)

    def no_upcast(v):            # the fault: every step in dt, rsqrt in either of torch's CPU renderings
        x = x_of(v).to(v.dtype)
        var = x.pow(2).mean(-1, keepdim=True) + eps(v)
        w = weight(v).to(v.dtype)
        once = torch.rsqrt(var.float()).to(v.dtype)                  # vectorised body: fp32, one rounding
        twice = 1 / torch.sqrt(var)                                  # scalar tail: sqrt and 1/x each rounded
        return Renderings((w * (x * once), w * (x * twice)), x.shape[-1])
    return [Variant("fp32_gain_after_cast", "fp32 upcast, gain after the cast back", True, variant(gain_after)),
            Variant("fp32_gain_before_cast", "fp32 upcast, gain before the cast back", True, variant(gain_before)),
            Variant("no_upcast", "no fp32 upcast", False, variant(no_upcast))]


# ---------------------------------------------------------------- RoPE

def _tables(v: VariantInput, x: torch.Tensor, spec) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin in fp32 as HF and the engines build them: fp32 inverse frequencies times fp32 positions."""
    from .rope import rope_inv_freq
    inv, scale = rope_inv_freq(spec, v.layer)
    pos = torch.tensor([p for _, p in v.rows], dtype=torch.float32, device=x.device)
    ang = pos[:, None] * inv.to(torch.float32).to(x.device)[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    return (emb.cos() * scale)[:, None, :], (emb.sin() * scale)[:, None, :]


def rotate(v: VariantInput, x: torch.Tensor, fp32_tables: bool, spec=None) -> torch.Tensor:
    """Rotate-half RoPE of x [rows, heads, d] at v's positions in v's dtype, its tables from `spec` (v.spec
    by default; MLA passes its rope dims as the head dim): the first rotary dims rotated, the rest kept."""
    cos, sin = _tables(v, x, spec or v.spec)
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    if fp32_tables:              # q.float() * cos + rot(q) * sin in fp32, rounded once
        y = (xr.float() * cos + rotated.float() * sin).to(v.dtype)
    else:                        # HF: tables cast to dt, product and sum each rounded
        xr, rotated = xr.to(v.dtype), rotated.to(v.dtype)
        y = xr * cos.to(v.dtype) + rotated * sin.to(v.dtype)
    return torch.cat([y, xp.to(v.dtype)], dim=-1)


def _rope(v: VariantInput, fp32_tables: bool) -> torch.Tensor:
    return rotate(v, next(iter(v.feeds.values())), fp32_tables)


_ROPE = [Variant("bf16_tables", "bf16 cos/sin tables", True, lambda v: _rope(v, False)),
         Variant("fp32_tables", "fp32 cos/sin tables", True, lambda v: _rope(v, True))]


# ---------------------------------------------------------------- attention

def _attention(kernel) -> Callable[[VariantInput], torch.Tensor]:
    def run(v: VariantInput) -> torch.Tensor:
        q, kk, vv, kv_rows = v.feeds["attn.q_rope"], v.feeds["attn.k_rope"], v.feeds["attn.v"], v.feeds["__kv_rows__"]
        dt, scale = v.dtype, v.spec.head_dim ** -0.5
        rep = q.shape[1] // kk.shape[1]
        dev = q.device
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=dt, device=dev)
        for qi, qpos, kidx, kpos in each_sample(v.rows, kv_rows, dev):
            qs = q[qi].to(dt).transpose(0, 1)                                   # [H, Tq, d]
            ks = kk[kidx].to(dt).repeat_interleave(rep, dim=1).transpose(0, 1)  # [H, Tk, d]
            vs = vv[kidx].to(dt).repeat_interleave(rep, dim=1).transpose(0, 1)
            mask = (kpos[None, :] <= qpos[:, None])[None]                       # [1, Tq, Tk]
            o = kernel(qs[None], ks[None], vs[None], mask[None], scale, dt)[0]  # [H, Tq, d]
            out[qi] = o.transpose(0, 1).reshape(len(qi), -1).to(dt)
        return out
    return run


def _attention_variants() -> list[Variant]:
    from torch.nn.attention import SDPBackend
    return [Variant("eager", "eager attention", True, _attention(K.eager)),
            Variant("flash", "flash-style attention", True,
                    _attention(K.flash)),
            Variant("sdpa_math", "SDPA math path", True, _attention(K.sdpa(SDPBackend.MATH))),
            Variant("sdpa", "fused SDPA kernel", True, _attention(K.sdpa(SDPBackend.FLASH_ATTENTION))),
            Variant("scaled_gemm", "scale inside the score GEMM, fp32 softmax (megatron-core local)", True,
                    _attention(K.scaled_gemm)),
            Variant("softmax_bf16", "bf16 softmax", False, _attention(K.softmax_bf16)),
            Variant("kv_fp8", "fp8 KV cache", False, _attention(K.kv_fp8(K.eager)))]


# ---------------------------------------------------------------- gated MLPs and experts

def _act(fused: bool):
    """The activation and product of a gated MLP: unfused (silu and product each rounded), or fused (one
    rounding in fp32). The fault, silu evaluated op by op in dt, is act_bf16.py's (`_op_by_op`)."""
    def fn(g: torch.Tensor, u: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        if fused:
            return (F.silu(g.float()) * u.float()).to(dt)
        return F.silu(g) * u
    return fn


def _gated(x, wg, wu, wd, dt, act, down: Callable | None = None):
    h = act(_gemm(x, wg, dt), _gemm(x, wu, dt), dt)
    return down(h, wd) if down is not None else _gemm(h, wd, dt)


def _shared_weights(v: VariantInput):
    if v.spec.at_layer(v.layer).num_experts:
        return v.ref.weights(v.layer).shared()
    return v.w("mlp.gate_proj.weight"), v.w("mlp.up_proj.weight"), v.w("mlp.down_proj.weight")


def _gated_mlp(act, tp: bool = False) -> Callable[[VariantInput], object]:
    def run(v: VariantInput):
        wg, wu, wd = _shared_weights(v)
        x = v.feeds["mlp_norm"]
        if not tp:
            return _gated(x, wg, wu, wd, v.dtype, act)
        return _tp_worst(v, lambda k: _gated(x, wg, wu, wd, v.dtype, act,
                                             down=lambda h, w: _row_parallel(h, w, v.dtype, k)))
    return run


def _experts(act, fp32_combine: bool, probs_first: bool = False,
             tp: bool = False) -> Callable[[VariantInput], object]:
    """Each routed expert on its rows, x its top-k weight (after the expert, or — megatron-core's experts —
    on the activation before down_proj); the outputs summed in dt one expert after another (HF's index_add,
    megatron's scatter_add) or in fp32 and rounded once (fused MoE kernels). With `tp`, the experts split as
    a TP engine runs them (gate/up column-parallel, down_proj row-parallel over the intermediate dimension):
    each rank's whole experts output over its slice, rounded on the rank, then the ranks' partials summed in
    dt (the all-reduce), at each degree `_tp_worst` tries."""
    def one(v: VariantInput, k: int, i: int) -> torch.Tensor:
        x, ids, wts, dt = v.feeds["mlp_norm"], v.feeds["moe.topk_ids"].long(), v.feeds["moe.topk_weights"], v.dtype
        lw = v.ref.weights(v.layer)
        out = torch.zeros(x.shape, dtype=torch.float32 if fp32_combine else dt, device=x.device)
        for e in torch.unique(ids).tolist():
            r, slot = torch.nonzero(ids == e, as_tuple=True)
            w = wts[r, slot, None]
            wg, wu, wd = _rank_slice(lw.expert(e), k, i)
            if probs_first:
                h = act(_gemm(x[r], wg, dt), _gemm(x[r], wu, dt), dt)
                hw = (h.float() * w.float()).to(dt)     # bf16 x bf16 or x fp32 weights: one rounding
                out.index_add_(0, r, _gemm(hw, wd, dt).to(out.dtype))
                continue
            y = _gated(x[r], wg, wu, wd, dt, act)
            out.index_add_(0, r, (y.float() * w.float()) if fp32_combine else y * w.to(dt))
        return out.to(dt)

    def sharded(v: VariantInput, k: int) -> torch.Tensor:
        out = None
        for i in range(k):
            p = one(v, k, i)
            out = p if out is None else out + p
        return out
    if tp:
        return lambda v: _tp_worst(v, lambda k: sharded(v, k))
    return lambda v: one(v, 1, 0)


def _rank_slice(w: tuple, k: int, i: int) -> tuple:
    """Rank i of k's gate, up and down_proj of one expert: rows of gate/up, columns of down_proj."""
    wg, wu, wd = w
    if k == 1:
        return w
    n = wg.shape[0]
    if n % k:
        raise ValueError(f"intermediate size {n} does not split into {k} shards")
    s = slice(i * (n // k), (i + 1) * (n // k))
    return wg[s], wu[s], wd[:, s]


_UNFUSED, _FUSED = _act(False), _act(True)


def _op_by_op(make: Callable[[Callable], Callable[[VariantInput], torch.Tensor]]) -> Callable[[VariantInput], Renderings]:
    """A fault whose activation is evaluated op by op in dt: one rendering per form real code writes it in
    (act_bf16.py: SiLU as x * sigmoid(x) or x / (1 + exp(-x))), the nearest chosen per row."""
    def run(v: VariantInput) -> Renderings:
        outs = tuple(make(form)(v) for form in gated_forms(v.spec.hidden_act))
        return Renderings(outs, outs[0].shape[-1])
    return run


_GATED = [Variant("unfused", "unfused silu x up", True, _gated_mlp(_UNFUSED)),
          Variant("fused_silu_up", "fused silu x up", True, _gated_mlp(_FUSED)),
          Variant("row_parallel", "row-parallel down_proj", True, _gated_mlp(_UNFUSED, tp=True), layouts=True),
          Variant("silu_bf16", "silu in bf16 (an extra rounding)", False,
                  _op_by_op(_gated_mlp))]
_EXPERTS = [Variant("unfused", "unfused experts, bf16 combine", True,
                    _experts(_UNFUSED, False)),
            Variant("fused_silu_up", "fused silu x up", True, _experts(_FUSED, False)),
            Variant("fp32_combine", "fp32 combine", True,
                    _experts(_UNFUSED, True)),
            Variant("fused_fp32_combine", "fused silu x up, fp32 combine", True, _experts(_FUSED, True)),
            Variant("probs_before_down", "top-k weight applied before down_proj (megatron-core)", True,
                    _experts(_UNFUSED, False, probs_first=True)),
            # TP (or expert-TP) over the intermediate dimension: each rank's experts output, all-reduced
            Variant("row_parallel", "row-parallel down_proj, ranks' partials summed", True,
                    _experts(_UNFUSED, False, tp=True), layouts=True),
            Variant("row_parallel_fp32_combine", "row-parallel down_proj, fp32 combine on each rank", True,
                    _experts(_UNFUSED, True, tp=True), layouts=True),
            Variant("row_parallel_fused_fp32_combine", "row-parallel down_proj, fused silu x up, fp32 combine "
                    "on each rank", True, _experts(_FUSED, True, tp=True), layouts=True),
            Variant("row_parallel_probs_before_down", "row-parallel down_proj, top-k weight applied before "
                    "down_proj", True, _experts(_UNFUSED, False, probs_first=True, tp=True), layouts=True),
            Variant("silu_bf16", "silu in bf16 (an extra rounding)", False,
                    _op_by_op(lambda a: _experts(a, False))),
            # the same fault inside the other engines' experts: SGLang's CPU path combines in fp32,
            # megatron-core's applies the top-k weight before down_proj
            Variant("silu_bf16_fp32_combine", "silu in bf16 (an extra rounding), fp32 combine", False,
                    _op_by_op(lambda a: _experts(a, True))),
            Variant("silu_bf16_probs_before_down", "silu in bf16 (an extra rounding), top-k weight applied "
                    "before down_proj", False, _op_by_op(lambda a: _experts(a, False, probs_first=True)))]


# ---------------------------------------------------------------- top-k weights

def _topk_weights(bf16: bool) -> Callable[[VariantInput], torch.Tensor]:
    def run(v: VariantInput) -> torch.Tensor:
        spec, dt = v.spec, v.dtype
        logits, ids = v.feeds["moe.router_logits"], v.feeds["moe.topk_ids"].long()
        if spec.scoring_func == "sigmoid":
            scores = torch.sigmoid(logits.to(dt) if bf16 else logits.float())
        else:
            scores = torch.softmax(logits.to(dt) if bf16 else logits.float(), dim=-1)
        w = torch.gather(scores, -1, ids)
        if spec.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        return (w * spec.routed_scaling_factor).to(dt)
    return run


_TOPK = [Variant("fp32", "fp32 top-k weights", True, _topk_weights(False)),
         Variant("bf16", "bf16 top-k weights", True, _topk_weights(True))]


def _registry() -> dict[str, list[Variant]]:
    return {
        "attn_norm": _norm_variants(None, lambda v: v.w("input_layernorm.weight")),
        "mlp_norm": _norm_variants(None, lambda v: v.w("post_attention_layernorm.weight")),
        "final_norm": _norm_variants(None, lambda v: v.w("model.norm.weight")),
        "attn.q_norm": _norm_variants("attn.q", lambda v: v.w("self_attn.q_norm.weight")),
        "attn.k_norm": _norm_variants("attn.k", lambda v: v.w("self_attn.k_norm.weight")),
        "attn.q": _proj_variants("q", "attn_norm", False),
        "attn.k": _proj_variants("k", "attn_norm", False),
        "attn.v": _proj_variants("v", "attn_norm", False),
        "attn.q_rope": _ROPE, "attn.k_rope": _ROPE,
        "attn.core": _attention_variants(),
        "attn.out": _proj_variants("o", "attn.core", True),
        "moe.router_logits": _plain_gemm("mlp_norm", "mlp.gate.weight"),
        "moe.topk_weights": _TOPK,
        "moe.experts_out": _EXPERTS,
        "gated_mlp": _GATED,
        "logits": [Variant("fp32_accumulate", "fp32 accumulation", True, _logits)],
    }


VARIANTS: dict[str, list[Variant]] = _registry()


# ---------------------------------------------------------------- measuring them

def tp_degrees(manifest: dict) -> tuple[int, ...]:
    """The TP degree the trace records (Megatron's config, the adapters' parallel layout, SGLang's server
    arguments), else every one of TP_UNKNOWN: a row-parallel GEMM's clean envelope depends on it."""
    where = [(manifest.get("model") or {}).get("tensor_model_parallel_size"),
             (manifest.get("parallel") or {}).get("tp_size"), (manifest.get("numerics") or {}).get("tp_size")]
    for k in where:
        if isinstance(k, int) and not isinstance(k, bool) and k >= 1:
            return (k,) if k > 1 else ()
    return TP_UNKNOWN


def variant_rows(n: int) -> list[int]:
    """At most VARIANT_ROWS row indices, evenly spaced over n rows (all of them when fewer)."""
    if n <= VARIANT_ROWS:
        return list(range(n))
    return sorted({int(i) for i in np.linspace(0, n - 1, VARIANT_ROWS)})
