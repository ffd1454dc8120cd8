"""tic-trace: find the first operator where two frameworks stop computing the same thing."""

from .record.version import __version__  # noqa: E402
from .record.filters import Filters  # noqa: E402
from .store.format import Trace, TraceFormatError, open_trace  # noqa: E402
from .store.writer import TraceDirectoryInUse  # noqa: E402

__all__ = ["Filters", "Trace", "TraceDirectoryInUse", "TraceFormatError", "Tracer", "open_trace", "trace", "__version__"]


def __getattr__(name: str):
    # The tracer (and torch) load on first use: reading and comparing traces need numpy only, so the
    # comparator's worker processes start in a fraction of a second.
    if name in ("Tracer", "trace"):
        from .record import tracer
        return getattr(tracer, name)
    raise AttributeError(f"module 'tic_trace' has no attribute {name!r}")
