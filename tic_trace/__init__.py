"""tic-trace: find the first operator where two frameworks stop computing the same thing."""
__version__ = "0.1.0"

from .filters import Filters  # noqa: E402
from .format import Trace, TraceFormatError, open_trace  # noqa: E402
from .tracer import Tracer, trace  # noqa: E402

__all__ = ["Filters", "Trace", "TraceFormatError", "Tracer", "open_trace", "trace", "__version__"]
