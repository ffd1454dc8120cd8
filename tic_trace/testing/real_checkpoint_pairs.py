"""Clean pairs and planted faults on the real Gemma-3-270M checkpoint (tic_trace/testing/real_checkpoint.py),
for tests/test_real_checkpoint.py.

Token ids are real conversations through the model's own tokenizer and chat template: a user's RL-style prompt
and a fixed model answer, cut to `TOKENS` positions (fixed text, so the ids are the same on every machine and
CPU code path). The vocabulary is 262144 wide: every traced position costs a 1 MB fp32 logits row per side, so
the batch stays small.

A clean variant changes how one side computes (attention kernel, TP split of the row-parallel layers, the
fused residual add + norm, RoPE tables' dtype, batching, prefill + decode); a fault changes one op of one
layer in the computation (never the trace). Gemma's (1 + w) norms, per-layer-type RoPE and sandwich norms need
their own planters where the Llama-family ones in clean_variants.py / precision_faults.py assume otherwise.
"""
from __future__ import annotations

import contextlib
import copy
import types
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

import tic_trace

from . import clean_variants as cv
from . import precision_faults as pf
from .faults import FAULTS

TOKENS = 24
CONVERSATIONS = (
    ("Solve step by step: a train travels 120 km in 1.5 hours. What is its average speed?",
     "The average speed is distance divided by time: 120 km / 1.5 h = 80 km/h."),
    ("Write a Python function that returns the square of a number.",
     "def square(x):\n    return x * x"),
)


def sample_ids(tok) -> torch.Tensor:
    """[len(CONVERSATIONS), TOKENS]: each conversation in the chat template (BOS first), cut to TOKENS."""
    rows = []
    for user, answer in CONVERSATIONS:
        msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        ids = tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
        if len(ids) < TOKENS:
            raise ValueError(f"conversation of {len(ids)} tokens, fewer than {TOKENS}")
        rows.append(ids[:TOKENS])
    return torch.tensor(rows)


KEYS = [f"s{i}" for i in range(len(CONVERSATIONS))]


def trace_batch(model, out, ids, **kw) -> str:
    """One traced forward over the batch (points in full)."""
    with tic_trace.trace(model, out, adapter="hf", points_mode="full", **kw) as t, torch.no_grad():
        t.sample_keys = KEYS[:ids.shape[0]]
        model(ids)
    assert t.failed is None, t.failed
    return str(out)


def trace_split(model, out, ids) -> str:
    """Each sample in a forward of its own, in the other order: other GEMM shapes, the same rows."""
    with tic_trace.trace(model, out, adapter="hf", points_mode="full") as t, torch.no_grad():
        for i in reversed(range(ids.shape[0])):
            t.sample_keys = [KEYS[i]]
            model(ids[i:i + 1])
            t.step()
    assert t.failed is None, t.failed
    return str(out)


def trace_decode(model, out, ids, prompt: int) -> str:
    """A prefill of `prompt` positions, then one cached decode step per remaining position."""
    with tic_trace.trace(model, out, adapter="hf", points_mode="full") as t, torch.no_grad():
        t.sample_keys = KEYS[:ids.shape[0]]
        cache = model(ids[:, :prompt], use_cache=True).past_key_values
        for j in range(prompt, ids.shape[1]):
            t.step()
            cache = model(ids[:, j:j + 1], past_key_values=cache, use_cache=True).past_key_values
    assert t.failed is None, t.failed
    return str(out)


def trace_side_b(model, out, ids, clean: str | None = None, fault: tuple[str, int] | None = None,
                 prompt: int = 16) -> str:
    """Side B of a pair: a copy of `model` computing as clean variant `clean` (CLEAN) and/or with
    `fault` = (name, layer) planted (FAULT_LIST), traced as that variant traces (`prompt`: the prefill's
    positions of a prefill + decode pair). The model itself is left as it was."""
    m = copy.deepcopy(model)
    c = CLEAN[clean] if clean else Clean("identical", "")
    if c.plant:
        c.plant(m)
    if fault:
        FAULT_LIST[fault[0]].plant(m, fault[1])
    with (c.context(m) if c.context else contextlib.nullcontext()):
        if c.trace == "split":
            return trace_split(m, out, ids)
        if c.trace == "decode":
            return trace_decode(m, out, ids, prompt)
        return trace_batch(m, out, ids)


