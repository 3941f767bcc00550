"""Stop strings on detokenized text: finding them, and holding back text that might become one.

Text grows by a chunk per detokenized token. `check_stop_strings` only searches where a match could be new (it must
end inside the new chunk), and among new matches picks the one that ends first, so the result does not depend on
how the text was chunked. `stop_hold_back` says how many trailing characters to keep out of a stream because they
could be the start of a stop string that would later be cut.
"""

from __future__ import annotations

from collections.abc import Sequence


def check_stop_strings(
    output_text: str, new_text_len: int, stop: Sequence[str], include_stop_str_in_output: bool
) -> tuple[str, str] | None:
    """Find a stop string that ends in the last `new_text_len` characters of `output_text`.

    Returns (text truncated before the stop string, or after it when `include_stop_str_in_output`, the stop
    string), or None. Earlier text was checked on earlier calls and is not searched again. When several stop
    strings match, the one that ends first wins (it is the one a character-by-character stream would hit);
    among those ending at the same place, the one starting first (the longest).
    """
    if new_text_len <= 0 or not stop:
        return None
    new_start = max(len(output_text) - new_text_len, 0)
    best: tuple[int, int, str] | None = None  # (end, start, stop string)
    for s in stop:
        # A new match ends after new_start, so it starts at or after new_start - len(s) + 1.
        start = output_text.find(s, max(new_start - len(s) + 1, 0))
        if start < 0:
            continue
        cand = (start + len(s), start, s)
        if best is None or cand[:2] < best[:2]:
            best = cand
    if best is None:
        return None
    end, start, s = best
    return output_text[: end if include_stop_str_in_output else start], s


def stop_hold_back(output_text: str, stop: Sequence[str], include_stop_str_in_output: bool) -> int:
    """How many trailing characters of `output_text` a stream must withhold for now.

    That is the longest suffix that is a proper prefix of some stop string: if the stop string completes, the text
    is cut at its start, so those characters must never have been shown. Nothing is held back when the stop string
    stays in the output, since then every streamed character survives. Call after `check_stop_strings` found
    nothing; streamed text is then always a prefix of the final text.
    """
    if include_stop_str_in_output:
        return 0
    return partial_marker_len(output_text, stop)


def partial_marker_len(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of `text` that is the start (not the whole) of one of `markers`: a later delta may
    complete it into a marker, so a stream holds it back (stop strings here, the reply parsers' markers in
    dsv4/serve/parsers)."""
    held = 0
    for marker in markers:
        # Only lengths longer than what is already held can raise the answer; try them from the longest down.
        for n in range(min(len(marker) - 1, len(text)), held, -1):
            if text.endswith(marker[:n]):
                held = n
                break
    return held
