"""An HF checkpoint directory as the exact reference's source of weights and model facts.

A checkpoint is untrusted input, like a trace (docs/security.md, "The exact reference's inputs"):
`config.json` is read only if it is a regular file under CONFIG_MAX_BYTES (opened non-blocking: a FIFO cannot
hang the reader), and every value the reference uses is checked by one typed schema (`model_spec`: an error
names config.json, the key and what was expected). `*.safetensors` files must be regular files; their
headers are read first and every tensor the reference reads is checked against the shape config.json gives
it before a byte of it is allocated. Tensors are read lazily, one at a time, with the `safetensors` library
(never pickle: `.bin` checkpoints are refused), and rounded to the dtype the side that ran them held them in
(`tensor(name, dtype=...)`: an fp32 checkpoint of a bf16 run is replayed with bf16 weights).
Weights are looked up by HF parameter name; `reference._LayerWeights` knows the names the Qwen2/Qwen3(-MoE),
Llama and DeepSeek-style families use, including the per-expert and the fused (`gate_up_proj`) layouts.
"""
from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# A real config.json is a few KB (multimodal ones tens of KB): anything this large is not one.
CONFIG_MAX_BYTES = 4 << 20
_BIG = 1 << 31            # bound of any count in config.json: a Python int, never an int64 wrap


class CheckpointError(ValueError):
    """A checkpoint directory that cannot serve as the reference; the message names the file and the fix."""


class ReferenceMismatch(Exception):
    """The checkpoint is not the model, or not the weights, the traces ran: the replay would compare each side
    with another op. Not comparable (CLI exit 3); `problems` says what differs."""

    def __init__(self, path: str | Path, problems: list[str]):
        self.path, self.problems = str(path), list(problems)
        shown = "; ".join(problems[:8]) + (f"; … {len(problems) - 8} more" if len(problems) > 8 else "")
        super().__init__(f"{path} is not the model or the weights the traces ran: {shown}. Pass the checkpoint "
                         "the run loaded (for slime, the --hf-checkpoint of this step's weights), or leave out "
                         "--reference to compare A with B alone")


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
    intermediate_size: int = 0             # dense MLP width (0: not stated); for the tensors' shape check
    moe_intermediate_size: int = 0         # one expert's width (0: not stated)
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        from dataclasses import asdict
        return asdict(self)


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


def _rope_spec(c: _Config) -> RopeSpec:
    key = "rope_parameters" if c.has("rope_parameters") else "rope_scaling"
    p = c.obj(key) or _Config({}, c.where, f"{c.prefix}{key}.")
    nested = sorted(k for k, v in p.d.items() if isinstance(v, dict))
    if nested:      # Gemma3 style: one RoPE per layer type; the reference knows one RoPE per model
        raise CheckpointError(f"{c.where}: key '{c.prefix}{key}' holds one RoPE per layer type "
                              f"({', '.join(nested[:3])}; Gemma3 style), which the exact reference does not "
                              "replay (nor that model's other ops): leave out --reference to compare A with B alone")
    theta = p.num("rope_theta", 0.0, 1e12, default=None, lo_open=True)
    if theta is None:
        theta = c.num("rope_theta", 0.0, 1e12, default=10000.0, lo_open=True)
    kind = p.str("rope_type", "", ("default", "linear", "yarn")) or p.str("type", "default", ("default", "linear", "yarn"))
    prf = p.num("partial_rotary_factor", 0.0, 1.0, default=None, lo_open=True)
    spec = RopeSpec(
        theta=theta, kind=kind, factor=p.num("factor", 0.0, 1e6, default=1.0, lo_open=True),
        partial_rotary_factor=prf if prf is not None else c.num("partial_rotary_factor", 0.0, 1.0, default=1.0,
                                                                lo_open=True),
        original_max_position_embeddings=p.int("original_max_position_embeddings", 1, _BIG, default=None),
        beta_fast=p.num("beta_fast", -1e6, 1e6, default=32.0), beta_slow=p.num("beta_slow", -1e6, 1e6, default=1.0),
        mscale=p.num("mscale", -1e6, 1e6, default=None), mscale_all_dim=p.num("mscale_all_dim", -1e6, 1e6, default=None),
        attention_factor=p.num("attention_factor", 0.0, 1e6, default=None, lo_open=True),
        truncate=p.bool("truncate", True))
    if kind == "yarn" and spec.original_max_position_embeddings is None and not c.has("max_position_embeddings"):
        raise p.error("original_max_position_embeddings", "given for yarn RoPE (or max_position_embeddings)")
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
    return ModelSpec(
        model_type=model_type, num_layers=c.int("num_hidden_layers", 1, 1 << 16),
        hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        vocab_size=c.int("vocab_size", 1, _BIG),
        # eps >= 0: a negative one makes the normalisation's square root undefined (a non-finite reference)
        rms_norm_eps=c.num("rms_norm_eps", 0.0, 1.0, default=1e-6),
        rope=_rope_spec(c), hidden_act=c.str("hidden_act", "silu"),
        attention_bias=c.bool("attention_bias", model_type == "qwen2"),
        tie_word_embeddings=c.bool("tie_word_embeddings", False),
        num_experts=experts, num_experts_per_tok=topk,
        # Mixtral's router renormalises the top-k weights always; its configs have no norm_topk_prob
        norm_topk_prob=c.bool("norm_topk_prob", False) or model_type == "mixtral",
        scoring_func=c.str("scoring_func", "softmax"),
        routed_scaling_factor=c.num("routed_scaling_factor", 0.0, 1e6, default=1.0, lo_open=True),
        n_group=c.int("n_group", 0, 1 << 16, default=1) or 1, topk_group=c.int("topk_group", 0, 1 << 16, default=1) or 1,
        shared_expert_intermediate_size=c.int("shared_expert_intermediate_size", 0, 1 << 24, default=0),
        n_shared_experts=c.int("n_shared_experts", 0, 1 << 16, default=0),
        max_position_embeddings=c.int("max_position_embeddings", 1, _BIG, default=None),
        intermediate_size=c.int("intermediate_size", 0, 1 << 24, default=0),
        moe_intermediate_size=c.int("moe_intermediate_size", 0, 1 << 24, default=0))


