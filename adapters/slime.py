"""slime integration: ``--tic-trace``, default off; both sides of chosen rollouts traced and compared.

One switch on a slime command line (``--tic-trace``, or ``tic_trace: true`` in a ``--custom-config-path``
YAML) traces, for the chosen rollout ids and a few samples of each, the SGLang rollout forward passes and
the Megatron forward pass that scores the same samples, into ``{tic_trace_dir}/rollout_{id:05d}/sglang/``
and ``.../megatron/``; ``tic-trace slime-report DIR --rollout-id N`` finds the first operator where they
diverge. See ``docs/slime.md``.

Pieces, all through slime's documented extension points (checked against THUDM/slime 624b824a,
2026-08-21; the three Megatron hook flags have kept these signatures since June 2025):

* :func:`add_arguments` -- ``parse_args(add_custom_arguments=add_arguments)`` (``fn(parser) -> parser``).
* :func:`configure` -- call on the parsed ``args``. Off: returns ``args`` untouched and imports nothing.
  On: validates the ``tic_trace*`` values (CLI or YAML), points slime's hook-path arguments at this module
  (chaining any hook the user already set), and sets the SGLang server arguments tracing needs.
* :func:`megatron_init` -- ``--custom-megatron-init-path``; called as ``fn(args)`` at the end of
  ``slime/backends/megatron_utils/initialize.py:init`` on every train rank, before the model is built.
  Installs two wrappers: ``MegatronTrainRayActor.train_actor`` (publishes the rollout id being trained)
  and ``slime.backends.megatron_utils.model.get_batch`` (names the samples of each packed micro-batch).
* :func:`before_log_prob_hook` -- ``--custom-megatron-before-log-prob-hook-path``; called as
  ``fn(args, model, store_prefix)`` by ``slime/backends/megatron_utils/model.py:forward_only``.
* :func:`before_train_step_hook` -- ``--custom-megatron-before-train-step-hook-path``; called as
  ``fn(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)`` by
  ``slime/backends/megatron_utils/model.py:train_one_step``.
* :func:`generate` -- ``--custom-generate-function-path``; awaited as ``fn(args, sample, sampling_params,
  evaluation=...)`` by ``slime/rollout/sglang_rollout.py:generate_and_rm``. Gives traced samples the
  request id ``f"{rollout_id}-{sample.index}"`` and delegates to the user's generate function or slime's.
* :func:`slime_report` -- ``tic-trace slime-report``.

Which samples: those of a traced rollout whose ``sample.index`` modulo the rollout's nominal size
(``rollout_batch_size * n_samples_per_prompt``) is below ``--tic-trace-max-samples``. slime's sample
indices run on across rollouts (the data source counts globally), so this is "the first N samples of each
rollout" on the default data path, and in every case a pure function of the sample index: both sides
select the same samples without talking to each other.
"""
from __future__ import annotations

import argparse
import contextvars
import functools
import importlib
import inspect
import logging
import os
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("tic_trace.slime")

#: Record modes of the canonical points (``tic_trace.filters.MODES``; not imported: off means off).
MODES = ("stats", "full", "rows")
DEFAULT_ROLLOUT_IDS = "0"
DEFAULT_MAX_SAMPLES = 4
DEFAULT_MODE = "rows"

_HERE = __name__                      # "tic_trace.adapters.slime": slime's load_function wants pkg.module.attr
#: slime argument -> the function of this module it is pointed at when tracing is on.
HOOK_PATHS = {
    "custom_megatron_init_path": f"{_HERE}.megatron_init",
    "custom_megatron_before_log_prob_hook_path": f"{_HERE}.before_log_prob_hook",
    "custom_megatron_before_train_step_hook_path": f"{_HERE}.before_train_step_hook",
    "custom_generate_function_path": f"{_HERE}.generate",
}
#: Where configure() keeps the user's own hook paths (called by ours, never dropped).
CHAINED_ATTR = "tic_trace_chained_hooks"
#: SGLang server arguments (``args.sglang_<ServerArgs field>``) set for a traced run, and why.
SERVER_ARGS = {
    "sglang_disable_cuda_graph": "CUDA-graph replay runs captured kernels without calling the modules: "
                                 "no hook fires, decode steps would be invisible",
    "sglang_disable_radix_cache": "a prefix-cache hit skips the prompt rows of a request (siblings of one "
                                  "prompt share them): those rows would never be computed under its rid",
}
_SGLANG_HOOK_FACTORY = "tic_trace.adapters.sglang"


