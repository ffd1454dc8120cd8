"""Bit-exact hashes of the parameters behind each traced module, so a report can say "side B's weights at
L3.attn.q differ from side A's / from the checkpoint" (the weight-sync bug: the weights pushed to the engine
after a training step are not the trainer's).

`ParameterHasher` hashes every parameter once (stats.device_hash, all hashes fetched in one host sync) and
again only when the parameter's storage or in-place version counter changed, so hashing per pass costs
almost nothing after the first. Read side: `weight_hashes_by_point` groups a trace's recorded hashes by the
canonical point whose module owns them, through the adapter's table.
"""
from __future__ import annotations

import threading
from typing import Any

import torch

from .stats import device_hash


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

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, int, str, int]] = {}   # name -> (data_ptr, version, dtype, hash)
        self._emitted = False
        self._background: tuple[threading.Thread, dict] | None = None

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
        before = set(k for k, _ in self._todo(params))
        self._join(params)
        todo = self._todo(params)
        if todo:
            with torch.no_grad():
                hs = torch.stack([device_hash(p.detach()).cpu() for _, p in todo]).tolist()
            for (k, p), h in zip(todo, hs):
                self._seen[k] = (*_state(p), int(h))
        keys = params if not self._emitted else [k for k in params if k in before]
        self._emitted = True
        if not keys:
            return None
        return {k: [self._seen[k][3], self._seen[k][2].removeprefix("torch."), list(params[k].shape)] for k in keys}


def weight_hashes_by_point(view: Any) -> dict[tuple[str, int | None], dict[str, list]]:
    """{(point, layer): {parameter name: [hash, dtype, shape]}} from the first pass of rank 0 that recorded
    weights (the full map; later passes hold only parameters changed since). A parameter belongs to the
    point whose record its module writes (`module:out`)."""
    adapter, config = view.adapter, view.config
    compiled = [(pm, pm.regex()) for pm in adapter.points if adapter.applies(pm, config)]
    info = view.trace.rank_info(view.trace.ranks[0]) if view.trace.ranks else {}
    out: dict[tuple[str, int | None], dict[str, list]] = {}
    for rank in view.trace.ranks[:1]:
        for pidx in view.trace.pass_indices(rank):
            weights = view._pass(rank, pidx).meta.get("weights")
            if not isinstance(weights, dict):
                continue
            for name, val in weights.items():
                key = _point_of(name.rsplit(".", 1)[0], compiled, adapter, info, config)
                if key is not None:
                    out.setdefault(key, {})[name] = val
            return out
    return out


def _point_of(module: str, compiled, adapter, info: dict, config: dict) -> tuple[str, int | None] | None:
    for suffix in (":out", ":out[0]"):
        for pm, rx in compiled:
            m = rx.match(module + suffix)
            if m is None:
                continue
            layer = None
            if "layer" in rx.groupindex and m.group("layer") is not None:
                layer = adapter.global_layer(int(m.group("layer")), info, config)
            return pm.point, layer
    return None
