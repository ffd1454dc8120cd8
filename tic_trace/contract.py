"""The contract of two traces, diffed before any tensor: what both sides claim to compute.

Versions, the model description (eps, RoPE, heads, experts, top-k, routing, vocabulary, tied embeddings),
the numerics settings each adapter records (`Adapter.numerics`: SGLang server arguments, Megatron
TransformerConfig fields, HF attention/experts implementations), the dtype each side recorded every common
canonical point in (fp32 on one side and bf16 on the other is a `precision` difference at that point), and
bit-exact parameter hashes per point (side against side, and against the reference checkpoint). No tensor
value is read: only manifests, pass metadata and record headers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .adapter import rope_scaling_of
from .align import CanonicalView, common_points
from .canonical import BY_NAME, key_name
from .checkpoint import HFCheckpoint
from .dtypes import dtype_info, known_dtype

# Model-description keys every adapter's `describe` writes under the same name (compared where both have one).
CONFIG_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
               "num_experts", "num_experts_per_tok", "shared_experts", "rms_norm_eps", "rope_theta",
               "rope_scaling", "norm_topk_prob", "router_scoring", "tie_word_embeddings")
VERSION_KEYS = ("tic_trace", "torch", "python", "numpy", "transformers", "megatron.core", "sglang")


@dataclass(frozen=True)
class ContractDiff:
    section: str          # "version" | "config" | "numerics" | "dtype" | "weights"
    key: str              # the setting, or the canonical point key ("L3.attn.q")
    a: Any
    b: Any                # side B's value, or the checkpoint's when `against` is "checkpoint"
    kind: str = "contract"   # "precision" for a point recorded in different float dtypes
    against: str = "B"    # "B" | "checkpoint"
    side: str | None = None  # for checkpoint differences: which side differs from it ("A" | "B")
    note: str = ""


def _same(x: Any, y: Any) -> bool:
    if isinstance(x, (int, float)) and isinstance(y, (int, float)) and not isinstance(x, bool):
        return math.isclose(float(x), float(y), rel_tol=1e-5, abs_tol=0.0)
    return x == y


def _same_rope(x: Any, y: Any) -> bool:
    """RoPE scaling as `rope_scaling_of` spells it, on the keys both sides state: a loader fills in defaults
    a checkpoint's config.json leaves out (YaRN's `truncate`, `beta_fast`), and an older config names the kind
    `type`; the kind and every parameter both state must agree."""
    x, y = rope_scaling_of(x) if isinstance(x, dict) else x, rope_scaling_of(y) if isinstance(y, dict) else y
    if not (isinstance(x, dict) and isinstance(y, dict)):
        return _same(x, y)
    return all(_same(x[k], y[k]) for k in set(x) & set(y))


def _diff_dicts(section: str, da: dict, db: dict, keys) -> list[ContractDiff]:
    # None is "not known" for every key but rope_scaling, where it is a value: plain RoPE
    return [ContractDiff(section, k, da[k], db[k]) for k in keys
            if k in da and k in db and (k == "rope_scaling" or (da[k] is not None and db[k] is not None))
            and not (_same_rope if k == "rope_scaling" else _same)(da[k], db[k])]


def checkpoint_config(ckpt: HFCheckpoint) -> dict:
    """The checkpoint's model description under CONFIG_KEYS."""
    s = ckpt.spec
    raw = ckpt.config if isinstance(ckpt.config, dict) else {}
    cfg = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    rope = rope_scaling_of(cfg.get("rope_parameters") or cfg.get("rope_scaling"))
    return {"num_layers": s.num_layers, "hidden_size": s.hidden_size, "num_attention_heads": s.num_attention_heads,
            "num_key_value_heads": s.num_key_value_heads, "head_dim": s.head_dim, "vocab_size": s.vocab_size,
            "num_experts": s.num_experts, "num_experts_per_tok": s.num_experts_per_tok if s.num_experts else 0,
            "rms_norm_eps": s.rms_norm_eps, "rope_theta": s.rope.theta, "rope_scaling": rope,
            "norm_topk_prob": s.norm_topk_prob, "router_scoring": s.scoring_func,
            "tie_word_embeddings": s.tie_word_embeddings}


