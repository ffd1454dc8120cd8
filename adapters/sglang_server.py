"""Tracing inside an unmodified SGLang server: ``--forward-hooks`` (:func:`forward_hooks_spec`,
:func:`forward_hook_factory`), in-process tracing of a model's forwards (:func:`trace_forwards`), and the
server arguments that hide operators from the tracer (:func:`tracing_problems`). See docs/sglang.md."""
from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from tic_trace.adapters.sglang_rows import _mode, _par, _tp, forward_batch_rows, parse_sample_rid, row_rids

log = logging.getLogger("tic_trace.sglang")

@contextlib.contextmanager
def trace_forwards(model: Any, out_dir: Any, **kwargs: Any):
    """Trace an SGLang model's forwards in-process: every ``model.forward(...)`` call (what SGLang's runners
    call) is one pass, and nothing between them (the engine's KV bookkeeping) is recorded: the tracer is
    resumed for each forward and paused after it. Keyword arguments go to ``tic_trace.trace`` (adapter
    ``"sglang"`` unless given). Yields the tracer::

        with trace_forwards(model, "traces/sglang", points_mode="full") as t:
            engine.generate(...)
    """
    from tic_trace import Tracer
    kwargs.setdefault("adapter", "sglang")
    kwargs["auto_step"] = True
    t = Tracer(model, out_dir, **kwargs).start()
    t.pause()
    inner = model.forward          # the tracer's wrapper of the root forward

    @functools.wraps(inner)
    def forward(*args, **kw):
        t.resume()
        try:
            return inner(*args, **kw)
        finally:
            t.pause()

    model.forward = forward
    try:
        yield t
    finally:
        t.stop()                   # also restores the model's own forward


# ================================================================== inside an unmodified server

def _adapter_cls():
    from tic_trace.adapters.sglang import SGLangAdapter
    return SGLangAdapter


HOOK_FACTORY = "tic_trace.adapters.sglang_server:forward_hook_factory"
#: Modules the hook is registered on (SGLang wants at least one); the hook itself only finds the model
#: when the factory could not, and notices torch.compile. The tracer works through the model's forward.
HOOK_TARGETS = ["model.embed_tokens", "*.embed_tokens"]
#: How canonical-point records are kept: the tracer's modes, and ``subset`` (``rows`` of the rows that
#: tic_trace.graph.row_subset keeps by (sample, position): the same rows the Megatron side keeps).
MODES = ("stats", "full", "rows", "subset")


def tracer_points_mode(mode: str) -> tuple[str, Any]:
    """A hook mode as the tracer's ``points_mode`` and ``row_subset``."""
    if mode == "subset":
        from tic_trace.graph.row_subset import RowSubset
        return "rows", RowSubset()
    return mode, None

TRACING_SERVER_ARGS = (
    "--cuda-graph-backend-decode=disabled --cuda-graph-backend-prefill=disabled (or the deprecated "
    "--disable-cuda-graph, the only spelling in older SGLang), no --enable-torch-compile, "
    "--disable-radix-cache, --disable-overlap-schedule (see docs/sglang.md)"
)


def forward_hooks_spec(out_dir: str, rollout_ids: list[int] | None = None, max_samples: int = 4,
                       mode: str = "rows", filters: list[str] | None = None, *, every: int = 0,
                       periodic_mode: str = "subset") -> list[dict]:
    """The JSON-able value of SGLang's ``--forward-hooks`` (slime: ``--sglang-forward-hooks``) that traces
    the server's forwards with this adapter.

    ``rollout_ids`` given: only rows whose request id is ``"{rollout_id}-{sample_index}"`` with
    ``rollout_id in rollout_ids`` and ``sample_index < max_samples`` are traced, each rollout into
    ``{out_dir}/rollout_{id:05d}/sglang/`` (a forward without such rows writes nothing; other requests' rows
    of a traced forward have no key, and in ``rows`` mode their values are not stored). ``rollout_ids``
    None: every forward, every row, into ``{out_dir}``. ``mode``: how canonical-point records are kept
    (``rows`` = the traced rows' values, ``subset`` = those of a few rows per sample chosen by (sample,
    position), ``full``, ``stats``); dispatcher ops are statistics. ``filters``:
    module-path globs to record (``re:`` for a regex). ``every`` N > 0: rollouts whose id is a multiple of N
    are traced too, in ``periodic_mode`` when they are not in ``rollout_ids`` (slime's ``--tic-trace-every``).
    """
    if mode not in MODES or periodic_mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    config = {
        "out_dir": str(out_dir),
        "rollout_ids": None if rollout_ids is None else sorted({int(i) for i in rollout_ids}),
        "max_samples": int(max_samples),
        "mode": mode,
        "filters": None if not filters else [str(f) for f in filters],
        "every": int(every),
        "periodic_mode": periodic_mode,
    }
    return [{"name": "tic_trace", "target_modules": list(HOOK_TARGETS), "hook_factory": HOOK_FACTORY,
             "config": config}]


