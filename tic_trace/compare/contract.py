"""The contract of two traces, diffed before any tensor: what both sides claim to compute.

Versions, the model description (eps, RoPE, heads, experts, top-k, routing, vocabulary, tied embeddings),
the numerics settings each adapter records (`Adapter.numerics`: SGLang server arguments, Megatron
TransformerConfig fields, HF attention/experts implementations), the dtype each side recorded every common
canonical point in (fp32 on one side and bf16 on the other is a `precision` difference at that point), and
bit-exact parameter hashes per point (side against side, and against the reference checkpoint). No trace
tensor value is read: only manifests, pass metadata and record headers.

With a reference, `check_reference` decides first whether the checkpoint can serve at all (the model facts,
every recorded parameter's shape and dtype, the recorded hashes: `ReferenceMismatch`, exit 3, when no side
agrees with it), and the contract says, per side, which dtype the checkpoint's weights were rounded to for
that side's replay and how many of its tensors a hash confirmed (section `reference`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..graph.adapter import rope_scaling_of
from ..graph.canonical import BY_NAME, EXPERT_IDS, key_name
from ..replay.checkpoint import FLOAT_DTYPES, HFCheckpoint, ReferenceMismatch
from ..store.dtypes import dtype_info, known_dtype
from ..view.align import CanonicalView, common_points
from .choice import selection_bias_differences

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
    """The checkpoint's model description under CONFIG_KEYS, in the adapters' spelling (`rope_scaling` as the
    HF adapter states it: the config's scalar RoPE parameters other than theta; None for plain RoPE)."""
    s = ckpt.spec
    raw = ckpt.config if isinstance(ckpt.config, dict) else {}
    cfg = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    rope = rope_scaling_of(cfg.get("rope_parameters") or cfg.get("rope_scaling"))
    return {"num_layers": s.num_layers, "hidden_size": s.hidden_size, "num_attention_heads": s.num_attention_heads,
            "num_key_value_heads": s.num_key_value_heads, "head_dim": s.head_dim, "vocab_size": s.vocab_size,
            "num_experts": s.num_experts, "num_experts_per_tok": s.num_experts_per_tok if s.num_experts else 0,
            "shared_experts": bool(s.shared_expert_intermediate_size or s.n_shared_experts),
            "rms_norm_eps": s.rms_norm_eps, "rope_theta": s.rope.theta, "rope_scaling": rope,
            "norm_topk_prob": s.norm_topk_prob, "router_scoring": s.scoring_func,
            # as transformers loads it (HFCheckpoint._head_tie), not only as config.json states it
            "tie_word_embeddings": getattr(ckpt, "tie_word_embeddings", s.tie_word_embeddings)}


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
    out += _selection_bias_diffs(view_a.config, view_b.config)
    if reference is not None:
        for side, view in (("A", view_a), ("B", view_b)):
            out += reference_entries(side, view, reference)
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
    """Every parameter of both sides compared in the checkpoint's layout (weight_coverage.py): one `weights`
    difference per point whose tensors differ, and a `hashes` line saying how many were compared and naming
    every one that was not (absent only when all were compared and agree: the renderers then say "agree")."""
    from ..graph.weight_points import hf_point_of
    from .weight_coverage import compare_weights, side_weights
    ca, cb = side_weights(view_a), side_weights(view_b)
    cov = compare_weights(ca, cb)
    out = []
    whole = cov.compared == cov.total and cov.compared > 0
    for key, names in _by_point(cov.differing, hf_point_of):
        out.append(ContractDiff("weights", key, names, names,
                                note=f"parameters whose bits differ between A and B: {', '.join(names)}"
                                     + (f" ({cov.compared} of {cov.total} parameters compared)" if whole else "")))
    if not whole or set(cov.differing) - {n for d in out for n in d.a}:
        # some parameter not compared (or differing ones no point reads): said, and named, in one line
        out.append(ContractDiff("hashes", "A-B", cov.compared, cov.total, note=cov.sentence()))
    if reference is not None:
        for side, cw in (("A", ca), ("B", cb)):
            bad = [n for n, (hashes, shape) in cw.tensors.items()
                   if _tensor_vs_checkpoint(reference, n, hashes, shape) is False]
            for key, names in _by_point(bad, hf_point_of):
                out.append(ContractDiff("weights", key, names, "checkpoint", against="checkpoint", side=side,
                                        note=f"{side}'s parameters differ from the checkpoint's: {', '.join(names)}"))
    return out


def _by_point(names: list[str], point_of) -> list[tuple[str, list[str]]]:
    """Checkpoint tensor names grouped by the canonical point that reads them, in dataflow order (a tensor no
    point reads stays in the `hashes` line only)."""
    groups: dict[tuple, list[str]] = {}
    for n in names:
        k = point_of(n)
        if k is not None:
            groups.setdefault(k, []).append(n)
    return [(key_name(*k), sorted(v)) for k, v in sorted(groups.items(), key=lambda kv: (kv[0][1] is None,
                                                                                          kv[0][1] or 0, kv[0][0]))]


def _tensor_vs_checkpoint(ckpt: HFCheckpoint, name: str, hashes: dict[str, int], shape) -> bool | None:
    """Whether a side's checkpoint-layout hash of tensor `name` is the checkpoint's (None: not comparable), in
    the checkpoint's own dtype when the side hashed it in that one, else in the side's."""
    if ckpt.parts(name) != [name] or not ckpt.dtypes(name) <= set(FLOAT_DTYPES):
        return None
    if tuple(ckpt.info[name].shape) != tuple(shape):
        return None
    own = ckpt.info[name].dtype
    dt = own if own in hashes else next((d for d in hashes if d in FLOAT_DTYPES), None)
    if dt is None:
        return None
    want = ckpt.hash(name, dt)
    return None if want is None else want == hashes[dt]


def _selection_bias_diffs(config_a: dict, config_b: dict) -> list[ContractDiff]:
    """The routers' selection bias (a buffer, so not among the hashed parameters), where the sides' differ: at
    the expert choice it changes."""
    return [ContractDiff("weights", key_name(EXPERT_IDS, layer), ["router selection bias"], ["router selection bias"],
                         note=f"the router's selection-only bias differs for expert(s) "
                              f"{', '.join(map(str, experts[:8]))}{' ...' if len(experts) > 8 else ''}")
            for layer, experts in selection_bias_differences(config_a, config_b)]


def _vs_checkpoint(ckpt: HFCheckpoint, name: str, entry) -> str:
    """One recorded parameter [hash, dtype, shape] against the checkpoint tensor(s) it holds (`ckpt.parts`:
    itself, or the per-expert tensors of a fused expert parameter): "absent" (none), "layout" (another shape
    that is a shard or padding of it: not comparable bit for bit), "other-shape", "not-float" (the side or the
    checkpoint holds it quantized), "agrees" or "differs" (the checkpoint's rounded to the side's dtype, hashed)."""
    shape = ckpt.shape(name)
    if shape is None:
        return "absent"
    h, dtype, got = entry[0], entry[1], list(entry[2])
    if got != list(shape):
        return "layout" if _is_layout(name, got, list(shape)) else "other-shape"
    if dtype not in FLOAT_DTYPES or not ckpt.dtypes(name) <= set(FLOAT_DTYPES):
        return "not-float"
    return "agrees" if ckpt.hash(name, dtype) == h else "differs"


def _is_layout(name: str, side: list, ck: list) -> bool:
    """Another shape that the same weights take in a parallel layout: one dimension split into equal shards
    (tensor or expert parallelism), or an embedding / output layer with padded rows."""
    if len(side) != len(ck):
        return False
    diff = [i for i, (x, y) in enumerate(zip(side, ck)) if x != y]
    if len(diff) != 1:
        return False
    i = diff[0]
    if 0 < side[i] < ck[i] and ck[i] % side[i] == 0:
        return True
    return i == 0 and side[i] > ck[i] and name.endswith(("embed_tokens.weight", "lm_head.weight"))


# ------------------------------------------------------------------------------------------------ the reference

def _label(side: str) -> str:
    return side if " " in side else f"side {side}"


def _shown(v) -> str:
    return str(v) if isinstance(v, (int, float, bool)) or v is None else repr(v)


def check_reference(ckpt: HFCheckpoint, views: dict[str, CanonicalView]) -> None:
    """Can `ckpt` be the exact reference of these traces (`views`: {"A": view, "B": view}, or one trace)? Raise
    ReferenceMismatch naming every problem when it is not the model or not the weights they ran.

    A fact of the checkpoint is contradicted when some side states it and no side agrees: a model fact
    (layers, heads, hidden size, experts, vocabulary, eps, RoPE, ...), a recorded parameter's shape (a shard or
    padded rows is another layout, not a contradiction) or its hash (the checkpoint's tensor rounded to the
    side's dtype). One side disagreeing where the other agrees is what the replay is for (a weight-sync bug,
    a misconfigured side): the contract lists it and the replay blames that side. Tensors the replay reads must
    be float (a quantized checkpoint is not the weights a float side ran)."""
    from ..view.weight_map import recorded_weights
    problems: list[str] = []
    ref = checkpoint_config(ckpt)
    for k in CONFIG_KEYS:
        if ref.get(k) is None:
            continue
        stated = {s: v.config.get(k) for s, v in views.items() if v.config.get(k) is not None}
        if stated and not any(_same(x, ref[k]) for x in stated.values()):
            why = getattr(ckpt, "tie_note", None) if k == "tie_word_embeddings" else None
            problems.append(f"{k}: " + ", ".join(f"{_label(s)} {_shown(x)}" for s, x in stated.items())
                            + f", checkpoint {_shown(ref[k])}" + (f" ({why})" if why else ""))
    from ..replay.checkpoint import expected_shape
    for name, info in ckpt.info.items():
        if info.dtype not in FLOAT_DTYPES and expected_shape(name, ckpt.spec) is not None:
            problems.append(f"{name}: stored as {info.dtype} in the checkpoint (quantized): the replay needs the "
                            "float weights the run held")
    recorded = {s: recorded_weights(v) for s, v in views.items()}
    for name in sorted(n for n in set().union(*recorded.values()) if ckpt.parts(n)):
        got = {s: (_vs_checkpoint(ckpt, name, r[name]), r[name]) for s, r in recorded.items() if name in r}
        states = {st for st, _ in got.values()}
        if "other-shape" in states and not states & {"agrees", "differs", "layout"}:
            problems.append(f"{name}: " + ", ".join(f"{_label(s)} {list(e[2])}" for s, (st, e) in got.items())
                            + f", checkpoint {list(ckpt.shape(name))}")
        elif "not-float" in states and ckpt.dtypes(name) <= set(FLOAT_DTYPES):
            problems.append(f"{name}: " + ", ".join(f"{_label(s)} holds it as {e[1]}" for s, (st, e) in got.items())
                            + " (quantized): the exact replay of float weights is not that op")
    # hashes in the checkpoint's layout (every framework's, merged over ranks): contradicted where every side
    # that holds the tensor differs from the checkpoint
    verdicts = _checkpoint_verdicts(ckpt, views)
    contradicted = sorted(n for n, by_side in verdicts.items() if not any(by_side.values()))
    if contradicted:
        problems.append(f"{len(contradicted)} parameter(s) whose hash differs from the checkpoint's on every side "
                        f"that recorded it ({', '.join(contradicted[:4])}{' …' if len(contradicted) > 4 else ''})")
    if problems:
        raise ReferenceMismatch(ckpt.path, problems)


def _checkpoint_verdicts(ckpt: HFCheckpoint, views: dict[str, CanonicalView]) -> dict[str, dict[str, bool]]:
    """{checkpoint tensor: {side: its hash agrees with the checkpoint's}} where a side's checkpoint-layout hash
    of that tensor is comparable with it (weight_coverage.side_weights)."""
    from .weight_coverage import side_weights
    out: dict[str, dict[str, bool]] = {}
    for side, view in views.items():
        for n, (hashes, shape) in side_weights(view).tensors.items():
            v = _tensor_vs_checkpoint(ckpt, n, hashes, shape)
            if v is not None:
                out.setdefault(n, {})[side] = v
    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    if getattr(ckpt, "tie_word_embeddings", False) and head in ckpt.info and head not in out and embed in out:
        out[head] = dict(out[embed])       # tied: the head is the embedding's values (a tied model holds one)
    return out


def reference_entries(side: str, view: CanonicalView, ckpt: HFCheckpoint) -> list[ContractDiff]:
    """What this side's replay uses of the checkpoint: the dtype its weights are rounded to (where that is not
    the checkpoint's own), and how many checkpoint tensors its parameter hashes confirmed."""
    from collections import Counter

    from ..view.weight_map import recorded_weights, side_weight_dtypes
    dts = side_weight_dtypes(view, ckpt)
    rounding: Counter = Counter()
    for name, info in ckpt.info.items():
        dt, how = dts.source(name)
        if dt is not None and dt != info.dtype:
            rounding[(dt, info.dtype, how)] += 1
    out = []
    if rounding:
        side_dt = "/".join(sorted({k[0] for k in rounding}))
        ck_dt = "/".join(sorted({k[1] for k in rounding}))
        parts = [f"{n} tensor(s) {c} rounded to {d} ({how})" for (d, c, how), n in sorted(rounding.items())]
        out.append(ContractDiff("reference", "weights", side_dt, ck_dt, against="checkpoint", side=side,
                                note=f"{_label(side)}'s exact replay uses the checkpoint's {ck_dt} weights rounded to "
                                     f"{side_dt}, the dtype {_label(side)} held them in: {'; '.join(parts)}"))
    rec = recorded_weights(view)
    verdicts = _checkpoint_verdicts(ckpt, {side: view})
    compared = len(verdicts)
    agree = sum(v[side] for v in verdicts.values())
    total = len(ckpt.info)
    if compared < total:
        from .weight_coverage import few
        rest = few(sorted(n for n in ckpt.info if n not in verdicts), 4)
        why = ("it recorded no parameter hashes" if not rec else
               f"no hash of {_label(side)}'s maps onto them in the checkpoint's shape and a float dtype: {rest}")
        note = (f"no parameter hash of {_label(side)} was compared with the checkpoint ({why}): nothing confirms "
                f"these are the weights {_label(side)} ran" if not compared else
                f"{compared} of {total} checkpoint tensors compared with {_label(side)}'s parameter hashes "
                f"({agree} agree); the other {total - compared} are not confirmed ({why})")
        out.append(ContractDiff("reference", "hashes", compared, total, against="checkpoint", side=side, note=note))
    return out