def point_dtypes(view: CanonicalView) -> dict[tuple[str, int | None], str]:
    """The dtype each canonical point was recorded in (record headers only)."""
    return {k: view.load(*k, values=False).dtype for k in view.points() if k != ("logprobs", None)
            or ("logprobs", None) in view.entries}


def diff_contract(view_a: CanonicalView, view_b: CanonicalView,
                  reference: HFCheckpoint | None = None) -> list[ContractDiff]:
    """Every contract difference between two traces (and each against the checkpoint), in the order
    versions, config, numerics, dtypes (dataflow order), weights."""
    ma, mb = view_a.trace.manifest, view_b.trace.manifest
    out = _diff_dicts("version", ma.get("versions") or {}, mb.get("versions") or {}, VERSION_KEYS)
    out += _diff_dicts("config", view_a.config, view_b.config, CONFIG_KEYS)
    if reference is not None:
        ref = checkpoint_config(reference)
        for side, view in (("A", view_a), ("B", view_b)):
            out += [ContractDiff(d.section, d.key, d.a, d.b, against="checkpoint", side=side)
                    for d in _diff_dicts("config", view.config, ref, CONFIG_KEYS)]
    na, nb = ma.get("numerics") or {}, mb.get("numerics") or {}
    out += _diff_dicts("numerics", na, nb, sorted(set(na) & set(nb)))
    out += _dtype_diffs(view_a, view_b)
    out += _weight_diffs(view_a, view_b, reference)
    return out


def _dtype_diffs(view_a: CanonicalView, view_b: CanonicalView) -> list[ContractDiff]:
    both, _, _ = common_points(view_a, view_b)
    da, db = point_dtypes(view_a), point_dtypes(view_b)
    out = []
    for k in both:
        a, b = da.get(k), db.get(k)
        if a is None or b is None or a == b or BY_NAME.get(k[0]) is None or BY_NAME[k[0]].kind == "ids":
            continue
        floats = all(known_dtype(x) and dtype_info(x).is_float for x in (a, b))
        out.append(ContractDiff("dtype", key_name(*k), a, b, kind="precision" if floats else "contract",
                                note="the two sides compute this point's output in different precisions"
                                if floats else ""))
    return out


def _weight_diffs(view_a: CanonicalView, view_b: CanonicalView,
                  reference: HFCheckpoint | None) -> list[ContractDiff]:
    from .weight_map import weight_hashes_by_point
    wa, wb = weight_hashes_by_point(view_a), weight_hashes_by_point(view_b)
    out = []
    for k in sorted(set(wa) & set(wb), key=lambda k: (k[1] is None, k[1] or 0, k[0])):
        # only parameters held alike (dtype and shape) are comparable bit for bit
        names = sorted(n for n in set(wa[k]) & set(wb[k])
                       if list(wa[k][n][1:3]) == list(wb[k][n][1:3]) and wa[k][n][0] != wb[k][n][0])
        if names:
            out.append(ContractDiff("weights", key_name(*k), names, names,
                                    note=f"parameters whose bits differ between A and B: {', '.join(names)}"))
    if reference is not None:
        for side, w in (("A", wa), ("B", wb)):
            for k, params in w.items():
                bad = [n for n, (h, dt, _) in params.items() if _checkpoint_hash(reference, n, dt) not in (None, h)]
                if bad:
                    out.append(ContractDiff("weights", key_name(*k), bad, "checkpoint", against="checkpoint",
                                            side=side, note=f"{side}'s parameters differ from the checkpoint's: "
                                                            f"{', '.join(sorted(bad))}"))
    return out


def _checkpoint_hash(ckpt: HFCheckpoint, name: str, dtype: str) -> int | None:
    """The checkpoint tensor's hash in the dtype the side held it in (None: not in the checkpoint under
    this name, e.g. a fused or sharded framework layout)."""
    if not ckpt.has(name):
        return None
    import torch

    from .stats import device_hash
    t = ckpt.raw(name)
    want = getattr(torch, dtype, None)
    if want is not None and t.dtype != want:
        t = t.to(want)
    return int(device_hash(t))
