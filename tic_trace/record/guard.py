"""How every tracer entry point runs: `_guarded` is the one place that marks the tracer busy and the thread as
inside tracer code (so the ops the tracer runs itself are not recorded, also by another active tracer),
catches an exception inside the tracer (logged once, tracing disabled, never reaching the model's forward) and
notes the calls of another thread that arrive while it is busy."""
from __future__ import annotations

import logging
import threading
import traceback

log = logging.getLogger("tic_trace")


# Depth of tracer-internal code on this thread, over all tracers: the ops one tracer runs itself (statistics,
# copies, pass bookkeeping) are not the model's, also for another tracer active at the same time.
_INTERNAL = threading.local()


# One tracer records one thread at a time (its frames and pass state are not per thread). Module calls and
# ops of a thread that arrive while another thread is inside the tracer are skipped, and said.
CONCURRENT_THREADS_NOTE = ("module calls or ops of one thread ran while the tracer was recording another "
                           "thread's: those were not recorded (the model runs modules on several threads at "
                           "once); trace it with its modules on one thread")


class GuardedEntry:
    """The guard and the failure path of `Tracer` (a mixin: the state lives on the tracer)."""

    def _guarded(self, fn, *args) -> None:
        if not self._live:
            return
        if self._busy:
            if not getattr(_INTERNAL, "depth", 0):     # busy on another thread: this call goes unrecorded
                self._notes.add(CONCURRENT_THREADS_NOTE)
            return
        self._busy = True
        depth = getattr(_INTERNAL, "depth", 0)
        _INTERNAL.depth = depth + 1
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        finally:
            self._busy = False
            _INTERNAL.depth = depth

    def _discard_host_copies(self) -> None:
        """Let the writer thread finish what is queued (it may still write into the pass) before the pass
        is aborted; its error, if any, is the one already being handled."""
        try:
            self._stager.drain()
        except Exception:  # noqa: BLE001
            pass

    def _fail(self, e: BaseException) -> None:
        if self.failed is None:
            self.failed = e
            log.warning("tic-trace: tracing disabled after an internal error (the model's forward is unaffected; "
                        "passes already written stay readable): %s: %s\n%s", type(e).__name__, e,
                        "".join(traceback.format_exception(type(e), e, e.__traceback__, limit=4)))
        self._live = False
        self._discard_host_copies()
        lost = None
        if self._pass is not None:
            lost = self._pass.index
            try:
                self._pass.abort()
            except Exception:  # noqa: BLE001
                pass
            self._pass = None
        self._clear_pass_records()
        self._run_ended_early(e, lost)
