"""The tracer: a dispatch mode for every operator plus module hooks for boundaries and outputs.

Shape borrowed from torch's FlopCounterMode: the public `Tracer` is a plain context manager that composes a
private `TorchDispatchMode` and a module-scope tracker. Every public entry point is guarded: an exception
inside the tracer is logged once, disables tracing, and never reaches the model's forward.

`Tracer` is this module's class (its state and public API) over one mixin per job: `guard.GuardedEntry` (the
entry guard and failure), `modules.ModuleHooks` (module and function hooks), `dispatch.OpRecording` (the
dispatch mode's ops), `capture.TensorCapture` (one recorded value) and `passes.PassLifecycle` (passes, run and
manifest).
"""
from __future__ import annotations

import contextlib
import os
import re
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from ..store.writer import PassWriter, TraceDirectoryInUse, TraceWriter, claim_run_directory
from .alias import AliasCache
from .capture import TensorCapture, _Pending
from .dispatch import OpRecording, _DispatchRecorder
from .filters import MODES, Filters
from .guard import GuardedEntry
from .host_copy import DEFAULT_CAP_BYTES, HostStager
from .modules import ModuleHooks, _Frame
from .passes import PassLifecycle, new_run_id
from ..graph.row_subset import RowSubset
from .stat_slots import StatSlots
from .weights import ParameterHasher


class Tracer(GuardedEntry, ModuleHooks, OpRecording, TensorCapture, PassLifecycle):
    """Records named tensors of a model's forward into a trace directory. See `trace()`."""

    def __init__(self, model: torch.nn.Module | Sequence[torch.nn.Module], out_dir: os.PathLike | str, *,
                 adapter: Any = None, mode: str = "stats", points_mode: str | None = None,
                 filters: Filters | None = None, rank: int | None = None, record_views: bool = False,
                 record_inputs: Iterable[str] | None = None, skip_recompute: bool = True,
                 auto_step: bool = False, sample_rows: Sequence[int] | None = None,
                 sample_keys: Sequence[str] | None = None, tag: str | None = None, manifest: dict | None = None,
                 run: str | None = None, pinned_cap_bytes: int = DEFAULT_CAP_BYTES, on_cap: str = "wait",
                 reuse_aliases: bool = True, durable: bool = False, row_subset: RowSubset | None = None):
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
        # rows mode: of the sample rows, only those whose (key, position) the subset keeps (row_subset.py)
        self.row_subset = row_subset
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
        self._post_hook_ids: dict[int, int] = {}    # id(module) -> our forward hook's id (kept last)
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
        self._standing_notes: set[str] = set()    # said in every pass (a torch.compile'd module)
        self._blind: list[str] = []
        self.passes_written: list[Path] = []
        self._paths: dict[int, str] = {}
        self._activity = False
        self._incomplete: str | None = None   # why the open pass is not a whole forward
        self._run_incomplete: dict | None = None   # why the run ended early (a failure), in rank.msgpack
        self._forwards_not_recorded = 0       # root forwards after that failure
        self._start_thread = threading.get_ident()
        # Bit-exact hashes of every parameter, in each pass's metadata (changed ones re-hashed only).
        self.hash_weights = True
        self._param_hasher = ParameterHasher(self.adapter)

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
        self._start_thread = threading.get_ident()    # taps outside any module call: this thread's
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
        self._write_run_incomplete()  # a failed run: the final count of forwards it did not record

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
            sel = self._selected_rows()
            if sel is not None:
                self._row_select = torch.tensor(sel, dtype=torch.long)
                self._row_select_list = sel
                self._row_select_dev = {}
            else:
                self._row_select = None
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def _selected_rows(self) -> list[int] | None:
        """The rows of the current pass whose values `rows` mode stores: `sample_rows` that are rows of the table,
        and, with a `row_subset`, only those it keeps (None where the pass then stores no row: statistics only)."""
        if self.sample_rows is None:
            return None
        sel = [i for i in self.sample_rows if 0 <= i < self._n_rows]
        if self.row_subset is None:
            return sel
        keys, positions = self._rows["keys"], self._rows["positions"]
        sel = [i for i in sel if self.row_subset.keeps(keys[i], positions[i])]
        return sel or None

    def __enter__(self) -> "Tracer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


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
    (`tic_trace.store.writer.wait_for_disk()` waits for all of them).
    """
    return Tracer(model, out_dir, adapter=adapter, mode=mode, points_mode=points_mode, filters=filters, **kwargs)
