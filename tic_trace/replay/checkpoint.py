"""An HF checkpoint directory as the exact reference's source of weights and model facts.

A checkpoint is untrusted input, like a trace (docs/security.md, "The exact reference's inputs"):
`config.json` is read only if it is a regular file under CONFIG_MAX_BYTES (opened non-blocking: a FIFO cannot
hang the reader), and every value the reference uses is checked by one typed schema (`model_spec.model_spec`:
an error names config.json, the key and what was expected). `*.safetensors` files must be regular files; their
headers are read first and every tensor the reference reads is checked against the shape config.json gives
it before a byte of it is allocated. Tensors are read lazily, one at a time, with the `safetensors` library
(never pickle: `.bin` checkpoints are refused), and rounded to the dtype the side that ran them held them in
(`tensor(name, dtype=...)`: an fp32 checkpoint of a bf16 run is replayed with bf16 weights).
Weights are looked up by HF parameter name; `reference._LayerWeights` knows the names the Qwen2/Qwen3(-MoE),
Llama and DeepSeek-style families use, including the per-expert and the fused (`gate_up_proj`) layouts.
"""
from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..store.untrusted import file_kind, read_upto
from ..families import family_for
from .model_spec import CONFIG_MAX_BYTES, CheckpointError, ModelSpec, model_spec


class ReferenceMismatch(Exception):
    """The checkpoint is not the model, or not the weights, the traces ran: the replay would compare each side
    with another op. Not comparable (CLI exit 3); `problems` says what differs."""

    def __init__(self, path: str | Path, problems: list[str]):
        self.path, self.problems = str(path), list(problems)
        shown = "; ".join(problems[:8]) + (f"; … {len(problems) - 8} more" if len(problems) > 8 else "")
        super().__init__(f"{path} is not the model or the weights the traces ran: {shown}. Pass the checkpoint "
                         "the run loaded (for slime, the --hf-checkpoint of this step's weights), or leave out "
                         "--reference to compare A with B alone")


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
    arch = family_for(spec).shapes(rest, spec)     # the family's own layout (fused, with biases)
    if arch is not None:
        return arch
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
        "mlp.gate.weight": [e, H],
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


def _not_regular(path: Path, mode: int) -> CheckpointError:
    return CheckpointError(f"{path}: not a regular file ({file_kind(mode)}): a checkpoint's config.json and "
                           "*.safetensors must be files (a FIFO or device would block the reader or never end); "
                           "pass the directory the model was saved to")


def read_config(path: Path, limit: int = CONFIG_MAX_BYTES, what: str = "config.json") -> Any:
    """config.json's (or another small JSON file's) value. Symlinks are followed (a hub snapshot links into its
    blob store), but what they reach must be a regular file of at most `limit` bytes: opened non-blocking and
    checked with fstat before a byte is read, so a FIFO cannot hang the reader and /dev/zero cannot fill memory."""
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
        if st.st_size > limit:
            raise CheckpointError(f"{path}: {st.st_size} bytes, over the {limit}-byte limit for a "
                                  f"{what}: pass the checkpoint's own {what}")
        data = read_upto(fd, limit + 1, 1 << 20)   # a file that grows past the limit is refused
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise CheckpointError(f"{path}: grew past the {limit}-byte limit while being read")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text (byte {e.start}): a {what} is UTF-8 JSON") from None
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
        self._stored: dict[str, str] = {}     # a name the model loads -> the tensor the checkpoint stores it as
        if (self.spec.tie_word_embeddings and "model.embed_tokens.weight" not in self.info
                and "lm_head.weight" in self.info):
            # tied, saved under the head's name only: transformers loads the embedding from it
            self.info["model.embed_tokens.weight"] = self.info["lm_head.weight"]
            self._stored["model.embed_tokens.weight"] = "lm_head.weight"
        self._where = {k: v.file for k, v in self.info.items()}
        self._hashes: dict[tuple[str, str], int] = {}
        self.tie_word_embeddings, self.tie_note = self._head_tie()

    def _head_tie(self) -> tuple[bool, str | None]:
        """Whether the model this checkpoint loads has tied embeddings, as transformers (5.x) decides it: tied
        when config.json says so, unless the checkpoint also holds an `lm_head.weight` with other values than
        `model.embed_tokens.weight` (transformers then loads both, untied, with a warning). The note says why
        the checkpoint's tie differs from its config.json (None: it does not)."""
        if not self.spec.tie_word_embeddings:
            return False, None
        head, embed = self.info.get("lm_head.weight"), self.info.get("model.embed_tokens.weight")
        if head is None or embed is None:
            return True, None
        if head.shape == embed.shape and head.dtype == embed.dtype:
            import torch
            if torch.equal(self._get("lm_head.weight"), self._get("model.embed_tokens.weight")):
                return True, None
        return False, ("config.json ties the embeddings, but the checkpoint also holds an lm_head.weight that "
                       "differs from model.embed_tokens.weight, so transformers loads them untied (lm_head from "
                       "its own tensor)")

    def _index(self) -> dict[str, TensorInfo]:
        """Every tensor's file, dtype and shape, from the headers; each tensor the reference reads checked
        against the shape config.json gives it (nothing of a tensor is read here)."""
        from .checkpoint_index import check_tensors, shard_plan
        plan = shard_plan(self.path, read_config)
        self.notes = list(plan.notes)
        files = plan.files
        held: dict[Path, list[str]] = {}
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
                    held[f] = list(h.keys())
                    for k in held[f]:
                        sl = h.get_slice(k)
                        dt = str(sl.get_dtype())
                        out[k] = TensorInfo(f, _ST_DTYPES.get(dt, dt), tuple(int(d) for d in sl.get_shape()))
            except Exception as e:   # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
        check_tensors(held, plan, self.path)
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
            return h.get_tensor(self._stored.get(name, name))

    def tensor(self, name: str, device: str = "cpu", dtype: str | None = None, rows=None):
        """One parameter as float64 on `device`, first rounded to `dtype` (the dtype the side held it in) when
        given: bf16/fp16/fp32 widen exactly, so the float64 tensor holds exactly the values that side ran.
        `rows` (an index tensor): only those rows, taken before widening (`ExactReference.vocab_entries`)."""
        import torch
        info = self.info.get(name)
        if info is not None and info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{info.file}: tensor {name} is stored as {info.dtype}, not a float dtype "
                                  "(a quantized checkpoint): the exact reference needs the float weights")
        t = self._get(name)
        if rows is not None:
            t = t[rows]
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

            from ..record.stats import device_hash
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
