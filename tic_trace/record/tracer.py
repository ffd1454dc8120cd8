"""The tracer: a dispatch mode for every operator plus module hooks for boundaries and outputs.

Shape borrowed from torch's FlopCounterMode: the public `Tracer` is a plain context manager that composes a
private `TorchDispatchMode` and a module-scope tracker. Every public entry point is guarded: an exception
inside the tracer is logged once, disables tracing, and never reaches the model's forward.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import platform
import re
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import keystr, tree_flatten_with_path

from ..store.dtypes import torch_dtype_name
from ..store.format import PassWriter, Record, TraceDirectoryInUse, TraceWriter, claim_run_directory
from .alias import AliasCache
from .filters import MODES, Filters
from .host_copy import DEFAULT_CAP_BYTES, HostStager, as_storage
from .odd_tensors import recordable
from .stat_slots import StatSlots
from .stats import stats_dict
from .version import __version__
from .weights import ParameterHasher

log = logging.getLogger("tic_trace")

ROOT = "<root>"
GLOBAL = "<global>"
# Collectives: their outputs are filled asynchronously on another stream; reading them here would race.
_COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional"}
_SKIP_NAMESPACES = _COLLECTIVE_NAMESPACES | {"_dtensor", "profiler", "prims"}
# Ops whose outputs are uninitialised memory or pure metadata, and reshapes that alias their input without
# being flagged as views (their bits are the input's, already recorded where it was produced).
_SKIP_OPS = {"aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided",
             "aten.resize_", "aten.set_", "aten.detach", "aten.lift_fresh", "aten.record_stream",
             "aten._local_scalar_dense", "aten.alias", "aten.sym_size", "aten.sym_stride", "aten.sym_numel",
             "aten._unsafe_view", "aten._reshape_alias"}


@dataclass
class _Frame:
    path: str
    scope: str              # path, plus "#k" for the k-th call of the same module in this pass
    call: int
    ops: int = 0            # dispatcher ops directly in this frame (names op indices)
    ops_region: int = 0     # dispatcher ops in this frame and its children
    taps: dict = field(default_factory=dict)


@dataclass
class _Pending:
    record: Record
    stat_slot: int | None = None
    bytes_of: "_Pending | None" = None   # a full record of the same tensor whose stored bytes this one shares


# Depth of tracer-internal code on this thread, over all tracers: the ops one tracer runs itself (statistics,
# copies, pass bookkeeping) are not the model's, also for another tracer active at the same time.
_INTERNAL = threading.local()


# One tracer records one thread at a time (its frames and pass state are not per thread). Module calls and
# ops of a thread that arrive while another thread is inside the tracer are skipped, and said.
CONCURRENT_THREADS_NOTE = ("module calls or ops of one thread ran while the tracer was recording another "
                           "thread's: those were not recorded (the model runs modules on several threads at "
                           "once); trace it with its modules on one thread")


class _DispatchRecorder(TorchDispatchMode):
    def __init__(self, tracer: "Tracer"):
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


class Tracer:
    """Records named tensors of a model's forward into a trace directory. See `trace()`."""

    def __init__(self, model: torch.nn.Module | Sequence[torch.nn.Module], out_dir: os.PathLike | str, *,
                 adapter: Any = None, mode: str = "stats", points_mode: str | None = None,
                 filters: Filters | None = None, rank: int | None = None, record_views: bool = False,
                 record_inputs: Iterable[str] | None = None, skip_recompute: bool = True,
                 auto_step: bool = False, sample_rows: Sequence[int] | None = None,
                 sample_keys: Sequence[str] | None = None, tag: str | None = None, manifest: dict | None = None,
                 run: str | None = None, pinned_cap_bytes: int = DEFAULT_CAP_BYTES, on_cap: str = "wait",
                 reuse_aliases: bool = True, durable: bool = False):
        if mode not in MODES or (points_mode is not None and points_mode not in MODES):
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}/{points_mode!r}")
        self.models = list(model) if isinstance(model, (list, tuple)) else [model]
        self.out_dir = Path(out_dir)
        self.mode = mode
        self.points_mode = points_mode or mode
        self.filters = filters or Filters()
        self.record_views = record_views
        self.skip_recompute = skip_recompute
        self.auto_step = auto_step
        self.sample_rows = list(sample_rows) if sample_rows is not None else None
        self.sample_keys = list(sample_keys) if sample_keys is not None else None
        self.tag = tag
        self.extra_manifest = dict(manifest or {})
        # A trace directory holds one run (docs/security.md). Tracers that deliberately write one run together
        # (one per micro-batch) share a `run` id; by default every tracer is a run of its own.
        self.run = str(run) if run is not None else new_run_id()
        self.record_inputs = Filters(modules=list(record_inputs)) if record_inputs else None
        self.record_input_kwargs: tuple[str, ...] = ("hidden_states",)
        self._rank = rank
        self.adapter = _resolve_adapter(adapter)
        self.rows_provider: Callable[[tuple, dict], tuple | None] | None = None
        # state
        self._live = False            # recording right now
        self._busy = False            # inside our own code: ops we run are not the model's
        self.failed: BaseException | None = None
        self._handles: list = []
        self._undo: list[Callable[[], None]] = []
        self._mode: _DispatchRecorder | None = None
        self._writer: TraceWriter | None = None
        self._pass: PassWriter | None = None
        self._pass_count = 0
        self._stack: list[_Frame] = []
        self._calls: dict[str, int] = {}
        self._pending: list[_Pending] = []
        self._stats = StatSlots()
        self._alias = AliasCache() if reuse_aliases else None
        self._stored_full: dict[int, _Pending] = {}   # statistics slot -> the record that stored it in full
        self._stager = HostStager(pinned_cap_bytes, on_cap)
        self.durable = durable
        self._seq = 0
        self._rows: dict | None = None
        self._row_select: torch.Tensor | None = None
        self._row_select_list: list[int] = []
        self._row_select_dev: dict[torch.device, torch.Tensor] = {}
        self._record_rows: list[tuple[re.Pattern, list[int]]] = []
        self._mode_entered = False
        self._paused = False
        self._n_rows: int | None = None
        self._notes: set[str] = set()
        self._blind: list[str] = []
        self.passes_written: list[Path] = []
        self._paths: dict[int, str] = {}
        self._activity = False
        self._incomplete: str | None = None   # why the open pass is not a whole forward
        # Bit-exact hashes of every parameter, in each pass's metadata (changed ones re-hashed only).
        self.hash_weights = True
        self._param_hasher = ParameterHasher()

    # ------------------------------------------------------------ public API
    @property
    def rank(self) -> int:
        if self._rank is None:
            dist = torch.distributed
            self._rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return self._rank

    def start(self) -> "Tracer":
        """Install the hooks and begin recording. Raises `TraceDirectoryInUse` (a FileExistsError), before
        touching the model, if the output directory holds another run's passes for this rank: a trace never
        mixes runs. Any other problem disables tracing with a warning; the model runs on untouched."""
        try:
            if not self.filters.want_rank(self.rank):
                return self
            claim_run_directory(self.out_dir, self.rank, self.run)
        except TraceDirectoryInUse:
            raise
        except Exception as e:  # noqa: BLE001
            self._fail(e)
            return self
        try:
            self._install()
            self._mode = _DispatchRecorder(self)
            self._mode.__enter__()
            self._mode_entered = True
            self._live = True
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        return self

    def stop(self) -> None:
        live, self._live = self._live or (self._paused and self.failed is None), False
        self._paused = False
        if self._mode is not None:
            try:
                if self._mode_entered:
                    self._mode.__exit__(None, None, None)
            except Exception as e:  # noqa: BLE001
                self._fail(e)
            self._mode_entered = False
            self._mode = None
        if live:
            self._live = True
            self._guarded(self._end_pass)
            self._live = False
        try:
            self._stager.close()      # the writer thread ends and the host ring is freed
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        self._uninstall()

    def step(self, tag: str | None = None) -> None:
        """Close the current pass (one engine forward) and start the next, optionally tagged."""
        self._guarded(self._end_pass)
        if tag is not None:
            self.tag = tag

    def pause(self) -> None:
        """Stop recording until `resume()`, at no cost to the model: hooks return at once and the dispatch
        mode is left, so ops no longer pass through Python. For engines that trace only some of their
        forwards (e.g. SGLang passes without a selected request). Call between passes, in the thread that
        runs the forwards; several tracers pause in the reverse order they resumed."""
        try:
            if self._paused or self._mode is None:
                return
            self._paused = True
            self._live = False
            if self._alias is not None:    # ops while paused are unseen: their writes could not end a reuse
                self._alias.clear()
            if self._mode_entered:
                self._mode_entered = False
                self._mode.__exit__(None, None, None)
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def resume(self) -> None:
        """Record again after `pause()` (not after a failure or `stop()`)."""
        try:
            if not self._paused or self._mode is None or self.failed is not None:
                return
            self._paused = False
            self._mode.__enter__()
            self._mode_entered = True
            self._live = True
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    @property
    def paused(self) -> bool:
        return self._paused

    @contextlib.contextmanager
    def pausing(self):
        """`with tracer.pausing(): ...` runs the block untraced."""
        was = self._paused
        self.pause()
        try:
            yield self
        finally:
            if not was:
                self.resume()

    def set_record_rows(self, pattern: str, rows: Sequence[int]) -> None:
        """For the current pass: records whose name matches the regex `pattern` (`re.fullmatch`) hold not
        every row of the pass's row table but `rows[j]` in their leading position `j` (e.g. an engine's
        logits, computed for the last row of each request only). `-1` marks an entry that is no row of the
        table: it is not stored. Such records store their rows' values (mode `rows`, `row_index` = the
        rows), so readers join them like any other record. Cleared when the pass ends."""
        try:
            self._record_rows.append((re.compile(pattern), [int(r) for r in rows]))
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def set_rows(self, keys: Sequence[str | None], positions: Sequence[int],
                 tokens: Sequence[int] | None = None) -> None:
        """Name the token rows of the current pass: row i is position `positions[i]` of sample `keys[i]`
        (None for padding). This is what lets passes of different engines meet row by row."""
        try:
            if len(keys) != len(positions) or (tokens is not None and len(tokens) != len(keys)):
                raise ValueError("set_rows: keys, positions and tokens must have one entry per row")
            self._rows = {"keys": [None if k is None else str(k) for k in keys],
                          "positions": [int(p) for p in positions],
                          "tokens": None if tokens is None else [int(t) for t in tokens]}
            self._n_rows = len(keys)
            if self.sample_rows is not None:
                sel = [i for i in self.sample_rows if 0 <= i < self._n_rows]
                self._row_select = torch.tensor(sel, dtype=torch.long)
                self._row_select_list = sel
                self._row_select_dev = {}
            else:
                self._row_select = None
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def tap_function(self, namespace: Any, attr: str, label: str | None = None) -> None:
        """Record the outputs of a plain function (e.g. `apply_rotary_pos_emb` in a modeling module) under the
        module scope that calls it. Restored at `stop()`."""
        orig = getattr(namespace, attr)
        wrapper = self._tap_wrapper(orig, label or attr)
        setattr(namespace, attr, wrapper)
        self._undo.append(lambda: setattr(namespace, attr, orig))

    def tap_method(self, obj: Any, attr: str, label: str | None = None) -> None:
        """Record the outputs of a bound method of one object (e.g. Megatron's `router.gating`)."""
        had = attr in vars(obj)
        orig = getattr(obj, attr)
        setattr(obj, attr, self._tap_wrapper(orig, label or attr))

        def undo():
            if had:
                setattr(obj, attr, orig)
            else:
                try:
                    delattr(obj, attr)
                except AttributeError:
                    pass
        self._undo.append(undo)

    def record_inputs_of(self, patterns: Iterable[str]) -> None:
        """Also record the positional inputs of modules matching these globs (`re:` for regexes)."""
        have = list(self.record_inputs.modules or []) if self.record_inputs is not None else []
        self.record_inputs = Filters(modules=have + list(patterns))

    def __enter__(self) -> "Tracer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------ failure
    def _discard_host_copies(self) -> None:
        """Let the writer thread finish what is queued (it may still write into the pass) before the pass
        is aborted; its error, if any, is the one already being handled."""
        try:
            self._stager.drain()
        except Exception:  # noqa: BLE001
            pass

    def _fail(self, e: BaseException) -> None:
        if self.failed is None:
            self.failed = e
            log.warning("tic-trace: tracing disabled after an internal error (the model's forward is unaffected; "
                        "passes already written stay readable): %s: %s\n%s", type(e).__name__, e,
                        "".join(traceback.format_exception(type(e), e, e.__traceback__, limit=4)))
        self._live = False
        self._discard_host_copies()
        if self._pass is not None:
            try:
                self._pass.abort()
            except Exception:  # noqa: BLE001
                pass
            self._pass = None
        self._clear_pass_records()

    def _clear_pass_records(self) -> None:
        """Forget what the pass being closed or abandoned recorded: its records, statistics and stored bytes."""
        self._pending.clear()
        self._stats.clear()
        self._stored_full.clear()

    # ------------------------------------------------------------ installation
    def _install(self) -> None:
        multi = len(self.models) > 1
        for ci, model in enumerate(self.models):
            prefix = f"chunk{ci}." if multi else ""
            root_name = f"chunk{ci}" if multi else ROOT
            for name, mod in model.named_modules():
                if mod is model:
                    continue
                path = prefix + name
                self._paths[id(mod)] = path
                self._handles.append(mod.register_forward_pre_hook(
                    functools.partial(self._pre_hook, path), with_kwargs=True))
                self._handles.append(mod.register_forward_hook(
                    functools.partial(self._post_hook, path), with_kwargs=True, always_call=True))
            # Engines such as SGLang call the root's `forward` directly, bypassing hooks: wrap the method.
            self._wrap_root(model, root_name)
        if self.adapter is not None:
            self.adapter.prepare(self, self.models)
        if self._writer is None:
            self._writer = TraceWriter(self.out_dir, self.rank, self._manifest(), self._rank_info(), self.run)

    def _wrap_root(self, model: torch.nn.Module, path: str) -> None:
        had = "forward" in vars(model)
        orig = model.forward
        tracer = self

        @functools.wraps(orig)
        def forward(*args, **kwargs):
            tracer._guarded(tracer._enter, path, args, kwargs, True)
            try:
                out = orig(*args, **kwargs)
            except BaseException as e:
                tracer._guarded(tracer._mark_incomplete, f"the forward of {path} raised {type(e).__name__}")
                tracer._guarded(tracer._exit, path, None, True)
                raise
            tracer._guarded(tracer._exit, path, out, True)
            return out

        model.forward = forward

        def undo():
            if had:
                model.forward = orig
            else:
                try:
                    del model.forward
                except AttributeError:
                    pass
        self._undo.append(undo)

    def _uninstall(self) -> None:
        for h in self._handles:
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass
        self._handles.clear()
        for undo in reversed(self._undo):
            try:
                undo()
            except Exception:  # noqa: BLE001
                pass
        self._undo.clear()

    def _manifest(self) -> dict:
        versions = {"tic_trace": __version__, "torch": torch.__version__, "python": platform.python_version(),
                    "numpy": np.__version__}
        for mod in ("transformers", "megatron.core", "sglang"):
            m = sys.modules.get(mod)
            if m is not None and getattr(m, "__version__", None):
                versions[mod] = str(m.__version__)
        m = {"framework": self.adapter.name if self.adapter is not None else "torch", "versions": versions,
             "created": time.time(),
             "tracer": {"mode": self.mode, "points_mode": self.points_mode, "record_views": self.record_views,
                        "skip_recompute": self.skip_recompute, "sample_rows": self.sample_rows}}
        if self.adapter is not None:
            m["model"] = self.adapter.describe(self.models)
            m["parallel"] = self.adapter.parallel_layout()
            m["numerics"] = self.adapter.numerics(self.models)
        m.update(self.extra_manifest)
        return m

    def _rank_info(self) -> dict:
        dist = torch.distributed
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        info = {"world_size": world, "hostname": socket.gethostname(), "pid": os.getpid()}
        if self.adapter is not None:
            info["coords"] = self.adapter.rank_coords()
        return info

    # ------------------------------------------------------------ hooks
    def _guarded(self, fn, *args) -> None:
        if not self._live:
            return
        if self._busy:
            if not getattr(_INTERNAL, "depth", 0):     # busy on another thread: this call goes unrecorded
                self._notes.add(CONCURRENT_THREADS_NOTE)
            return
        self._busy = True
        depth = getattr(_INTERNAL, "depth", 0)
        _INTERNAL.depth = depth + 1
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        finally:
            self._busy = False
            _INTERNAL.depth = depth

    def _pre_hook(self, path, module, args, kwargs):
        self._guarded(self._enter, path, args, kwargs, False)

    def _post_hook(self, path, module, args, kwargs, output):
        if output is None and sys.exc_info()[1] is not None and self._stack and self._stack[0].path == path \
                and torch._C._current_graph_task_id() == -1:
            # torch calls always_call hooks with no output when the module raised: the outermost traced
            # module (a model called without its root wrapper) did not return. Not in backward: activation
            # recomputation stops itself early with an exception, by design.
            self._guarded(self._mark_incomplete, f"{path} raised {type(sys.exc_info()[1]).__name__}")
        self._guarded(self._exit, path, output, False)

    def _mark_incomplete(self, why: str) -> None:
        if self._incomplete is None:
            self._incomplete = why

    def _enter(self, path: str, args: tuple, kwargs: dict, is_root: bool) -> None:
        if is_root and not self._stack and self.adapter is not None and self._rows is None:
            rows = self.adapter.rows_from_forward(self, args, kwargs)
            if rows is not None:
                self.set_rows(*rows)
        self._activity = True
        call = self._calls.get(path, 0)
        self._calls[path] = call + 1
        frame = _Frame(path=path, scope=path if call == 0 else f"{path}#{call}", call=call)
        self._stack.append(frame)
        if self.record_inputs is not None and self.record_inputs.want_module(path) and self.filters.want_module(path):
            # Positional inputs only: keyword inputs are masks, caches and rotary tables, rarely activations.
            for i, a in enumerate(args):
                self._capture_tree(f"{frame.scope}:in[{i}]", path, "in", None, call, a, self.points_mode)
            for k in self.record_input_kwargs:
                if k in kwargs:
                    self._capture_tree(f"{frame.scope}:in.{k}", path, "in", None, call, kwargs[k], self.points_mode)

    def _exit(self, path: str, output: Any, is_root: bool) -> None:
        # Pop to the matching frame: an exception inside a child may have skipped its post-hook.
        while self._stack and self._stack[-1].path != path:
            self._stack.pop()
        if not self._stack:
            return
        frame = self._stack.pop()
        if self._stack:
            self._stack[-1].ops_region += frame.ops_region
        if self.filters.want_module(path) and output is not None:
            self._capture_tree(f"{frame.scope}:out", path, "out", None, frame.call, output, self.points_mode,
                               ops_in_region=frame.ops_region)
        if frame.ops_region == 0 and self._pass is not None:
            self._blind.append(frame.scope)
        if is_root and not self._stack and self.auto_step:
            self._end_pass()

    def _tap_wrapper(self, orig: Callable, label: str) -> Callable:
        tracer = self

        @functools.wraps(orig)
        def tapped(*args, **kwargs):
            out = orig(*args, **kwargs)
            tracer._guarded(tracer._on_tap, label, out)
            return out
        return tapped

    def _on_tap(self, label: str, out: Any) -> None:
        frame = self._stack[-1] if self._stack else None
        scope = frame.scope if frame else GLOBAL
        path = frame.path if frame else GLOBAL
        if not self.filters.want_module(path):
            return
        n = 0
        if frame is not None:
            n = frame.taps.get(label, 0)
            frame.taps[label] = n + 1
        name = f"{scope}/fn:{label}" + (f"#{n}" if n else "")
        self._capture_tree(f"{name}:out", path, "tap", label, frame.call if frame else 0, out, self.points_mode)

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

    # ------------------------------------------------------------ capture
    def _capture_tree(self, base: str, path: str, kind: str, op: str | None, call: int, value: Any, mode: str,
                      ops_in_region: int | None = None, depth: int = 0) -> None:
        if isinstance(value, torch.Tensor):
            leaves = [("", value)]
        else:
            try:
                flat, _ = tree_flatten_with_path(value)
            except Exception:  # noqa: BLE001 - unknown containers are simply not traced
                return
            leaves = []
            for p, v in flat:
                if isinstance(v, torch.Tensor):
                    leaves.append((keystr(p), v))
                elif kind in ("out", "tap") and depth < 3 and dataclasses.is_dataclass(v) and not isinstance(v, type):
                    # An output dataclass pytree does not know (SGLang's LogitsProcessorOutput): its tensor
                    # fields, named like named-tuple fields: `{base}.{field}`. Inputs are not expanded
                    # (an engine's batch descriptor would be recorded at every module).
                    for f in dataclasses.fields(v):
                        fv = getattr(v, f.name, None)
                        if fv is not None:
                            self._capture_tree(f"{base}{keystr(p)}.{f.name}", path, kind, op, call, fv, mode,
                                               ops_in_region, depth + 1)
        for key, t in leaves:
            rec_t, note, extra = recordable(t)     # odd tensors: recorded in another form, or named
            if note:
                self._notes.add(note)
            if rec_t is not None:
                self._capture(base + key, path, kind, op, call, rec_t, mode, ops_in_region, extra)

    def _open_pass(self) -> PassWriter:
        if self._pass is None:
            if self._writer is None:
                raise RuntimeError("tracer not started")
            self._pass = self._writer.begin_pass({}, self.durable)
            self._pass_index = self._pass.index
            self._begin_weights()
        return self._pass

    def _begin_weights(self) -> None:
        """Parameter hashes of CPU weights start now, beside the forward (weights.ParameterHasher.begin)."""
        if self.hash_weights:
            try:
                self._param_hasher.begin(self.models)
            except Exception as e:  # noqa: BLE001 - the pass's end hashes them instead
                self._notes.add(f"parameter hashes not started beside the forward: {type(e).__name__}: {e}")

    def _capture(self, name: str, path: str, kind: str, op: str | None, call: int, t: torch.Tensor, mode: str,
                 ops_in_region: int | None, extra: dict | None = None) -> None:
        phase = "forward"
        if torch._C._current_graph_task_id() != -1:
            phase = "recompute"
            if self.skip_recompute:
                return
        if t.is_cuda and torch.cuda.is_current_stream_capturing():
            self._notes.add("CUDA graph capture in progress: ops inside captured graphs are not recorded; "
                            "disable CUDA graphs to trace them (SGLang: --disable-cuda-graph)")
            return
        if not self.filters.want_pass(self._pass_count):
            return
        pw = self._open_pass()
        mode = self.filters.mode_for(name, mode)
        dtype = torch_dtype_name(t.dtype)
        rec = Record(name=name, module=path, kind=kind, op=op, call=call, seq=self._seq, phase=phase, dtype=dtype,
                     shape=tuple(t.shape), mode=mode, stats=None, hash=None, ops_in_region=ops_in_region)
        if extra:
            rec.extra.update(extra)
        self._seq += 1
        pending = _Pending(rec)
        # Our own ops on t (a plain tensor: `recordable` lets no wrapper subclass through) skip every Python
        # dispatch mode: in a module hook the tracer's mode is still active, and each op through it costs
        # 15-80 us. Inside the mode's own handler this changes nothing.
        with torch.no_grad(), torch._C._DisableTorchDispatch():
            x = t.detach()
            subset = self._subset_for(name, x) if self._record_rows and kind != "op" else None
            pending.stat_slot = self._stats_slot(x)
            if subset is not None:
                x = self._select_subset(x, rec, subset)
            elif mode == "rows":
                x = self._select_rows(x, rec)
            if rec.mode in ("full", "rows"):
                self._store_value(pw, x, pending, whole=subset is None)
        pw.add(rec)
        self._pending.append(pending)

    def _store_value(self, pw: PassWriter, x: torch.Tensor, pending: _Pending, whole: bool) -> None:
        """Store x's value, or, for a full record of a tensor already stored in full in this pass (an alias:
        same statistics slot), share that record's bytes (same logical values, same bytes; resolved at the
        pass's end, once the writer has placed them)."""
        if pending.record.mode != "full" or not whole:
            self._store(pw, x, pending)
            return
        pending.bytes_of = self._stored_full.get(pending.stat_slot)
        if pending.bytes_of is None:
            self._store(pw, x, pending)
            self._stored_full[pending.stat_slot] = pending

    def _stats_slot(self, x: torch.Tensor) -> int:
        """The slot of x's statistics and hash: an earlier record's when x aliases it (see alias.py), else
        new ones computed on x's device (bounded transient memory, no host sync)."""
        slot = self._alias.lookup(x) if self._alias is not None else None
        if slot is None:
            slot = self._stats.add(x)
            if self._alias is not None:
                self._alias.add(x, slot)
        return slot

    def _subset_for(self, name: str, x: torch.Tensor) -> list[int] | None:
        for rx, rows in self._record_rows:
            if rx.fullmatch(name):
                if x.dim() >= 1 and x.shape[0] == len(rows):
                    return rows
                self._notes.add(f"{name}: {tuple(x.shape)} does not have the {len(rows)} rows set_record_rows named")
                return None
        return None

    def _select_subset(self, x: torch.Tensor, rec: Record, subset: list[int]) -> torch.Tensor:
        """A record holding `subset[j]` of the pass's rows at position j (see `set_record_rows`): keep the
        entries that are rows (and, in rows mode, selected rows); stored as mode `rows`."""
        if rec.mode == "stats":
            return x
        if rec.mode == "rows":
            if self._row_select is None:
                rec.mode = "stats"
                return x
            want = set(self._row_select_list)
        else:
            want = None
        keep = [j for j, r in enumerate(subset) if r >= 0 and (want is None or r in want)]
        rec.mode = "rows"
        rec.row_index = [subset[j] for j in keep]
        if len(keep) == x.shape[0]:
            return x
        return x.index_select(0, torch.tensor(keep, dtype=torch.long, device=x.device))

    def _select_rows(self, x: torch.Tensor, rec: Record) -> torch.Tensor:
        n, sel = self._n_rows, self._row_select
        if n is None or sel is None:
            rec.mode = "stats"
            return x
        dims = self.adapter.token_dims(rec.name) if self.adapter is not None else None
        if dims == 0:
            rec.mode = "stats"
            return x
        if dims in (None, 1) and x.dim() >= 1 and x.shape[0] == n:
            flat = x
        elif dims in (None, 2) and x.dim() >= 2 and x.shape[0] * x.shape[1] == n:
            flat = x.reshape(n, *x.shape[2:])
            rec.extra["row_dims"] = 2
        else:
            rec.mode = "stats"     # not a per-token tensor: statistics only
            return x
        rec.row_index = self._row_select_list
        return flat.index_select(0, self._row_select_on(x.device))

    def _row_select_on(self, device: torch.device) -> torch.Tensor:
        """The selected row indices on `device`, copied there once per pass (not once per record)."""
        idx = self._row_select_dev.get(device)
        if idx is None:
            src = self._row_select.pin_memory() if device.type == "cuda" else self._row_select
            idx = self._row_select_dev[device] = src.to(device, non_blocking=True)   # no host sync
        return idx

    def _store(self, pw: PassWriter, x: torch.Tensor, pending: _Pending) -> None:
        """The value's bytes into the pass's blob: device tensors through the bounded host copy and its writer
        thread (no host sync); over the cap, the record keeps its statistics only (named in the notes)."""
        rec = pending.record
        if x.numel() and self._stager.wants(x):
            if not self._stager.stage(pw, rec, x):
                rec.mode, rec.row_index = "stats", None
                rec.extra.pop("row_dims", None)
            return
        self._stager.write_now(pw, rec, as_storage(x.cpu().contiguous()))

    def _weights_meta(self) -> dict | None:
        """Parameter hashes for this pass's metadata; a failure here only loses them (noted once)."""
        if not self.hash_weights:
            return None
        try:
            return self._param_hasher(self.models)
        except Exception as e:  # noqa: BLE001 - never break the user's run over a diagnostic
            self._notes.add(f"parameter hashes not recorded: {type(e).__name__}: {e}")
            self.hash_weights = False
            return None

    def _end_pass(self) -> None:
        pw = self._pass
        incomplete = self._incomplete
        if incomplete is None and self._stack:
            incomplete = f"the pass ended while {self._stack[0].path} was still running"
        self._incomplete = None
        self._stack.clear()
        self._calls.clear()
        if pw is None:
            self._rows = None
            self._record_rows = []
            if self._activity:
                self._pass_count += 1
            self._activity = False
            return
        # The one host sync of the pass: all statistics and hashes come over together.
        stats_np, hashes_np = self._stats.fetch()
        self._stager.drain()    # every queued host copy is in the blob (the writer's error, if any, raised)
        for p in self._pending:
            if p.stat_slot is not None:
                p.record.stats = stats_dict(stats_np[p.stat_slot])
                p.record.hash = int(hashes_np[p.stat_slot])
            if p.bytes_of is not None:
                src, rec = p.bytes_of.record, p.record
                rec.offset, rec.nbytes, rec.crc = src.offset, src.nbytes, src.crc
                if not src.has_data:     # the stored copy was degraded at the cap: so is this record
                    rec.mode = "stats"
                    self._stager.degraded.append(rec.name)
        self._notes.update(self._stager.take_notes())
        weights = self._weights_meta()
        pw.meta.update(tag=self.tag, rows=self._rows, rank=self.rank, pass_number=self._pass_count,
                       blind_regions=sorted(set(self._blind))[:2000], notes=sorted(self._notes), weights=weights)
        self.passes_written.append(pw.close(incomplete=incomplete))
        self._pass = None
        self._clear_pass_records()
        if self._alias is not None:
            self._alias.clear()
        self._blind.clear()
        self._notes.clear()
        self._rows = None
        self._row_select = None
        self._record_rows = []
        self._n_rows = None
        self._seq = 0
        self._pass_count += 1
        self._activity = False


