"""The exact reference: every canonical op recomputed in float64 from the inputs one side recorded.

`ExactReference.compute(point, layer, feeds, rows)` returns what the op between a point's recorded feeds and
the point itself computes in exact arithmetic (float64 is ~2^45 times finer than bf16 and ~2^29 finer than
fp32 for these op sizes: its own rounding is far below the ULP of any dtype a side computes in). Feeds are the
side's *own* recorded inputs, so an op's error is measured without the error its inputs inherit.

Weights come from an HF checkpoint (`checkpoint.HFCheckpoint`), one layer at a time: `compute` for layer L
drops every other layer's weights, so memory stays O(one layer). Each side is replayed with the weights *it*
ran: `ExactReference.for_view(view)` rounds every checkpoint tensor to the dtype that side held it in (its
parameter hashes say so, else its model dtype; `weight_map.side_weight_dtypes`), so an fp32 checkpoint of a
bf16 run gives a bf16 side bf16 weights and an fp32 side fp32 ones. Nothing here imports a framework.
"""
from __future__ import annotations

import math
import sys
from contextlib import contextmanager
from typing import Callable, Iterator

import numpy as np
import torch

from ..families import family_for
from ..families.base import ROUTER_SELECTION_BIAS
from ..graph.canonical import BY_NAME
from .attention_ops import each_sample, spans_heads, windowed_attention
from .layer_types import rope_of_layer
from .checkpoint import FLOAT_DTYPES, HFCheckpoint
from .weight_store import WeightStore
from .grouped_topk import GroupedTopkError, eligible_choice
from .model_spec import ModelSpec
from .rope import apply_rope, rope_inv_freq  # noqa: F401 - rope_inv_freq: with the ops here
from .not_replayable import NotReplayable  # noqa: F401 - imported from here by the replay

RowId = tuple[str, int]
F64 = torch.float64
VOCAB_TENSORS = ("lm_head.weight", "model.embed_tokens.weight")    # indexed by token: ExactReference.vocab_entries


# ---------------------------------------------------------------- pure float64 ops

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * w over the last dim (Llama/Qwen convention: the weight is the scale)."""
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    y = x @ w.T
    return y + b if b is not None else y


_ACT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": torch.nn.functional.silu, "swish": torch.nn.functional.silu,
    "gelu": lambda x: torch.nn.functional.gelu(x),
    "gelu_pytorch_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "relu": torch.relu,
}


def gated_mlp(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor, act: str) -> torch.Tensor:
    """down(act(gate x) * up x): one expert, or a dense MLP."""
    fn = _ACT.get(act)
    if fn is None:
        raise NotReplayable(f"activation {act!r} is not replayed (known: {sorted(_ACT)})")
    return linear(fn(linear(x, wg)) * linear(x, wu), wd)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Softmax attention of one sample's queries q [Tq, H, d] at positions q_pos over its keys k, v
    [Tk, KV, d] at positions k_pos: query i sees the keys at positions <= q_pos[i]. GQA: head h reads kv
    head h // (H/KV)."""
    rep = q.shape[1] // k.shape[1]
    kx = k.repeat_interleave(rep, dim=1)
    vx = v.repeat_interleave(rep, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kx) * scale
    s = s.masked_fill((k_pos[None, :] > q_pos[:, None])[None], -math.inf)
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vx)