# ------------------------------------------------------------------------------------------ clean variants

def _layer(model, i):
    return model.model.layers[i]


def _wrap(module, fn) -> None:
    module.forward = types.MethodType(fn, module)


def tp_row_parallel(k: int, declared: bool) -> Callable:
    """Every o_proj and down_proj as a TP=k row-parallel layer (bf16 partials summed in bf16); `declared`:
    the model says its degree (`_tp_size`), as a sharded HF model's trace would, else the trace says TP 1."""
    plant = cv.tp_row_parallel(k)

    def go(model) -> None:
        plant(model)
        if not declared:
            del model._tp_size
    return go


def _fused_add_norm_layer(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None,
                          cache=None, **kwargs):
    """Gemma3's decoder layer with SGLang's fused residual add + RMSNorm: the add in fp32, its bf16 rounding
    kept as the residual stream, the pre-MLP norm applied to the fp32 sum (one kernel). The norm module is
    called on the rounded sum (the residual stream it is handed) and computes from the fp32 sum."""
    residual = hidden_states
    h = self.input_layernorm(hidden_states)
    h, _ = self.self_attn(hidden_states=h, position_embeddings=position_embeddings, attention_mask=attention_mask,
                          position_ids=position_ids, cache=cache, **kwargs)
    h = self.post_attention_layernorm(h)
    mid32 = residual.float() + h.float()
    mid = mid32.to(residual.dtype)
    self.pre_feedforward_layernorm.fp32_sum = mid32
    try:
        h = self.pre_feedforward_layernorm(mid)
    finally:
        self.pre_feedforward_layernorm.fp32_sum = None
    h = self.post_feedforward_layernorm(self.mlp(h))
    return mid + h


def _fused_norm(self, x):
    xf = self.fp32_sum if getattr(self, "fp32_sum", None) is not None else x.float()
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())
    return n.to(x.dtype)


def fused_add_norm(model) -> None:
    """Every layer with the fused residual add + pre-MLP RMSNorm in fp32 (SGLang's GemmaRMSNorm with residual)."""
    for lay in model.model.layers:
        _wrap(lay, _fused_add_norm_layer)
        _wrap(lay.pre_feedforward_layernorm, _fused_norm)


def rope_fp32_tables(model) -> contextlib.AbstractContextManager:
    """RoPE with fp32 cos/sin tables (each layer type's own base), q and k rotated in fp32 and rounded back
    once, while the context is open (HF's bf16 tables restored after). Trace inside the context."""
    rotary = model.model.rotary_emb

    def pre_for(layer_type):
        def pre(mod, args, kwargs):
            h = kwargs["hidden_states"]
            pos = kwargs.get("position_ids")
            if pos is None:
                pos = torch.arange(h.shape[1])[None]
            kwargs["position_embeddings"] = rotary(h.float(), pos, layer_type)
            return args, kwargs
        return pre

    return cv.rotated_in_fp32(model, lambda lay: pre_for(lay.self_attn.layer_type))


@dataclass(frozen=True)
class Clean:
    name: str
    what: str
    plant: Callable | None = None               # fn(model) before tracing
    trace: str = "batch"                        # "batch" | "split" | "decode"
    context: Callable | None = None             # fn(model) -> context manager to trace inside


CLEAN = {c.name: c for c in [
    Clean("sdpa", "torch's fused SDPA attention instead of HF's eager", cv.attention("sdpa")),
    Clean("flash", "flash-style attention: online softmax over key blocks", cv.attention("flash")),
    Clean("tp2_declared", "o_proj and down_proj row-parallel over 2 shards, TP 2 declared", tp_row_parallel(2, True)),
    Clean("tp2_undeclared", "o_proj and down_proj row-parallel over 2 shards, the trace says TP 1",
          tp_row_parallel(2, False)),
    Clean("tp4_declared", "o_proj and down_proj row-parallel over 4 shards, TP 4 declared", tp_row_parallel(4, True)),
    Clean("tp4_undeclared", "o_proj and down_proj row-parallel over 4 shards, the trace says TP 1",
          tp_row_parallel(4, False)),
    Clean("fused_add_norm", "residual add + pre-MLP RMSNorm fused in fp32 (SGLang's)", fused_add_norm),
    Clean("rope_fp32", "RoPE cos/sin tables in fp32, q/k rotated in fp32", context=rope_fp32_tables),
    Clean("batch_split", "each sample in its own forward, in the other order", trace="split"),
    Clean("prefill_decode", "a prefill, then cached decode steps", trace="decode"),
]}


