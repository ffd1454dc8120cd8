"""The one typed schema of everything a trace (or a saved JSON report) says about itself, checked on read.

A trace comes from someone else's cluster: every field the reader uses is declared here, as a `TypedDict`, and
`validate()` checks a decoded document against it before any other code looks at it. A wrong type becomes a
`TraceFormatError` that names the file and the field (`model.num_attention_heads must be a count, got '4'`),
never a `TypeError` three modules later. Fields not declared here are kept as written and never interpreted.

The type language is Python's own: `str`, `int` (never a bool), `float` (an int is fine), `bool`, `None`,
`list[X]`, `dict[str, X]`, `X | Y`, `Literal[...]`, nested `TypedDict`s, `Any`, and `Annotated[X, Check(...)]`
for a bound. Each schema is compiled once into a tree of small checker functions.
"""
# No `from __future__ import annotations` here: TypedDict needs evaluated annotations to tell Required fields.
import os
import types
from dataclasses import dataclass
from typing import (Annotated, Any, Callable, Literal, NotRequired, Required, TypedDict, Union, get_args,
                    get_origin, get_type_hints, is_typeddict)

from .errors import TraceFormatError


@dataclass(frozen=True)
class Check:
    """A bound on a value already of the right type: `Annotated[int, Check("a count", lambda v: v >= 0)]`."""
    what: str
    ok: Callable[[Any], bool]


Count = Annotated[int, Check("a non-negative integer below 2**31", lambda v: 0 <= v < 2**31)]
Offset = Annotated[int, Check("a non-negative integer below 2**63", lambda v: 0 <= v < 2**63)]
Int64 = Annotated[int, Check("an integer of at most 64 bits", lambda v: -2**63 <= v < 2**64)]
ShortText = Annotated[str, Check("a string of at most 4096 characters", lambda v: len(v) <= 4096)]
Scalar = Union[str, int, float, bool, None]
# Readers walk the layers (dataflow order, a missing point's feeds): a hostile count must not make that endless.
LayerCount = Annotated[int, Check("a layer count from 0 to 65536", lambda v: 0 <= v <= 1 << 16)]


# ---------------------------------------------------------------- trace documents

class ModelConfig(TypedDict, total=False):
    """`manifest["model"]`: the model facts transforms read (adapters' `describe()`). Other keys: any scalar."""
    model_type: str | None
    architecture: ShortText | None       # the adapter's name for it (checked against the reader's table)
    architecture_verified: bool          # whether the tracing adapter's table had it (the reader re-checks)
    qk_norm: bool
    num_layers: LayerCount
    hidden_size: Count
    num_attention_heads: Count
    num_key_value_heads: Count
    head_dim: Count
    vocab_size: Count
    padded_vocab_size: Count
    num_experts: Count
    num_experts_per_tok: Count
    shared_experts: bool
    moe_layers: list[Count]
    qk_layernorm: bool
    fused_input_norm: bool
    fused_dense_mlp_norm: bool
    moe_shared_expert_overlap: bool
    sequence_parallel: bool
    tp_partial: dict[str, list[Count]]
    attention_output_gate: bool
    rms_norm_eps: float | None
    rope_theta: float | None
    dtype: str | None
    router_scoring: str | None
    router_selection_bias: dict[str, list[float]]    # MoE layer -> its router's selection-only bias, [E]
    router_n_group: Count
    router_topk_group: Count
    router_group_top: Count


class RowSubsetSettings(TypedDict, total=False):
    """`tracer.row_subset`: the identity rule that chose a `rows` trace's rows (graph/row_subset.py)."""
    rule: ShortText
    stride: int


class TracerSettings(TypedDict, total=False):
    mode: str
    points_mode: str
    record_views: bool
    skip_recompute: bool
    sample_rows: list[int] | None
    row_subset: RowSubsetSettings


