"""Planted faults: small, realistic numerical bugs planted in the *computation* of one side.

Each fault is one `Fault` entry: the canonical point where it must be found, and per framework a function
`plant(model, layer)` that changes how that model computes (an attribute, a weight, or a forward), never what
a trace records. Adapters' test suites reuse this table: adding a framework means adding its planter to the
entries it supports.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Fault:
    name: str
    point: str                   # canonical point where the finder must report it
    layered: bool                # found at the planted layer (else a global point)
    what: str
    plant: dict = field(default_factory=dict)   # framework -> fn(model, layer)
    moe_only: bool = False
    cause: str = "operator"      # the cause class the report must name (report.schema.CAUSES)
    setup: dict = field(default_factory=dict)   # framework -> fn(model, layer): a property of the *model*
                                                # both sides need before the fault means anything (e.g. two
                                                # experts' router rows nearly tied); applied with `prepare`
    suite: str = "core"          # "core": the adapters' suites run it; "redteam": tests/test_finder_redteam.py;
                                 # "decode": acts in decode steps only, so only tests that drive decode run it


FAULTS: dict[str, Fault] = {}


def fault(name: str, point: str, what: str, *, layered: bool = True, moe_only: bool = False, cause: str = "operator",
          suite: str = "core"):
    """Register a planter for `framework` under fault `name` (decorator: @fault(...).on("hf")), or a setup
    both sides need (@fault(...).setup_on("hf"))."""
    def _register(framework: str, fn: Callable, slot: str):
        f = FAULTS.get(name) or Fault(name, point, layered, what, {}, moe_only, cause, {}, suite)
        plant_, setup_ = dict(f.plant), dict(f.setup)
        (plant_ if slot == "plant" else setup_)[framework] = fn
        FAULTS[name] = Fault(f.name, f.point, f.layered, f.what, plant_, f.moe_only, f.cause, setup_, f.suite)

    class _Reg:
        @staticmethod
        def on(framework: str):
            def deco(fn: Callable):
                _register(framework, fn, "plant")
                return fn
            return deco

        @staticmethod
        def setup_on(framework: str):
            def deco(fn: Callable):
                _register(framework, fn, "setup")
                return fn
            return deco
    return _Reg


def plant(model, framework: str, name: str, layer: int) -> Fault:
    f = FAULTS[name]
    if framework not in f.plant:
        raise KeyError(f"fault {name!r} has no planter for {framework!r} (has: {sorted(f.plant)})")
    f.plant[framework](model, layer)
    return f


def prepare(model, framework: str, name: str | None, layer: int) -> None:
    """Apply fault `name`'s setup (if it has one) to a model of either side, before tracing it."""
    f = FAULTS.get(name) if name else None
    if f is None or not f.setup:
        return
    if framework not in f.setup:
        raise KeyError(f"fault {name!r} has no setup for {framework!r} (has: {sorted(f.setup)})")
    f.setup[framework](model, layer)


def one_sided(names: list[str]) -> list[str]:
    """The faults that need nothing on the other side (no setup)."""
    return [n for n in names if not FAULTS[n].setup]


def _hf_layer(model, layer):
    return model.model.layers[layer]


def _wrap_forward(module, new_forward):
    module.forward = types.MethodType(new_forward, module)


# ---------------------------------------------------------------- HF planters

@fault("rmsnorm_eps", "attn_norm", "input RMSNorm epsilon 1e-6 -> 1e-2").on("hf")
def _hf_rmsnorm_eps(model, layer):
    _hf_layer(model, layer).input_layernorm.variance_epsilon = 1e-2


@fault("rope_theta", "attn.q_rope", "RoPE base 10000 -> 5000 in one layer's attention").on("hf")
def _hf_rope_theta(model, layer):
    attn = _hf_layer(model, layer).self_attn
    head_dim = attn.head_dim
    inv = 1.0 / (5000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))

    def pre(mod, args, kwargs):
        cos, sin = kwargs["position_embeddings"]
        s = cos.shape[-2]
        pos = kwargs.get("position_ids")
        pos = pos.float() if pos is not None else torch.arange(s, dtype=torch.float32)[None]
        freqs = pos[..., None] * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        kwargs["position_embeddings"] = (emb.cos().to(cos.dtype), emb.sin().to(sin.dtype))
        return args, kwargs
    attn.register_forward_pre_hook(pre, with_kwargs=True)


@fault("softmax_scale", "attn.core", "attention softmax scale x1.05").on("hf")
def _hf_softmax_scale(model, layer):
    _hf_layer(model, layer).self_attn.scaling *= 1.05


@fault("qk_norm_weight", "attn.k_norm", "one K-norm weight element x1.05").on("hf")
def _hf_qk_norm(model, layer):
    with torch.no_grad():
        _hf_layer(model, layer).self_attn.k_norm.weight[3] *= 1.05


@fault("o_proj_weight", "attn.out", "output projection weight nudged by 1%").on("hf")
def _hf_o_proj(model, layer):
    with torch.no_grad():
        w = _hf_layer(model, layer).self_attn.o_proj.weight
        w.add_(0.01 * w.abs().mean() * torch.sign(w))


