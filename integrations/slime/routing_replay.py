"""Routing replay (R3): record the rollout's routed experts of the traced samples where slime hands them to Megatron.

With ``--use-rollout-routing-replay``, slime asks SGLang for ``return_routed_experts``, decodes
``meta_info["routed_experts"]`` into ``Sample.rollout_routed_experts`` (int32 ``[tokens - 1, layers, topk]``, SGLang's
slot order), ships it to the train actors in ``rollout_data["rollout_routed_experts"]`` (one per sample, beside
``rollout_data["sample_indices"]``) and ``MegatronTrainRayActor.train_actor`` calls ``fill_routing_replay`` to hand
them to the routers before the log-prob pass (then deletes them). :func:`install` wraps ``fill_routing_replay``:
before it runs, the ids of the traced samples of a traced rollout are written to
``{rollout_dir}/routing_replay/rank{R}.routed_experts.msgpack`` (``tic_trace.store.routed_experts``), which
``tic_trace.compare.routing_replay`` checks against the trainer's trace (the ids its routers applied).

These are exactly the ids the engine returned: recording them on the train side needs no request change and names
each sample by the index the Megatron trace uses. Never raises into training.
"""
from __future__ import annotations

import functools
import importlib
from typing import Any, Callable

from tic_trace.integrations.slime.budget import ROUTING_REPLAY as SUBDIR   # the disk budget prunes it
from tic_trace.integrations.slime.config import (
    enabled, mode_for, rollout_dir, sample_key, selected, traced, warn_once, wrap_once,
)

_INSTALLED: set[str] = set()


def routed_experts_path(base, rollout_id: int, rank: int):
    """Where train rank `rank` writes rollout `rollout_id`'s routed experts."""
    return rollout_dir(base, rollout_id) / SUBDIR / f"rank{int(rank):05d}.routed_experts.msgpack"


def record_rollout_routed_experts(args: Any, rollout_id: int, rollout_data: dict, rank: int = 0) -> int:
    """Write the routed experts of the traced samples in `rollout_data` (this DP rank's share); returns how many
    samples were written (0: R3 off, rollout not traced, or none of its samples traced)."""
    if not enabled(args) or not traced(args, rollout_id) or mode_for(args, rollout_id) == "stats":
        return 0        # a statistics-only trace holds no expert ids to check them against
    experts, indices = rollout_data.get("rollout_routed_experts"), rollout_data.get("sample_indices")
    if experts is None or indices is None:
        return 0
    import numpy as np

    from tic_trace.store.routed_experts import RoutedExperts, write_routed_experts
    samples = {}
    for idx, ids in zip(indices, experts):
        if selected(args, int(idx)):
            a = ids.detach().cpu().numpy() if hasattr(ids, "detach") else np.asarray(ids)
            samples[sample_key(rollout_id, int(idx))] = a.astype(np.int32, copy=False)
    if not samples:
        return 0
    src = "slime rollout_data['rollout_routed_experts'] (SGLang meta_info.routed_experts), at fill_routing_replay"
    write_routed_experts(routed_experts_path(args.tic_trace_dir, rollout_id, rank),
                         RoutedExperts(int(rollout_id), src, samples))
    return len(samples)


def install() -> None:
    """Wrap ``MegatronTrainRayActor.fill_routing_replay(self, data_iterator, num_microbatches, rollout_data)``
    (once per process). A slime without it (no R3) is left alone."""
    if "fill" in _INSTALLED:
        return
    try:
        cls = importlib.import_module("slime.backends.megatron_utils.actor").MegatronTrainRayActor
    except Exception as e:  # noqa: BLE001 - tracing never stops training
        warn_once("r3-import", f"tic-trace: routing replay not recorded: {type(e).__name__}: {e}")
        return
    wrap_once(cls, "fill_routing_replay", _wrap)
    _INSTALLED.add("fill")


def _wrap(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def fill_routing_replay(self, data_iterator, num_microbatches, rollout_data, *a, **kw):
        _record_guarded(getattr(self, "args", None), rollout_data)
        return orig(self, data_iterator, num_microbatches, rollout_data, *a, **kw)
    return fill_routing_replay


def _record_guarded(args: Any, rollout_data: Any) -> None:
    try:
        # train_actor calls fill_routing_replay; its wrapper (megatron_hooks) has published the rollout id
        from tic_trace.integrations.slime.megatron_hooks import current_rollout_id
        rid = current_rollout_id()
        if args is None or rid is None or not isinstance(rollout_data, dict):
            return
        import torch
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        record_rollout_routed_experts(args, rid, rollout_data, rank)
    except Exception as e:  # noqa: BLE001 - never break training over tracing
        warn_once("r3-record", f"tic-trace: routed experts not recorded: {type(e).__name__}: {e}")