# ================================================================== flags

def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``--tic-trace`` flag family, for ``slime.utils.arguments.parse_args(add_custom_arguments=...)``.

    Defines flags only: nothing is imported and nothing changes until :func:`configure` sees
    ``args.tic_trace`` true.
    """
    g = parser.add_argument_group("tic-trace", "train-inference consistency tracing (default off)")
    g.add_argument("--tic-trace", action="store_true", default=False,
                   help="Trace the SGLang rollout and the Megatron forward of the same samples for the rollouts "
                        "in --tic-trace-rollout-ids, for `tic-trace slime-report`. Sets the hook-path arguments "
                        "and --sglang-disable-cuda-graph / --sglang-disable-radix-cache itself.")
    g.add_argument("--tic-trace-dir", type=str, default=None,
                   help="Where traces go: {dir}/rollout_{id:05d}/{megatron,sglang}/. Must be on a filesystem "
                        "every train and rollout node writes to. Default: {--save}/tic_trace, else ./tic-trace.")
    g.add_argument("--tic-trace-rollout-ids", type=str, default=DEFAULT_ROLLOUT_IDS,
                   help="Comma-separated rollout ids to trace, e.g. '0,3' (default: 0).")
    g.add_argument("--tic-trace-max-samples", type=int, default=DEFAULT_MAX_SAMPLES,
                   help="Samples traced per rollout: those whose index modulo rollout_batch_size * "
                        f"n_samples_per_prompt is below this (default {DEFAULT_MAX_SAMPLES}).")
    g.add_argument("--tic-trace-mode", type=str, default=DEFAULT_MODE, choices=MODES,
                   help="How the canonical points are recorded: 'rows' (values of the traced samples' tokens, "
                        "default), 'full' (whole tensors), 'stats' (statistics only; cannot join differently "
                        "batched passes). Dispatcher ops are always recorded as statistics.")
    g.add_argument("--tic-trace-filter", type=str, nargs="+", default=None,
                   help="Module-path globs to record (both frameworks' names, e.g. '*layers.0*' "
                        "'*layers.1*'); 're:' prefix for a regex. Default: every module.")
    return parser


def _truthy(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


def enabled(args: Any) -> bool:
    return _truthy(getattr(args, "tic_trace", False))


def _parse_ids(v: Any) -> list[int]:
    if v is None or v == "":
        return [int(DEFAULT_ROLLOUT_IDS)]
    if isinstance(v, int) and not isinstance(v, bool):
        items = [v]
    elif isinstance(v, (list, tuple, set)):
        items = list(v)
    else:
        items = [p for p in str(v).replace(" ", ",").split(",") if p]
    out = set()
    for x in items:
        try:
            i = int(x)
        except (TypeError, ValueError):
            raise ValueError(f"tic_trace_rollout_ids: {x!r} is not an integer rollout id (give e.g. '0,3')") from None
        if i < 0:
            raise ValueError(f"tic_trace_rollout_ids: rollout ids are >= 0, got {i}")
        out.add(i)
    if not out:
        raise ValueError("tic_trace_rollout_ids: no rollout id given")
    return sorted(out)


def _parse_filters(v: Any) -> list[str] | None:
    if v is None or v == "" or v == []:
        return None
    items = [v] if isinstance(v, str) else list(v)
    out = []
    for x in items:
        s = str(x)
        out.extend(p for p in (s.split(",") if not s.startswith("re:") else [s]) if p)
    return out or None


def _default_dir(args: Any) -> str:
    save = getattr(args, "save", None)
    return os.path.join(save, "tic_trace") if save else "tic-trace"


def normalize(args: Any) -> Any:
    """Validate and normalise the ``tic_trace*`` attributes in place (they may come from argparse or from
    a ``--custom-config-path`` YAML, which slime ``setattr``s unchecked). Raises ``ValueError``."""
    args.tic_trace = True
    args.tic_trace_rollout_ids = _parse_ids(getattr(args, "tic_trace_rollout_ids", DEFAULT_ROLLOUT_IDS))
    n = getattr(args, "tic_trace_max_samples", DEFAULT_MAX_SAMPLES)
    try:
        n = int(n if n is not None else DEFAULT_MAX_SAMPLES)
    except (TypeError, ValueError):
        raise ValueError(f"tic_trace_max_samples: expected a positive integer, got {n!r}") from None
    if n < 1:
        raise ValueError(f"tic_trace_max_samples: expected a positive integer, got {n}")
    args.tic_trace_max_samples = n
    mode = str(getattr(args, "tic_trace_mode", None) or DEFAULT_MODE).lower()
    if mode not in MODES:
        raise ValueError(f"tic_trace_mode: expected one of {', '.join(MODES)}, got {mode!r}")
    args.tic_trace_mode = mode
    args.tic_trace_filter = _parse_filters(getattr(args, "tic_trace_filter", None))
    d = getattr(args, "tic_trace_dir", None) or _default_dir(args)
    # Absolute: SGLang servers and Ray actors do not share the driver's working directory.
    args.tic_trace_dir = os.path.abspath(os.path.expanduser(str(d)))
    return args


# ================================================================== configure

def configure(args: Any) -> Any:
    """Turn the parsed slime ``args`` into a traced run when ``args.tic_trace`` is set; else change nothing.

    Sets ``custom_megatron_init_path``, ``custom_megatron_before_log_prob_hook_path``,
    ``custom_megatron_before_train_step_hook_path`` and ``custom_generate_function_path`` to this module
    (a hook the user set is kept in ``args.tic_trace_chained_hooks`` and called by ours), appends the
    SGLang adapter's hook spec to ``sglang_forward_hooks``, and sets ``sglang_disable_cuda_graph`` and
    ``sglang_disable_radix_cache``. Idempotent. Returns ``args``.
    """
    if not enabled(args):
        return args
    normalize(args)
    chained = dict(getattr(args, CHAINED_ATTR, None) or {})
    for attr, ours in HOOK_PATHS.items():
        current = getattr(args, attr, None)
        if current and current != ours:
            chained[attr] = current
        setattr(args, attr, ours)
    setattr(args, CHAINED_ATTR, chained)
    for attr in SERVER_ARGS:
        setattr(args, attr, True)
    if not getattr(args, "debug_train_only", False):
        args.sglang_forward_hooks = _with_sglang_spec(args)
    _warn_about_setup(args)
    return args


def _with_sglang_spec(args: Any) -> list[dict]:
    import json
    have = getattr(args, "sglang_forward_hooks", None)
    if isinstance(have, str):
        have = json.loads(have) if have.strip() else None
    if isinstance(have, dict):
        have = [have]
    keep = [h for h in (have or []) if not str((h or {}).get("hook_factory", "")).startswith(_SGLANG_HOOK_FACTORY)]
    from tic_trace.adapters.sglang import forward_hooks_spec
    spec = forward_hooks_spec(args.tic_trace_dir, list(args.tic_trace_rollout_ids), _SGLANG_MAX_SAMPLES,
                              args.tic_trace_mode, args.tic_trace_filter)
    return keep + list(spec)


# The SGLang hooks trace rows whose rid is "{rollout_id}-{sample_index}" with sample_index below a bound.
# Sample indices run on across rollouts, so that bound cannot be the per-rollout sample count: the
# selection is made by `generate` (only selected samples get such a rid); the bound only has to let them in.
_SGLANG_MAX_SAMPLES = 2 ** 62


def _warn_about_setup(args: Any) -> None:
    if getattr(args, "rollout_external", False) or getattr(args, "rollout_external_engine_addrs", None):
        log.warning("tic-trace: external rollout engines are not started by slime: start them with "
                    "--disable-cuda-graph --disable-radix-cache --forward-hooks '%s' yourself",
                    _json(getattr(args, "sglang_forward_hooks", None)))
    if getattr(args, "sglang_config", None):
        log.warning("tic-trace: --sglang-config server groups may override disable_cuda_graph / "
                    "disable_radix_cache / forward_hooks per group; keep them out of the groups' overrides")
    if int(getattr(args, "update_weights_interval", 1) or 1) > 1 or getattr(args, "keep_old_actor", False):
        log.warning("tic-trace: with --update-weights-interval > 1 or --keep-old-actor the rollout and the "
                    "traced Megatron pass may use different weights: expect differences from that alone")
    if getattr(args, "debug_train_only", False):
        log.warning("tic-trace: --debug-train-only: only the Megatron side is traced")
    if getattr(args, "debug_rollout_only", False):
        log.warning("tic-trace: --debug-rollout-only: only the SGLang side is traced")


def _json(x: Any) -> str:
    import json
    try:
        return json.dumps(x)
    except (TypeError, ValueError):
        return str(x)


# ================================================================== selection and keys

def samples_per_rollout(args: Any) -> int:
    return int(getattr(args, "rollout_batch_size", 0) or 0) * int(getattr(args, "n_samples_per_prompt", 1) or 1)


def selected(args: Any, sample_index: int) -> bool:
    """Whether sample ``sample_index`` of a traced rollout is traced (same answer on both sides)."""
    per = samples_per_rollout(args)
    i = int(sample_index)
    return (i % per if per > 0 else i) < int(getattr(args, "tic_trace_max_samples", DEFAULT_MAX_SAMPLES))


def sample_key(rollout_id: int, sample_index: int) -> str:
    """The row key both sides use: SGLang's request id, Megatron's packed-segment key."""
    return f"{int(rollout_id)}-{int(sample_index)}"


def rollout_dir(base: str | os.PathLike, rollout_id: int) -> Path:
    return Path(base) / f"rollout_{int(rollout_id):05d}"


# ================================================================== chaining

def _load(path: str):
    """``pkg.module.attr`` (slime's convention) or ``pkg.module:attr``."""
    if ":" in path:
        mod, _, attr = path.partition(":")
    else:
        mod, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(mod), attr)


