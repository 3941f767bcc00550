"""Marker search for the streaming parsers: where a marker starts, and how much of a buffer's end to hold back."""
from collections.abc import Sequence

from dsv4.engine.stop import partial_marker_len

__all__ = ["cut_marker_start", "find_first", "partial_marker_len"]


def find_first(text: str, markers: Sequence[str]) -> tuple[int, str] | None:
    """The earliest occurrence of any of `markers` in `text` as (position, marker), the longest marker on a tie."""
    best: tuple[int, str] | None = None
    for marker in markers:
        pos = text.find(marker)
        if pos != -1 and (best is None or pos < best[0] or (pos == best[0] and len(marker) > len(best[1]))):
            best = (pos, marker)
    return best


def cut_marker_start(tail: str) -> int:
    """Where a held-back tail, at the end of the stream, is a marker cut short: the position of a `<` followed by
    more of a marker (`</`, `<｜`, `<thi`), or len(tail) when nothing in it is. A lone `<` or newlines are text."""
    pos = tail.find("<")
    return pos if pos != -1 and len(tail) - pos >= 2 else len(tail)
