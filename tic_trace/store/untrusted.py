"""Reading files a user or an attacker may hand us: bounded reads and what a path that is no regular file is.
Shared by the trace reader and the reference checkpoint's reader."""
from __future__ import annotations

import os
import stat


def read_upto(fd: int, n: int, chunk: int) -> bytes:
    """At most `n` bytes from `fd`, read `chunk` bytes at a time (the callers ask one byte over their limit, so a
    file that grows while read is seen)."""
    chunks, left = [], n
    while left > 0:
        b = os.read(fd, min(left, chunk))
        if not b:
            break
        chunks.append(b)
        left -= len(b)
    return b"".join(chunks)


def file_kind(mode: int) -> str:
    """What a path that is not a regular file is, in words."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a plain file"