def _chained(args: Any, attr: str):
    path = (getattr(args, CHAINED_ATTR, None) or {}).get(attr)
    if not path or path == HOOK_PATHS.get(attr):
        return None
    return _load(path)


# ================================================================== Megatron side: per-process state

class _Session:
    """Tracing of one forward pass over a rollout's micro-batches (the actor log-prob pass, or train step 0):
    one tic-trace pass per traced micro-batch forward, written to ``rollout_NNNNN/megatron``."""

    def __init__(self, args: Any, model_chunks: list, rollout_id: int, phase: str):
        self.args = args
        self.chunks = list(model_chunks)
        self.rollout_id = int(rollout_id)
        self.phase = phase
        self.out_dir = rollout_dir(args.tic_trace_dir, rollout_id) / "megatron"
        # One run for every micro-batch tracer of this process in this rollout directory (they append passes).
        self.run = f"slime-megatron-{_PROCESS_RUN}"
        self.tracer = None
        self.handles = [c.register_forward_hook(self._after_forward, always_call=True) for c in self.chunks]
        self.passes = 0

    def _after_forward(self, module, args, output):
        # The chunk's forward returned (the tracer already closed its root frame): this micro-batch is done.
        try:
            self.stop_current()
        except Exception as e:  # noqa: BLE001 - a forward hook: never into the model's forward
            _warn_once("stop", f"tic-trace: stopping the micro-batch tracer failed: {type(e).__name__}: {e}")
        return None

    def begin_micro_batch(self, sample_indices: list[int] | None) -> None:
        self.stop_current()
        if sample_indices is None:
            _warn_once("no-indices", "tic-trace: could not read this micro-batch's sample_indices; not traced")
            return
        keys = [sample_key(self.rollout_id, i) if selected(self.args, i) else None for i in sample_indices]
        if not any(keys):
            return
        import torch

        import tic_trace
        from tic_trace.filters import Filters
        a = self.args
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.tracer = tic_trace.trace(
            self.chunks, self.out_dir, adapter=_megatron_adapter(a), mode="stats", points_mode=a.tic_trace_mode,
            filters=Filters(modules=a.tic_trace_filter) if a.tic_trace_filter else None, rank=rank,
            # the packing appends one padding pseudo-sequence: no key
            sample_keys=keys + [None], tag=self.phase,
            manifest={"slime": {"rollout_id": self.rollout_id, "phase": self.phase, "store_prefix": "",
                                "sample_keys": [k for k in keys if k]}}, run=self.run)
        try:
            self.tracer.start()
        except tic_trace.TraceDirectoryInUse as e:   # an earlier job's trace: keep it, train on untraced
            self.tracer = None
            _warn_once(f"in-use-{self.rollout_id}", f"tic-trace: not tracing rollout {self.rollout_id}: {e}")

    def stop_current(self) -> None:
        t, self.tracer = self.tracer, None
        if t is None:
            return
        t.stop()
        self.passes += len(t.passes_written)
        if t.failed is not None:
            _warn_once(f"failed-{self.rollout_id}", f"tic-trace: Megatron tracing failed in rollout {self.rollout_id}"
                                                    f" ({self.phase}): {t.failed}")

    def close(self) -> None:
        self.stop_current()
        for h in self.handles:
            h.remove()
        self.handles = []


