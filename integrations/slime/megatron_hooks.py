"""The Megatron side: slime's three Megatron hook arguments and the two wrappers that name what is trained.

* :func:`megatron_init` -- ``--custom-megatron-init-path``; called as ``fn(args)`` at the end of
  ``slime/backends/megatron_utils/initialize.py:init`` on every train rank, before the model is built.
  Checks the slime version, then wraps ``MegatronTrainRayActor.train_actor`` (publishes the rollout id
  being trained), ``slime.backends.megatron_utils.model.get_batch`` (names the samples of each packed
  micro-batch) and ``get_log_probs_and_entropy`` (records the log-probs the trainer used: :mod:`.used_logprobs`).
* :func:`before_log_prob_hook` -- ``--custom-megatron-before-log-prob-hook-path``; called as
  ``fn(args, model, store_prefix)`` by ``slime/backends/megatron_utils/model.py:forward_only``.
* :func:`before_train_step_hook` -- ``--custom-megatron-before-train-step-hook-path``; called as
  ``fn(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)`` by ``train_one_step``.
"""
from __future__ import annotations

import functools
import importlib
import os
from typing import Any

from tic_trace.integrations.slime.config import (
    chained_hook, enabled, mode_for, rollout_dir, sample_key, selected, traced, tracer_points_mode, warn_once,
    wrap_once,
)
from tic_trace.integrations.slime.version import check_megatron_side


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
        self.keys: list | None = None     # the current micro-batch's sample keys (None: not traced)
        self.loss_masks: list | None = None   # its per-sample loss masks, as get_batch returned them

    def _after_forward(self, module, args, output):
        # The chunk's forward returned (the tracer already closed its root frame): this micro-batch is done.
        try:
            self.stop_current()
        except Exception as e:  # noqa: BLE001 - a forward hook: never into the model's forward
            warn_once("stop", f"tic-trace: stopping the micro-batch tracer failed: {type(e).__name__}: {e}")
        return None

    def begin_micro_batch(self, sample_indices: list[int] | None) -> None:
        self.stop_current()
        self.keys = None
        if sample_indices is None:
            warn_once("no-indices", "tic-trace: could not read this micro-batch's sample_indices; not traced")
            return
        keys = [sample_key(self.rollout_id, i) if selected(self.args, i) else None for i in sample_indices]
        if not any(keys):
            return
        self.keys = keys
        import torch

        import tic_trace
        from tic_trace import Filters
        a = self.args
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        points_mode, subset = tracer_points_mode(mode_for(a, self.rollout_id))
        self.tracer = tic_trace.trace(
            self.chunks, self.out_dir, adapter=_megatron_adapter(a), mode="stats", points_mode=points_mode,
            row_subset=subset, filters=Filters(modules=a.tic_trace_filter) if a.tic_trace_filter else None, rank=rank,
            # the packing appends one padding pseudo-sequence: no key
            sample_keys=keys + [None], tag=self.phase,
            manifest={"slime": {"rollout_id": self.rollout_id, "phase": self.phase, "store_prefix": "",
                                "sample_keys": [k for k in keys if k],
                                # slime's --hf-checkpoint: the exact reference of `slime-report` (docs/replay.md)
                                "hf_checkpoint": _hf_checkpoint(a),
                                # how slime reduces train_rollout_logprob_abs_diff (the reconciliation's weights)
                                "calculate_per_token_loss": bool(getattr(a, "calculate_per_token_loss", False)),
                                # R3 on or off: the reconciliation's routing-replay part says which
                                "use_rollout_routing_replay": bool(getattr(a, "use_rollout_routing_replay", False))}},
            run=self.run)
        try:
            self.tracer.start()
        except tic_trace.TraceDirectoryInUse as e:   # an earlier job's trace: keep it, train untraced
            self.tracer = None
            warn_once(f"in-use-{self.rollout_id}", f"tic-trace: not tracing rollout {self.rollout_id}: {e}")

    def stop_current(self) -> None:
        t, self.tracer = self.tracer, None
        if t is None:
            return
        t.stop()
        self.passes += len(t.passes_written)
        if t.failed is not None:
            warn_once(f"failed-{self.rollout_id}", f"tic-trace: Megatron tracing failed in rollout {self.rollout_id}"
                                                    f" ({self.phase}): {t.failed}")

    def close(self) -> None:
        self.stop_current()
        for h in self.handles:
            h.remove()
        self.handles = []
        if self.passes:
            from tic_trace.integrations.slime.budget import after_rollout_traced
            after_rollout_traced(self.args, self.rollout_id)


