"""HF transformers reference adapter: the architectures of `ARCHITECTURES` -> canonical points.

HF is the implementation users trust, so its mapping is deliberately direct: every point is a module output,
a module input, or the output of `apply_rotary_pos_emb` (tapped in the model's own modeling module, since
RoPE is a function call, not a module). Row r of a pass is batch b, position s, with r = b*S + s.

The table's module names mean these points only in the architectures of `ARCHITECTURES` (keyed by the
model class; transformers 5.24). The rows and architectures are the model families' (tic_trace/families/<name>/
names.py, read through `families.framework_names`): the base rows are the plain transformer's, each family's
rows hold for its architectures only; this module keeps the mechanics (taps, inputs recorded, describe). Any
other class is recorded as unverified and refused at compare time (docs/adapters.md); `REFUSED` says what the
table would get wrong for the ones known to differ.
"""
from __future__ import annotations

import re
import sys
from typing import Any

from tic_trace.families import framework_names
from tic_trace.graph.adapter import Adapter, PointMap, plain_settings, register_adapter, rope_scaling_of

from tic_trace.adapters.router_facts import selection_facts

# the families' HF tables (tic_trace/families/<name>/names.py); what each key means: families.base.FrameworkNames
_FAM = framework_names("hf")


def _taps() -> dict[str, tuple[str, ...]]:
    """A module name's last part -> the functions of its modeling module to tap (every family's `taps`)."""
    out: dict[str, tuple[str, ...]] = {}
    for n in _FAM:
        for suffix, fns in n.tables.get("taps", {}).items():
            out[suffix] = (*out.get(suffix, ()), *fns)
    return out


_TAPS = _taps()
_TOKEN_DIMS = {part: d for n in _FAM for part, d in n.tables.get("token_dims", {}).items()}
# config attributes a family names its numerics settings by (Gemma's activation), recorded beside the base's
_NUMERICS = tuple(k for n in _FAM for k in n.tables.get("numerics", ()))

# the base rows (families/transformer/names.py), then each family's rows (each for its architectures)
POINTS = tuple(pm for n in _FAM for pm in n.points)
# (point, architecture) pairs whose generic row is replaced by one of those
_OVERRIDDEN = frozenset().union(*(n.tables.get("overridden", ()) for n in _FAM))


ARCHITECTURES = {a.name: a for n in _FAM for a in n.architectures}

REFUSED: dict[str, str] = {a: why for n in _FAM for a, why in n.refused.items()}
_QK = ("attn.q_norm", "attn.k_norm")