class _State:
    def __init__(self):
        self.rollout_id: int | None = None      # the rollout MegatronTrainRayActor.train_actor is training
        self.logprob_traced: set[int] = set()
        self.session: _Session | None = None
        self.warned: set[str] = set()


_S = _State()
_PROCESS_RUN = f"{os.getpid()}-{os.urandom(6).hex()}"


def _warn_once(key: str, msg: str) -> None:
    if key not in _S.warned:
        _S.warned.add(key)
        log.warning(msg)


def _guard(fn):
    """Our own Megatron-side logic never raises into training: it logs once and gives up."""
    @functools.wraps(fn)
    def inner(*a, **kw):
        try:
            return fn(*a, **kw)
        except Exception as e:  # noqa: BLE001
            _warn_once(f"err-{fn.__name__}", f"tic-trace: {fn.__name__} failed, tracing skipped: "
                                             f"{type(e).__name__}: {e}")
            try:
                _end_session()
            except Exception:  # noqa: BLE001
                _S.session = None
            return None
    return inner


_ADAPTER_CLS = None


def _megatron_adapter(args: Any):
    """The Megatron adapter, recording (in 'rows' mode) only the rows of the traced samples."""
    global _ADAPTER_CLS
    if _ADAPTER_CLS is None:
        from tic_trace.adapters.megatron import MegatronAdapter

        class SlimeMegatronAdapter(MegatronAdapter):
            def rows_from_forward(self, tracer, args, kwargs):
                rows = super().rows_from_forward(tracer, args, kwargs)
                if rows is not None:
                    tracer.sample_rows = [i for i, k in enumerate(rows[0]) if k is not None]
                return rows
        _ADAPTER_CLS = SlimeMegatronAdapter
    return _ADAPTER_CLS(vocab_size=getattr(args, "vocab_size", None))