class _State:
    def __init__(self):
        self.rollout_id: int | None = None      # the rollout MegatronTrainRayActor.train_actor is training
        self.logprob_traced: set[int] = set()
        self.session: _Session | None = None


_S = _State()
_PROCESS_RUN = f"{os.getpid()}-{os.urandom(6).hex()}"


def _guard(fn):
    """Our own Megatron-side logic never raises into training: it logs once and gives up."""
    @functools.wraps(fn)
    def inner(*a, **kw):
        try:
            return fn(*a, **kw)
        except Exception as e:  # noqa: BLE001
            warn_once(f"err-{fn.__name__}", f"tic-trace: {fn.__name__} failed, tracing skipped: "
                                             f"{type(e).__name__}: {e}")
            try:
                _end_session()
            except Exception:  # noqa: BLE001
                _S.session = None
            return None
    return inner


_ADAPTER_CLS = None


def _hf_checkpoint(args: Any) -> str | None:
    """slime's --hf-checkpoint as an absolute path (None when the run has none)."""
    import os
    p = getattr(args, "hf_checkpoint", None)
    return os.path.abspath(os.path.expanduser(str(p))) if p else None


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
        warn_once("allgather-cp", "tic-trace: --allgather-cp with context parallelism packs rows differently; "
                                   "the Megatron side is not traced")
        return
    if "get_batch" not in _PATCHED:
        warn_once("patches", "tic-trace: megatron_init did not run in this process (is --custom-megatron-init-path "
                              "still tic_trace.integrations.slime.megatron_init?): micro-batches cannot be named, the "
                              "Megatron side is not traced")
        return
    _S.session = _Session(args, model_chunks, rollout_id, phase)


# ================================================================== Megatron hooks (slime's signatures)

def before_log_prob_hook(args, model_chunks, store_prefix):
    """``--custom-megatron-before-log-prob-hook-path``: ``forward_only`` calls it after ``model.eval()``,
    before the pipeline schedule, for every log-prob pass: ``store_prefix`` ``"ref_"`` / ``"teacher_"``
    (other weights swapped into the same modules: not traced) and ``""`` (the actor, or the critic's values).
    Traces the actor's ``""`` pass of the chosen rollouts."""
    user = chained_hook(args, "custom_megatron_before_log_prob_hook_path")
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
        warn_once("no-rollout-id", "tic-trace: rollout id unknown at the log-prob pass (MegatronTrainRayActor."
                                    "train_actor not wrapped); falling back to train step 0")
        return
    if not traced(args, rid):
        return
    _S.logprob_traced.add(rid)
    _begin_session(args, model_chunks, rid, "logprob")


def before_train_step_hook(args, rollout_id, step_id, model_chunks, optimizer, opt_param_scheduler):
    """``--custom-megatron-before-train-step-hook-path``: ``train_one_step`` calls it after zeroing grads,
    before forward/backward. Traces step 0 of a chosen rollout when its actor log-prob pass was skipped
    (``can_reuse_log_probs_in_loss``, ``--use-rollout-logprobs``): step 0 still runs the rollout's weights.
    Activation-recompute records are tagged and skipped by the tracer."""
    user = chained_hook(args, "custom_megatron_before_train_step_hook_path")
    if user is not None:
        user(args, rollout_id, step_id, model_chunks, optimizer, opt_param_scheduler)
    _on_train_step(args, rollout_id, step_id, model_chunks)


@_guard
def _on_train_step(args, rollout_id, step_id, model_chunks) -> None:
    _end_session()
    if not enabled(args) or _role(model_chunks) != "actor":
        return
    rid = int(rollout_id)
    if int(step_id) != 0 or not traced(args, rid) or rid in _S.logprob_traced:
        return
    _begin_session(args, model_chunks, rid, "train_step0")