@fault("residual_bf16", "mid", "post-attention residual add done in bf16").on("hf")
def _hf_residual_bf16(model, layer):
    lay = _hf_layer(model, layer)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, **kwargs):
        residual = hidden_states
        h = self.input_layernorm(hidden_states)
        h, _ = self.self_attn(hidden_states=h, attention_mask=attention_mask, position_ids=position_ids,
                              cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        h = (residual.bfloat16() + h.bfloat16()).to(residual.dtype)   # the fault
        residual = h
        h = self.post_attention_layernorm(h)
        h = self.mlp(h)
        return residual + h
    _wrap_forward(lay, forward)


@fault("mlp_norm_weight", "mlp_norm", "pre-MLP norm weight x1.02").on("hf")
def _hf_mlp_norm(model, layer):
    with torch.no_grad():
        _hf_layer(model, layer).post_attention_layernorm.weight.mul_(1.02)


@fault("router_bf16", "moe.router_logits", "router GEMM in bf16", moe_only=True).on("hf")
def _hf_router_bf16(model, layer):
    gate = _hf_layer(model, layer).mlp.gate
    orig = gate.forward

    def forward(self, hidden_states):
        hs = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(hs.bfloat16(), self.weight.bfloat16()).to(hs.dtype)   # the fault
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), idx
    del orig
    _wrap_forward(gate, forward)


@fault("expert_weight", "moe.experts_out", "expert 1's down-projection x1.02", moe_only=True).on("hf")
def _hf_expert_weight(model, layer):
    with torch.no_grad():
        _hf_layer(model, layer).mlp.experts.down_proj[1].mul_(1.02)


@fault("lm_head_bf16", "logits", "lm_head GEMM in bf16", layered=False).on("hf")
def _hf_lm_head_bf16(model, layer):
    head = model.lm_head

    def forward(self, x):
        return F.linear(x.bfloat16(), self.weight.bfloat16()).to(x.dtype)   # the fault
    _wrap_forward(head, forward)


def hf_faults(moe: bool) -> list[str]:
    """Faults planted on one side only (those with a both-sides setup are listed by `routing_faults`)."""
    return [n for n, f in FAULTS.items() if "hf" in f.plant and (moe or not f.moe_only) and not f.setup
            and f.suite == "core"]


# ---------------------------------------------------------------- Megatron planters
# `model` is a megatron-core GPTModel, possibly inside DDP / Float16Module wrappers (`.module`), or a list of
# virtual-pipeline chunks. `layer` is the global 0-based layer (`layer_number - 1`); a pipeline stage that
# does not hold it is left unchanged.

def _mg_roots(model) -> list:
    out = []
    for m in (model if isinstance(model, (list, tuple)) else [model]):
        depth = 0
        while not hasattr(m, "decoder") and hasattr(m, "module") and depth < 8:
            m, depth = m.module, depth + 1
        out.append(m)
    return out


def _mg_layer(model, layer):
    """The TransformerLayer with global index `layer` on this rank, or None."""
    for root in _mg_roots(model):
        for lay in getattr(getattr(root, "decoder", None), "layers", []) or []:
            if int(getattr(lay, "layer_number", 0)) - 1 == layer:
                return lay
    return None


def _mg_set(module, attr: str, value) -> None:
    """Set a plain attribute even where nn.Module.__setattr__ would object (a child module's name)."""
    object.__setattr__(module, attr, value)


@fault("rmsnorm_eps", "attn_norm", "input RMSNorm epsilon 1e-6 -> 1e-2").on("megatron")
def _mg_rmsnorm_eps(model, layer):
    lay = _mg_layer(model, layer)
    if lay is None:
        return
    norm = lay.input_layernorm
    if hasattr(norm, "eps"):               # torch.nn.RMSNorm (local spec), TE / apex norms
        norm.eps = 1e-2
    else:                                  # TE spec: the norm lives inside linear_qkv
        lay.self_attention.linear_qkv.eps = 1e-2