def _end_session() -> None:
    s, _S.session = _S.session, None
    if s is not None:
        s.close()


def _role(model_chunks) -> str:
    try:
        return str(getattr(model_chunks[0], "role", "actor") or "actor")
    except (IndexError, TypeError):
        return "actor"


@_guard
def _begin_session(args: Any, model_chunks, rollout_id: int, phase: str) -> None:
    _end_session()
    if getattr(args, "allgather_cp", False) and int(getattr(args, "context_parallel_size", 1) or 1) > 1:
        _warn_once("allgather-cp", "tic-trace: --allgather-cp with context parallelism packs rows differently; "
                                   "the Megatron side is not traced")
        return
    if "get_batch" not in _PATCHED:
        _warn_once("patches", "tic-trace: megatron_init did not run in this process (is --custom-megatron-init-path "
                              "still tic_trace.adapters.slime.megatron_init?): micro-batches cannot be named, the "
                              "Megatron side is not traced")
        return
    _S.session = _Session(args, model_chunks, rollout_id, phase)


# ================================================================== Megatron hooks (slime's signatures)

def before_log_prob_hook(args, model_chunks, store_prefix):
    """``--custom-megatron-before-log-prob-hook-path``: ``forward_only`` calls it after ``model.eval()``,
    before the pipeline schedule, for every log-prob pass: ``store_prefix`` ``"ref_"`` / ``"teacher_"``
    (other weights swapped into the same modules: not traced) and ``""`` (the actor, or the critic's values).
    Traces the actor's ``""`` pass of the chosen rollouts."""
    user = _chained(args, "custom_megatron_before_log_prob_hook_path")
    if user is not None:
        user(args, model_chunks, store_prefix)
    _on_log_prob_pass(args, model_chunks, store_prefix)


@_guard
def _on_log_prob_pass(args, model_chunks, store_prefix) -> None:
    _end_session()                       # a ref / teacher pass ends whatever was being traced
    if not enabled(args) or store_prefix != "" or _role(model_chunks) != "actor":
        return
    rid = _S.rollout_id
    if rid is None:
        _warn_once("no-rollout-id", "tic-trace: rollout id unknown at the log-prob pass (MegatronTrainRayActor."
                                    "train_actor not wrapped); falling back to train step 0")
        return
    if rid not in args.tic_trace_rollout_ids:
        return
    _S.logprob_traced.add(rid)
    _begin_session(args, model_chunks, rid, "logprob")