def route(logits: torch.Tensor, spec: ModelSpec, bias: torch.Tensor | None,
          ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted top-k ids, their weights in id order) from router logits [rows, E]. With `ids` given (a side's
    own choice), only the weights of those ids are computed: the weight op is judged apart from the choice."""
    if spec.scoring_func == "sigmoid":
        scores = torch.sigmoid(logits)
    elif spec.scoring_func == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        raise NotReplayable(f"router scoring {spec.scoring_func!r} is not replayed (known: softmax, sigmoid)")
    if ids is None:
        choice = scores + bias if bias is not None else scores
        try:                # DeepSeek-V3 / GLM-4.5: only the experts of the best groups are eligible
            choice = eligible_choice(choice, spec)
        except GroupedTopkError as e:
            raise NotReplayable(str(e)) from None
        ids = torch.topk(choice, spec.num_experts_per_tok, dim=-1).indices
        ids = torch.sort(ids, dim=-1).values
    w = torch.gather(scores, -1, ids.long())
    if spec.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    return ids.to(F64), w * spec.routed_scaling_factor


# ---------------------------------------------------------------- weights of one layer

class _LayerWeights:
    """HF parameter names of one decoder layer, read on demand from the checkpoint (cached for this layer),
    each rounded to the dtype the side being replayed held it in."""

    def __init__(self, ref: "ExactReference", layer: int | None):
        self.ref, self.ckpt, self.layer, self.device = ref, ref.ckpt, layer, ref.device
        self.prefix = f"model.layers.{layer}." if layer is not None else "model."
        self._cache: dict[str, torch.Tensor] = {}

    def get(self, *names: str, optional: bool = False) -> torch.Tensor | None:
        """The first of `names` (relative to the layer) the checkpoint has (a vocabulary-indexed tensor: only
        the entries being replayed, where `ExactReference.vocab_entries` says which)."""
        for n in names:
            full = n if n.startswith(("model.", "lm_head")) else self.prefix + n
            cols = self.ref.entries if full in VOCAB_TENSORS else None
            key = full if cols is None else (full, cols[1])
            if key not in self._cache and self.ckpt.has(full):
                info = self.ckpt.info[full]
                if info.dtype not in FLOAT_DTYPES:
                    raise NotReplayable(f"checkpoint tensor {full} is stored as {info.dtype} (quantized), not "
                                        "the float weights the op ran with")
                dtype = self.ref.weight_dtype(full)
                got = self.ref.store.get((key, dtype))      # the other side's read of the same values
                if got is None:
                    got = self.ref.store.put((key, dtype), self.ckpt.tensor(full, self.device, dtype,
                                                                            rows=None if cols is None else cols[0]))
                t, bad = got
                self._cache[key] = t
                if bad:
                    self.ref.nonfinite[full] = (bad, dtype or info.dtype)
            if key in self._cache:
                self.ref.read.append(full)
                return self._cache[key]
        for n in names:             # a tensor the checkpoint stores fused (Phi-3's qkv_proj), or under another name
            t = self.ref.family.derived_weight(self, n)
            if t is not None:
                return t
        if optional:
            return None
        raise NotReplayable(f"checkpoint has no {' / '.join(self.prefix + n for n in names)}")

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate, up, down) of routed expert e: per-expert tensors, or slices of the fused 3-D layout."""
        g = self.get(f"mlp.experts.{e}.gate_proj.weight", optional=True)
        if g is not None:
            return g, self.get(f"mlp.experts.{e}.up_proj.weight"), self.get(f"mlp.experts.{e}.down_proj.weight")
        gu = self.get("mlp.experts.gate_up_proj")
        inter = gu.shape[1] // 2
        return gu[e, :inter], gu[e, inter:], self.get("mlp.experts.down_proj")[e]

    def shared(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        for stem in ("mlp.shared_expert.", "mlp.shared_experts."):
            g = self.get(stem + "gate_proj.weight", optional=True)
            if g is not None:
                return g, self.get(stem + "up_proj.weight"), self.get(stem + "down_proj.weight")
        raise NotReplayable(f"checkpoint has no shared expert under {self.prefix}mlp")


# ---------------------------------------------------------------- the reference

def op_of(point: str, spec: ModelSpec) -> str:
    return family_for(spec).op_of(point, spec) or _generic_op_of(point, spec)


def _generic_op_of(point: str, spec: ModelSpec) -> str:
    """The op replayed at `point` where it depends on the model ('' = the point's own op): a dense model's
    `mlp.out` and a shared expert are a gated MLP (gate, up, act, product, down: five roundings in bf16); a
    MoE model's `mlp.out` adds the experts' output and, Qwen2-MoE style, the shared expert's scaled by a
    sigmoid gate (gate GEMM, sigmoid, product, sum: four roundings); without shared experts, or with
    DeepSeek-style ungated ones, it is one addition. Some ops are chosen by config facts any family may state
    (their variants: fact_variants.py): attention over windows, with soft-capped scores, a scale of its own or
    sinks; a dense gated MLP whose activation is not SiLU."""
    if point == "attn.core" and any(spec.extra.get(k) for k in ("sinks", "attn_softcap", "attn_scale",
                                                                  "sliding_window")):
        return "attention_ext"
    if point == "mlp.out" and not spec.num_experts and spec.hidden_act not in ("silu", "swish"):
        return "gated_mlp_act"
    if point == "moe.shared_out" or (point == "mlp.out" and not spec.num_experts):
        return "gated_mlp"
    if point == "mlp.out" and spec.shared_expert_intermediate_size:
        return "gated_shared_sum"
    return ""


def inputs_of(point: str, spec: ModelSpec, has_qk_norm: bool) -> tuple[str, ...]:
    """Canonical points whose recorded values the op producing `point` reads (canonical.SCHEMA's feeds, with
    the model's own shape: RoPE reads the projection itself when the model has no QK-norm, a dense MLP only
    its norm; `input`/`final_norm` read the previous layer's `output`, written `<prev>.output`)."""
    arch = family_for(spec).inputs_of(point, spec)
    if arch is not None:
        return arch
    if point in ("attn.q", "attn.k", "attn.v"):    # the schema's feeds of attn.q name MLA's q latent too
        return ("attn_norm",)
    if point == "mid":              # without sandwich norms (attn.post_norm, mlp.post_norm: Gemma's)
        return ("input", "attn.out")
    if point == "output":
        return ("mid", "mlp.out")
    if point in ("attn.q_rope", "attn.k_rope") and not has_qk_norm:
        return ("attn.q",) if point == "attn.q_rope" else ("attn.k",)
    if point == "mlp.out":
        if not spec.num_experts:
            return ("mlp_norm",)
        return ("moe.experts_out", "moe.shared_out", "mlp_norm") if _has_shared(spec) else ("moe.experts_out",)
    if point == "moe.experts_out":
        return ("mlp_norm", "moe.topk_ids", "moe.topk_weights")
    if point == "moe.topk_weights":
        return ("moe.router_logits", "moe.topk_ids")
    if point == "final_norm":
        return ("<last>.output",)
    if point in ("embed", "logprobs"):
        return ()     # read the tokens
    # the feeds only some architectures compute (canonical.PointSpec.optional) are theirs to name (Family.inputs_of)
    return tuple(f for f in BY_NAME[point].feeds if f not in BY_NAME or not BY_NAME[f].optional)


def _has_shared(spec: ModelSpec) -> bool:
    return bool(spec.shared_expert_intermediate_size or spec.n_shared_experts)


class ExactReference:
    """Replays canonical ops in float64 with an HF checkpoint's weights, on `device` (CPU by default).

    `weight_dtypes` (one side's, `weight_map.SideWeightDtypes`): the dtype that side held each checkpoint tensor
    in; each is rounded to it before widening. None: the checkpoint's own values (`for_view` gives a side's)."""

    def __init__(self, ckpt: HFCheckpoint | str, device: str = "cpu", weight_dtypes=None,
                 store: WeightStore | None = None):
        self.ckpt = ckpt if isinstance(ckpt, HFCheckpoint) else HFCheckpoint(ckpt)
        self.store = store or WeightStore()         # one layer's tensors, shared with the other side's copy
        self.spec = self.ckpt.spec
        self.family = family_for(self.spec)      # what the model computes otherwise than the base
        self.device = device
        self.weight_dtypes = weight_dtypes
        self.nonfinite: dict[str, tuple[int, str]] = {}    # tensors read with NaN/Inf: (count, dtype rounded to)
        self.read: list[str] = []                          # tensors the current `compute` read
        self.entries: tuple[torch.Tensor, bytes] | None = None  # vocab_entries' (indices, their key) while set
        self._w = _LayerWeights(self, None)
        # Any layer's q_norm says the model has QK-norm (a replayer also asks the side's own trace): one missing
        # tensor must not change the op replayed at every RoPE point.
        self.has_qk_norm = any(n.startswith("model.layers.") and n.endswith(".self_attn.q_norm.weight")
                               for n in self.ckpt.info)
        # the ops this architecture computes otherwise (its family's)
        self.arch_ops = {**({"attn.core": windowed_attention} if self.spec.extra.get("sliding_window") else {}),
                         **self.family.ops(self.spec, _OPS)}

    @contextmanager
    def vocab_entries(self, entries: np.ndarray | None) -> Iterator[None]:
        """While open, the vocabulary-indexed tensors (VOCAB_TENSORS: the embedding table, lm_head) are read
        at those entries (rows) only: the logits' exact op and every implementation of it (its variants, any
        family's) then compute those vocabulary columns alone (replay_rows.py), the embedding those tokens'
        rows, without widening a 262144-row table to float64. None: every entry."""
        if entries is None:
            yield
            return
        idx = np.ascontiguousarray(entries, dtype=np.int64)
        before, self.entries = self.entries, (torch.from_numpy(idx), idx.tobytes())
        try:
            yield
        finally:
            self.entries = before

    def for_view(self, view) -> "ExactReference":
        """This reference for one side: the same checkpoint, each tensor rounded to the dtype that side ran."""
        from ..view.weight_map import side_weight_dtypes
        return ExactReference(self.ckpt, self.device, side_weight_dtypes(view, self.ckpt), self.store)

    def weight_dtype(self, name: str) -> str | None:
        """The dtype `name` is rounded to before widening (None: used as stored)."""
        return self.weight_dtypes.of(name) if self.weight_dtypes is not None else None

    def weights(self, layer: int | None) -> _LayerWeights:
        if self._w.layer != layer:
            self._w = _LayerWeights(self, layer)   # memory: one layer's weights at a time
        self.store.enter(layer)
        return self._w

    def inputs_of(self, point: str, has_qk_norm: bool | None = None, layer: int | None = None) -> tuple[str, ...]:
        return inputs_of(point, self.spec.at_layer(layer), self.has_qk_norm if has_qk_norm is None else has_qk_norm)

    def op_of(self, point: str, layer: int | None = None) -> str:
        return op_of(point, self.spec.at_layer(layer))

    def compute(self, point: str, layer: int | None, feeds: dict[str, torch.Tensor], rows: list[RowId],
                tokens: dict[RowId, int] | None = None) -> torch.Tensor:
        """The exact output [rows, ...] of the op producing (point, layer) from `feeds` (float64, rows
        aligned with `rows`). Raises NotReplayable with the reason when it cannot."""
        fn = self.arch_ops.get(point) or _OPS.get(point)
        if fn is None:
            raise NotReplayable(f"{point} has no exact reference")
        self.read = []
        return fn(self, layer, feeds, rows, tokens or {})

    def nonfinite_weights(self) -> list[str]:
        """The tensors the last `compute` read that hold NaN/Inf, described for a reason."""
        return [f"checkpoint tensor {n} holds {self.nonfinite[n][0]} NaN/Inf value(s) (as {self.nonfinite[n][1]})"
                for n in dict.fromkeys(self.read) if n in self.nonfinite]


def _norm(weight: str) -> Callable:
    def op(ref: ExactReference, layer, feeds, rows, tokens):
        (x,) = feeds.values()
        return rms_norm(x, ref.weights(layer).get(weight), ref.spec.rms_norm_eps)
    return op


def _qk_norm(which: str) -> Callable:
    """Per head (Qwen3), or over the whole projection where the gain is heads x head_dim wide (OLMoE)."""
    def op(ref: ExactReference, layer, feeds, rows, tokens):
        x, w = feeds[f"attn.{which}"], ref.weights(layer).get(f"self_attn.{which}_norm.weight")
        if spans_heads(x, w):
            return rms_norm(x.reshape(*x.shape[:-2], -1), w, ref.spec.rms_norm_eps).reshape(x.shape)
        return rms_norm(x, w, ref.spec.rms_norm_eps)
    return op


def _proj(which: str, feed: str, heads: str | None) -> Callable:
    def op(ref: ExactReference, layer, feeds, rows, tokens):
        w = ref.weights(layer)
        y = linear(feeds[feed], w.get(f"self_attn.{which}_proj.weight"),
                   w.get(f"self_attn.{which}_proj.bias", optional=True))
        if heads is None:
            return y
        n = ref.spec.num_attention_heads if heads == "q" else ref.spec.num_key_value_heads
        return y.reshape(len(rows), n, ref.spec.head_dim)
    return op


def _rope(which: str) -> Callable:
    def op(ref: ExactReference, layer, feeds, rows, tokens):
        (x,) = feeds.values()
        pos = torch.tensor([p for _, p in rows], dtype=F64, device=x.device)
        return apply_rope(x, pos, ref.spec, layer)
    return op


_QUERY_BLOCK = 256     # queries per float64 score block: memory O(heads x block x keys)


def _attention(ref: ExactReference, layer, feeds, rows, tokens):
    """Per sample: the query rows asked for, over every key position 0..p of that sample (all must be
    present in the side's k_rope/v rows, gathered over passes; a decode step's KV cache is its earlier rows)."""
    return attend_by_sample(feeds["attn.q_rope"], feeds["attn.k_rope"], feeds["attn.v"], rows,
                            feeds["__kv_rows__"], ref.spec.head_dim ** -0.5)


def attend_by_sample(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: list[RowId],
                     kv_rows: dict[RowId, int], scale: float) -> torch.Tensor:
    """Causal attention of the query rows `rows` (q [rows, heads, d]) over each one's sample's key/value rows
    at positions 0..p (`kv_rows`: row id -> index into k, v), in query blocks: [rows, heads * v's width]."""
    out = torch.empty(q.shape[0], q.shape[1] * v.shape[-1], dtype=F64, device=q.device)
    for qi, qpos_all, kidx, kpos in each_sample(rows, kv_rows, q.device):
        for lo in range(0, len(qi), _QUERY_BLOCK):
            blk = torch.tensor(qi[lo:lo + _QUERY_BLOCK], device=q.device)
            qpos = qpos_all[lo:lo + _QUERY_BLOCK]
            hi = int(qpos.max()) + 1
            o = causal_attention(q[blk], k[kidx[:hi]], v[kidx[:hi]], scale, qpos, kpos[:hi])
            out[blk] = o.reshape(len(blk), -1)
    return out


def _add(a: str, b: str) -> Callable:
    """The residual add of its two feeds (`b`, or the sandwich norm standing in for it: inputs_of)."""
    def op(ref, layer, feeds, rows, tokens):
        x, y = feeds.values()
        return x + y
    return op


def _router(ref: ExactReference, layer, feeds, rows, tokens):
    return linear(feeds["mlp_norm"], ref.weights(layer).get("mlp.gate.weight"))


def _bias(ref: ExactReference, layer) -> torch.Tensor | None:
    return ref.weights(layer).get(ROUTER_SELECTION_BIAS, optional=True)      # the family's name: derived_weight


def _topk_ids(ref: ExactReference, layer, feeds, rows, tokens):
    return route(feeds["moe.router_logits"], ref.spec, _bias(ref, layer))[0]


def _topk_weights(ref: ExactReference, layer, feeds, rows, tokens):
    return route(feeds["moe.router_logits"], ref.spec, _bias(ref, layer), ids=feeds["moe.topk_ids"])[1]


def _experts(ref: ExactReference, layer, feeds, rows, tokens):
    x, ids, wts = feeds["mlp_norm"], feeds["moe.topk_ids"].long(), feeds["moe.topk_weights"]
    w = ref.weights(layer)
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        if not 0 <= e < ref.spec.num_experts:
            raise NotReplayable(f"expert id {e} outside 0..{ref.spec.num_experts - 1}")
        r, slot = torch.nonzero(ids == e, as_tuple=True)
        out.index_add_(0, r, wts[r, slot, None] * gated_mlp(x[r], *w.expert(e), ref.spec.hidden_act))
    return out


def _shared(ref: ExactReference, layer, feeds, rows, tokens):
    return gated_mlp(feeds["mlp_norm"], *ref.weights(layer).shared(), ref.spec.hidden_act)


def _mlp_out(ref: ExactReference, layer, feeds, rows, tokens):
    w = ref.weights(layer)
    if not ref.spec.at_layer(layer).num_experts:
        return gated_mlp(feeds["mlp_norm"], w.get("mlp.gate_proj.weight"), w.get("mlp.up_proj.weight"),
                         w.get("mlp.down_proj.weight"), ref.spec.hidden_act)
    out = feeds["moe.experts_out"]
    if "moe.shared_out" in feeds:
        gate = w.get("mlp.shared_expert_gate.weight", optional=True)
        s = feeds["moe.shared_out"]
        out = out + (torch.sigmoid(linear(feeds["mlp_norm"], gate)) * s if gate is not None else s)
    return out


def _identity(ref, layer, feeds, rows, tokens):
    (x,) = feeds.values()
    return x


def _token_ids(ref: ExactReference, rows: list[RowId], tokens: dict[RowId, int], shift: int) -> list[int]:
    """The recorded token of each row (shifted: the next token), every one inside the checkpoint's vocabulary:
    an id outside it (a padding -1, a row past the table) is said, with its row, never read as another row."""
    out, bad = [], []
    vocab = ref.spec.vocab_size
    for r in rows:
        row = (r[0], r[1] + shift)
        t = tokens.get(row)
        if t is None:
            raise NotReplayable(f"token of row {row} not recorded")
        t = int(t)
        if not 0 <= t < vocab:
            bad.append(f"{t} at row {row[0]}@{row[1]}")
        out.append(t)
    if bad:
        raise NotReplayable(f"token id(s) outside the checkpoint's vocabulary 0..{vocab - 1}: {', '.join(bad[:4])}"
                            + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
                            + ": the run fed ids no embedding row holds (padding?)")
    return out


def _embed(ref: ExactReference, layer, feeds, rows, tokens):
    entries, at = np.unique(np.asarray(_token_ids(ref, rows, tokens, 0), dtype=np.int64), return_inverse=True)
    with ref.vocab_entries(entries):        # the rows' tokens only, not the whole table widened
        w = ref.weights(None).get("model.embed_tokens.weight")
    return w[torch.from_numpy(at.reshape(-1)).to(w.device)]


def _logits(ref: ExactReference, layer, feeds, rows, tokens):
    w = ref.weights(None)
    head = w.get("lm_head.weight", optional=True)
    if head is None and ref.spec.tie_word_embeddings:
        head = w.get("model.embed_tokens.weight")
    if head is None:
        raise NotReplayable("checkpoint has no lm_head.weight and the embeddings are not tied")
    return linear(feeds["final_norm"], head)[:, :ref.spec.vocab_size]


def _logprobs(ref: ExactReference, layer, feeds, rows, tokens):
    lp = torch.log_softmax(feeds["logits"], dim=-1)
    nxt = torch.tensor(_token_ids(ref, rows, tokens, 1), device=lp.device)
    return lp.gather(-1, nxt[:, None])


class OpTable(dict):
    """point -> float64 op, handed to `Family.ops` (tic_trace/families/base.py) with `f64`, this module: the
    float64 helpers (linear, rms_norm, attend_by_sample...) a family's ops build on,
    since a family may not import reference (an import circle)."""
    f64 = None


_OPS = OpTable({
    "embed": _embed,
    "input": _identity,
    "attn_norm": _norm("input_layernorm.weight"),
    "attn.q": _proj("q", "attn_norm", "q"),
    "attn.k": _proj("k", "attn_norm", "kv"),
    "attn.v": _proj("v", "attn_norm", "kv"),
    "attn.q_norm": _qk_norm("q"),
    "attn.k_norm": _qk_norm("k"),
    "attn.q_rope": _rope("q"),
    "attn.k_rope": _rope("k"),
    "attn.core": _attention,
    "attn.out": _proj("o", "attn.core", None),
    "mid": _add("input", "attn.out"),
    "mlp_norm": _norm("post_attention_layernorm.weight"),
    "moe.router_logits": _router,
    "moe.topk_ids": _topk_ids,
    "moe.topk_weights": _topk_weights,
    "moe.experts_out": _experts,
    "moe.shared_out": _shared,
    "mlp.out": _mlp_out,
    "output": _add("mid", "mlp.out"),
    "final_norm": _norm("model.norm.weight"),
    "logits": _logits,
    "logprobs": _logprobs,
})
_OPS.f64 = sys.modules[__name__]