@fault("rope_theta", "attn.q_rope", "RoPE base 10000 -> 5000 in one layer's attention").on("megatron")
def _mg_rope_theta(model, layer):
    lay = _mg_layer(model, layer)
    if lay is None:
        return
    rope = _mg_roots(model)[0].rotary_pos_emb
    inv_old = rope.inv_freq.detach().double().cpu()
    dim = 2 * inv_old.numel()
    inv_new = 1.0 / (5000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    ratio = torch.cat([inv_new / inv_old, inv_new / inv_old])      # rotate-half layout [f | f]

    def rescale(freqs):
        # freqs [..., rot_dim] = position * inv_freq, whatever the positions (SBHD, THD, CP): rescale columns
        return (freqs.double() * ratio.to(freqs.device)).to(freqs.dtype)

    def pre(mod, args, kwargs):
        emb = kwargs.get("rotary_pos_emb")
        if emb is None:
            return None
        kwargs["rotary_pos_emb"] = tuple(rescale(e) for e in emb) if isinstance(emb, tuple) else rescale(emb)
        return args, kwargs
    lay.self_attention.register_forward_pre_hook(pre, with_kwargs=True)


@fault("softmax_scale", "attn.core", "attention softmax scale x1.05").on("megatron")
def _mg_softmax_scale(model, layer):
    lay = _mg_layer(model, layer)
    if lay is not None:
        lay.self_attention.core_attention.softmax_scale *= 1.05


@fault("qk_norm_weight", "attn.k_norm", "one K-norm weight element x1.05").on("megatron")
def _mg_qk_norm(model, layer):
    lay = _mg_layer(model, layer)
    if lay is not None:
        with torch.no_grad():
            lay.self_attention.k_layernorm.weight[3] *= 1.05


@fault("o_proj_weight", "attn.out", "output projection weight nudged by 1%").on("megatron")
def _mg_o_proj(model, layer):
    lay = _mg_layer(model, layer)
    if lay is not None:
        with torch.no_grad():
            w = lay.self_attention.linear_proj.weight
            w.add_(0.01 * w.abs().mean() * torch.sign(w))


@fault("residual_bf16", "mid", "post-attention residual add done in bf16").on("megatron")
def _mg_residual_bf16(model, layer):
    lay = _mg_layer(model, layer)
    if lay is None:
        return

    def bda(training, fused):
        def add(x_with_bias, residual, prob):
            x, bias = x_with_bias
            if bias is not None:
                x = x + bias
            return (residual.bfloat16() + x.bfloat16()).to(residual.dtype)   # the fault
        return add
    _mg_set(lay, "self_attn_bda", bda)


@fault("mlp_norm_weight", "mlp_norm", "pre-MLP norm weight x1.02").on("megatron")
def _mg_mlp_norm(model, layer):
    lay = _mg_layer(model, layer)
    if lay is None:
        return
    norm = lay.pre_mlp_layernorm
    w = getattr(norm, "weight", None)
    if w is None:                          # TE spec dense layer: the norm lives inside linear_fc1
        w = lay.mlp.linear_fc1.layer_norm_weight
    with torch.no_grad():
        w.mul_(1.02)


@fault("router_bf16", "moe.router_logits", "router GEMM in bf16", moe_only=True).on("megatron")
def _mg_router_bf16(model, layer):
    lay = _mg_layer(model, layer)
    if lay is None:
        return

    def gating(self, input):
        return F.linear(input.bfloat16(), self.weight.bfloat16()).to(input.dtype)   # the fault
    lay.mlp.router.gating = types.MethodType(gating, lay.mlp.router)


@fault("expert_weight", "moe.experts_out", "expert 1's down-projection x1.02", moe_only=True).on("megatron")
def _mg_expert_weight(model, layer):
    lay = _mg_layer(model, layer)
    if lay is None:
        return
    experts = lay.mlp.experts
    if 1 in lay.mlp.local_expert_indices:            # the expert-parallel rank holding global expert 1
        k = lay.mlp.local_expert_indices.index(1)
        with torch.no_grad():
            experts.local_experts[k].linear_fc2.weight.mul_(1.02)


@fault("lm_head_bf16", "logits", "lm_head GEMM in bf16", layered=False).on("megatron")
def _mg_lm_head_bf16(model, layer):
    for root in _mg_roots(model):
        head = getattr(root, "output_layer", None)
        if head is None:
            continue
        orig = head.forward

        def forward(input_, weight=None, runtime_gather_output=None, _orig=orig, _head=head):
            w = _head.weight if weight is None else weight
            out, bias = _orig(input_.bfloat16(), weight=w.bfloat16(), runtime_gather_output=runtime_gather_output)
            return out.to(input_.dtype), bias                              # the fault
        head.forward = forward


def megatron_faults(moe: bool) -> list[str]:
    """Faults planted on one side only (those with a both-sides setup are listed by `routing_faults`)."""
    return [n for n, f in FAULTS.items() if "megatron" in f.plant and (moe or not f.moe_only) and not f.setup
            and f.suite == "core"]


# ---------------------------------------------------------------- SGLang planters
# `model` is an SGLang `*ForCausalLM` (real SGLang model code, e.g. from `tic_trace.testing.sglang_cpu`);
# `layer` is the global 0-based layer. With pipeline parallelism a stage without the layer is left unchanged.
# The planters change the computation SGLang's native (forward_native / torch_native attention) path runs.

def _sg_layer(model, layer):
    layers = model.model.layers
    if layer >= len(layers):
        return None
    lay = layers[layer]
    return lay if hasattr(lay, "self_attn") else None     # PPMissingLayer on other pipeline stages


@fault("rmsnorm_eps", "attn_norm", "input RMSNorm epsilon 1e-6 -> 1e-2").on("sglang")
def _sg_rmsnorm_eps(model, layer):
    lay = _sg_layer(model, layer)
    if lay is not None:
        lay.input_layernorm.variance_epsilon = 1e-2


@fault("rope_theta", "attn.q_rope", "RoPE base 10000 -> 5000 in one layer's attention").on("sglang")
def _sg_rope_theta(model, layer):
    import copy
    lay = _sg_layer(model, layer)
    if lay is None:
        return
    attn = lay.self_attn
    # SGLang shares ONE rotary_emb module between all layers: give this layer its own copy with base 5000
    rope = copy.deepcopy(attn.rotary_emb)
    old = rope.cos_sin_cache
    rope.base = 5000.0
    rope.cos_sin_cache = rope._compute_cos_sin_cache().to(device=old.device, dtype=old.dtype)
    attn.rotary_emb = rope


@fault("softmax_scale", "attn.core", "attention softmax scale x1.05").on("sglang")
def _sg_softmax_scale(model, layer):
    lay = _sg_layer(model, layer)
    if lay is not None:
        lay.self_attn.attn.scaling *= 1.05          # RadixAttention.scaling, read by the attention backend


@fault("qk_norm_weight", "attn.k_norm", "one K-norm weight element x1.05").on("sglang")
def _sg_qk_norm(model, layer):
    lay = _sg_layer(model, layer)
    if lay is not None:
        with torch.no_grad():
            lay.self_attn.k_norm.weight[3] *= 1.05


@fault("o_proj_weight", "attn.out", "output projection weight nudged by 1%").on("sglang")
def _sg_o_proj(model, layer):
    lay = _sg_layer(model, layer)
    if lay is not None:
        with torch.no_grad():
            w = lay.self_attn.o_proj.weight
            w.add_(0.01 * w.abs().mean() * torch.sign(w))


@fault("residual_bf16", "mid", "post-attention residual add done in bf16").on("sglang")
def _sg_residual_bf16(model, layer):
    lay = _sg_layer(model, layer)
    if lay is None:
        return
    norm = lay.post_attention_layernorm
    orig = norm.forward        # post_attention_layernorm(attn_out, residual) -> (normed, residual + attn_out)

    def forward(x, residual=None, *args, **kwargs):
        if residual is None:
            return orig(x, *args, **kwargs)
        mid = (residual.bfloat16() + x.bfloat16()).to(residual.dtype)   # the fault
        return orig(mid.to(x.dtype)), mid
    norm.forward = forward


@fault("mlp_norm_weight", "mlp_norm", "pre-MLP norm weight x1.02").on("sglang")
def _sg_mlp_norm(model, layer):
    lay = _sg_layer(model, layer)
    if lay is not None:
        with torch.no_grad():
            lay.post_attention_layernorm.weight.mul_(1.02)


@fault("router_bf16", "moe.router_logits", "router GEMM in bf16", moe_only=True).on("sglang")
def _sg_router_bf16(model, layer):
    lay = _sg_layer(model, layer)
    if lay is None or not hasattr(lay.mlp, "gate"):
        return
    gate = lay.mlp.gate

    def forward(x):
        logits = F.linear(x.bfloat16(), gate.weight.bfloat16()).to(x.dtype)   # the fault
        return logits, None                  # ReplicatedLinear returns (output, bias)
    gate.forward = forward


@fault("expert_weight", "moe.experts_out", "expert 1's down-projection x1.02", moe_only=True).on("sglang")
def _sg_expert_weight(model, layer):
    lay = _sg_layer(model, layer)
    if lay is None or not hasattr(lay.mlp, "experts"):
        return
    experts = lay.mlp.experts
    local = experts.moe_ep_rank * experts.num_local_experts if hasattr(experts, "moe_ep_rank") else 0
    if local <= 1 < local + experts.num_local_experts:             # the expert-parallel rank holding expert 1
        with torch.no_grad():
            experts.w2_weight[1 - local].mul_(1.02)                   # w2 [E_local, H, I]: down_proj


@fault("lm_head_bf16", "logits", "lm_head GEMM in bf16", layered=False).on("sglang")
def _sg_lm_head_bf16(model, layer):
    lp = model.logits_processor
    orig = lp._get_logits      # LogitsProcessor's lm-head matmul (lm_head is never called as a module)

    def _get_logits(hidden_states, lm_head, logits_metadata, *args, **kwargs):
        w = lm_head.weight
        saved = w.data
        w.data = saved.bfloat16().to(saved.dtype)                      # the fault: bf16 operands
        try:
            return orig(hidden_states.bfloat16().to(hidden_states.dtype), lm_head, logits_metadata, *args, **kwargs)
        finally:
            w.data = saved
    lp._get_logits = _get_logits


@fault("decode_only_scale", "attn.core", "attention softmax scale x1.05 in decode steps only "
                                         "(a decode kernel that differs from the prefill kernel)").on("sglang")
def _sg_decode_only_scale(model, layer):
    lay = _sg_layer(model, layer)
    if lay is None:
        return
    attn = lay.self_attn.attn
    orig = attn.forward

    def forward(q, k, v, forward_batch, *args, **kwargs):
        if not forward_batch.forward_mode.is_decode():
            return orig(q, k, v, forward_batch, *args, **kwargs)
        saved = attn.scaling
        attn.scaling = saved * 1.05                                    # the fault, decode only
        try:
            return orig(q, k, v, forward_batch, *args, **kwargs)
        finally:
            attn.scaling = saved
    attn.forward = forward


def sglang_faults(moe: bool) -> list[str]:
    """Faults planted on one side only (those with a both-sides setup are listed by `routing_faults`)."""
    return [n for n, f in FAULTS.items() if "sglang" in f.plant and (moe or not f.moe_only) and not f.setup
            and f.suite == "core"]


# ---------------------------------------------------------------- routing faults (all frameworks)
# Router weights are [E, H] in every framework here (HF mlp.gate.weight, Megatron mlp.router.weight, SGLang
# mlp.gate.weight). NEAR_TIE = the two experts made nearly tied by the setup; the near-tie planters reverse
# their tiny logit difference inside one side's gate (what a different rounding of the router GEMM does to
# a near tie), so exactly the tokens where the pair straddles the top-k boundary flip, each on a margin
# within the router-logit error.

NEAR_TIE = (1, 2)
# |row 2 - row 1| of the router weights: logit gaps of about 1e-7, so that reversing one (the fault) moves a
# token's router logits by rounding-level amounts (~1e-6 of the row at most, under fp32's tolerance) even for
# the token it moves most: each token is judged on its own row (docs/report.md, "The worst rows"), and a
# reversal of a 1e-6 gap moved one token's logits by 1.5e-5 of its row, a real (if small) router difference
NEAR_TIE_GAP = 1e-7


def _router_weight(model, framework: str, layer: int):
    if framework == "hf":
        return _hf_layer(model, layer).mlp.gate.weight
    lay = _mg_layer(model, layer) if framework == "megatron" else _sg_layer(model, layer)
    if lay is None:
        return None
    return lay.mlp.router.weight if framework == "megatron" else getattr(getattr(lay.mlp, "gate", None), "weight", None)


def _near_tie_rows(model, framework: str, layer: int) -> None:
    w = _router_weight(model, framework, layer)
    if w is None:
        return
    i, j = NEAR_TIE
    g = torch.Generator().manual_seed(1234)
    u = torch.randn(w.shape[1], generator=g, dtype=torch.float64)
    with torch.no_grad():
        w[j] = (w[i].double() + NEAR_TIE_GAP * u / u.norm()).to(w.dtype)


# The least reversed gap: 8 units in the last place of a logit of magnitude max(1, |l|). A reversal smaller than
# that can vanish in the softmax the top-k reads (probabilities that round alike tie, and a tie keeps the lower
# index on both sides), so whether the fault flips anything would depend on one CPU's GEMM rounding.
NEAR_TIE_LEAST_REVERSAL = 2.0 ** -20


def _reverse_near_tie(logits: torch.Tensor) -> torch.Tensor:
    """The near-tied pair's logit difference reversed (the fault): expert j's logit moves to the other side of
    expert i's, by the same gap or at least NEAR_TIE_LEAST_REVERSAL relative; an exact tie stays a tie."""
    i, j = NEAR_TIE
    li, lj = logits[..., i].double(), logits[..., j].double()
    gap = lj - li
    least = NEAR_TIE_LEAST_REVERSAL * li.abs().clamp(min=1.0)
    out = logits.clone()
    out[..., j] = (li - torch.sign(gap) * torch.maximum(gap.abs(), least)).to(logits.dtype)
    return out


def _hf_gate_with(gate, change: Callable[[torch.Tensor], torch.Tensor], *, selection_only: bool = False) -> None:
    """Qwen3-MoE's HF router (linear -> softmax -> top-k -> renormalise) with `change` applied to its logits
    (with `selection_only`, to what the top-k sees, not to the logits it returns)."""
    def forward(self, hidden_states):
        hs = hidden_states.reshape(-1, self.hidden_dim)
        raw = F.linear(hs, self.weight)
        logits = raw if selection_only else change(raw)
        probs = torch.softmax(change(raw) if selection_only else logits, dtype=torch.float, dim=-1)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), idx
    _wrap_forward(gate, forward)


