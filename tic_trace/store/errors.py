"""The reader's one exception type (kept apart from format.py so the schema can raise it too)."""
from __future__ import annotations

import os


class TraceFormatError(Exception):
    """A trace file is missing, truncated, corrupted, hostile or of an unsupported version."""

    def __init__(self, path: os.PathLike | str, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")
