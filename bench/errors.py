"""How an error reads in one line (a result's `message`, a line of `membench fit`)."""
from __future__ import annotations


def first_line(e: BaseException) -> str:
    """The first line of the error's message, or its type's name if it has none."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