def _mg_gating_with(router, change: Callable[[torch.Tensor], torch.Tensor]) -> None:
    orig = router.gating
    router.gating = lambda input: change(orig(input))     # instance attribute: the adapter taps this one


def _sg_gate_with(gate, change: Callable[[torch.Tensor], torch.Tensor]) -> None:
    orig = gate.forward

    def forward(x, *args, **kwargs):
        out = orig(x, *args, **kwargs)
        if isinstance(out, tuple):
            return (change(out[0]), *out[1:])
        return change(out)
    gate.forward = forward


for _fw in ("hf", "megatron", "sglang"):
    fault("routing_near_tie", "moe.topk_ids", "router logits of two nearly tied experts rounded the other way "
          "(their ~1e-7 difference reversed inside the gate)", moe_only=True, cause="routing").setup_on(_fw)(
        lambda model, layer, _fw=_fw: _near_tie_rows(model, _fw, layer))
    fault("routing_near_tie_decode", "moe.topk_ids", "as routing_near_tie, in decode steps only (a decode "
          "router kernel that rounds differently)", moe_only=True, cause="routing").setup_on(_fw)(
        lambda model, layer, _fw=_fw: _near_tie_rows(model, _fw, layer))


@fault("routing_near_tie", "moe.topk_ids", "", moe_only=True, cause="routing").on("hf")
def _hf_near_tie(model, layer):
    _hf_gate_with(_hf_layer(model, layer).mlp.gate, _reverse_near_tie)


