"""The pass and run lifecycle: the run id, the manifest and rank facts written when the trace starts, a pass
opened at its first record, and closed with the one host sync of the pass (statistics and hashes fetched
together, host copies drained, parameter hashes and notes in its metadata) before the next begins."""
from __future__ import annotations

import os
import platform
import socket
import sys
import time

import numpy as np
import torch

from ..store.writer import PassWriter
from .stats import stats_dict
from .version import __version__


class PassLifecycle:
    """Passes and the run's metadata for `Tracer` (a mixin: the state lives on the tracer)."""

    def _manifest(self) -> dict:
        versions = {"tic_trace": __version__, "torch": torch.__version__, "python": platform.python_version(),
                    "numpy": np.__version__}
        for mod in ("transformers", "megatron.core", "sglang"):
            m = sys.modules.get(mod)
            if m is not None and getattr(m, "__version__", None):
                versions[mod] = str(m.__version__)
        m = {"framework": self.adapter.name if self.adapter is not None else "torch", "versions": versions,
             "created": time.time(),
             "tracer": {"mode": self.mode, "points_mode": self.points_mode, "record_views": self.record_views,
                        "skip_recompute": self.skip_recompute, "sample_rows": self.sample_rows}}
        if getattr(self, "row_subset", None) is not None:
            m["tracer"]["row_subset"] = self.row_subset.describe()
        if self.adapter is not None:
            m["model"] = self.adapter.describe(self.models)
            m["parallel"] = self.adapter.parallel_layout()
            m["numerics"] = self.adapter.numerics(self.models)
        m.update(self.extra_manifest)
        return m

    def _rank_info(self) -> dict:
        dist = torch.distributed
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        info = {"world_size": world, "hostname": socket.gethostname(), "pid": os.getpid()}
        if self.adapter is not None:
            info["coords"] = self.adapter.rank_coords()
        return info

    def _open_pass(self) -> PassWriter:
        if self._pass is None:
            if self._writer is None:
                raise RuntimeError("tracer not started")
            self._pass = self._writer.begin_pass({}, self.durable)
            self._pass_index = self._pass.index
            self._begin_weights()
        return self._pass

    def _begin_weights(self) -> None:
        """Parameter hashes of CPU weights start now, beside the forward (weights.ParameterHasher.begin)."""
        if self.hash_weights:
            try:
                self._param_hasher.begin(self.models)
            except Exception as e:  # noqa: BLE001 - the pass's end hashes them instead
                self._notes.add(f"parameter hashes not started beside the forward: {type(e).__name__}: {e}")

    def _weights_meta(self) -> dict | None:
        """Parameter hashes for this pass's metadata; a failure here only loses them (noted once)."""
        if not self.hash_weights:
            return None
        try:
            weights = self._param_hasher(self.models)
            if self._param_hasher.plan_error:
                self._notes.add(f"parameter hashes in the checkpoint's layout not recorded (the adapter's weight "
                                f"map failed: {self._param_hasher.plan_error})")
            return weights
        except Exception as e:  # noqa: BLE001 - never break the user's run over a diagnostic
            self._notes.add(f"parameter hashes not recorded: {type(e).__name__}: {e}")
            self.hash_weights = False
            return None

    def _end_pass(self) -> None:
        pw = self._pass
        incomplete = self._incomplete
        if incomplete is None and self._stack:
            incomplete = f"the pass ended while {self._stack[0].path} was still running"
        self._incomplete = None
        self._stack.clear()
        self._calls.clear()
        if pw is None:
            self._rows = None
            self._record_rows = []
            if self._activity:
                self._pass_count += 1
            self._activity = False
            return
        # The one host sync of the pass: all statistics and hashes come over together.
        stats_np, hashes_np = self._stats.fetch()
        self._stager.drain()    # every queued host copy is in the blob (the writer's error, if any, raised)
        for p in self._pending:
            if p.stat_slot is not None:
                p.record.stats = stats_dict(stats_np[p.stat_slot])
                p.record.hash = int(hashes_np[p.stat_slot])
            if p.bytes_of is not None:
                src, rec = p.bytes_of.record, p.record
                rec.offset, rec.nbytes, rec.crc = src.offset, src.nbytes, src.crc
                if not src.has_data:     # the stored copy was degraded at the cap: so is this record
                    rec.mode = "stats"
                    self._stager.degraded.append(rec.name)
        self._notes.update(self._stager.take_notes())
        self._notes.update(self._standing_notes)
        weights = self._weights_meta()
        pw.meta.update(tag=self.tag, rows=self._rows, rank=self.rank, pass_number=self._pass_count,
                       blind_regions=sorted(set(self._blind))[:2000], notes=sorted(self._notes), weights=weights,
                       weight_pieces=self._param_hasher.pieces if weights is not None else None)
        self.passes_written.append(pw.close(incomplete=incomplete))
        self._pass = None
        self._clear_pass_records()
        if self._alias is not None:
            self._alias.clear()
        self._blind.clear()
        self._notes.clear()
        self._rows = None
        self._row_select = None
        self._record_rows = []
        self._n_rows = None
        self._seq = 0
        self._pass_count += 1
        self._activity = False

    def write_row_table(self, keys: list, positions: list, tokens: list | None = None) -> None:
        """Write one pass that holds only the names of its rows (`set_rows`' arguments) and no record: a forward
        that ran untraced because the row subset keeps none of its rows (the SGLang hook, for a decode step of
        a periodic `subset` rollout). The row table is what the row identity check needs (the sides name the
        same rows, with the same tokens); statistics of rows no one compares are not worth their bytes. Call
        between passes (the tracer paused or idle); a failure disables tracing, as any other."""
        try:
            if self._writer is None or self.failed is not None or self._pass is not None or self._busy:
                return
            if not self.filters.want_pass(self._pass_count):
                self._pass_count += 1
                return
            self.set_rows(keys, positions, tokens)
            if self.failed is not None:
                return
            pw = self._writer.begin_pass({}, self.durable)
            try:
                pw.meta.update(tag=self.tag, rows=self._rows, rank=self.rank, pass_number=self._pass_count,
                               blind_regions=[], notes=[], weights=None, rows_only=True)
                self.passes_written.append(pw.close())
            except BaseException:
                pw.abort()
                raise
        except Exception as e:  # noqa: BLE001 - never into the engine's loop
            self._fail(e)
        finally:
            self._rows = None
            self._row_select = None
            self._n_rows = None
        if self.failed is None:
            self._pass_count += 1

    def _run_ended_early(self, e: BaseException, lost_pass: int | None) -> None:
        """The tracer failed and records nothing more: say so in `rank.msgpack` (`TraceWriter.mark_incomplete`),
        so that no reader takes the passes written before the failure for the whole run (docs/security.md)."""
        if self._writer is None:
            return
        if self._run_incomplete is None:
            what = "a write to the trace failed" if isinstance(e, OSError) else "the tracer's own code failed"
            self._run_incomplete = {"reason": f"{what}: {type(e).__name__}: {e}"[:4000], "lost_pass": lost_pass}
        self._write_run_incomplete()

    def _write_run_incomplete(self) -> None:
        """(Re)write the incomplete-run facts with the counts so far; best effort, never raises."""
        if self._run_incomplete is None or self._writer is None:
            return
        info = {**self._run_incomplete, "passes_written": len(self.passes_written),
                "forwards_not_recorded": self._forwards_not_recorded}
        try:
            self._writer.mark_incomplete(info)
        except Exception:  # noqa: BLE001 - the reader still sees a rank file that says incomplete, or none
            pass

    def _clear_pass_records(self) -> None:
        """Forget what the pass being closed or abandoned recorded: its records, statistics and stored bytes."""
        self._pending.clear()
        self._stats.clear()
        self._stored_full.clear()


def new_run_id() -> str:
    """A run id no other tracer has: host, process, time and 48 random bits."""
    return f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}-{os.urandom(6).hex()}"
