"""Capturing one recorded value: a pytree of outputs flattened into tensors (odd tensors recorded in another form,
or named), one `Record` each with its statistics slot (shared with an alias), and, in `full`/`rows` modes, the
stored value (all rows, the pass's selected rows, or the rows `set_record_rows` named) through the bounded host
copy."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import MappingKey, keystr, tree_flatten_with_path

from ..store.dtypes import torch_dtype_name
from ..store.format import Record
from ..store.writer import PassWriter
from .host_copy import as_storage
from .odd_tensors import recordable


def _flatten_with_path(value: Any) -> list:
    """`tree_flatten_with_path`'s leaves, also for a mapping registered as a pytree node without key paths:
    transformers 5.12 registers every `ModelOutput` so (no `flatten_with_keys_fn`, a ValueError here), which
    would silently drop a model's whole output (`<root>:out['logits']`); its entries get the names a dict's
    would, as they have under transformers 5.24."""
    try:
        return tree_flatten_with_path(value)[0]
    except ValueError:
        if not isinstance(value, Mapping):
            raise
        return [((MappingKey(k),) + tuple(p), v) for k, sub in value.items() for p, v in _flatten_with_path(sub)]


@dataclass
class _Pending:
    record: Record
    stat_slot: int | None = None
    bytes_of: "_Pending | None" = None   # a full record of the same tensor whose stored bytes this one shares


class TensorCapture:
    """How `Tracer` records one value (a mixin: the state lives on the tracer)."""

    def _capture_tree(self, base: str, path: str, kind: str, op: str | None, call: int, value: Any, mode: str,
                      ops_in_region: int | None = None, depth: int = 0) -> None:
        if isinstance(value, torch.Tensor):
            leaves = [("", value)]
        else:
            try:
                flat = _flatten_with_path(value)
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


def _as_storage(x: torch.Tensor, storage: str | None = None) -> np.ndarray:
    return as_storage(x)