@fault("routing_near_tie", "moe.topk_ids", "", moe_only=True, cause="routing").on("megatron")
def _mg_near_tie(model, layer):
    lay = _mg_layer(model, layer)
    if lay is not None:
        _mg_gating_with(lay.mlp.router, _reverse_near_tie)


@fault("routing_near_tie", "moe.topk_ids", "", moe_only=True, cause="routing").on("sglang")
def _sg_near_tie(model, layer):
    lay = _sg_layer(model, layer)
    if lay is not None and hasattr(lay.mlp, "gate"):
        _sg_gate_with(lay.mlp.gate, _reverse_near_tie)


@fault("routing_near_tie_decode", "moe.topk_ids", "", moe_only=True, cause="routing").on("hf")
def _hf_near_tie_decode(model, layer):
    lay = _hf_layer(model, layer)
    state = {"decode": False}
    _hf_gate_with(lay.mlp.gate, lambda x: _reverse_near_tie(x) if state["decode"] else x)
    orig = lay.mlp.forward

    def forward(hidden_states, *args, **kwargs):
        state["decode"] = hidden_states.dim() == 3 and hidden_states.shape[1] == 1   # one new token per sample
        return orig(hidden_states, *args, **kwargs)
    lay.mlp.forward = forward


@fault("routing_near_tie_decode", "moe.topk_ids", "", moe_only=True, cause="routing").on("sglang")
def _sg_near_tie_decode(model, layer):
    lay = _sg_layer(model, layer)
    if lay is None or not hasattr(lay.mlp, "gate"):
        return
    state = {"decode": False}
    _sg_gate_with(lay.mlp.gate, lambda x: _reverse_near_tie(x) if state["decode"] else x)
    orig = lay.forward

    def forward(positions, hidden_states, forward_batch, *args, **kwargs):
        state["decode"] = forward_batch.forward_mode.is_decode()
        return orig(positions, hidden_states, forward_batch, *args, **kwargs)
    lay.forward = forward