class Manifest(TypedDict, total=False):
    """`manifest.msgpack`: facts shared by every rank of the run."""
    schema: int
    format: Literal["tic-trace"]
    framework: Annotated[str, Check("an adapter name (letters, digits, '_', '-', '.')", lambda v: _is_name(v))]
    versions: dict[str, str]
    created: float
    run: ShortText
    tracer: TracerSettings
    model: ModelConfig
    parallel: dict[str, Union[int, bool, None]]


class RunIncomplete(TypedDict, total=False):
    """`rank.msgpack`'s `incomplete`: the tracer failed (a write, or its own code) and recorded no more."""
    reason: Required[ShortText]
    lost_pass: Count | None          # the pass being written when it failed (not kept)
    passes_written: Count            # complete passes of this run before the failure
    forwards_not_recorded: Count     # root forwards that ran after the failure (at stop(); a lower bound)


class RankInfo(TypedDict, total=False):
    """`rank00003/rank.msgpack`: this rank's place in the job."""
    rank: Count
    world_size: Count
    hostname: str
    pid: int
    run: ShortText
    coords: dict[str, Union[int, bool, None, list[int]]]
    incomplete: RunIncomplete


class RowTable(TypedDict, total=False):
    """The names of a pass's token rows: row i is position `positions[i]` of sample `keys[i]`."""
    keys: Required[list[str | None]]
    positions: Required[list[int]]
    tokens: list[int] | None


class PassMeta(TypedDict, total=False):
    """A pass index (`pass00012.idx`) without its records (`RecordWire`, checked one by one)."""
    records: Required[list[Any]]
    blob: Required[Annotated[str, Check("a file name in the rank directory", lambda v: _is_file_name(v))]]
    blob_nbytes: Required[Offset]
    index: Count
    tag: str | None
    rows: RowTable | None
    rank: Count
    run: ShortText
    pass_number: Count
    complete: bool
    incomplete: str | None
    blind_regions: list[str]
    notes: list[str]
    rows_only: bool        # the row table only, no record: a forward the row subset kept no row of


class Stats(TypedDict):
    count: float
    sum: float
    sumsq: float
    absmax: float
    min: float
    max: float
    nan: float
    inf: float


class RecordWire(TypedDict, total=False):
    """One record of a pass index."""
    name: Required[str]
    dtype: Required[str]
    shape: Required[list[Int64]]
    module: str
    kind: str
    op: str | None
    call: Int64
    seq: Int64
    phase: str
    mode: str
    stats: Stats | None
    hash: Int64 | None
    offset: Int64
    nbytes: Int64
    crc: Int64 | None
    row_index: list[Int64] | None
    ops_in_region: Int64 | None
    point: str | None
    extra: dict[str, Any]


# ---------------------------------------------------------------- validation

def validate(doc: Any, schema: type, path: os.PathLike | str, what: str) -> dict:
    """`doc` if it conforms to `schema` (a TypedDict above); else TraceFormatError naming `path` and the field."""
    problem = _compiled(schema)(doc, "")
    if problem is not None:
        raise TraceFormatError(path, f"{what}: {problem}")
    return doc


def conforms(value: Any, tp: Any) -> bool:
    return _checker(tp)(value, "") is None


_Checker = Callable[[Any, str], "str | None"]    # (value, dotted field name) -> problem or None
# the exact types each plain schema type accepts with no further check (a bool is no int or float here)
_PLAIN_TYPES: dict[Any, tuple[type, ...]] = {float: (float, int), int: (int,), str: (str,), bool: (bool,),
                                             type(None): (type(None),)}
_CACHE: dict[Any, _Checker] = {}


def _compiled(schema: type) -> _Checker:
    fn = _CACHE.get(schema)
    if fn is None:
        fn = _CACHE[schema] = _checker(schema)
    return fn


