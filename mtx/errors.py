"""Error text for mtx's one-line messages."""

from __future__ import annotations


def first_line(error: BaseException, limit: int | None = 200) -> str:
    """The first line of an exception's message (at most `limit` characters, None: all of it; tensorstore's trailing
    "See full error" pointer cut), or its type's name when it has no message."""
    lines = str(error).strip().splitlines()
    text = lines[0].split(" See full")[0][:limit].rstrip() if lines else ""
    return text or type(error).__name__
