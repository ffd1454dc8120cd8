"""The trace on disk: the framed file format and its reader (`format`), the writer (`writer`), the typed schema
every decoded document is checked against (`schema`), how dtypes are stored as bytes (`dtypes`) and the
reader's one exception (`errors`).

numpy and msgpack only, never torch. Both flows rest on it: the record flow writes traces, the answer flow reads
them.

May import: nothing of tic_trace.
"""