class HFAdapter(Adapter):
    name = "hf"
    points = POINTS
    architectures = ARCHITECTURES
    refused = REFUSED

    def architecture_of(self, models: list) -> str | None:
        return type(models[0]).__name__

    def prepare(self, tracer: Any, models: list) -> None:
        tapped = set()
        for model in models:
            for name, mod in model.named_modules():
                if name.endswith("self_attn"):
                    ns = sys.modules.get(type(mod).__module__)
                    if ns is not None and hasattr(ns, "apply_rotary_pos_emb") and ns.__name__ not in tapped:
                        tracer.tap_function(ns, "apply_rotary_pos_emb")
                        tapped.add(ns.__name__)
                for suffix, fns in _TAPS.items():                              # a family's module functions
                    ns = sys.modules.get(type(mod).__module__) if name.endswith(suffix) else None
                    if ns is not None and f"{ns.__name__}:{suffix}" not in tapped:
                        for fn in fns:
                            if hasattr(ns, fn):
                                tracer.tap_function(ns, fn)
                        tapped.add(f"{ns.__name__}:{suffix}")
        tracer.record_inputs_of(["re:^model\\.layers\\.\\d+$", "re:\\.self_attn\\.o_proj$",
                                 "re:\\.post_attention_layernorm$",
                                 *(r for n in _FAM for r in n.tables.get("record_inputs", ()))])

    def describe(self, models: list) -> dict:
        cfg = getattr(models[0], "config", None)
        if cfg is None:
            return {}
        text = getattr(cfg, "get_text_config", lambda: cfg)()
        heads = text.num_attention_heads
        attn0 = next((m for n, m in models[0].named_modules() if n.endswith("self_attn")), None)
        # The same fact under other names: DeepSeek/GLM `n_routed_experts`, Mixtral `num_local_experts`;
        # shared experts as a size (Qwen2-MoE) or a count (DeepSeek/GLM).
        n_exp = (getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
                 or getattr(text, "n_routed_experts", None) or 0)
        out = {
            **self.architecture_facts(models),
            "model_type": getattr(text, "model_type", None),
            "num_layers": text.num_hidden_layers,
            "hidden_size": text.hidden_size,
            "num_attention_heads": heads,
            "num_key_value_heads": getattr(text, "num_key_value_heads", heads),
            "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
            "vocab_size": text.vocab_size,
            "qk_norm": attn0 is not None and getattr(attn0, "q_norm", None) is not None,
            "num_experts": int(n_exp),
            "num_experts_per_tok": (getattr(text, "num_experts_per_tok", 0) or 0) if n_exp else 0,
            "shared_experts": bool(getattr(text, "shared_expert_intermediate_size", 0)
                                   or getattr(text, "n_shared_experts", 0)),
            "rms_norm_eps": getattr(text, "rms_norm_eps", None),
            "rope_theta": _rope_theta(text),
            "rope_scaling": _rope_scaling(text),
            "norm_topk_prob": bool(getattr(text, "norm_topk_prob", False)),
            "router_scoring": str(getattr(text, "scoring_func", "softmax")),
            "tie_word_embeddings": bool(getattr(text, "tie_word_embeddings", False)),
            "dtype": str(getattr(models[0], "dtype", "")).removeprefix("torch."),
            # transformers' own TP degree (`tp_size`: None unless the model was sharded with a tp_plan): the
            # replay's row-parallel variants follow it (replay/variants.py: tp_degrees)
            "tensor_model_parallel_size": int(getattr(models[0], "tp_size", None) or 1),
            **(selection_facts(models[0], text, "hf") if n_exp else {}),
            **{k: v for n in _FAM if "describe" in n.tables for k, v in n.tables["describe"](text).items()},
        }
        arch = self.architecture(out)
        if arch is not None:
            out.update(arch.defaults)
        return out

    def weight_pieces(self, models: list, params: dict) -> dict:
        from tic_trace.adapters.hf_weight_map import hf_weight_pieces
        return hf_weight_pieces(models, params)

    def numerics(self, models: list) -> dict:
        cfg = getattr(models[0], "config", None)
        if cfg is None:
            return {}
        out = plain_settings(cfg, ("_attn_implementation", "_experts_implementation", "hidden_act", *_NUMERICS))
        return {k.lstrip("_"): v for k, v in out.items()}

    def rows_from_forward(self, tracer: Any, args: tuple, kwargs: dict):
        """Row r = b*S + s of the root forward: sample `tracer.sample_keys[b]` (default `s{b}`; None where the
        2-D attention mask marks padding), at the position the model runs it at (`_positions`), with its
        token id. Logits computed for some positions only (`logits_to_keep`) are named here when a mask
        says which rows they are; an int keeps the last k positions of each sample, which the reader maps
        (`kept_rows`); an index tensor's rows are not stored (see `_keep_rows`)."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None or not hasattr(ids, "shape") or ids.dim() != 2:
            return None
        b, s = (int(x) for x in ids.shape)
        mask = kwargs.get("attention_mask")
        mask = mask if hasattr(mask, "dim") and mask.dim() == 2 else None   # a 4-D mask says no padding
        pos = _positions(kwargs, b, s, mask)
        keys = tracer.sample_keys or [f"s{i}" for i in range(b)]
        if len(keys) < b:
            raise ValueError(f"tracer.sample_keys names {len(keys)} sample(s) but the forward's batch holds {b}: "
                             "give one key per sample of each pass (set tracer.sample_keys before the forward)")
        _keep_rows(tracer, kwargs.get("logits_to_keep"), b, s)
        valid = mask[:, -s:].bool().tolist() if mask is not None else None
        out_keys, out_pos, out_tok = [], [], []
        ids_l, pos_l = ids.tolist(), pos.tolist()
        for i in range(b):
            for j in range(s):
                ok = valid is None or valid[i][j]
                out_keys.append(keys[i] if ok else None)
                out_pos.append(pos_l[i][j])
                out_tok.append(ids_l[i][j])
        return out_keys, out_pos, out_tok

    def applies(self, pm: PointMap, config: dict) -> bool:
        only, arch = pm.opts.get("archs"), config.get("architecture")
        if (arch not in only) if only is not None else (pm.point, arch) in _OVERRIDDEN:
            return False                    # a row for other architectures, or one they replace
        if any(n.tables["applies"](pm, config) is False for n in _FAM if "applies" in n.tables):
            return False                    # a family's row its model lacks (no layer runs linear attention)
        if pm.point in _QK and not config.get("qk_norm", True):
            return False                    # the attention has no QK-norm module (read off the model)
        return super().applies(pm, config)

    def kept_rows(self, record_name: str, shape: tuple, n_rows: int) -> list[int] | None:
        """The logits of `logits_to_keep=k` (an int: what `generate()` passes, k=1): `[B, k, V]` for a pass of
        B*S rows holds the last k positions of each sample, rows b*S + S-k .. b*S + S-1."""
        if record_name not in _LOGITS_RECORDS or len(shape) != 3:
            return None
        b, k = int(shape[0]), int(shape[1])
        if b <= 0 or k <= 0 or n_rows % b or b * k >= n_rows:
            return None
        s = n_rows // b
        return [i * s + s - k + j for i in range(b) for j in range(k)]

    def token_dims(self, record_name: str) -> int | None:
        for part, dim in _TOKEN_DIMS.items():       # a family's tapped functions' layouts
            if part in record_name:
                return dim
        if "apply_rotary_pos_emb" in record_name:
            return 0                        # [B, heads, S, d]: stored whole, the transform reads it
        if ".mlp.gate:" in record_name or ".mlp.experts:" in record_name:
            return 1
        return 2


# the records that hold the logits: lm_head's, and a family's own (Gemma's soft-capped ones: the model's output)
_LOGITS_RECORDS = ("lm_head:out", *(r for n in _FAM for r in n.tables.get("logits_records", ())))


def _positions(kwargs: dict, b: int, s: int, mask):
    """[b, s] positions the model runs its rows at. `position_ids` first: what RoPE reads (and, in
    transformers 5, what the decoder takes instead of `cache_position`; where both are given, e.g. older
    `generate()` on a left-padded batch, `cache_position` counts the pad slots too). Else `cache_position`
    (older transformers derive `position_ids` from it), else what the model computes itself: the cache's
    past length + 0..s-1, the past length read from the cache (`get_seq_length()`, or a legacy tuple's
    key length) or, for a cache that cannot tell, from the attention mask's width (past + current)."""
    import torch
    pos = kwargs.get("position_ids")
    if pos is not None and hasattr(pos, "dim"):
        if pos.dim() == 3:          # multimodal RoPE ([3, b, s]): its first (temporal) section
            pos = pos[0]
        return pos.reshape(-1, pos.shape[-1]).expand(b, -1).long()
    cp = kwargs.get("cache_position")
    if cp is not None and hasattr(cp, "dim"):
        return cp.reshape(1, -1).expand(b, -1).long()
    past = _past_length(kwargs.get("cache", kwargs.get("past_key_values")))
    if past is None:
        past = int(mask.shape[-1]) - s if mask is not None and mask.shape[-1] > s else 0
    return (torch.arange(s) + past).reshape(1, -1).expand(b, -1)