# ---------------------------------------------------------------- the tensors' shapes, from the config

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)")


def expected_shape(name: str, spec: ModelSpec) -> list[int | None] | tuple | None:
    """The shape config.json gives tensor `name` (None where a dimension is not stated), or None for a name
    the reference does not read."""
    H, V, hd = spec.hidden_size, spec.vocab_size, spec.head_dim
    q, kv = spec.num_attention_heads * hd, spec.num_key_value_heads * hd
    inter, f = spec.intermediate_size or None, spec.moe_intermediate_size or None
    e, s = spec.num_experts or None, spec.shared_expert_intermediate_size or None
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return [V, H]
    if name == "model.norm.weight":
        return [H]
    m = _LAYER.fullmatch(name)
    if m is None:
        return None
    rest = m.group(2)
    x = _EXPERT.fullmatch(rest)
    if x is not None:
        return [H, f] if x.group(2) == "down_proj" else [f, H]
    table: dict[str, list[int | None]] = {
        "input_layernorm.weight": [H], "post_attention_layernorm.weight": [H],
        "self_attn.q_proj.weight": [q, H], "self_attn.k_proj.weight": [kv, H], "self_attn.v_proj.weight": [kv, H],
        "self_attn.o_proj.weight": [H, q], "self_attn.q_proj.bias": [q], "self_attn.k_proj.bias": [kv],
        "self_attn.v_proj.bias": [kv], "self_attn.o_proj.bias": [H],
        # per head (Qwen3) or over all heads at once (OLMoE)
        "self_attn.q_norm.weight": ([hd], [q]), "self_attn.k_norm.weight": ([hd], [kv]),
        "mlp.gate_proj.weight": [inter, H], "mlp.up_proj.weight": [inter, H], "mlp.down_proj.weight": [H, inter],
        "mlp.gate.weight": [e, H], "mlp.gate.e_score_correction_bias": [e],
        "mlp.experts.gate_up_proj": [e, 2 * f if f else None, H], "mlp.experts.down_proj": [e, H, f],
        "mlp.shared_expert.gate_proj.weight": [s, H], "mlp.shared_expert.up_proj.weight": [s, H],
        "mlp.shared_expert.down_proj.weight": [H, s], "mlp.shared_expert_gate.weight": [1, H],
        "mlp.shared_experts.gate_proj.weight": [None, H], "mlp.shared_experts.up_proj.weight": [None, H],
        "mlp.shared_experts.down_proj.weight": [H, None],
    }
    return table.get(rest)