def before_train_step_hook(args, rollout_id, step_id, model_chunks, optimizer, opt_param_scheduler):
    """``--custom-megatron-before-train-step-hook-path``: ``train_one_step`` calls it after zeroing grads,
    before forward/backward. Traces step 0 of a chosen rollout when its actor log-prob pass was skipped
    (``can_reuse_log_probs_in_loss``, ``--use-rollout-logprobs``): step 0 still runs the rollout's weights.
    Activation-recompute records are tagged and skipped by the tracer."""
    user = _chained(args, "custom_megatron_before_train_step_hook_path")
    if user is not None:
        user(args, rollout_id, step_id, model_chunks, optimizer, opt_param_scheduler)
    _on_train_step(args, rollout_id, step_id, model_chunks)


@_guard
def _on_train_step(args, rollout_id, step_id, model_chunks) -> None:
    _end_session()
    if not enabled(args) or _role(model_chunks) != "actor":
        return
    rid = int(rollout_id)
    if int(step_id) != 0 or rid not in args.tic_trace_rollout_ids or rid in _S.logprob_traced:
        return
    _begin_session(args, model_chunks, rid, "train_step0")


def megatron_init(args):
    """``--custom-megatron-init-path``: ``initialize.init`` calls it on every train rank after the parallel
    state is set up, before the model is built. Installs (once per process) the wrappers that tell the
    hooks which rollout is trained and which samples each micro-batch packs."""
    user = _chained(args, "custom_megatron_init_path")
    if user is not None:
        user(args)
    if enabled(args):
        install_megatron_patches()


_PATCHED: set[str] = set()


def install_megatron_patches() -> None:
    """Wrap ``MegatronTrainRayActor.train_actor(self, rollout_id, rollout_data, ...)`` (called through
    ``self`` by ``train``; Ray binds ``train`` itself when the actor is created, so ``train`` cannot be
    wrapped from inside the actor) and ``slime.backends.megatron_utils.model.get_batch`` (looked up as a
    module global by both ``forward_step`` closures). Once per process; each independently."""
    _patch_train_actor()
    _patch_get_batch()


@_guard
def _patch_train_actor() -> None:
    if "actor" in _PATCHED:
        return
    cls = importlib.import_module("slime.backends.megatron_utils.actor").MegatronTrainRayActor
    orig = cls.train_actor
    if not getattr(orig, "_tic_trace", False):
        @functools.wraps(orig)
        def train_actor(self, rollout_id, *a, **kw):
            _S.rollout_id = int(rollout_id)
            try:
                return orig(self, rollout_id, *a, **kw)
            finally:
                try:
                    _end_session()
                except Exception:  # noqa: BLE001
                    _S.session = None
        train_actor._tic_trace = True
        cls.train_actor = train_actor
    _PATCHED.add("actor")


@_guard
def _patch_get_batch() -> None:
    if "get_batch" in _PATCHED:
        return
    model_mod = importlib.import_module("slime.backends.megatron_utils.model")
    orig = model_mod.get_batch
    if not getattr(orig, "_tic_trace", False):
        @functools.wraps(orig)
        def get_batch(data_iterator, keys, *a, **kw):
            sess = _S.session
            if sess is None:
                return orig(data_iterator, keys, *a, **kw)
            indices = _upcoming_sample_indices(data_iterator)
            batch = orig(data_iterator, keys, *a, **kw)
            # Started once the batch is built: its packing ops are not the model's.
            _begin_micro_batch(sess, indices)
            return batch
        get_batch._tic_trace = True
        model_mod.get_batch = get_batch
    _PATCHED.add("get_batch")


@_guard
def _begin_micro_batch(sess: _Session, indices) -> None:
    if _S.session is sess:
        sess.begin_micro_batch(indices)


def _upcoming_sample_indices(data_iterator) -> list[int] | None:
    """Sample indices of the micro-batch ``DataIterator.get_next`` is about to return: its local indices
    are ``micro_batch_indices[offset]`` into this DP rank's ``rollout_data`` lists, where
    ``rollout_data["sample_indices"][i]`` is ``Sample.index`` (shipped by ``_split_train_data_by_dp``)."""
    try:
        it = data_iterator[0] if isinstance(data_iterator, (list, tuple)) else data_iterator
        local = it.micro_batch_indices[it.offset]
        si = it.rollout_data.get("sample_indices")
        if si is None:
            return None
        return [int(si[i]) for i in local]
    except Exception:  # noqa: BLE001
        return None


# ================================================================== rollout side: generate

