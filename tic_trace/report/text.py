"""Strings from a trace (or a saved report) are text, never markup or terminal control.

Record names, module paths, sample keys, tags, notes and file paths come from other people's files. Printed
through rich as they are, `[/]` raises a MarkupError, `[link=...]` becomes a live link, `[abc]` vanishes, and an
ANSI escape clears the screen or retitles the window. Every renderer passes such strings through this module:

    visible(s)     control characters (C0, DEL, C1, bidi/zero-width formatting, line separators) as escapes
    text(s)        a rich Text of `visible(s)`: never parsed for markup or emoji codes
    error_line(m)  "error: m" as one line of Text

Never interpolate such a string into a markup string (`f"[bold]{name}[/]"`): build a Text (`Text.assemble`).
"""
from __future__ import annotations

import unicodedata
from typing import Any

from rich.text import Text

# Categories a terminal or a reader's eye acts on instead of showing: controls (Cc), format characters such as
# bidi overrides and zero-width joiners (Cf), line/paragraph separators (Zl/Zp), unassigned and surrogates.
_HIDDEN = {"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"}


def _escape_char(c: str) -> str:
    o = ord(c)
    if o < 0x100:
        return f"\\x{o:02x}"
    return f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def visible(s: Any, limit: int | None = None, keep: str = "") -> str:
    """`str(s)` with every control or invisible formatting character written as a Python-style escape
    (`\\x1b`, `\\u202e`), except those in `keep` (e.g. "\\n" where a line break is harmless), optionally cut to
    `limit` characters (the cut marked with '…')."""
    s = "" if s is None else str(s)
    if limit is not None and len(s) > limit:
        s = s[:max(limit - 1, 0)] + "…"
    if s.isprintable() and s.isascii():
        return s
    return "".join(_escape_char(c) if unicodedata.category(c) in _HIDDEN and c not in keep else c for c in s)


#: the longest text a renderer prints as one piece; a longer one (a hostile saved report's key or summary) is cut
MAX_PIECE = 10_000


def text(s: Any, style: str = "", limit: int | None = None) -> Text:
    """A rich Text showing `s` literally (no markup, no emoji codes), control characters made visible, at most
    `limit` (default MAX_PIECE) characters."""
    return Text(visible(s, MAX_PIECE if limit is None else limit), style=style)


def error_line(message: Any) -> Text:
    """`error: <message>` for the terminal, the message shown literally on one line."""
    return Text.assemble(("error: ", "bold red"), visible(message))
