"""An HF checkpoint directory as the exact reference's source of weights and model facts.

`config.json` becomes a `ModelSpec` (the numerics-relevant facts, one typed place); tensors are read lazily,
one at a time, with the `safetensors` library (never pickle: `.bin` checkpoints are refused). Weights are
looked up by HF parameter name; `layer_weights` knows the names the Qwen2/Qwen3(-MoE), Llama and
DeepSeek-style families use, including the per-expert and the fused (`gate_up_proj`) expert layouts.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint directory that cannot serve as the reference; the message names the file and the fix."""


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    kind: str = "default"                  # default | linear | yarn (HF's rope_type)
    factor: float = 1.0
    partial_rotary_factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


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
    n_group: int = 1                       # DeepSeek group-limited routing (n_group > 1 is not replayed)
    topk_group: int = 1
    shared_expert_intermediate_size: int = 0
    n_shared_experts: int = 0
    max_position_embeddings: int | None = None
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        from dataclasses import asdict
        return asdict(self)


def _rope_spec(cfg: dict, head_dim: int) -> RopeSpec:
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "linear", "yarn"):
        raise CheckpointError(f"config.json: rope_type {kind!r} is not replayed (known: default, linear, yarn)")
    return RopeSpec(
        theta=float(theta), kind=kind, factor=float(params.get("factor") or 1.0),
        partial_rotary_factor=float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)))


def model_spec(cfg: dict, where: str = "config.json") -> ModelSpec:
    """A ModelSpec from an HF config dict (a multimodal config's `text_config` is used when present)."""
    cfg = dict(cfg.get("text_config") or cfg)
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
        return ModelSpec(
            model_type=str(cfg.get("model_type", "")), num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden, num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
            vocab_size=int(cfg["vocab_size"]), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_rope_spec(cfg, head_dim), hidden_act=str(cfg.get("hidden_act", "silu")),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_experts=experts, num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
            # Mixtral's router renormalises the top-k weights always; its configs have no norm_topk_prob
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)) or cfg.get("model_type") == "mixtral",
            scoring_func=str(cfg.get("scoring_func", "softmax")),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
            n_group=int(cfg.get("n_group") or 1), topk_group=int(cfg.get("topk_group") or 1),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            max_position_embeddings=cfg.get("max_position_embeddings"))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: cannot read the model description ({type(e).__name__}: {e})") from None


class HFCheckpoint:
    """config.json + *.safetensors of one HF model directory; tensors read on demand, as float64."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{cfg_path}: no config.json; pass the HF checkpoint directory "
                                  "(the one slime's --hf-checkpoint names)")
        try:
            self.config: dict = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{cfg_path}: not readable JSON ({e})") from None
        self.spec = model_spec(self.config, str(cfg_path))
        self._where = self._index()
        self._files: dict[Path, Any] = {}

    def _index(self) -> dict[str, Path]:
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path}: no *.safetensors file (pickled .bin checkpoints are not read; "
                                  "convert with save_pretrained(safe_serialization=True))")
        try:
            from safetensors import safe_open
        except ImportError:
            raise CheckpointError("the exact reference needs the `safetensors` package: "
                                  "pip install -r requirements/base.txt") from None
        where: dict[str, Path] = {}
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as h:
                    for k in h.keys():
                        where[k] = f
            except Exception as e:   # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
        return where

    def names(self) -> list[str]:
        return sorted(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def tensor(self, name: str, device: str = "cpu"):
        """One parameter as float64 on `device` (bf16/fp16 widen exactly)."""
        import torch
        from safetensors import safe_open
        f = self._where.get(name)
        if f is None:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in the checkpoint")
        with safe_open(str(f), framework="pt", device="cpu") as h:
            t = h.get_tensor(name)
        return t.to(device=device, dtype=torch.float64)

    def raw(self, name: str):
        """One parameter in its stored dtype (for bit-exact hashes)."""
        from safetensors import safe_open
        with safe_open(str(self._where[name]), framework="pt", device="cpu") as h:
            return h.get_tensor(name)


def yarn_inv_freq_and_scale(rope: RopeSpec, head_dim: int, max_pos: int | None):
    """YaRN's inverse frequencies and attention factor as HF's `_compute_yarn_parameters` states them, in
    float64 (HF computes them in float32: that rounding is shared by every side and measured as theirs)."""
    import torch
    dim = int(head_dim * rope.partial_rotary_factor)
    base, factor = rope.theta, rope.factor
    omax = rope.original_max_position_embeddings or max_pos
    if omax is None:
        raise CheckpointError("config.json: yarn RoPE needs original_max_position_embeddings")

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = rope.attention_factor
    if att is None:
        att = (mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
               if rope.mscale and rope.mscale_all_dim else mscale(factor))

    def corr_dim(rot):
        return (dim * math.log(omax / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(rope.beta_fast), corr_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extra = 1.0 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, float(att)
