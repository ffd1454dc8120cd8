"""Module hooks: the boundaries of every module call (a frame per call, named by module path and call number),
the root forward wrapped for engines that bypass hooks, module outputs (and chosen inputs) recorded at the
boundary, and taps on plain functions and methods. Everything installed is undone at `stop()`."""
from __future__ import annotations

import functools
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from ..store.writer import TraceWriter
from .filters import Filters


ROOT = "<root>"
GLOBAL = "<global>"


@dataclass
class _Frame:
    path: str
    scope: str              # path, plus "#k" for the k-th call of the same module in this pass
    call: int
    ops: int = 0            # dispatcher ops directly in this frame (names op indices)
    ops_region: int = 0     # dispatcher ops in this frame and its children
    taps: dict = field(default_factory=dict)
    thread: int = 0         # the thread that entered this call (a module-global tap records its own thread's)


def compiled_modules(models: list[torch.nn.Module]) -> list[str]:
    """The module paths of `torch.compile`d modules (an `OptimizedModule` wrapper, or `Module.compile()` in
    place) in these models; the root of one model is `<root>`, of several `chunkN`."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:  # noqa: BLE001 - a torch without dynamo compiles nothing
        return []
    out = []
    multi = len(models) > 1
    for ci, model in enumerate(models):
        for name, mod in model.named_modules(remove_duplicate=False):
            if isinstance(mod, OptimizedModule) or getattr(mod, "_compiled_call_impl", None) is not None:
                prefix = f"chunk{ci}" if multi else ""
                out.append(".".join(x for x in (prefix, name) if x) or ROOT)
    return out


class _SharedTap:
    """The one patch of a module-global function for every tracer that taps it. Each tracer patching the
    function itself would see every thread's calls and, stopped out of order, restore another's wrapper or
    remove a live tracer's. The patch calls the function once and hands its output to each attached tracer
    that traces the calling thread (`ModuleHooks._tap_is_ours`)."""

    _lock = threading.Lock()
    _installed: dict = {}          # (id(namespace), attr) -> _SharedTap

    def __init__(self, namespace: Any, attr: str):
        self.namespace, self.attr = namespace, attr
        self.orig = getattr(namespace, attr)
        self.tracers: list[tuple[Any, str]] = []      # (tracer, label)
        orig, tap = self.orig, self

        @functools.wraps(orig)
        def tapped(*args, **kwargs):
            out = orig(*args, **kwargs)
            for tracer, label in tap.tracers:     # attach and detach replace the list, never change it
                if tracer._live and tracer._tap_is_ours():
                    tracer._guarded(tracer._on_tap, label, out)
            return out
        self.wrapper = tapped

    @classmethod
    def attach(cls, namespace: Any, attr: str, tracer: Any, label: str) -> "_SharedTap":
        with cls._lock:
            key = (id(namespace), attr)
            tap = cls._installed.get(key)
            if tap is None or getattr(namespace, attr, None) is not tap.wrapper:
                tap = cls._installed[key] = cls(namespace, attr)
                setattr(namespace, attr, tap.wrapper)
            tap.tracers = tap.tracers + [(tracer, label)]
            return tap

    def detach(self, tracer: Any) -> None:
        with self._lock:
            self.tracers = [(t, lab) for t, lab in self.tracers if t is not tracer]
            if self.tracers:
                return
            key = (id(self.namespace), self.attr)
            if self._installed.get(key) is self:
                del self._installed[key]
            if getattr(self.namespace, self.attr, None) is self.wrapper:   # else patched over since: leave it
                setattr(self.namespace, self.attr, self.orig)


class ModuleHooks:
    """Module and function hooks of `Tracer` (a mixin: the state lives on the tracer)."""

    def tap_function(self, namespace: Any, attr: str, label: str | None = None) -> None:
        """Record the outputs of a plain function (e.g. `apply_rotary_pos_emb` in a modeling module) under the
        module scope that calls it. The function is module-global, so is its patch (`_SharedTap`): one per
        function for every tracer, each recording only the calls of the thread it traces. Removed at the last
        `stop()`, in any order."""
        tap = _SharedTap.attach(namespace, attr, self, label or attr)
        self._undo.append(lambda: tap.detach(self))

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
                post = mod.register_forward_hook(functools.partial(self._post_hook, path), with_kwargs=True,
                                                 always_call=True)
                self._handles.append(post)
                self._post_hook_ids[id(mod)] = post.id
            # Engines such as SGLang call the root's `forward` directly, bypassing hooks: wrap the method.
            self._wrap_root(model, root_name)
        compiled = compiled_modules(self.models)
        if compiled:
            self._standing_notes.add(
                f"torch.compile'd module(s) {', '.join(compiled[:8])}{' …' if len(compiled) > 8 else ''}: under "
                "the tracer they ran eagerly (its hooks and dispatch mode keep the compiled code from running), "
                "so the trace is of the eager computation, not of the compiled one the model runs untraced "
                "(the two can differ in the last bits)")
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
            if tracer.failed is not None:     # counted for the incomplete-run note (passes.py)
                tracer._forwards_not_recorded += 1
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
        self._post_hook_ids.clear()
        for undo in reversed(self._undo):
            try:
                undo()
            except Exception:  # noqa: BLE001
                pass
        self._undo.clear()

    def _pre_hook(self, path, module, args, kwargs):
        if self._live:
            self._keep_post_hook_last(module)
        self._guarded(self._enter, path, args, kwargs, False)

    def _keep_post_hook_last(self, module: torch.nn.Module) -> None:
        """A forward hook registered after the trace started would run after ours, so the recorded output
        would not be the one the model goes on with (a hook may replace it). Ours moves to the end before
        each call: torch reads the hooks after `forward` returns, so this call already runs them in order."""
        hooks = getattr(module, "_forward_hooks", None)
        hid = self._post_hook_ids.get(id(module))
        try:
            if hid is not None and len(hooks) > 1 and next(reversed(hooks)) != hid:
                hooks.move_to_end(hid)
        except (KeyError, AttributeError, TypeError):    # another torch's hook table: keep the order it has
            pass

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
        frame = _Frame(path=path, scope=path if call == 0 else f"{path}#{call}", call=call,
                       thread=threading.get_ident())
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
            if tracer._live and tracer._tap_is_ours():
                tracer._guarded(tracer._on_tap, label, out)
            return out
        return tapped

    def _tap_is_ours(self) -> bool:
        """Whether a tapped call on this thread belongs to this tracer: the thread runs this tracer's innermost
        module call (or, outside any, is the thread that started it). Another tracer's model on another thread
        is not ours to record, nor a call this tracer missed."""
        try:
            top = self._stack[-1] if self._stack else None
        except IndexError:      # the tracer's own thread emptied the stack just now
            top = None
        return (top.thread if top is not None else self._start_thread) == threading.get_ident()

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
