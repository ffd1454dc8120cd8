"""Adapters as data: a table from a framework's record names to canonical points, plus named transforms.

An adapter is mostly a list of `PointMap` rows. Each row says which record (a regex over record names, with a
`(?P<layer>\\d+)` group for per-layer points) becomes which canonical point, how the shards of several ranks
are put back together (`merge`), and how the result is laid out as `[rows, ...features]` (`transform`).
Transforms and merges live in registries so a new model family is a new table, not new control flow.

This module never imports a framework; adapters import theirs lazily, inside the methods that touch a model.
"""
from __future__ import annotations

import importlib
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np


@dataclass(frozen=True)
class PointMap:
    point: str                          # canonical point, e.g. "attn.q" or "embed"
    record: str                         # regex over record names; per-layer points capture (?P<layer>\d+)
    transform: str = "tokens"           # registered transform producing [rows, ...]
    merge: str = "same"                 # registered merge of rank shards: same | sum | cat:<axis> | ...
    opts: dict = field(default_factory=dict)
    also: dict = field(default_factory=dict)   # extra named records, templates formatted with {layer}
    note: str = ""                      # why this mapping is what it is (shown by `tic-trace inspect --points`)

    def regex(self) -> re.Pattern:
        return re.compile(self.record + r"$")


@dataclass
class TransformContext:
    n_rows: int                         # rows of this record (after rows-mode selection)
    config: dict                        # the trace manifest's model description
    opts: dict
    layer: int | None
    extra: dict[str, np.ndarray]        # arrays of `PointMap.also`, merged and decoded like the primary


_TRANSFORMS: dict[str, Callable[[np.ndarray, TransformContext], np.ndarray]] = {}
_MERGES: dict[str, Callable[[list[np.ndarray], dict], np.ndarray]] = {}


def register_transform(name: str):
    def deco(fn):
        _TRANSFORMS[name] = fn
        return fn
    return deco


def register_merge(name: str):
    def deco(fn):
        _MERGES[name] = fn
        return fn
    return deco


def transform(name: str) -> Callable[[np.ndarray, TransformContext], np.ndarray]:
    try:
        return _TRANSFORMS[name]
    except KeyError:
        raise KeyError(f"unknown transform {name!r}; registered: {sorted(_TRANSFORMS)}") from None


def merge(name: str, arrays: list[np.ndarray], config: dict) -> np.ndarray:
    if len(arrays) == 1 and name != "sum":
        return arrays[0]
    if name.startswith("cat:"):
        return np.concatenate(arrays, axis=int(name[4:]))
    try:
        fn = _MERGES[name]
    except KeyError:
        raise KeyError(f"unknown merge {name!r}; registered: {sorted(_MERGES)} or cat:<axis>") from None
    return fn(arrays, config)


# ---------------------------------------------------------------- generic transforms and merges