_RID: contextvars.ContextVar[str | None] = contextvars.ContextVar("tic_trace_rid", default=None)


async def generate(args, sample, sampling_params, evaluation=False):
    """``--custom-generate-function-path``: for a traced sample of a traced rollout, every ``/generate``
    request it sends carries ``rid = f"{rollout_id}-{sample.index}"`` (set by a wrapper around slime's HTTP
    ``post``, for this coroutine only); then the user's own generate function (if one was set) or slime's
    ``slime.rollout.sglang_rollout.generate`` runs unchanged. Evaluation requests are never tagged."""
    rid = _rid_for(args, sample, evaluation)
    fn = _generate_delegate(args)
    token = _RID.set(rid) if rid is not None else None
    try:
        if "evaluation" in _params(fn):
            return await fn(args, sample, sampling_params, evaluation=evaluation)
        return await fn(args, sample, sampling_params)
    finally:
        if token is not None:
            _RID.reset(token)


def request_rid() -> str | None:
    """The rid :func:`generate` gives the sample whose request is being sent from this coroutine, or None.
    For a custom generate function that sends requests with its own HTTP client: ``payload["rid"] = rid``."""
    return _RID.get()


def _params(fn) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _generate_delegate(args):
    user = _chained(args, "custom_generate_function_path")
    if user is not None:
        return user
    return importlib.import_module("slime.rollout.sglang_rollout").generate


def current_rollout_id() -> int | None:
    """The rollout the RolloutManager is generating: slime publishes it with
    ``slime.rollout.sample_hooks.set_current_rollout_id`` (v0.3.1+) before calling the rollout function."""
    try:
        mod = importlib.import_module("slime.rollout.sample_hooks")
    except ImportError:
        return None
    v = getattr(mod, "_current_rollout_id", None)
    return None if v is None else int(v)


def _rid_for(args, sample, evaluation) -> str | None:
    try:
        if evaluation or not enabled(args):
            return None
        idx = getattr(sample, "index", None)
        if idx is None:
            return None
        rollout_id = current_rollout_id()
        if rollout_id is None:
            _warn_once("no-current-rollout", "tic-trace: slime does not publish the current rollout id "
                                             "(slime.rollout.sample_hooks, v0.3.1+): requests are not tagged")
            return None
        ids = args.tic_trace_rollout_ids if isinstance(args.tic_trace_rollout_ids, list) \
            else _parse_ids(args.tic_trace_rollout_ids)
        if rollout_id not in ids or not selected(args, idx):
            return None
        install_rid_injection()
        return sample_key(rollout_id, idx)
    except Exception as e:  # noqa: BLE001 - never break a rollout over tracing
        _warn_once("rid", f"tic-trace: request not tagged: {type(e).__name__}: {e}")
        return None


#: Modules whose ``post`` sends the rollout's ``/generate`` requests (slime's default ``generate`` uses the
#: name it imported into ``sglang_rollout``; custom generate functions usually import it from http_utils).
POST_MODULES = ("slime.utils.http_utils", "slime.rollout.sglang_rollout")


def install_rid_injection() -> None:
    """Wrap ``post`` in :data:`POST_MODULES` (once): a ``/generate`` payload sent while :func:`generate`
    runs for a traced sample gets that sample's ``rid`` unless it already has one. Other requests, other
    coroutines and untraced samples pass through unchanged."""
    for name in POST_MODULES:
        mod = sys.modules.get(name)
        if mod is None:
            try:
                mod = importlib.import_module(name)
            except ImportError:
                continue
        orig = getattr(mod, "post", None)
        if orig is None or getattr(orig, "_tic_trace", False):
            continue
        setattr(mod, "post", _rid_post(orig))


def _rid_post(orig):
    @functools.wraps(orig)
    async def post(url, payload, *a, **kw):
        rid = _RID.get()
        if rid is not None and isinstance(payload, dict) and "rid" not in payload \
                and str(url).split("?", 1)[0].rstrip("/").endswith("/generate"):
            payload = {**payload, "rid": rid}
        out = orig(url, payload, *a, **kw)
        return await out if inspect.isawaitable(out) else out
    post._tic_trace = True
    return post


# ================================================================== report

