"""The dispatch mode: every dispatcher op of the model's forward reaches the tracer here (`_DispatchRecorder`),
named (`aten.mm`), skipped when its output is uninitialised memory, metadata, an alias or a collective's
(filled asynchronously on another stream), and recorded under the module scope that runs it (`_on_op`). An op's
writes end the reuse of statistics for the tensors it wrote (alias.py)."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .guard import _INTERNAL
from .modules import GLOBAL


# Collectives: their outputs are filled asynchronously on another stream; reading them here would race.
_COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional"}
_SKIP_NAMESPACES = _COLLECTIVE_NAMESPACES | {"_dtensor", "profiler", "prims"}
# Ops whose outputs are uninitialised memory or pure metadata, and reshapes that alias their input without
# being flagged as views (their bits are the input's, already recorded where it was produced).
_SKIP_OPS = {"aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided",
             "aten.resize_", "aten.set_", "aten.detach", "aten.lift_fresh", "aten.record_stream",
             "aten._local_scalar_dense", "aten.alias", "aten.sym_size", "aten.sym_stride", "aten.sym_numel",
             "aten._unsafe_view", "aten._reshape_alias"}


class _DispatchRecorder(TorchDispatchMode):
    def __init__(self, tracer: Any):     # the Tracer whose ops these are
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not getattr(_INTERNAL, "depth", 0):     # not an op some tracer runs itself
            self.tracer._guarded(self.tracer._on_op, func, args, kwargs or {}, out)
        return out


_OP_INFO_CACHE: dict[Any, tuple[str, bool, tuple[str, ...], bool]] = {}


def _op_info(func) -> tuple[str, bool, tuple[str, ...], bool, bool]:
    """(name 'aten.mm', skip?, names of written arguments, is_view, may write any tensor argument?)."""
    info = _OP_INFO_CACHE.get(func)
    if info is None:
        schema = func._schema
        name = schema.name.replace("::", ".")
        ns = name.split(".", 1)[0]
        is_view = bool(getattr(func, "is_view", False))
        skip = ns in _SKIP_NAMESPACES or name in _SKIP_OPS
        written = tuple(a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write)
        # Writes a schema does not annotate: c10d's in-place collectives (`allreduce_(Tensor[] tensors, ...)`,
        # no `(a!)`, and no version bump either) and custom ops named in place without annotations.
        unannotated = not written and (ns in _COLLECTIVE_NAMESPACES or name.endswith("_"))
        info = (name, skip, written, is_view, unannotated)
        _OP_INFO_CACHE[func] = info
    return info


_WRITTEN_POS: dict[Any, tuple[int, ...]] = {}


def _written_args(func, written: tuple[str, ...], args: tuple, kwargs: dict) -> list:
    """The arguments an op writes (schema alias annotations `Tensor(a!)`), positional or keyword."""
    pos = _WRITTEN_POS.get(func)
    if pos is None:
        pos = _WRITTEN_POS[func] = tuple(i for i, a in enumerate(func._schema.arguments) if a.name in written)
    out = [args[i] for i in pos if i < len(args)]
    out.extend(v for k, v in kwargs.items() if k in written)
    return out


class OpRecording:
    """What `Tracer` does with one dispatcher op (a mixin: the state lives on the tracer)."""

    def _on_op(self, func, args, kwargs, out) -> None:
        name, skip, written, is_view, unannotated = _op_info(func)
        if self._alias is not None:
            if written:
                self._alias.forget(_written_args(func, written, args, kwargs))
            elif unannotated:       # may have written any tensor it was given: no later reuse of those
                self._alias.forget([*args, *kwargs.values()])
        if skip or (is_view and not self.record_views):
            return
        frame = self._stack[-1] if self._stack else None
        if frame is not None:
            n = frame.ops
            frame.ops += 1
            frame.ops_region += 1
            scope, path, call = frame.scope, frame.path, frame.call
        else:
            n, scope, path, call = self._seq, GLOBAL, GLOBAL, 0
        if not (self.filters.want_op(name) and self.filters.want_module(path)):
            return
        base = f"{scope}/op{n}:{name}"
        if out is None or (isinstance(out, (tuple, list)) and not any(isinstance(o, torch.Tensor) for o in out)):
            # Mutating ops that return nothing (custom kernels, foreach): the written arguments are the output.
            if written:
                schema_args = [a.name for a in func._schema.arguments]
                for i, a in enumerate(args):
                    if i < len(schema_args) and schema_args[i] in written:
                        self._capture_tree(f"{base}:arg.{schema_args[i]}", path, "op", name, call, a, self.mode)
                for k, v in kwargs.items():
                    if k in written:
                        self._capture_tree(f"{base}:arg.{k}", path, "op", name, call, v, self.mode)
            return
        self._capture_tree(base, path, "op", name, call, out, self.mode)