def _move_router_row(model, framework: str, layer: int) -> None:
    w = _router_weight(model, framework, layer)
    if w is not None:
        with torch.no_grad():
            w[[1, 3]] = w[[3, 1]].clone()


for _fw in ("hf", "megatron", "sglang"):
    fault("router_weight", "moe.router_logits", "router rows of experts 1 and 3 swapped (a router weight loaded "
          "in the wrong expert order)", moe_only=True, cause="routing").on(_fw)(
        lambda model, layer, _fw=_fw: _move_router_row(model, _fw, layer))


def routing_faults() -> list[str]:
    return [n for n, f in FAULTS.items() if f.cause == "routing" and f.suite == "core"]


EXPERT_BIAS = 0.2             # added to expert 3's router logit before the top-k, on one side only


def _bias_expert(logits: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    out[..., 3] += EXPERT_BIAS
    return out


@fault("expert_bias", "moe.topk_ids", "a load-balancing bias (+0.2 on expert 3) in one side's top-k selection "
       "only: the router logits agree, the choice does not", moe_only=True, cause="routing").on("hf")
def _hf_expert_bias(model, layer):
    _hf_gate_with(_hf_layer(model, layer).mlp.gate, _bias_expert, selection_only=True)


@fault("expert_bias", "moe.topk_ids", "", moe_only=True, cause="routing").on("megatron")
def _mg_expert_bias(model, layer):
    lay = _mg_layer(model, layer)
    if lay is None:
        return
    orig = lay.mlp.router.routing
    lay.mlp.router.routing = lambda logits, *args, **kwargs: orig(_bias_expert(logits), *args, **kwargs)


@fault("expert_bias", "moe.topk_ids", "", moe_only=True, cause="routing").on("sglang")
def _sg_expert_bias(model, layer):
    lay = _sg_layer(model, layer)
    if lay is None or not hasattr(lay.mlp, "topk"):
        return
    topk = lay.mlp.topk
    orig = topk.forward

    def forward(hidden_states, router_logits, *args, **kwargs):
        return orig(hidden_states, _bias_expert(router_logits), *args, **kwargs)
    topk.forward = forward


# Decode-only routing change with a margin no rounding reaches: the prefill rows of a decode trace are computed
# by other GEMM shapes than the one-forward side's rows, so they agree only to rounding, and any fault that
# needs a near tie could flip them too on some machine's kernels. A +0.2 selection bias flips only where the
# decode step's router says so, on margins ~1e5x the router-logit error.
@fault("expert_bias_decode", "moe.topk_ids", "as expert_bias, in decode steps only (a decode router kernel "
       "with a selection bias the prefill kernel lacks)", moe_only=True, cause="routing", suite="decode").on("hf")
def _hf_expert_bias_decode(model, layer):
    lay = _hf_layer(model, layer)
    state = {"decode": False}
    _hf_gate_with(lay.mlp.gate, lambda x: _bias_expert(x) if state["decode"] else x, selection_only=True)
    orig = lay.mlp.forward

    def forward(hidden_states, *args, **kwargs):
        state["decode"] = hidden_states.dim() == 3 and hidden_states.shape[1] == 1   # one new token per sample
        return orig(hidden_states, *args, **kwargs)
    lay.mlp.forward = forward


@fault("expert_bias_decode", "moe.topk_ids", "", moe_only=True, cause="routing", suite="decode").on("sglang")
def _sg_expert_bias_decode(model, layer):
    lay = _sg_layer(model, layer)
    if lay is None or not hasattr(lay.mlp, "topk"):
        return
    state = {"decode": False}
    topk = lay.mlp.topk
    orig_topk, orig_layer = topk.forward, lay.forward

    def topk_forward(hidden_states, router_logits, *args, **kwargs):
        logits = _bias_expert(router_logits) if state["decode"] else router_logits
        return orig_topk(hidden_states, logits, *args, **kwargs)

    def layer_forward(positions, hidden_states, forward_batch, *args, **kwargs):
        state["decode"] = forward_batch.forward_mode.is_decode()
        return orig_layer(positions, hidden_states, forward_batch, *args, **kwargs)
    topk.forward, lay.forward = topk_forward, layer_forward


def _nan_final_norm_weight(model, framework: str, layer: int) -> None:
    if framework == "hf":
        norm = model.model.norm
    elif framework == "megatron":
        norm = next((getattr(getattr(r, "decoder", None), "final_layernorm", None) for r in _mg_roots(model)), None)
    else:
        norm = getattr(model.model, "norm", None)
    w = getattr(norm, "weight", None)
    if w is not None:
        with torch.no_grad():
            w[5] = float("nan")


# NaN after the layers: a NaN inside a MoE layer also reaches the router, and Megatron then routes no token to
# some expert (a zero-size expert input, which the tracer cannot store yet).
for _fw in ("hf", "megatron", "sglang"):
    fault("final_norm_nan", "final_norm", "one final-norm weight element NaN (an uninitialised parameter)",
          layered=False, cause="nonfinite").on(_fw)(lambda model, layer, _fw=_fw: _nan_final_norm_weight(model, _fw, layer))


# ---------------------------------------------------------------- red-team faults (tests/test_finder_redteam.py)
# Bugs a real engine or trainer has had, none of them one of the faults above. Each is planted in the
# computation of one side; `redteam_faults(framework)` lists them.

def redteam_faults(framework: str, moe: bool = True) -> list[str]:
    return [n for n, f in FAULTS.items() if f.suite == "redteam" and framework in f.plant
            and (moe or not f.moe_only)]


def _rt(name: str, point: str, what: str, **kw):
    return fault(name, point, what, suite="redteam", **kw)


def _hf_attention_with(model, layer: int, fn: Callable) -> None:
    """One layer's attention through `fn` (a transformers attention function), the other layers unchanged."""
    import copy
    from transformers import AttentionInterface
    name = f"tic_redteam_{id(model)}_{layer}_{fn.__name__}"
    AttentionInterface.register(name, fn)
    attn = _hf_layer(model, layer).self_attn
    cfg = copy.copy(attn.config)
    cfg._attn_implementation = name
    attn.config = cfg


def _eager(module, q, k, v, mask, scaling, *, tile: bool = False, future: int = 0):
    rep = module.num_key_value_groups
    k2, v2 = (k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)) if tile else \
        (k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
    s = torch.matmul(q, k2.transpose(2, 3)) * scaling
    if future:
        n = s.shape[-1]
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=s.device).tril(future), float("-inf"))
    elif mask is not None:
        s = s + mask
    p = torch.softmax(s, -1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v2).transpose(1, 2).contiguous(), None