def _past_length(cache) -> int | None:
    """Tokens already in a KV cache (None: no cache, or one that cannot tell)."""
    if cache is None:
        return None
    get = getattr(cache, "get_seq_length", None)
    if callable(get):
        try:
            return int(get())
        except Exception:  # noqa: BLE001 - a cache type that needs arguments: the mask decides
            return None
    try:                    # legacy tuple of (key, value) per layer, keys [b, heads, past, head_dim]
        return int(cache[0][0].shape[-2])
    except Exception:  # noqa: BLE001
        return None


def _keep_rows(tracer: Any, keep, b: int, s: int) -> None:
    """Name the rows of logits computed for some positions only. A boolean [b, s] mask: HF flattens the kept
    rows to [n, V], named exactly (set_record_rows). An index tensor gives [b, k, V], whose rows the
    tracer's per-record row list (leading dimension only) cannot name, and the reader would take for the
    last k positions: the record is kept out of the pass (all -1) rather than compared on the wrong rows.
    An int needs nothing here: the reader maps it (HFAdapter.kept_rows)."""
    import torch
    if keep is None or isinstance(keep, int) or not isinstance(keep, torch.Tensor):
        return
    for rx in map(re.escape, _LOGITS_RECORDS):
        if keep.dim() == 2 and keep.dtype == torch.bool and tuple(keep.shape) == (b, s):
            tracer.set_record_rows(rx, [i * s + j for i, j in keep.nonzero().tolist()])
        elif keep.dim() >= 1:
            tracer.set_record_rows(rx, [-1] * b)


def _rope_theta(cfg) -> float | None:
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        theta = params.get("rope_theta") if isinstance(params, dict) else None
    return theta


def _rope_scaling(cfg) -> dict | None:
    """RoPE kind and scaling parameters as the config states them (None for plain RoPE), in the contract's
    one spelling (`rope_scaling_of`)."""
    return rope_scaling_of(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None))


ADAPTER = HFAdapter
register_adapter(HFAdapter)