def _graph_backend(sa: Any, phase: str) -> str:
    cfg = getattr(sa, "cuda_graph_config", None)
    b = None
    if isinstance(cfg, dict):
        b = (cfg.get(phase) or {}).get("backend")
    elif cfg is not None:
        b = getattr(getattr(cfg, phase, None), "backend", None)
    if b:
        return str(b)
    if getattr(sa, "disable_cuda_graph", False) or getattr(sa, f"disable_{phase}_cuda_graph", False):
        return "disabled"
    b = getattr(sa, f"cuda_graph_backend_{phase}", None)
    return str(b) if b else "default"


def tracing_problems(server_args: Any = None) -> list[str]:
    """What in the server's arguments hides operators from the tracer, each with the flag to set. Reads the
    running server's arguments when none are given; [] when they are not available."""
    sa = server_args
    if sa is None:
        try:
            from sglang.srt.runtime_context import get_server_args
            sa = get_server_args()
        except Exception:  # noqa: BLE001
            return []
    if sa is None:
        return []
    problems = []
    device = str(getattr(sa, "device", None) or "cuda")
    if device != "cpu":
        for phase in ("decode", "prefill"):
            backend = _graph_backend(sa, phase)
            if backend != "disabled":
                problems.append(
                    f"{phase} CUDA graphs are on (backend {backend!r}): a graph replay runs recorded kernels "
                    f"without calling the model's modules, so no hook fires and {phase} forwards are missing "
                    f"from the trace. Start the server with --cuda-graph-backend-{phase}=disabled "
                    "(or --disable-cuda-graph for both phases).")
    if getattr(sa, "enable_torch_compile", False):
        problems.append("--enable-torch-compile is set: compiled forwards inline module calls (hooks and the "
                        "dispatch mode see nothing or a different graph). Remove --enable-torch-compile.")
    if getattr(sa, "enable_flashinfer_allreduce_fusion", False) and \
            not getattr(sa, "enforce_disable_flashinfer_allreduce_fusion", False):
        problems.append("FlashInfer all-reduce fusion is on (the default for Qwen3-MoE, GLM-4-MoE and DeepSeek-V3 "
                        "on SM90/SM100 at TP>1): the residual add, all-reduce and input_layernorm run as one fused "
                        "call, so input_layernorm records go missing and MoE outputs stay TP partials in every "
                        "layer but the last. Start the server with --enforce-disable-flashinfer-allreduce-fusion.")
    if getattr(sa, "enable_fused_qk_norm_rope", False):
        problems.append("--enable-fused-qk-norm-rope is set: QK-norm and RoPE run in one fused kernel, so "
                        "attn.q_norm / attn.k_norm are not recorded. Remove it to trace them.")
    return problems