def _causal_off_by_one(module, q, k, v, mask, scaling=None, **kw):
    return _eager(module, q, k, v, mask, scaling, future=1)      # each query also sees the next token


def _gqa_tiled(module, q, k, v, mask, scaling=None, **kw):
    return _eager(module, q, k, v, mask, scaling, tile=True)     # query head h reads kv head h % kv_heads


@_rt("causal_off_by_one", "attn.core", "causal mask off by one: each token attends one future token").on("hf")
def _hf_causal_off_by_one(model, layer):
    _hf_attention_with(model, layer, _causal_off_by_one)


@_rt("gqa_tiled", "attn.core", "GQA head mapping permuted: kv heads tiled instead of interleaved").on("hf")
def _hf_gqa_tiled(model, layer):
    _hf_attention_with(model, layer, _gqa_tiled)


@_rt("rotate_half_interleaved", "attn.q_rope", "RoPE with the interleaved rotate_half convention "
                                               "(pairs 2i, 2i+1) on a half-split model").on("hf")
def _hf_rotate_half_interleaved(model, layer):
    import sys
    attn = _hf_layer(model, layer).self_attn
    mod = sys.modules[type(attn).__module__]
    orig = mod.rotate_half

    def interleaved(x):
        return torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
    attn.register_forward_pre_hook(lambda *a: setattr(mod, "rotate_half", interleaved))
    attn.register_forward_hook(lambda *a: setattr(mod, "rotate_half", orig))


@_rt("k_norm_weight_on_q", "attn.q_norm", "the K-norm weight loaded into the Q-norm").on("hf")
def _hf_k_norm_on_q(model, layer):
    attn = _hf_layer(model, layer).self_attn
    with torch.no_grad():
        attn.q_norm.weight.copy_(attn.k_norm.weight)


def _v_bias(n: int) -> torch.Tensor:
    return 0.01 * torch.randn(n, generator=torch.Generator().manual_seed(3))


@_rt("v_bias", "attn.v", "a stray bias (std 0.01) on the v projection").on("hf")
def _hf_v_bias(model, layer):
    v = _hf_layer(model, layer).self_attn.v_proj
    b = _v_bias(v.out_features)
    v.register_forward_hook(lambda mod, i, o: o + b.to(o.dtype))


# HF's and SGLang's models name these modules and attributes alike: one planter serves both.
_FINAL_NORM_EPS = _rt("final_norm_eps", "final_norm", "final RMSNorm epsilon 1e-6 -> 1e-3 (only there)", layered=False)
_LM_HEAD_ROW = _rt("lm_head_row", "logits", "one lm_head row (token 7) x1.05", layered=False)