def _shape_text(want: list[int | None] | tuple) -> str:
    if isinstance(want, tuple):
        return " or ".join(_shape_text(w) for w in want)
    return str(['?' if w is None else w for w in want])


def _fits(shape: list[int], want: list[int | None] | tuple) -> bool:
    """`want`: one shape (None: any size there) or a tuple of the shapes a model may give that tensor."""
    if isinstance(want, tuple):
        return any(_fits(shape, w) for w in want)
    return len(shape) == len(want) and all(w is None or int(d) == w for d, w in zip(shape, want))


# safetensors' dtype names -> torch's; the float ones are what a reference can widen to float64
_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I8": "int8", "U8": "uint8",
              "I16": "int16", "I32": "int32", "I64": "int64", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
              "F8_E5M2": "float8_e5m2"}
FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str            # torch's name ("bfloat16"); a safetensors name where torch has none
    shape: tuple[int, ...]


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a plain file"


def _not_regular(path: Path, mode: int) -> CheckpointError:
    return CheckpointError(f"{path}: not a regular file ({_kind(mode)}): a checkpoint's config.json and "
                           "*.safetensors must be files (a FIFO or device would block the reader or never end); "
                           "pass the directory the model was saved to")


def read_config(path: Path) -> Any:
    """config.json's JSON value. Symlinks are followed (a hub snapshot links into its blob store), but what they
    reach must be a regular file of at most CONFIG_MAX_BYTES: opened non-blocking and checked with fstat before
    a byte is read, so a FIFO cannot hang the reader and /dev/zero cannot fill memory."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no config.json; pass the HF checkpoint directory "
                              "(the one slime's --hf-checkpoint names)") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st.st_mode)
        if st.st_size > CONFIG_MAX_BYTES:
            raise CheckpointError(f"{path}: {st.st_size} bytes, over the {CONFIG_MAX_BYTES}-byte limit for a "
                                  "config.json (real ones are a few KB): pass the checkpoint's own config.json")
        chunks, left = [], CONFIG_MAX_BYTES + 1       # a file that grows past the limit while read is refused
        while left > 0:
            b = os.read(fd, min(left, 1 << 20))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > CONFIG_MAX_BYTES:
        raise CheckpointError(f"{path}: grew past the {CONFIG_MAX_BYTES}-byte limit while being read")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text (byte {e.start}): a config.json is UTF-8 JSON") from None
    except RecursionError:
        raise CheckpointError(f"{path}: nested too deeply to be a model config") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from None


class HFCheckpoint:
    """config.json + *.safetensors of one HF model directory; tensors read on demand, as float64."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a directory; pass the HF checkpoint directory "
                                  "(config.json + *.safetensors)")
        cfg_path = self.path / "config.json"
        self.config = read_config(cfg_path)
        self.spec = model_spec(self.config, str(cfg_path))
        self.info = self._index()
        self._where = {k: v.file for k, v in self.info.items()}
        self._hashes: dict[tuple[str, str], int] = {}

    def _index(self) -> dict[str, TensorInfo]:
        """Every tensor's file, dtype and shape, from the headers; each tensor the reference reads checked
        against the shape config.json gives it (nothing of a tensor is read here)."""
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path}: no *.safetensors file (pickled .bin checkpoints are not read; "
                                  "convert with save_pretrained(safe_serialization=True))")
        try:
            from safetensors import safe_open
        except ImportError:
            raise CheckpointError("the exact reference needs the `safetensors` package: "
                                  "pip install -r requirements/base.txt") from None
        out: dict[str, TensorInfo] = {}
        for f in files:
            try:
                st = os.stat(f)
            except OSError as e:
                raise CheckpointError(f"{f}: cannot open: {e.strerror or e}") from None
            if not stat.S_ISREG(st.st_mode):       # checked before safe_open, which would block on a FIFO
                raise _not_regular(f, st.st_mode)
            try:
                with safe_open(str(f), framework="pt") as h:
                    for k in h.keys():
                        sl = h.get_slice(k)
                        dt = str(sl.get_dtype())
                        out[k] = TensorInfo(f, _ST_DTYPES.get(dt, dt), tuple(int(d) for d in sl.get_shape()))
            except Exception as e:   # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
        for k, t in out.items():
            want = expected_shape(k, self.spec)
            if want is not None and not _fits(list(t.shape), want):
                raise CheckpointError(
                    f"{t.file}: tensor {k} has shape {list(t.shape)} where config.json gives "
                    f"{_shape_text(want)}: the weights and config.json are not of one model")
        return out

    def names(self) -> list[str]:
        return sorted(self.info)

    def has(self, name: str) -> bool:
        return name in self.info

    def _get(self, name: str):
        t = self.info.get(name)
        if t is None:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in the checkpoint")
        from safetensors import safe_open
        with safe_open(str(t.file), framework="pt", device="cpu") as h:
            return h.get_tensor(name)

    def tensor(self, name: str, device: str = "cpu", dtype: str | None = None):
        """One parameter as float64 on `device`, first rounded to `dtype` (the dtype the side held it in) when
        given: bf16/fp16/fp32 widen exactly, so the float64 tensor holds exactly the values that side ran."""
        import torch
        info = self.info.get(name)
        if info is not None and info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{info.file}: tensor {name} is stored as {info.dtype}, not a float dtype "
                                  "(a quantized checkpoint): the exact reference needs the float weights")
        t = self._get(name)
        want = getattr(torch, dtype, None) if dtype in FLOAT_DTYPES else None
        if want is not None and t.dtype != want:
            t = t.to(want)
        return t.to(device=device, dtype=torch.float64)

    def raw(self, name: str):
        """One parameter in its stored dtype (for bit-exact hashes)."""
        return self._get(name)

    def parts(self, name: str) -> list[str]:
        """The checkpoint tensors a model parameter called `name` holds: itself, or, for transformers' fused
        expert parameters (`mlp.experts.gate_up_proj` [E, 2F, H] = per expert cat(gate, up); `mlp.experts
        .down_proj` [E, H, F]), the per-expert tensors the checkpoint stores them as; [] for neither."""
        if name in self.info:
            return [name]
        m = _FUSED.fullmatch(name)
        e = self.spec.num_experts
        if m is None or not e:
            return []
        stem = m.group(1)
        kinds = ("gate_proj", "up_proj") if m.group(2) == "gate_up_proj" else ("down_proj",)
        out = [f"{stem}{i}.{k}.weight" for i in range(e) for k in kinds]
        return out if all(n in self.info for n in out) else []

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The shape of parameter `name` as the model holds it (a fused expert parameter: the stacked shape)."""
        ps = self.parts(name)
        if not ps:
            return None
        if ps == [name]:
            return self.info[name].shape
        first = self.info[ps[0]].shape
        if any(len(self.info[n].shape) != 2 for n in ps):
            return None
        rows = sum(self.info[n].shape[0] for n in ps) // self.spec.num_experts
        return (self.spec.num_experts, rows, first[1])

    def dtypes(self, name: str) -> set[str]:
        return {self.info[n].dtype for n in self.parts(name)}

    def _held(self, name: str):
        """Parameter `name` in its stored dtype, as the model holds it (fused expert parameters stacked)."""
        ps = self.parts(name)
        if ps == [name]:
            return self._get(name)
        import torch
        per = len(ps) // self.spec.num_experts
        return torch.stack([torch.cat([self._get(n) for n in ps[i:i + per]], 0) for i in range(0, len(ps), per)])

    def hash(self, name: str, dtype: str) -> int | None:
        """The tensor's bit-exact hash (stats.device_hash) once rounded to `dtype`, the dtype a side held it in;
        None when the checkpoint has no such tensor or it cannot be held in that dtype. Cached: both sides
        and the contract ask for the same ones."""
        key = (name, dtype)
        if key not in self._hashes:
            import torch

            from .stats import device_hash
            want = getattr(torch, dtype, None) if isinstance(dtype, str) else None
            if not self.parts(name) or not isinstance(want, torch.dtype):
                return None
            t = self._held(name)
            if t.dtype != want:
                if not (t.dtype.is_floating_point and want.is_floating_point):
                    return None
                t = t.to(want)
            self._hashes[key] = int(device_hash(t))
        return self._hashes[key]


def yarn_inv_freq_and_scale(rope: RopeSpec, head_dim: int, max_pos: int | None):
    """YaRN's inverse frequencies and attention factor as HF's `_compute_yarn_parameters` states them, in
    float64 (HF computes them in float32: that rounding is shared by every side and measured as theirs)."""
    import torch
    dim = int(head_dim * rope.partial_rotary_factor)
    base, factor = rope.theta, rope.factor
    omax = rope.original_max_position_embeddings or max_pos
    if omax is None:       # model_spec refuses such a config; kept for a RopeSpec built by hand
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
