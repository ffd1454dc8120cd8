"""The model facts of an HF checkpoint, read from its config.json under one typed schema (`model_spec`: an error
names config.json, the key and what was expected), whose RoPE rope.py computes.

`ModelSpec` is what the exact reference needs to know about the model; checkpoint.py reads the file
(`read_config`: bounded, a regular file, UTF-8) and the tensors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .not_replayable import CheckpointError
from .rope import ROPE_KINDS
from ..families import Family, family_of_config

# A real config.json is a few KB (multimodal ones tens of KB): anything this large is not one.
CONFIG_MAX_BYTES = 4 << 20
_BIG = 1 << 31            # bound of any count in config.json: a Python int, never an int64 wrap


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    kind: str = "default"                  # default | linear | yarn | llama3 (HF's rope_type)
    factor: float = 1.0
    partial_rotary_factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    low_freq_factor: float = 1.0           # llama3: wavelengths over original_max / low_freq_factor are scaled,
    high_freq_factor: float = 4.0          # those under original_max / high_freq_factor kept, a ramp between


@dataclass(frozen=True)
class ModelSpec:
    """What the reference needs to know about the model, read from config.json."""
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeSpec
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False
    scoring_func: str = "softmax"          # softmax | sigmoid (DeepSeek-V3 style)
    routed_scaling_factor: float = 1.0
    n_group: int = 1                       # DeepSeek group-limited routing (grouped_topk.py)
    topk_group: int = 1
    shared_expert_intermediate_size: int = 0
    n_shared_experts: int = 0
    max_position_embeddings: int | None = None
    intermediate_size: int = 0             # dense MLP width (0: not stated); for the tensors' shape check
    moe_intermediate_size: int = 0         # one expert's width (0: not stated)
    # DeepSeek-V3 / GLM-4.5 style MoE; 0 where the config has none (MLA's facts are its family's: `extra`)
    first_k_dense_replace: int = 0         # layers 0..k-1 run a dense MLP, the others the MoE block
    mlp_only_layers: tuple[int, ...] = ()  # Qwen2/3-MoE: these layers run a dense MLP
    decoder_sparse_step: int = 1           # Qwen2/3-MoE: layer i runs the MoE block only where (i+1) % step == 0
    extra: dict = field(default_factory=dict)     # the family's config facts (Family.facts), `layer_ropes`

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` of this MoE model runs the MoE block (not a dense MLP)."""
        return (layer >= self.first_k_dense_replace and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def as_dict(self) -> dict:
        from dataclasses import asdict
        return asdict(self)

    def at_layer(self, layer: int | None) -> "ModelSpec":
        """The facts of one layer: a dense layer of a MoE model (below `first_k_dense_replace`, in
        `mlp_only_layers`, or off the `decoder_sparse_step` grid, as transformers builds them) computes a dense
        MLP, so its spec has no experts; a linear-attention layer's (listed in a family's
        `extra["linear_layers"]`) spec says so (`extra["at_linear_layer"]`)."""
        from dataclasses import replace
        if layer is None:
            return self
        out = self
        if self.num_experts and not self.is_sparse(layer):
            out = replace(out, num_experts=0, num_experts_per_tok=0, n_shared_experts=0,
                          shared_expert_intermediate_size=0)
        if layer in self.extra.get("linear_layers", ()):
            out = replace(out, extra={**out.extra, "at_linear_layer": True})
        return out


# ---------------------------------------------------------------- config.json: one typed schema

_MISSING = object()


def _shown(v: Any) -> str:
    if v is _MISSING:
        return "missing"
    if isinstance(v, (dict, list)):
        return f"a JSON {'object' if isinstance(v, dict) else 'array'}"
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


class _Config:
    """Typed reads of one config object. Every read names its key; a wrong type or range is a CheckpointError
    naming config.json, the key (dotted for nested objects) and what was expected. Keys the reference does not
    read are not looked at (HF configs carry many)."""

    def __init__(self, d: dict, where: str, prefix: str = ""):
        self.d, self.where, self.prefix = d, where, prefix

    def error(self, key: str, expected: str, value: Any = _MISSING) -> CheckpointError:
        return CheckpointError(f"{self.where}: key '{self.prefix}{key}' must be {expected}, not {_shown(value)}")

    def raw(self, key: str) -> Any:
        return self.d.get(key, _MISSING)

    def has(self, key: str) -> bool:
        return self.d.get(key) is not None

    def int(self, key: str, lo: int, hi: int, default: Any = _MISSING) -> Any:
        """An integer in [lo, hi] (JSON true/false and numbers with a fraction are not integers); a missing or
        null key gives `default` (required when there is none)."""
        v = self.raw(key)
        if v is _MISSING or v is None:
            if default is _MISSING:
                raise self.error(key, f"an integer from {lo} to {hi}", v)
            return default
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise self.error(key, f"an integer from {lo} to {hi}", v)
        return v

    def ints(self, key: str, lo: int, hi: int) -> tuple[int, ...]:
        """A JSON array of integers in [lo, hi]; missing or null is empty."""
        v = self.raw(key)
        if v is _MISSING or v is None:
            return ()
        if not isinstance(v, list) or len(v) > 1 << 16 \
                or any(isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi for x in v):
            raise self.error(key, f"an array of integers from {lo} to {hi}", v)
        return tuple(v)

    def num(self, key: str, lo: float, hi: float, default: Any = _MISSING, lo_open: bool = False) -> Any:
        """A finite number in [lo, hi] (or (lo, hi] with `lo_open`)."""
        v = self.raw(key)
        what = f"a finite number {'>' if lo_open else '>='} {lo:g} and <= {hi:g}"
        if v is _MISSING or v is None:
            if default is _MISSING:
                raise self.error(key, what, v)
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or not (lo < v if lo_open else lo <= v) or v > hi:
            raise self.error(key, what, v)
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self.raw(key)
        if v is _MISSING or v is None:
            return default
        if not isinstance(v, bool):
            raise self.error(key, "true or false", v)
        return v

    def str(self, key: str, default: str, choices: tuple[str, ...] | None = None) -> str:
        v = self.raw(key)
        if v is _MISSING or v is None:
            return default
        if not isinstance(v, str) or len(v) > 200:
            raise self.error(key, "a string", v)
        if choices is not None and v not in choices:
            raise self.error(key, f"one of {', '.join(choices)} (the kinds replayed)", v)
        return v

    def obj(self, key: str) -> "_Config | None":
        v = self.raw(key)
        if v is _MISSING or v is None:
            return None
        if not isinstance(v, dict):
            raise self.error(key, "a JSON object or null", v)
        return _Config(v, self.where, f"{self.prefix}{key}.")


LAYER_TYPES = ("full_attention", "sliding_attention")     # the layer types a config may give a RoPE each


def rope_params(c: _Config) -> "_Config":
    """The config's RoPE object (`rope_parameters`, else the older `rope_scaling`; empty when neither)."""
    key = "rope_parameters" if c.has("rope_parameters") else "rope_scaling"
    return c.obj(key) or _Config({}, c.where, f"{c.prefix}{key}.")


def layer_rope_specs(c: _Config) -> dict[str, RopeSpec]:
    """Gemma3 style: one RoPE per layer type ({} when the config gives one RoPE for the model)."""
    p = rope_params(c)
    nested = sorted(k for k, v in p.d.items() if isinstance(v, dict))
    if not nested:
        return {}
    if set(nested) - set(LAYER_TYPES) or set(p.d) - set(nested):
        raise CheckpointError(f"{c.where}: key '{p.prefix[:-1]}' holds RoPE objects for {', '.join(nested[:3])}: "
                              f"the exact reference knows one RoPE per model or one per layer type "
                              f"({', '.join(LAYER_TYPES)}), not both mixed or others")
    return {k: _rope_from(c, p.obj(k)) for k in nested}


def _rope_spec(c: _Config) -> RopeSpec:
    by_type = layer_rope_specs(c)
    if by_type:     # the model's RoPE is the full-attention layers' (each layer's: layer_types.rope_of_layer)
        return by_type.get("full_attention") or next(iter(by_type.values()))
    return _rope_from(c, rope_params(c))


def _rope_from(c: _Config, p: _Config) -> RopeSpec:
    theta = p.num("rope_theta", 0.0, 1e12, default=None, lo_open=True)
    if theta is None:
        theta = c.num("rope_theta", 0.0, 1e12, default=10000.0, lo_open=True)
    kind = p.str("rope_type", "") or p.str("type", "default")
    prf = p.num("partial_rotary_factor", 0.0, 1.0, default=None, lo_open=True)
    if kind not in ROPE_KINDS:
        # another kind (Phi-3's longrope, dynamic NTK): the checkpoint still serves every point but the RoPE
        # ones, which the replay says it does not judge (reference.rope_inv_freq)
        return RopeSpec(theta=theta, kind=kind, partial_rotary_factor=prf if prf is not None else
                        c.num("partial_rotary_factor", 0.0, 1.0, default=1.0, lo_open=True))
    spec = RopeSpec(
        theta=theta, kind=kind, factor=p.num("factor", 0.0, 1e6, default=1.0, lo_open=True),
        partial_rotary_factor=prf if prf is not None else c.num("partial_rotary_factor", 0.0, 1.0, default=1.0,
                                                                lo_open=True),
        original_max_position_embeddings=p.int("original_max_position_embeddings", 1, _BIG, default=None),
        beta_fast=p.num("beta_fast", -1e6, 1e6, default=32.0), beta_slow=p.num("beta_slow", -1e6, 1e6, default=1.0),
        mscale=p.num("mscale", -1e6, 1e6, default=None), mscale_all_dim=p.num("mscale_all_dim", -1e6, 1e6, default=None),
        attention_factor=p.num("attention_factor", 0.0, 1e6, default=None, lo_open=True),
        truncate=p.bool("truncate", True),
        low_freq_factor=p.num("low_freq_factor", 0.0, 1e6, default=1.0, lo_open=True),
        high_freq_factor=p.num("high_freq_factor", 0.0, 1e6, default=4.0, lo_open=True))
    if kind == "yarn" and spec.original_max_position_embeddings is None and not c.has("max_position_embeddings"):
        raise p.error("original_max_position_embeddings", "given for yarn RoPE (or max_position_embeddings)")
    if kind == "llama3":
        if spec.original_max_position_embeddings is None:
            raise p.error("original_max_position_embeddings", "given for llama3 RoPE")
        if spec.high_freq_factor <= spec.low_freq_factor:
            raise p.error("high_freq_factor", "larger than low_freq_factor for llama3 RoPE", spec.high_freq_factor)
    return spec


def model_spec(cfg: Any, where: str = "config.json") -> ModelSpec:
    """A ModelSpec from an HF config dict (a multimodal config's `text_config` is used when present), every
    value checked by type and range."""
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{where}: must hold a JSON object (the model's config), not {_shown(cfg)}")
    c = _Config(cfg, where).obj("text_config") or _Config(cfg, where)
    heads = c.int("num_attention_heads", 1, 1 << 16)
    hidden = c.int("hidden_size", 1, 1 << 24)
    kv = c.int("num_key_value_heads", 1, heads, default=heads)
    if heads % kv:
        raise c.error("num_key_value_heads", f"a divisor of num_attention_heads ({heads})", kv)
    head_dim = c.int("head_dim", 1, 1 << 16, default=None)
    if head_dim is None:
        if hidden % heads:
            raise c.error("head_dim", f"given where hidden_size ({hidden}) is not a multiple of num_attention_heads "
                                      f"({heads})")
        head_dim = hidden // heads
    experts = 0
    for k in ("num_experts", "num_local_experts", "n_routed_experts"):   # the first one stated and non-zero
        experts = experts or c.int(k, 0, 1 << 16, default=0)
    topk = c.int("num_experts_per_tok", 0, 1 << 16, default=0)
    if experts and not 1 <= topk <= experts:
        raise c.error("num_experts_per_tok", f"an integer from 1 to the number of experts ({experts})", topk)
    model_type = c.str("model_type", "")
    fam = family_of_config(model_type, c)       # its owner, else the family its config's facts say
    # ModelSpec fields its code fixes where config.json is silent, or that its config states under its own key
    dflt = {**fam.defaults.get(model_type, {}), **fam.config_defaults(c, model_type)}
    fields = dict(**_dense_layers(c),
        model_type=model_type, num_layers=c.int("num_hidden_layers", 1, 1 << 16),
        hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        vocab_size=c.int("vocab_size", 1, _BIG),
        # eps >= 0: a negative one makes the normalisation's square root undefined (a non-finite reference)
        rms_norm_eps=c.num("rms_norm_eps", 0.0, 1.0, default=1e-6),
        rope=_rope_spec(c), hidden_act=c.str("hidden_act", "") or dflt.get("hidden_act", "silu"),
        attention_bias=c.bool("attention_bias", dflt.get("attention_bias", False)),
        tie_word_embeddings=c.bool("tie_word_embeddings", False),
        num_experts=experts, num_experts_per_tok=topk,
        # a family's code may fix it whatever the config says (Family.fixed: Mixtral's, GPT-OSS's)
        norm_topk_prob=c.bool("norm_topk_prob", dflt.get("norm_topk_prob", False)),
        scoring_func=c.str("scoring_func", dflt.get("scoring_func", "softmax")),
        routed_scaling_factor=c.num("routed_scaling_factor", 0.0, 1e6, default=1.0, lo_open=True),
        n_group=c.int("n_group", 0, 1 << 16, default=1) or 1, topk_group=c.int("topk_group", 0, 1 << 16, default=1) or 1,
        shared_expert_intermediate_size=c.int("shared_expert_intermediate_size", 0, 1 << 24, default=0),
        n_shared_experts=c.int("n_shared_experts", 0, 1 << 16, default=0),
        max_position_embeddings=c.int("max_position_embeddings", 1, _BIG, default=None),
        intermediate_size=c.int("intermediate_size", 0, 1 << 24, default=0),
        moe_intermediate_size=c.int("moe_intermediate_size", 0, 1 << 24, default=0),
        extra=_extra(fam, c, model_type, hidden))
    return ModelSpec(**{**fields, **fam.fixed.get(model_type, {})})    # the fields its code fixes, whatever


def _extra(fam: Family, c: _Config, model_type: str, hidden: int) -> dict:
    """`ModelSpec.extra`: the family's config facts, and the RoPE per layer type where the config gives one."""
    out = fam.facts(c, model_type, hidden)
    ropes = layer_rope_specs(c)
    return {**out, "layer_ropes": ropes} if ropes else out


def _dense_layers(c: _Config) -> dict:
    """Which layers of a MoE model are dense (`first_k_dense_replace`, Qwen-MoE's `mlp_only_layers` and
    `decoder_sparse_step`)."""
    return {"first_k_dense_replace": c.int("first_k_dense_replace", 0, 1 << 16, default=0),
            "mlp_only_layers": c.ints("mlp_only_layers", 0, 1 << 16),
            "decoder_sparse_step": c.int("decoder_sparse_step", 1, 1 << 16, default=1)}

