"""The oldest slime the integration works with, checked by what slime's code has rather than by a version string
(slime is usually run from a checkout on PYTHONPATH, without package metadata).

* The Megatron side needs ``MegatronTrainRayActor.train_actor`` (first in slime v0.2.0: the rollout id being
  trained is read from it) and a ``DataIterator`` whose ``micro_batch_indices`` is always set (v0.3.0;
  before, it was ``None`` without dynamic batching and no micro-batch could be named: nothing would be
  traced, silently).
* The rollout side needs ``slime.rollout.sample_hooks.set_current_rollout_id`` (v0.3.1), which
  ``RolloutManager.generate`` calls with the rollout being generated.
"""
from __future__ import annotations

import importlib
import inspect

MIN_SLIME = "v0.3.1"
MIN_SLIME_MEGATRON_SIDE = "v0.3.0"


class UnsupportedSlime(RuntimeError):
    """The installed slime is older than the integration supports."""


def _refuse(what: str, need: str) -> None:
    raise UnsupportedSlime(f"tic-trace --tic-trace needs slime {need} or newer: this slime has no {what}. "
                           f"Update slime (git pull in its checkout), or run without --tic-trace.")


def check_megatron_side() -> None:
    """Raise :class:`UnsupportedSlime` unless the train side of slime is v0.3.0 or newer."""
    actor = importlib.import_module("slime.backends.megatron_utils.actor").MegatronTrainRayActor
    if not callable(getattr(actor, "train_actor", None)):
        _refuse("MegatronTrainRayActor.train_actor (added in v0.2.0)", MIN_SLIME_MEGATRON_SIDE)
    data_iterator = importlib.import_module("slime.backends.megatron_utils.data").DataIterator
    try:
        param = inspect.signature(data_iterator.__init__).parameters.get("micro_batch_indices")
    except (TypeError, ValueError):
        param = None
    if param is None or param.default is not inspect.Parameter.empty:
        _refuse("DataIterator(rollout_data, micro_batch_indices) with the indices always set (v0.3.0)",
                MIN_SLIME_MEGATRON_SIDE)


def check_rollout_side() -> None:
    """Raise :class:`UnsupportedSlime` unless the rollout side of slime is v0.3.1 or newer."""
    try:
        hooks = importlib.import_module("slime.rollout.sample_hooks")
    except ImportError:
        hooks = None
    if not callable(getattr(hooks, "set_current_rollout_id", None)):
        _refuse("slime.rollout.sample_hooks.set_current_rollout_id (added in v0.3.1)", MIN_SLIME)
