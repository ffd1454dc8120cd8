"""The version of tic-trace, written into every manifest the tracer writes (`versions.tic_trace`);
`tic_trace.__version__` is this value."""
__version__ = "0.1.0"