class _HookSession:
    """One per server process (TP rank): lazily started tracers, one per traced rollout (or one for all)."""

    def __init__(self, config: dict):
        self.config = dict(config or {})
        mode = self.config.get("mode") or "rows"
        if mode not in MODES:
            raise ValueError(f"tic-trace hook: mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        ids = self.config.get("rollout_ids")
        self.rollout_ids = None if ids is None else {int(i) for i in ids}
        self.every = int(self.config.get("every") or 0)
        self.periodic_mode = self.config.get("periodic_mode") or "subset"
        if self.periodic_mode not in MODES:
            raise ValueError(f"tic-trace hook: periodic_mode must be one of {MODES}, got {self.periodic_mode!r}")
        self.max_samples = int(self.config.get("max_samples", 4) if self.config.get("max_samples") is not None else 4)
        self.out_dir = Path(self.config.get("out_dir") or "tic-trace")
        self.root: Any = None
        self.tracers: dict[int | None, Any] = {}
        self.passes_seen = 0
        self.passes_traced = 0
        self.passes_rows_only = 0     # forwards of a `subset` rollout with no kept row: row table only
        self._plain: Any = None
        self._had_forward = False
        self._top: Any = None
        self._wrapper: Any = None
        self._hook: Any = None
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- plumbing
    def _warn(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def attach(self, root: Any) -> None:
        """Wrap ``root.forward`` (what SGLang's ModelRunner calls). Tracers start at the next forward."""
        with self._lock:
            if self.root is not None:
                return
            self.root = root
            self._had_forward = "forward" in vars(root)
            self._plain = root.forward
            self._top = self._plain
            session = self

            @functools.wraps(self._plain)
            def forward(*args, **kwargs):
                return session._forward(args, kwargs)

            self._wrapper = forward
            root.forward = forward
        for p in tracing_problems():
            self._warn(p[:40], "tic-trace: %s Recipe for tracing runs: %s", p, TRACING_SERVER_ARGS)

    def _rank(self) -> int:
        tp, r = _tp()
        if _par("tp_size") is not None:
            return (_par("pp_rank") or 0) * tp + r
        import torch
        d = torch.distributed
        return d.get_rank() if d.is_available() and d.is_initialized() else 0

    def _select(self, rollout: int | None) -> Callable[[str], bool] | None:
        if rollout is None:
            return None

        def want(rid: str) -> bool:
            p = parse_sample_rid(rid)
            return p is not None and p[0] == rollout and p[1] < self.max_samples
        return want

    def _traced(self, rollout: int) -> bool:
        return rollout in self.rollout_ids or (self.every > 0 and rollout % self.every == 0)

    def _mode_for(self, rollout: int | None) -> str:
        return self.mode if rollout is None or rollout in self.rollout_ids else self.periodic_mode

    def _tracer_for(self, rollout: int | None):
        t = self.tracers.get(rollout)
        if t is not None:
            return t
        from tic_trace import Filters, Tracer
        out = self.out_dir if rollout is None else self.out_dir / f"rollout_{rollout:05d}" / "sglang"
        filters = Filters(modules=self.config["filters"]) if self.config.get("filters") else None
        root = self.root
        root.forward = self._top          # the new tracer wraps the chain of earlier tracers, not this session
        try:
            mode, subset = tracer_points_mode(self._mode_for(rollout))
            t = Tracer(root, out, adapter=_adapter_cls()(rid_filter=self._select(rollout)), mode="stats",
                       points_mode=mode, filters=filters, rank=self._rank(), auto_step=True,
                       sample_rows=[] if mode == "rows" else None, row_subset=subset,
                       manifest={"sglang_hook": {k: v for k, v in self.config.items() if k != "out_dir"}})
            t.start()
            self._top = root.forward
        finally:
            root.forward = self._wrapper
        t.pause()
        self.tracers[rollout] = t
        log.info("tic-trace: tracing SGLang forwards (rank %d) into %s", t.rank, out)
        return t

    def _plan(self, args: tuple, kwargs: dict) -> list:
        """The tracers to run for this forward (resumed, with their rows chosen)."""
        import torch
        if getattr(torch.compiler, "is_compiling", lambda: False)():
            self._warn("compile", "tic-trace: the model's forward runs under torch.compile: not traced. "
                                  "Remove --enable-torch-compile. Recipe: %s", TRACING_SERVER_ARGS)
            return []
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            self._warn("graph", "tic-trace: a CUDA graph is being captured: this forward is not traced, and its "
                                "replays will not be either. Recipe: %s", TRACING_SERVER_ARGS)
            return []
        fb = kwargs.get("forward_batch", args[2] if len(args) > 2 else None)
        if fb is None or getattr(fb, "forward_mode", None) is None:
            self._warn("nofb", "tic-trace: a forward without a ForwardBatch: not traced")
            return []
        if _mode(fb) not in ("extend", "decode"):
            return []
        ids = kwargs.get("input_ids", args[0] if args else None)
        n = int(ids.shape[0]) if ids is not None and hasattr(ids, "shape") and ids.dim() else None
        rids = row_rids(fb, n)
        if self.rollout_ids is None:
            picked = {None: [i for i, r in enumerate(rids) if r is not None]}
        else:
            picked: dict[int | None, list[int]] = {}
            for i, rid in enumerate(rids):
                p = parse_sample_rid(rid)
                if p is not None and self._traced(p[0]) and p[1] < self.max_samples:
                    picked.setdefault(p[0], []).append(i)
        out = []
        table: list = []          # this forward's row table, read once (only for a `subset` rollout)
        for rollout in sorted(picked, key=lambda x: -1 if x is None else x):
            if not picked[rollout]:
                continue
            t = self._tracer_for(rollout)
            if self._mode_for(rollout) in ("rows", "subset"):
                t.sample_rows = picked[rollout]
            if t.row_subset is not None and not self._keeps_a_row(t, fb, ids, picked[rollout], table):
                self.passes_rows_only += 1
                continue
            out.append(t)
        return out

    def _keeps_a_row(self, t: Any, fb: Any, ids: Any, rows: list[int], table: list) -> bool:
        """Whether the subset of `t` keeps one of this forward's `rows`. If not, the forward runs untraced and
        `t` writes its row table only (`Tracer.write_row_table`): a decode step of a periodic `subset` rollout
        usually holds no kept row, and its statistics were most of that rollout's trace."""
        if not table:
            table.append(forward_batch_rows(fb, ids))
        got = table[0]
        keys, positions = got["keys"], got["positions"]
        if any(i < len(keys) and t.row_subset.keeps(keys[i], positions[i]) for i in rows):
            return True
        want = getattr(t.adapter, "rid_filter", None)
        named = [k if k is not None and (want is None or want(k)) else None for k in keys]
        t.write_row_table(named, positions, got["tokens"])
        return False

    def _forward(self, args: tuple, kwargs: dict):
        self.passes_seen += 1
        try:
            active = self._plan(args, kwargs)
        except Exception as e:  # noqa: BLE001 - tracing never breaks a forward
            self._warn("plan", "tic-trace: not tracing this forward: %s: %s", type(e).__name__, e)
            active = []
        for t in active:
            t.resume()
        if active:
            self.passes_traced += 1
        try:
            return self._top(*args, **kwargs)
        finally:
            for t in reversed(active):
                t.pause()

    def on_hook(self, module: Any) -> None:
        import torch
        if getattr(torch.compiler, "is_compiling", lambda: False)():
            return
        if self.root is None:
            root = _root_in_stack(module)
            if root is not None:
                self.attach(root)

    def close(self) -> None:
        """Stop every tracer, restore the model's forward and remove the hook (tests, shutdown)."""
        for t in reversed(list(self.tracers.values())):
            try:
                t.stop()
            except Exception:  # noqa: BLE001
                pass
        self.tracers.clear()
        if self.root is not None:
            if self._had_forward:
                self.root.forward = self._plain
            else:
                try:
                    del self.root.forward
                except AttributeError:
                    pass
            for mod in self.root.modules():
                for hid, h in list(getattr(mod, "_forward_hooks", {}).items()):
                    if h is self._hook:
                        del mod._forward_hooks[hid]
        self.root = None
        if self in _SESSIONS:
            _SESSIONS.remove(self)


_SESSIONS: list[_HookSession] = []


def _root_in_stack(module: Any = None) -> Any:
    """The SGLang model whose forward is running: the nearest caller frame's ``self`` that is an nn.Module
    with a ``logits_processor`` (and contains ``module``)."""
    try:
        import torch
        f = sys._getframe(1)
    except Exception:  # noqa: BLE001
        return None
    while f is not None:
        obj = f.f_locals.get("self")
        if isinstance(obj, torch.nn.Module) and hasattr(obj, "logits_processor"):
            if module is None or any(m is module for m in obj.modules()):
                return obj
        f = f.f_back
    return None


def _model_in_callers() -> Any:
    """The model SGLang's ``register_forward_hooks(model, specs)`` is registering on (its caller frames)."""
    try:
        import torch
        f = sys._getframe(2)
    except Exception:  # noqa: BLE001
        return None
    depth = 0
    while f is not None and depth < 12:
        for name in ("model", "self"):
            obj = f.f_locals.get(name)
            if isinstance(obj, torch.nn.Module) and hasattr(obj, "logits_processor"):
                return obj
        mr = f.f_locals.get("model_runner")
        if mr is not None and hasattr(getattr(mr, "model", None), "logits_processor"):
            return mr.model
        f = f.f_back
        depth += 1
    return None


def forward_hook_factory(config: dict) -> Callable:
    """The ``hook_factory`` of :func:`forward_hooks_spec` (SGLang calls it once per process with the spec's
    ``config`` from ``register_forward_hooks``, after CUDA-graph capture). Finds the model being registered
    on and wraps its ``forward``: the first forward with rows to trace starts a tracer in this process (rank =
    TP rank), and every forward is one pass (``auto_step``). Returns the forward hook SGLang registers on
    ``HOOK_TARGETS``; it returns None (a hook's return value would replace the module output), finds the
    model if the factory could not (tracing starts at the next forward) and notices torch.compile."""
    try:
        session = _HookSession(config)
        _SESSIONS.append(session)
        root = _model_in_callers()
        if root is not None:
            session.attach(root)
    except Exception as e:  # noqa: BLE001 - a bad tracing config must not take the server down
        log.error("tic-trace: not tracing this SGLang server (hook config %r): %s: %s", config, type(e).__name__, e)
        return None          # SGLang then registers nothing and says so

    def hook(module, inputs, output):
        try:
            session.on_hook(module)
        except Exception as e:  # noqa: BLE001 - never into the model's forward
            session._warn("hook", "tic-trace hook: %s: %s", type(e).__name__, e)
        return None

    session._hook = hook
    hook.tic_trace_session = session
    return hook


def close_sessions() -> None:
    """Stop the tracers of every hook session of this process (tests; a server's shutdown)."""
    for s in list(_SESSIONS):
        s.close()