@_FINAL_NORM_EPS.on("sglang")
@_FINAL_NORM_EPS.on("hf")
def _final_norm_eps(model, layer):
    model.model.norm.variance_epsilon = 1e-3


@_LM_HEAD_ROW.on("sglang")
@_LM_HEAD_ROW.on("hf")
def _lm_head_row(model, layer):
    with torch.no_grad():
        model.lm_head.weight[7] *= 1.05


@_rt("no_norm_topk_prob", "moe.topk_weights", "norm_topk_prob off on one side", moe_only=True).on("hf")
def _hf_no_norm_topk(model, layer):
    _hf_layer(model, layer).mlp.gate.norm_topk_prob = False


@_rt("topk_width", "moe.topk_ids", "top-1 routing on one side where the model says top-2", moe_only=True,
     cause="routing").on("hf")
def _hf_topk_width(model, layer):
    _hf_layer(model, layer).mlp.gate.top_k = 1


@_rt("logit_softcap", "logits", "logits soft-capped (5 tanh(x/5)) on one side", layered=False).on("hf")
def _hf_logit_softcap(model, layer):
    model.lm_head.register_forward_hook(lambda mod, i, o: 5.0 * torch.tanh(o / 5.0))


def _nan_row(y: torch.Tensor) -> torch.Tensor:
    y = y.clone()
    y.view(-1, y.shape[-1])[min(3, y.numel() // y.shape[-1] - 1), 0] = float("nan")
    return y


@_rt("nan_one_token", "attn.out", "one element of one token's attention output NaN", cause="nonfinite").on("hf")
def _hf_nan_one_token(model, layer):
    _hf_layer(model, layer).self_attn.o_proj.register_forward_hook(lambda mod, i, o: _nan_row(o))


@_rt("dropout_attn_out", "attn.out", "dropout-like zeroing of 1% of the attention output").on("hf")
def _hf_dropout_attn_out(model, layer):
    def hook(mod, i, out):
        keep = torch.rand(out.shape, generator=torch.Generator().manual_seed(5)) >= 0.01
        return out * keep.to(out.dtype)
    _hf_layer(model, layer).self_attn.o_proj.register_forward_hook(hook)


@_rt("residual_scale", "mid", "the attention residual scaled by (1 + 1e-3)").on("hf")
def _hf_residual_scale(model, layer):
    lay = _hf_layer(model, layer)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, **kwargs):
        h = self.input_layernorm(hidden_states)
        h, _ = self.self_attn(hidden_states=h, attention_mask=attention_mask, position_ids=position_ids,
                              cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        mid = hidden_states * (1 + 1e-3) + h                              # the fault
        return mid + self.mlp(self.post_attention_layernorm(mid))
    _wrap_forward(lay, forward)


# SGLang: the rollout side
@_rt("topk_width", "moe.topk_ids", "", moe_only=True, cause="routing").on("sglang")
def _sg_topk_width(model, layer):
    lay = _sg_layer(model, layer)
    if lay is not None and hasattr(lay.mlp, "topk"):
        lay.mlp.topk.topk_config.top_k = 1


@_rt("decode_rope_position", "attn.q_rope", "decode steps rotate q/k at position + 1 (a KV-cache position "
                                            "bug); prefill is right").on("sglang")
def _sg_decode_rope_position(model, layer):
    lay = _sg_layer(model, layer)
    if lay is None:
        return
    attn = lay.self_attn
    orig = attn.forward

    def forward(positions, hidden_states, forward_batch, *args, **kwargs):
        if forward_batch.forward_mode.is_decode():
            positions = positions + 1                                      # the fault
        return orig(positions, hidden_states, forward_batch, *args, **kwargs)
    attn.forward = forward


@_rt("nan_one_token", "attn.out", "", cause="nonfinite").on("sglang")
def _sg_nan_one_token(model, layer):
    lay = _sg_layer(model, layer)
    if lay is not None:
        lay.self_attn.o_proj.register_forward_hook(lambda mod, i, o: (_nan_row(o[0]), o[1]))


@_rt("v_bias", "attn.v", "").on("sglang")
def _sg_v_bias(model, layer):
    lay = _sg_layer(model, layer)
    if lay is None:
        return
    attn = lay.self_attn
    b = _v_bias(attn.kv_size)

    def hook(mod, i, out):
        y = out[0].clone()
        y[..., attn.q_size + attn.kv_size:] += b.to(y.dtype)             # the v slice of the fused qkv
        return y, out[1]
    attn.qkv_proj.register_forward_hook(hook)


@_rt("no_norm_topk_prob", "moe.topk_weights", "", moe_only=True).on("sglang")
def _sg_no_norm_topk(model, layer):
    lay = _sg_layer(model, layer)
    if lay is not None and hasattr(lay.mlp, "topk"):
        lay.mlp.topk.topk_config.renormalize = False


@_rt("residual_scale", "mid", "").on("sglang")
def _sg_residual_scale(model, layer):
    lay = _sg_layer(model, layer)
    if lay is None:
        return
    norm = lay.post_attention_layernorm
    orig = norm.forward

    def forward(x, residual=None, *args, **kwargs):
        if residual is None:
            return orig(x, *args, **kwargs)
        return orig(x, residual * (1 + 1e-3), *args, **kwargs)            # the fault
    norm.forward = forward