def megatron_init(args):
    """``--custom-megatron-init-path``: ``initialize.init`` calls it on every train rank after the parallel
    state is set up, before the model is built. Installs (once per process) the wrappers that tell the
    hooks which rollout is trained and which samples each micro-batch packs."""
    user = chained_hook(args, "custom_megatron_init_path")
    if user is not None:
        user(args)
    if enabled(args):
        check_megatron_side()
        install_megatron_patches()


_PATCHED: set[str] = set()


def install_megatron_patches() -> None:
    """Wrap ``MegatronTrainRayActor.train_actor(self, rollout_id, rollout_data, ...)`` (called through
    ``self`` by ``train``; Ray binds ``train`` itself when the actor is created, so ``train`` cannot be
    wrapped from inside the actor) and ``slime.backends.megatron_utils.model.get_batch`` (looked up as a
    module global by both ``forward_step`` closures). Once per process; each independently."""
    _patch_train_actor()
    _patch_get_batch()
    _patch_routing_replay()
    _patch_log_probs()


def current_rollout_id() -> int | None:
    """The rollout ``MegatronTrainRayActor.train_actor`` is training in this process (None before the first)."""
    return _S.rollout_id


@_guard
def _patch_routing_replay() -> None:
    """R3: record the traced samples' routed experts where slime hands them to Megatron (:mod:`.routing_replay`)."""
    from tic_trace.integrations.slime.routing_replay import install
    install()


@_guard
def _patch_train_actor() -> None:
    if "actor" in _PATCHED:
        return
    cls = importlib.import_module("slime.backends.megatron_utils.actor").MegatronTrainRayActor
    wrap_once(cls, "train_actor", _publishing_rollout_id, required=True)
    _PATCHED.add("actor")


def _publishing_rollout_id(orig):
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
    return train_actor


@_guard
def _patch_get_batch() -> None:
    if "get_batch" in _PATCHED:
        return
    wrap_once(importlib.import_module("slime.backends.megatron_utils.model"), "get_batch", _naming_micro_batch,
              required=True)
    _PATCHED.add("get_batch")


def _naming_micro_batch(orig):
    @functools.wraps(orig)
    def get_batch(data_iterator, keys, *a, **kw):
        sess = _S.session
        if sess is None:
            return orig(data_iterator, keys, *a, **kw)
        indices = _upcoming_sample_indices(data_iterator)
        batch = orig(data_iterator, keys, *a, **kw)
        # Started once the batch is built: its packing ops are not the model's.
        _begin_micro_batch(sess, indices)
        sess.loss_masks = batch.get("loss_masks") if isinstance(batch, dict) else None
        return batch
    return get_batch


#: Modules that call slime's get_log_probs_and_entropy by a name of their own: the actor's compute_log_prob
#: (the log-prob pass) and loss.py's policy_loss_function (the train step).
LOG_PROB_MODULES = ("slime.backends.megatron_utils.loss", "slime.backends.megatron_utils.actor")


@_guard
def _patch_log_probs() -> None:
    """Wrap ``get_log_probs_and_entropy`` where slime calls it: the per-sample log-probs it returns for a traced
    micro-batch are recorded as the trainer's used log-probs (:mod:`.used_logprobs`); its result is returned
    untouched."""
    if "log_probs" in _PATCHED:
        return
    for name in LOG_PROB_MODULES:
        wrap_once(importlib.import_module(name), "get_log_probs_and_entropy", _recording_log_probs)
    _PATCHED.add("log_probs")


def _recording_log_probs(orig):
    @functools.wraps(orig)
    def get_log_probs_and_entropy(logits, *a, **kw):
        res = orig(logits, *a, **kw)
        sess = _S.session
        if sess is not None and sess.keys is not None:
            _record_log_probs(sess, kw, res)
        return res
    return get_log_probs_and_entropy


@_guard
def _record_log_probs(sess: _Session, kw: dict, res) -> None:
    from tic_trace.integrations.slime.used_logprobs import record_trainer
    record_trainer(sess.args, sess.out_dir, sess.phase, sess.keys, kw, res, sess.loss_masks)


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

