"""tic-trace: find the first operator where two frameworks stop computing the same thing."""
__version__ = "0.1.0"

from .filters import Filters  # noqa: E402
from .format import Trace, TraceDirectoryInUse, TraceFormatError, open_trace  # noqa: E402
from .tracer import Tracer, trace  # noqa: E402

__all__ = ["Filters", "Trace", "TraceDirectoryInUse", "TraceFormatError", "Tracer", "open_trace", "trace", "__version__"]
