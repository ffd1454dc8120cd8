"""Bit-exact hashes of the parameters behind each traced module, so a report can say "side B's weights at
L3.attn.q differ from side A's / from the checkpoint" (the weight-sync bug: the weights pushed to the engine
after a training step are not the trainer's).

`ParameterHasher` hashes every parameter once (stats.device_hash, all hashes fetched in one host sync) and
again only when the parameter's storage or in-place version counter changed, so hashing per pass costs
almost nothing after the first. Read side (numpy only): `view.weight_map.weight_hashes_by_point` groups a trace's
recorded hashes by the canonical point whose module owns them, through the adapter's table.
"""
from __future__ import annotations

import threading
from typing import Any

import torch

from .stats import device_hash
from .weight_pieces import hash_pieces


_State = tuple[int, int, str]   # (data_ptr, in-place version, dtype): a parameter unchanged while it holds


def _state(p: torch.Tensor) -> _State:
    return p.data_ptr(), p._version, str(p.dtype)


class ParameterHasher:
    """Called once per pass. The first call returns every parameter's hash; later calls only those whose
    storage, dtype or in-place version changed since (None when nothing did), so a long decode loop does
    not repeat the whole map in every pass's index.

    `begin` (at a pass's first record) hashes the CPU parameters that need it on a background thread while the
    forward runs (the numba kernel releases the GIL: on a spare core this takes the hashing off the forward's
    wall time); the call at the pass's end joins it and keeps only hashes whose parameter still has the state
    it had when read. Accelerator parameters are hashed at the pass's end, on the caller's stream, as before."""

    def __init__(self, adapter: Any = None) -> None:
        self._seen: dict[str, tuple[int, int, str, int]] = {}   # name -> (data_ptr, version, dtype, hash)
        self._emitted = False
        self._background: tuple[threading.Thread, dict] | None = None
        self._adapter = adapter
        self._plan: dict[str, list] | None = None     # name -> its WeightPieces (the adapter's map, asked once)
        self.pieces: dict[str, list] | None = None    # the last call's: name -> hash_pieces(...) ([]: not mapped)
        self.plan_error: str | None = None

    @staticmethod
    def _params(models: list) -> dict[str, torch.Tensor]:
        params: dict[str, torch.Tensor] = {}
        for i, model in enumerate(models):
            for name, p in model.named_parameters():
                params[name if i == 0 else f"{i}:{name}"] = p
        return params

    def _todo(self, params: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        return [(k, p) for k, p in params.items() if self._seen.get(k, (None,))[:3] != _state(p)]

    def begin(self, models: list) -> None:
        """Start hashing the CPU parameters that changed (all, the first time) on a background thread."""
        if self._background is not None:
            return
        # States read here, on the caller's thread: a tensor made under a dispatch mode (a `detach` in the
        # tracer's own) may not share the parameter's version counter.
        todo = [(k, p, _state(p)) for k, p in self._todo(self._params(models)) if p.device.type == "cpu"]
        if not todo:
            return
        result: dict = {}

        def work() -> None:
            try:
                with torch.no_grad():
                    for k, p, st in todo:
                        result[k] = (st, int(device_hash(p)))
            except BaseException as e:  # noqa: BLE001 - handed to the caller at the join
                result["__error__"] = e

        thread = threading.Thread(target=work, name="tic-trace-weights", daemon=True)
        thread.start()
        self._background = (thread, result)

    def _join(self, params: dict[str, torch.Tensor]) -> None:
        if self._background is None:
            return
        thread, result = self._background
        self._background = None
        thread.join()
        err = result.pop("__error__", None)
        if err is not None:
            raise err
        for k, (st, h) in result.items():
            p = params.get(k)
            if p is not None and _state(p) == st:       # unchanged since it was read
                self._seen[k] = (*st, h)

    def __call__(self, models: list) -> dict[str, list] | None:
        """{parameter name: [hash, dtype, shape]} (first model's names unprefixed; further models' as
        `i:name`)."""
        params = self._params(models)
        changed = self._todo(params)      # since the last call: what this pass reports
        self._join(params)
        todo = self._todo(dict(changed))  # of those, what the background thread did not hash
        if todo:
            with torch.no_grad():
                hs = torch.stack([device_hash(p.detach()).cpu() for _, p in todo]).tolist()
            for (k, p), h in zip(todo, hs):
                self._seen[k] = (*_state(p), int(h))
        keys = params if not self._emitted else [k for k, _ in changed]
        self._emitted = True
        self.pieces = self._hash_pieces(models, params, keys) if keys else None
        if not keys:
            return None
        return {k: [self._seen[k][3], self._seen[k][2].removeprefix("torch."), list(params[k].shape)] for k in keys}

    def _hash_pieces(self, models: list, params: dict[str, torch.Tensor], keys) -> dict[str, list] | None:
        """{name: hash_pieces of its checkpoint-layout pieces} for `keys` ([] where the adapter maps none),
        None when the adapter declares no map. A parameter that is its piece whole reuses its own hash."""
        if self._plan is None:
            plan_of = getattr(self._adapter, "weight_pieces", None)
            if not callable(plan_of):
                return None
            try:
                plan = plan_of(models, params)
            except Exception as e:  # noqa: BLE001 - the map is lost, the whole-parameter hashes are not
                self.plan_error = f"{type(e).__name__}: {e}"
                self._adapter = None
                return None
            if plan is None:               # an adapter that declares no map: whole-parameter hashes only
                self._adapter = None
                return None
            self._plan = dict(plan)
        out: dict[str, list] = {}
        for k in keys:
            pieces, p = self._plan.get(k) or [], params[k]
            try:
                # a parameter that is its checkpoint tensor whole: its own hash is already known
                out[k] = hash_pieces(p, pieces, own=self._seen[k][3]) if pieces else []
            except Exception as e:  # noqa: BLE001 - a map that does not fit this parameter: not mapped
                self.plan_error = f"{k}: {type(e).__name__}: {e}"
                out[k] = []
        return out