def _as_storage(x: torch.Tensor, storage: str | None = None) -> np.ndarray:
    return as_storage(x)


_WRITTEN_POS: dict[Any, tuple[int, ...]] = {}


def _written_args(func, written: tuple[str, ...], args: tuple, kwargs: dict) -> list:
    """The arguments an op writes (schema alias annotations `Tensor(a!)`), positional or keyword."""
    pos = _WRITTEN_POS.get(func)
    if pos is None:
        pos = _WRITTEN_POS[func] = tuple(i for i, a in enumerate(func._schema.arguments) if a.name in written)
    out = [args[i] for i in pos if i < len(args)]
    out.extend(v for k, v in kwargs.items() if k in written)
    return out


def new_run_id() -> str:
    """A run id no other tracer has: host, process, time and 48 random bits."""
    return f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}-{os.urandom(6).hex()}"


def _resolve_adapter(adapter: Any):
    if adapter is None or not isinstance(adapter, str):
        return adapter
    from ..graph.adapter import load_adapter
    return load_adapter(adapter)


def trace(model: torch.nn.Module | Sequence[torch.nn.Module], out_dir: os.PathLike | str, *,
          adapter: Any = None, mode: str = "stats", points_mode: str | None = None,
          filters: Filters | None = None, **kwargs: Any) -> Tracer:
    """Trace `model`'s forward into `out_dir`.

        with tic_trace.trace(model, "traces/hf", adapter="hf", points_mode="full"):
            model(input_ids)

    `mode` applies to dispatcher ops, `points_mode` (default: `mode`) to module inputs/outputs and taps, the
    records adapters map to canonical points. Use `start()`/`stop()` instead of `with`, and `step()` between the
    forwards of an engine (or `auto_step=True`: one pass per root forward).

    `out_dir` holds one run: if it already holds another run's passes for this rank, `start()` raises
    `TraceDirectoryInUse` before touching the model. Tracers meant to write one run together pass the same
    `run=` id. A pass whose forward raised is kept as incomplete and never compared (docs/security.md).
    Memory (docs/scale.md): stored values of device tensors go through a pinned ring of at most
    `pinned_cap_bytes` (default 4 GiB) written to disk by a writer thread; when it is full the forward waits
    (`on_cap="wait"`) or the record keeps statistics only (`on_cap="stats"`), named in the pass notes.
    `reuse_aliases=False` recomputes statistics for records that alias an earlier one of the same pass.
    A closed pass is readable at once; its blob reaches the disk through a background fsync (a machine crash
    can cost the last passes, and their CRCs then say so); `durable=True` waits for the fsync of each pass
    (`tic_trace.store.format.wait_for_disk()` waits for all of them).
    """
    return Tracer(model, out_dir, adapter=adapter, mode=mode, points_mode=points_mode, filters=filters, **kwargs)