def _describe(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if is_typeddict(tp):
        return "a map"
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return args[1].what
    if origin is list:
        return "a list"
    if origin is dict:
        return "a map"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false"}.get(tp, str(tp))


def _bad(field: str, tp: Any, v: Any) -> str:
    return f"field {field!r} must be {_describe(tp)}, not {_short(v)}"


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _checker(tp: Any) -> _Checker:
    if tp is Any:
        return lambda v, f: None
    if is_typeddict(tp):
        return _map_checker(tp)
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        inner, check = _checker(args[0]), args[1]
        return lambda v, f: None if inner(v, f) is None and check.ok(v) else _bad(f, tp, v)
    if origin is list:
        item = _checker(args[0])

        def check_list(v, f):
            if not isinstance(v, list):
                return _bad(f, tp, v)
            for i, x in enumerate(v):
                if item(x, "") is not None:         # the field's name is built only for a problem
                    return item(x, f"{f}[{i}]")
            return None
        return check_list
    if origin is dict:
        val = _checker(args[1])

        def check_dict(v, f):
            if not isinstance(v, dict):
                return _bad(f, tp, v)
            for k, x in v.items():
                if not isinstance(k, str):
                    return f"field {f!r} has a key that is not a string: {_short(k)}"
                if val(x, "") is not None:
                    return val(x, f"{f}.{k}")
            return None
        return check_dict
    if origin is Literal:
        return lambda v, f: None if any(type(v) is type(a) and v == a for a in args) else _bad(f, tp, v)
    if origin in (Union, types.UnionType):
        alts = [_checker(a) for a in args]
        real = [_checker(a) for a in args if a is not type(None)]
        nullable = type(None) in args
        quick = frozenset(t for a in args for t in _PLAIN_TYPES.get(a, ()))

        def check_union(v, f):
            if (v is None and nullable) or type(v) in quick:     # the common cases, without a call
                return None
            for c in alts:
                if c(v, "") is None:
                    return None
            # `X | None` given a wrong X: say what is wrong inside it, not only "X or null".
            return real[0](v, f) if len(real) == 1 and v is not None else _bad(f, tp, v)
        return check_union
    if tp is type(None):
        return lambda v, f: None if v is None else _bad(f, tp, v)
    if tp is bool:
        return lambda v, f: None if isinstance(v, bool) else _bad(f, tp, v)
    if tp is int:
        return lambda v, f: None if isinstance(v, int) and not isinstance(v, bool) else _bad(f, tp, v)
    if tp is float:
        return lambda v, f: None if isinstance(v, (int, float)) and not isinstance(v, bool) else _bad(f, tp, v)
    if tp is str:
        return lambda v, f: None if isinstance(v, str) else _bad(f, tp, v)
    raise TypeError(f"schema type {tp!r} is not supported")


def _map_checker(td: type) -> _Checker:
    hints = get_type_hints(td, include_extras=True)
    fields = []
    for name, hint in hints.items():
        required = name in td.__required_keys__
        origin = get_origin(hint)
        if origin in (Required, NotRequired):
            hint = get_args(hint)[0]
        fields.append((name, required, _checker(hint)))

    def check(v, f):
        if not isinstance(v, dict):
            return _bad(f, td, v) if f else f"not a map but {_short(v)}"
        for name, required, fn in fields:
            if name not in v:
                if required:
                    return f"missing field {f'{f}.{name}' if f else name!r}"
                continue
            # checked without its dotted name first: building it for every field of 100k points was most of
            # reading a large report back; a checker is pure, so the second call only words the problem
            if fn(v[name], "") is not None:
                return fn(v[name], f"{f}.{name}" if f else name)
        return None
    return check


def _is_name(v: str) -> bool:
    return 0 < len(v) <= 64 and all(c.isascii() and (c.isalnum() or c in "_-.") for c in v)


def _is_file_name(v: str) -> bool:
    return (0 < len(v) <= 255 and v not in (".", "..") and not v.startswith(".")
            and not any(c in v for c in "/\\\x00"))