def slime_report(args, console) -> int:
    """``tic-trace slime-report DIR --rollout-id N``: Megatron (reference, side A) against SGLang (side B).

    Prints the tokens with the largest |Δ logprob| and where each one's divergence starts, then the first
    divergence and the rest. Exit code 0 consistent, 1 divergent, 2 a side is missing or nothing could be
    compared."""
    from tic_trace.align import CanonicalView
    from tic_trace.diverge import find_divergence
    from tic_trace.report import render_terminal, write_reports
    from tic_trace.text import error_line, text
    from tic_trace.tools.cli import _tolerance

    base = Path(args.dir)
    rdir = rollout_dir(base, args.rollout_id)
    if not base.is_dir():
        console.print(error_line(f"{base} does not exist: give the --tic-trace-dir of the slime run "
                                 "(default {--save}/tic_trace)"), soft_wrap=True)
        return 2
    if not rdir.is_dir():
        have = sorted(p.name for p in base.glob("rollout_*") if p.is_dir())
        console.print(error_line(f"no traces of rollout {args.rollout_id}: {rdir} does not exist. "
                                 f"Traced rollouts here: {', '.join(have) or 'none'}. Check --tic-trace-rollout-ids "
                                 "and that the run reached that rollout."), soft_wrap=True)
        return 2
    sides = {"megatron": rdir / "megatron", "sglang": rdir / "sglang"}
    why = {
        "megatron": "the train ranks wrote nothing. Check that --tic-trace was on for the train actors (their "
                    "args carry custom_megatron_*_hook_path = tic_trace.adapters.slime.*), that tic_trace is "
                    "importable on the train nodes, that the rollout was trained, and that this directory is "
                    "shared by the train nodes.",
        "sglang": "the SGLang servers wrote nothing. Check that tic_trace is importable in the SGLang server "
                  "processes (Ray runtime env: PYTHONPATH or pip install on the rollout nodes), that the "
                  "engines got --sglang-forward-hooks (not external engines, no --sglang-config override), "
                  "that requests carried rid '<rollout>-<sample index>' (slime >= v0.3.1), and that this "
                  "directory is shared by the rollout nodes.",
    }
    for name, p in sides.items():
        if not (p / "manifest.msgpack").is_file():
            state = "does not exist" if not p.exists() else "holds no trace (no manifest.msgpack)"
            console.print(error_line(f"{name} side missing: {p} {state}: {why[name]}"), soft_wrap=True)
            return 2
    va, vb = CanonicalView(str(sides["megatron"])), CanonicalView(str(sides["sglang"]))
    rep = find_divergence(va, vb, tolerance=_tolerance(args), worst_tokens=getattr(args, "worst_tokens", 8))
    report = rep.to_json()
    report["slime"] = {"dir": str(base), "rollout_id": int(args.rollout_id),
                       "a": str(sides["megatron"]), "b": str(sides["sglang"])}
    console.print(text(f"slime rollout {args.rollout_id}: A = Megatron {sides['megatron']}  B = SGLang {sides['sglang']}"))
    _print_worst(console, report)
    render_terminal({**report, "worst_tokens": []}, console)
    write_reports(report, console, getattr(args, "json", None), getattr(args, "html", None))
    if report["verdict"] == "not_comparable" or not (report.get("rows") or {}).get("matched"):
        console.print("[bold yellow]nothing compared:[/] the two sides share no (sample, position) row. Rows are "
                      "keyed '<rollout>-<sample index>': check that SGLang requests carried that rid (tic_trace"
                      ".adapters.slime.generate is the --custom-generate-function-path) and the mode is not "
                      "'stats'.")
        return 2
    return 1 if report["verdict"] == "divergent" else 0


def _print_worst(console, report: dict) -> None:
    from rich.table import Table

    from tic_trace.text import text
    w = report.get("worst_tokens") or []
    if not w:
        console.print("no per-token log-probabilities on both sides (logits not traced on one side?)")
        return
    t = Table(title="tokens with the largest |Δ logprob| (A Megatron, B SGLang; logprob of the next token, "
                    "before temperature) and where each one's divergence starts",
              title_justify="left", show_edge=False)
    for col in ("sample", "pos", "|Δlogp|", "logp A", "logp B", "divergence starts", "routing flip"):
        t.add_column(col)
    for x in w:
        t.add_row(text(x["sample"]), str(x["position"]), f"{x['abs_dlogprob']:.3e}", f"{x['logprob_a']:.5f}",
                  f"{x['logprob_b']:.5f}", text(x.get("divergence_starts") or "-"), "yes" if x.get("routing_flip") else "")
    console.print(t)
    console.print()