# ------------------------------------------------------------------------------------------ faults

def _stale_o_proj(model, layer):
    """The layer's o_proj computes with a stale copy of its weight (the previous step's: every element 1%
    of the mean |w| off), the parameter itself untouched (a missed weight sync)."""
    lin = _layer(model, layer).self_attn.o_proj
    w = lin.weight.detach()
    g = torch.Generator().manual_seed(layer)
    stale = (w.float() + 0.01 * w.float().abs().mean() * torch.randn(w.shape, generator=g)).to(w.dtype)
    lin.forward = lambda x: F.linear(x, stale)


def _wrong_eps(model, layer):
    """The MLP branch's RMSNorm with eps 1e-6 -> 1e-5 (Llama's default where Gemma says 1e-6). Where the eps
    matters: that norm's inputs have mean squares down to 1e-8 (the pre-MLP norm's are 1e4-1e6, where no eps
    shows)."""
    _layer(model, layer).post_feedforward_layernorm.eps = 1e-5


def _gelu_bf16(model, layer):
    """The MLP's GELU-tanh evaluated step by step in bf16: every elementwise op rounded."""
    mlp = _layer(model, layer).mlp

    def act(self, x):
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return 0.5 * x * (1.0 + torch.tanh(inner))
    _wrap(mlp.act_fn, act)


def _norm_no_upcast(attr):
    def plant(model, layer):
        pf.offset_rmsnorm_no_upcast(getattr(_layer(model, layer), attr))
    return plant


def _norm_no_upcast_attn(attr):
    def plant(model, layer):
        pf.offset_rmsnorm_no_upcast(getattr(_layer(model, layer).self_attn, attr))
    return plant


def _rope_theta(model, layer):
    FAULTS["rope_theta"].plant["hf"](model, layer)


@dataclass(frozen=True)
class Fault:
    name: str
    point: str
    what: str
    plant: Callable             # fn(model, layer)


FAULT_LIST = {f.name: f for f in [
    Fault("input_norm_no_upcast", "attn_norm", "input RMSNorm in bf16 (no fp32 upcast)",
          _norm_no_upcast("input_layernorm")),
    Fault("post_attn_norm_no_upcast", "attn.post_norm", "attention-branch RMSNorm in bf16",
          _norm_no_upcast("post_attention_layernorm")),
    Fault("pre_mlp_norm_no_upcast", "mlp_norm", "pre-MLP RMSNorm in bf16",
          _norm_no_upcast("pre_feedforward_layernorm")),
    Fault("softmax_bf16", "attn.core", "attention softmax in bf16", pf.PRECISION_FAULTS["softmax_bf16"].plant),
    Fault("rope_theta", "attn.q_rope", "RoPE base 5000 in one layer", _rope_theta),
    Fault("stale_o_proj", "attn.out", "o_proj computed with a stale weight", _stale_o_proj),
    Fault("wrong_eps", "mlp.post_norm", "MLP-branch RMSNorm eps 1e-5 (Gemma's is 1e-6)", _wrong_eps),
    Fault("gelu_bf16", "mlp.out", "GELU-tanh step by step in bf16", _gelu_bf16),
    Fault("kv_fp8", "attn.core", "K and V through an fp8 cache", pf.PRECISION_FAULTS["kv_fp8"].plant),
    Fault("q_norm_no_upcast", "attn.q_norm", "Q-norm in bf16 (no fp32 upcast)", _norm_no_upcast_attn("q_norm")),
]}
# o_proj's reduction in 4 bf16 partials at TP 1 (precision_faults.o_proj_bf16_partials) is not among them: it is
# bit for bit a TP = 4 row-parallel o_proj, which the replay names as an undeclared split (the tp4_undeclared
# clean pair), not a fault.
