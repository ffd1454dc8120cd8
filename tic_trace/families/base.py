"""The contract of a model family: what one folder `tic_trace/families/<name>/` provides (docs/architecture.md,
"Model families").

A family is everything tic-trace knows about one kind of model that the base transformer (the plain dense / MoE
decoder every core module computes: `replay/reference.py`'s ops, the canonical graph) does not: the config.json
`model_type` values it owns, its config facts (`ModelSpec` fields its code fixes, `ModelSpec.extra`), the shapes
of its checkpoint tensors, the float64 exact ops, op inputs and op names that replace the base's, the clean
variants and known faults of those ops, and the name tables that map each framework's module and parameter names
onto its canonical points (strings and `graph.adapter` rows only, no framework import).

Each family's `__init__.py` builds one `Family` (`FAMILY = Family(...)`) and says in its docstring what the
family is and what is verified per framework; `tic_trace/families/__init__.py` is the registry of them. The core
asks the registry (`family_of_config`, `family_for`) and calls these hooks; it never names a family. Every hook has a
default that changes nothing, so a family states only where it differs from the base transformer.

Import rules (tests/test_architecture.py): a family imports only the core (store, graph, view, replay's leaf
modules) and never another family nor a framework; its `__init__`, facts and shapes import no torch (the exact
ops and variants may, as replay/ does, and are imported lazily by the hooks below: `lazy`). A family may not import
a module that reads the registry: replay's that dispatch through it (reference, model_spec, checkpoint,
intrinsic, clean_noise), graph's that assemble from it (canonical, weight_points, supported); that would be an
import circle; it receives what it needs as arguments (the base ops, the config reader). Its `points.py` imports
only `graph.point_spec`.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..graph.point_spec import FamilyPoint

#: The frameworks a family states its verification for, in the README's column order.
FRAMEWORKS = ("hf", "megatron", "sglang")

# The base transformer's names (under model.layers.N.) for weights it computes with wherever a spec states them,
# but that no base checkpoint stores: a family's `derived_weight` says where its checkpoint keeps them.
#: the router's selection-only bias, added to the scores for the top-k choice only (replay/reference.py's route)
ROUTER_SELECTION_BIAS = "mlp.gate.selection_bias"
#: one learned logit per head in the attention softmax's denominator (`ModelSpec.extra["sinks"]`)
ATTENTION_SINKS = "self_attn.sink_logits"


def _no_facts(c: Any, model_type: str, hidden: int) -> dict:
    return {}


def _no_config_defaults(c: Any, model_type: str) -> dict:
    return {}


def _no_shape(rest: str, spec: Any) -> list | None:
    return None


def _no_ops(spec: Any, base: Mapping[str, Callable]) -> dict[str, Callable]:
    return {}


def _no_inputs(point: str, spec: Any) -> tuple[str, ...] | None:
    return None


def _no_op_name(point: str, spec: Any) -> str:
    return ""


def _no_weight(w: Any, name: str) -> Any:
    return None


def _no_variants() -> dict[str, list]:
    return {}


def _no_names() -> dict[str, "FrameworkNames"]:
    return {}


def _no_kv_rows(feeds: Mapping[str, Any], common_rows: Callable, tensor: Callable) -> dict | None:
    return None


def lazy(package: str, module: str, attr: str, *, cache: bool = False) -> Callable:
    """A hook that imports `module` (relative to `package`: the family's `__name__`) on its first call and calls
    its `attr` with the hook's arguments: a family's `__init__` states its hooks without importing torch or its
    large tables (`ops=lazy(__name__, ".ops", "ops")`; tests/test_architecture.py reads these as imports).
    `cache`: a hook without arguments whose result is built once (a variants table)."""
    @functools.cache
    def target() -> Callable:
        return getattr(importlib.import_module(module, package), attr)

    if cache:
        return functools.cache(lambda: target()())

    def call(*args: Any, **kwargs: Any) -> Any:
        return target()(*args, **kwargs)
    return call


@dataclass(frozen=True)
class FrameworkNames:
    """One framework's name tables for a family: strings and `graph.adapter` rows only (no framework import).
    The adapter of that framework concatenates every family's tables; it keeps only the mechanics (hooks, TP
    merges, weight conversion) that must import the framework."""
    points: tuple = ()                              # graph.adapter.PointMap rows of this family's architectures
    architectures: tuple = ()                       # graph.adapter.Architecture rows: the classes / structures verified
    refused: Mapping[str, str] = field(default_factory=dict)   # architecture -> what the table would get wrong
    tables: Mapping[str, Any] = field(default_factory=dict)    # the adapter's own named tables (module lists,
    #                                                            parameter names...), by the name the adapter reads


@dataclass(frozen=True)
class Family:
    """What a family folder provides. Hooks take the spec as `Any` (a `replay.model_spec.ModelSpec`: importing
    it from a family would be an import circle)."""
    name: str                                   # its folder: tic_trace/families/<name>/
    title: str                                  # as people name it (the README's family table)
    model_types: tuple[str, ...]                # config.json model_type values it owns (the registry's keys)
    description: str                            # what the family is, one or two sentences
    verified: Mapping[str, str]                 # framework (FRAMEWORKS) -> what is verified there; absent: not
    # A model whose model_type no family owns is this family's when its config.json states what only this family
    # computes (MLA's kv latent: Kimi-K2's `kimi_k2` is DeepSeek-V3's architecture): `claims_config(c)` on
    # model_spec's typed reader picks the family whose `facts` read the config; `claims(spec)` on the spec those
    # facts made picks the family whose ops replay it (`families.family_for`). None: model_type alone.
    claims_config: Callable[[Any], bool] | None = None
    claims: Callable[[Any], bool] | None = None

    # --- the canonical graph (points.py: data only, `graph.point_spec`; graph/canonical.py assembles them)
    # the points only this family computes, where they sit and which base points read them
    points: tuple[FamilyPoint, ...] = ()
    # base point -> what this family's layers compute there, added to its meaning ("MLA: q_b_proj...")
    remarks: Mapping[str, str] = field(default_factory=dict)
    # (regex of an HF checkpoint tensor's name under model.layers.N, point whose op reads it) for the tensors the
    # family names otherwise than the base (graph/weight_points.py tries them before the base's)
    weight_points: tuple[tuple[str, str], ...] = ()

    # --- config.json -> ModelSpec (no torch)
    # ModelSpec field values where config.json does not state them, by model_type (Qwen2's q/k/v bias)
    defaults: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # ModelSpec field values its code fixes whatever config.json says, by model_type (Mixtral's renormalised top-k)
    fixed: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # ModelSpec field values where config.json does not state the field's own key, read from a key of the
    # family's own: (c, model_type) -> dict, `c` as for `facts` (Gemma states its activation as `hidden_activation`)
    config_defaults: Callable[[Any, str], dict] = _no_config_defaults
    # ModelSpec.extra from config.json: (c, model_type, hidden_size) -> dict, `c` model_spec's typed reader of the
    # text config (c.int / c.num / c.bool / c.str / c.raw / c.has / c.error). The core adds `layer_ropes`; the
    # sliding windows are the family's to read (`replay.layer_types.windows`), since layer_types may mean other
    # layer kinds (Qwen3-Next's linear attention).
    facts: Callable[[Any, str, int], dict] = _no_facts
    # the shape config.json implies for a checkpoint tensor under model.layers.N (`rest`: its name there) that
    # the family stores otherwise than the base transformer; None: not one of its tensors
    shapes: Callable[[str, Any], list | None] = _no_shape

    # --- the exact replay (may import torch, lazily inside the hook)
    # point -> float64 op replacing (or adding to) the base transformer's `base` (reference._OPS), for this spec;
    # `base.f64` is reference itself, whose float64 helpers (linear, rms_norm, attend_by_sample) the ops may use
    ops: Callable[[Any, Mapping[str, Callable]], dict[str, Callable]] = _no_ops
    # the recorded points the op producing `point` reads where the family decides (None: the base's feeds)
    inputs_of: Callable[[str, Any], tuple[str, ...] | None] = _no_inputs
    # the op replayed at `point` where the family makes it another (its key into `variants`; "": the base's)
    op_of: Callable[[str, Any], str] = _no_op_name
    # a weight the checkpoint stores as part of another or under another name: (reference._LayerWeights, the
    # base transformer's name) -> tensor, or None (Phi-3's fused qkv_proj, Mixtral's block_sparse_moe; the
    # weights only named here, ROUTER_SELECTION_BIAS and ATTENTION_SINKS, under the family's checkpoint names)
    derived_weight: Callable[[Any, str], Any] = _no_weight
    # op name (`op_of`'s) or point -> its clean variants and known faults (replay.variants.Variant lists); called
    # for every op replayed: build the table once (functools.cache)
    variants: Callable[[], dict[str, list]] = _no_variants
    # ops whose variants run on whole samples (a recurrence), never on a subset of rows
    whole_sample_ops: frozenset = frozenset()
    # point -> inputs its op reads only where the trace holds them
    optional_inputs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # op name (`op_of`'s) -> its clean envelope in 16 bits, the excess over correct rounding its clean kernels
    # reach (intrinsic_verdict.ENVELOPE: the limit where its variants did not run)
    envelopes: Mapping[str, float] = field(default_factory=dict)
    # op name (`op_of`'s) -> how a report names it ("B's RMSNorm (1 + w) at L1 matches ...": intrinsic_verdict)
    op_words: Mapping[str, str] = field(default_factory=dict)
    # ops whose fp32 output carries the precision of the 16-bit GEMM before it (logits soft-capped in fp32 from a
    # 16-bit lm_head): judged in the side's compute dtype, as fp32 ULPs would blame every clean run (intrinsic.py)
    judged_in_compute: frozenset = frozenset()
    # the recorded points its attention (attn.core) reads at every earlier key row of a sample, not row-selected,
    # besides the base's attn.k_rope and attn.v (MLA's kv_b and kv latent: replay/intrinsic.py gathers them)
    kv_points: tuple[str, ...] = ()
    # those rows gathered where its attention reads its own: (attn.core's recorded feeds by point, each a
    # view.align.CanonicalTensor; common_rows(first, [others]) -> (rows of the first in every other, each one's
    # indices of them); tensor(numpy array) -> float64 tensor on the replay's device) -> the op's key/value feeds
    # with "__kv_rows__" (row -> index), or None where the base's k_rope / v rows serve
    kv_rows: Callable[[Mapping[str, Any], Callable, Callable], dict | None] = _no_kv_rows

    # --- name tables: framework (FRAMEWORKS) -> FrameworkNames, imported lazily (names.py)
    names: Callable[[], Mapping[str, FrameworkNames]] = _no_names

    def __post_init__(self) -> None:
        unknown = set(self.verified) - set(FRAMEWORKS)
        if unknown:
            raise ValueError(f"family {self.name}: verified names unknown frameworks {sorted(unknown)}; "
                             f"use {', '.join(FRAMEWORKS)}")
        stray = (set(self.defaults) | set(self.fixed)) - set(self.model_types)
        if stray:
            raise ValueError(f"family {self.name}: defaults/fixed for model_types it does not own: {sorted(stray)}")
