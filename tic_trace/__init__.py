"""tic-trace: find the first operator where two frameworks stop computing the same thing.

The public API (docs/api.md), one name each for the two flows and what joins them:

    trace, Tracer        record a forward into a trace directory (record/)
    open_trace, Trace    read a trace (store/)
    find_divergence      compare two traces: the first op where they diverge (compare/)
    Report               what find_divergence returns, and what the renderers display (report/)

plus `Filters` (what to record), `TraceFormatError`, `TraceDirectoryInUse` and `__version__`. The layout of the
package is docs/architecture.md.
"""
import importlib as _importlib

from .record.filters import Filters
from .record.version import __version__
from .store.format import Trace, TraceFormatError, open_trace
from .store.writer import TraceDirectoryInUse

__all__ = ["Filters", "Report", "Trace", "TraceDirectoryInUse", "TraceFormatError", "Tracer", "find_divergence",
           "open_trace", "trace", "__version__"]

# Loaded on first use: the tracer imports torch, and reading and comparing traces need numpy only, so the
# comparator's worker processes start in a fraction of a second; the finder and the report type load with it.
# Looked up at every access (never cached here): a test that patches the defining module is seen.
_LAZY = {"Tracer": "record.tracer", "trace": "record.tracer", "find_divergence": "compare.diverge",
         "Report": "report.schema"}


def __getattr__(name: str):
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'tic_trace' has no attribute {name!r}")
    return getattr(_importlib.import_module(f"{__name__}.{where}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