@register_transform("tokens")
def _tokens(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """Leading dims are the token rows in row-table order ([B,S,...] b-major or [S,B,...] s-major, as the
    adapter's row table was built); features are flattened."""
    return a.reshape(ctx.n_rows, -1)


def _heads_of(ctx: TransformContext) -> tuple[int, int]:
    which = ctx.opts.get("heads", "q")
    cfg = ctx.config
    n = cfg["num_attention_heads"] if which == "q" else cfg["num_key_value_heads"]
    return n, cfg["head_dim"]


@register_transform("heads")
def _heads(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """[..rows.., heads*head_dim] or [..rows.., heads, head_dim] -> [rows, heads, head_dim]."""
    n, hd = _heads_of(ctx)
    return a.reshape(ctx.n_rows, n, hd)


@register_transform("bhsd")
def _bhsd(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """[B, heads, S, head_dim] (HF attention layout) -> [B*S, heads, head_dim]."""
    b, h, s, d = a.shape
    return np.ascontiguousarray(a.transpose(0, 2, 1, 3)).reshape(b * s, h, d)


@register_transform("sorted_ids")
def _sorted_ids(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    return np.sort(a.reshape(ctx.n_rows, -1), axis=-1)


@register_transform("weights_by_sorted_ids")
def _weights_by_sorted_ids(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """Top-k weights reordered to follow their expert ids in ascending order (slot order is an
    implementation detail; the id -> weight pairing is not)."""
    ids = ctx.extra["ids"].reshape(ctx.n_rows, -1)
    order = np.argsort(ids, axis=-1, kind="stable")
    return np.take_along_axis(a.reshape(ctx.n_rows, -1), order, axis=-1)


@register_transform("dense_topk_ids")
def _dense_topk_ids(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """[rows, E] routing map (bool or probabilities, zero off the top-k) -> [rows, k] sorted expert ids."""
    k = int(ctx.config["num_experts_per_tok"])
    m = a.reshape(ctx.n_rows, -1) != 0
    idx = np.argsort(~m, axis=-1, kind="stable")[:, :k]
    return np.sort(idx, axis=-1).astype(np.float64)


@register_transform("dense_topk_weights")
def _dense_topk_weights(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """[rows, E] probabilities (zero off the top-k) -> [rows, k] weights in ascending expert-id order."""
    k = int(ctx.config["num_experts_per_tok"])
    p = a.reshape(ctx.n_rows, -1)
    m = ctx.extra["map"].reshape(ctx.n_rows, -1) != 0 if "map" in ctx.extra else p != 0
    idx = np.sort(np.argsort(~m, axis=-1, kind="stable")[:, :k], axis=-1)
    return np.take_along_axis(p, idx, axis=-1)


@register_transform("vocab")
def _vocab(a: np.ndarray, ctx: TransformContext) -> np.ndarray:
    """Logits: rows x true vocabulary (padding columns cut)."""
    v = int(ctx.config["vocab_size"])
    return a.reshape(ctx.n_rows, -1)[:, :v]


@register_merge("same")
def _same(arrays: list[np.ndarray], config: dict) -> np.ndarray:
    return arrays[0]


@register_merge("sum")
def _sum(arrays: list[np.ndarray], config: dict) -> np.ndarray:
    out = arrays[0].astype(np.float64)
    for a in arrays[1:]:
        out = out + a
    return out


def as_ints(x: Any) -> list[int]:
    """A tensor, array or sequence (or None) as a list of Python ints: for the CPU-side index fields of a
    framework's batch metadata."""
    if x is None:
        return []
    if hasattr(x, "tolist"):
        x = x.tolist()
    return [int(v) for v in x]


def plain_settings(obj: Any, names: Sequence[str]) -> dict:
    """`names` read from a config object as JSON values (enums, dtypes and callables by name); absent ones
    are left out."""
    out = {}
    for n in names:
        if not hasattr(obj, n):
            continue
        v = getattr(obj, n)
        if v is None or isinstance(v, (bool, int, float, str)):
            out[n] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(x, (bool, int, float, str)) for x in v):
            out[n] = list(v)
        elif isinstance(v, dict):
            out[n] = {str(k): x if isinstance(x, (bool, int, float, str, type(None))) else str(x) for k, x in v.items()}
        else:
            out[n] = getattr(v, "__name__", None) or getattr(v, "name", None) or str(v).removeprefix("torch.")
    return out


def rope_scaling_of(params: Any) -> dict | None:
    """RoPE kind and scaling parameters as one spelling (None for plain RoPE): HF configs name the kind
    `rope_type` or (older) `type`, keep `rope_theta` inside `rope_parameters` or not, and add defaults when a
    config is loaded. The contract compares what this returns (and only the keys both sides state)."""
    if not isinstance(params, dict):
        return None
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return None
    out = {k: v for k, v in params.items() if k not in ("rope_theta", "type", "rope_type")
           and isinstance(v, (int, float, str, bool))}
    return {"rope_type": str(kind), **out}


# ---------------------------------------------------------------- architectures an adapter maps
#
# A table maps module names, and the same names mean other things in other architectures (Gemma2's
# `post_attention_layernorm` normalises the attention branch before the residual add; in Llama it is the
# pre-MLP norm). So every adapter names the architectures its table was verified on, and a trace of any
# other is marked unverified: the comparator refuses it (not comparable, exit 3) unless told to accept
# unverified mappings, and then says so in every report (docs/adapters.md).

log = logging.getLogger("tic_trace.adapter")


@dataclass(frozen=True)
class Architecture:
    """One architecture an adapter's table maps, and how that was verified (the README's table is made of
    these rows, by `graph.supported.supported_architectures_markdown`)."""
    name: str                    # as the adapter's `architecture_of` names it (manifest model.architecture)
    families: tuple[str, ...]    # model families (README rows) run through this entry in the tests
    mapped: str                  # what the table maps for it, in a few words
    replay: str                  # what the exact replay (--reference) covers for it
    tests: str                   # the tests that verify it
    lacks: tuple[str, ...] = ()  # canonical points it never computes: never listed as missing
    replay_gaps: tuple[str, ...] = ()   # points the replay cannot judge for it (said as "not replayed")
    defaults: Mapping[str, Any] = field(default_factory=dict)  # facts its code fixes whatever the config says


@dataclass(frozen=True)
class ArchitectureCheck:
    """Whether a trace's architecture is one its adapter's table maps (read time, from the manifest)."""
    adapter: str
    name: str | None
    verified: bool
    why: str = ""                # why not, one line (empty when verified)

    def describe(self) -> str:
        return (f"{self.name or 'an unnamed architecture'} ({self.adapter} adapter)"
                + ("" if self.verified else f": {self.why}"))


# ---------------------------------------------------------------- the adapter base

class Adapter:
    """Base adapter: override the table and the few hooks a framework needs."""
    name = "base"
    points: Sequence[PointMap] = ()
    # The architectures this table is verified on, by the name `architecture_of` gives (None: the adapter
    # declares none, and every trace it reads is unverified), and architectures known to be mapped wrongly,
    # with what is wrong (named in the refusal).
    architectures: Mapping[str, Architecture] | None = None
    refused: Mapping[str, str] = {}

    # --- trace time (these may import the framework)
    def prepare(self, tracer: Any, models: list) -> None:
        """Install taps and choose module inputs to record. Called once by `Tracer.start()`."""

    def describe(self, models: list) -> dict:
        """Model facts the transforms need (heads, head_dim, vocab, layers, experts, ...)."""
        return {}

    def numerics(self, models: list) -> dict:
        """Settings that change how the model computes (kernels, backends, precisions, fusions), as plain
        JSON values, for the contract diff (tic_trace/compare/contract.py). Default: none known."""
        return {}

    def architecture_of(self, models: list) -> str | None:
        """The architecture of the traced model, as the `architectures` table names it (trace time)."""
        return None

    def architecture_facts(self, models: list) -> dict:
        """What `describe()` records about the architecture: its name and whether the table maps it (read
        back by nobody but people: the reader checks the name against its own table). An unverified one is
        logged loudly once, at trace start; never raises (a tracer failure must not break the forward)."""
        try:
            name = self.architecture_of(models)
        except Exception as e:  # noqa: BLE001 - an odd model object: recorded as unnamed, refused when compared
            log.warning("tic-trace: the %s adapter could not name the model's architecture (%s: %s)",
                        self.name, type(e).__name__, e)
            name = None
        check = self.check_architecture({"architecture": name})
        if not check.verified:
            log.warning("tic-trace: UNVERIFIED MAPPING: %s. The trace is marked unverified: comparing it is "
                        "refused (not comparable, exit 3) unless unverified mappings are accepted "
                        "(--allow-unverified / find_divergence(..., allow_unverified=True)).", check.describe())
        return {"architecture": name, "architecture_verified": check.verified}

    def settle_verified(self, facts: dict) -> dict:
        """`facts` (a whole `describe()`) with `architecture_verified` re-decided on all of them: an adapter whose
        `check_architecture` also reads setup facts (a switch, a backend) refuses a structure its table has, and
        the trace must say so at trace time too, as loudly as an unknown name. Never raises."""
        if not facts.get("architecture_verified"):
            return facts
        try:
            check = self.check_architecture(facts)
        except Exception as e:  # noqa: BLE001 - recorded as unverified: the reader re-checks anyway
            check = ArchitectureCheck(self.name, facts.get("architecture"), False, f"{type(e).__name__}: {e}")
        if check.verified:
            return facts
        log.warning("tic-trace: UNVERIFIED MAPPING: %s. The trace is marked unverified: comparing it is refused "
                    "(not comparable, exit 3) unless unverified mappings are accepted.", check.describe())
        return {**facts, "architecture_verified": False}

    def check_architecture(self, config: dict) -> ArchitectureCheck:
        """Whether the architecture a trace names (`config["architecture"]`, from its manifest) is in this
        adapter's table. Read time, no framework: the reader's table decides, not what the trace claims."""
        name = config.get("architecture")
        name = name if isinstance(name, str) and name else None
        if self.architectures is None:
            return ArchitectureCheck(self.name, name, False, f"the {self.name} adapter declares no table of the "
                                     "architectures it maps (Adapter.architectures)")
        if name is None:
            return ArchitectureCheck(self.name, None, False, "the trace does not name its model's architecture "
                                     "(written by an older tic-trace, or the adapter could not tell)")
        if name in self.architectures:
            return ArchitectureCheck(self.name, name, True)
        why = self.refused.get(name)
        return ArchitectureCheck(self.name, name, False,
                                 f"known to be mapped wrongly by the {self.name} table: {why}" if why else
                                 f"not in the {self.name} adapter's table of verified architectures "
                                 f"({', '.join(sorted(self.architectures))})")

    def architecture(self, config: dict) -> Architecture | None:
        """The table's entry for a trace's architecture (None: not in the table)."""
        name = config.get("architecture")
        return (self.architectures or {}).get(name) if isinstance(name, str) else None

    def weight_pieces(self, models: list, params: dict) -> dict | None:
        """Trace time: {parameter name (`ParameterHasher`'s): [record.weight_pieces.WeightPiece]}, the slices of
        HF checkpoint tensors each parameter holds, so that parameter hashes compare across layouts (fused,
        sharded) and with a checkpoint; a name left out is named as not mappable. None: this adapter declares
        no map (only whole-parameter hashes are recorded)."""
        return None

    def parallel_layout(self) -> dict:
        return {}

    def rank_coords(self) -> dict:
        return {}

    def rows_from_forward(self, tracer: Any, args: tuple, kwargs: dict) -> tuple | None:
        """(keys, positions, tokens) of the rows of a root forward, when the inputs tell them."""
        return None

    def token_dims(self, record_name: str) -> int | None:
        """How many leading dims of this record are token rows (1 or 2), 0 if it is not per token,
        None if unknown (the tracer then guesses from the row count)."""
        return None

    # --- read time (pure numpy)
    def kept_rows(self, record_name: str, shape: tuple, n_rows: int) -> list[int] | None:
        """For a record stored whole (no row index) that holds fewer rows than its pass's row table (e.g.
        logits computed for the last position of each sample only): the table rows it holds, in its own
        order; None when the record is not such a record. Default: none is."""
        return None

    def rank_groups(self, ranks: list[int], rank_infos: dict[int, dict]) -> list[list[int]]:
        """Ranks whose shards make up one full tensor (a model-parallel group), in merge order."""
        return [sorted(ranks)]

    def global_layer(self, local: int, rank_info: dict, config: dict) -> int:
        return local

    def promised_points(self, config: dict) -> list[str]:
        """Canonical points this adapter promises for a model with this description."""
        return sorted({p.point for p in self.points if self.applies(p, config)})

    def merge_shards(self, pm: PointMap, layer: int | None, arrays: list[np.ndarray],
                     config: dict) -> tuple[np.ndarray, str | None]:
        """One point's record from the ranks of a model-parallel group, as one tensor, and a note for the
        report when the records contradict what the adapter expected (None: nothing to say). Default: the
        PointMap's registered merge."""
        return merge(pm.merge, arrays, config), None

    def keeps(self, pm: PointMap, layer: int | None, config: dict) -> bool:
        """Whether a record matched by `pm` in this (global) layer really is that point. Default: always.
        For layers where the module exists but computes something else (e.g. an identity stand-in for a
        norm fused into the next GEMM)."""
        return True

    def applies(self, pm: PointMap, config: dict) -> bool:
        arch = self.architecture(config)
        if arch is not None and pm.point in arch.lacks:
            return False
        if pm.point == "moe.shared_out":
            return bool(config.get("num_experts")) and bool(config.get("shared_experts"))
        if pm.point.startswith("moe."):
            return bool(config.get("num_experts"))
        return True


# Adapters register themselves (`register_adapter`, when their module is imported). A name read from a trace
# only ever looks this table up: the one import it may cause is of tic-trace's own adapter module for a
# built-in name, so a trace cannot choose what code runs (docs/security.md).
_REGISTRY: dict[str, type[Adapter] | Adapter] = {}
_BUILTIN_MODULES = {"hf": "tic_trace.adapters.hf", "megatron": "tic_trace.adapters.megatron",
                    "sglang": "tic_trace.adapters.sglang"}
_INSTANCES: dict[str, Adapter] = {}


class UnknownAdapter(ValueError):
    """No adapter is registered under a name."""


def register_adapter(adapter: type[Adapter] | Adapter, name: str | None = None):
    """Make `adapter` (a class, instantiated on first use, or an instance) available by `name` (default: its
    `name` attribute), for traces whose manifest names it. Returns `adapter`, so it works as a decorator."""
    key = name or adapter.name
    _REGISTRY[key] = adapter
    _INSTANCES.pop(key, None)
    return adapter


def registered_adapters() -> list[str]:
    return sorted(set(_REGISTRY) | set(_BUILTIN_MODULES))


def get_adapter(name: str | Adapter) -> Adapter:
    """A registered adapter by name ('hf', 'megatron', 'sglang', or one a module registered). Never imports a
    module a name says: safe for names read from a trace. For 'package.module:Class', see `load_adapter`."""
    if isinstance(name, Adapter):
        return name
    if not isinstance(name, str):
        raise UnknownAdapter(f"an adapter name must be a string, got {name!r:.80}")
    if name in _INSTANCES:
        return _INSTANCES[name]
    if name not in _REGISTRY and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    entry = _REGISTRY.get(name)
    if entry is None:
        raise UnknownAdapter(
            f"no adapter is registered as {name!r:.80} (registered: {', '.join(registered_adapters())}); import the "
            "module that registers it (tic_trace.graph.adapter.register_adapter), or name it explicitly as "
            "'package.module:Class' (--adapter-a/--adapter-b on the command line)")
    inst = entry() if isinstance(entry, type) else entry
    _INSTANCES[name] = inst
    return inst


def load_adapter(spec: str | Adapter) -> Adapter:
    """`spec` as the user wrote it: an adapter, a registered name, or 'package.module:Class', which imports
    that module. For names a person typed (Python API, an explicit command-line option), never for names
    read from a trace."""
    if isinstance(spec, Adapter) or not isinstance(spec, str) or ":" not in spec:
        return get_adapter(spec)
    modname, _, attr = spec.partition(":")
    try:
        obj = getattr(importlib.import_module(modname), attr)
    except (ImportError, AttributeError) as e:
        raise UnknownAdapter(f"cannot load adapter {spec!r}: {e}") from None
    inst = obj() if isinstance(obj, type) else obj
    if not isinstance(inst, Adapter):
        raise UnknownAdapter(f"{spec!r} is not a tic_trace.graph.adapter.Adapter (got {type(inst).__name__})")
    return inst
