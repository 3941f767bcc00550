"""Stop strings: matching on chunked text, truncation, and the hold-back that keeps streams honest."""

from __future__ import annotations

import random

import pytest

from dsv4.engine.stop import check_stop_strings, stop_hold_back


def test_match_truncates_before_or_after_stop_string() -> None:
    assert check_stop_strings("Hello world!", 12, ["world"], False) == ("Hello ", "world")
    assert check_stop_strings("Hello world!", 12, ["world"], True) == ("Hello world", "world")
    assert check_stop_strings("Hello world", 12, ["xyz"], False) is None
    assert check_stop_strings("Hello", 0, ["Hello"], False) is None
    assert check_stop_strings("Hello", 5, [], False) is None


def test_stop_string_spanning_two_chunks() -> None:
    text = "The answer is 42. ENDING"
    first, second = "The answer is 42. E", "NDING"
    assert check_stop_strings(first, len(first), ["END"], False) is None
    assert check_stop_strings(first + second, len(second), ["END"], False) == ("The answer is 42. ", "END")
    assert check_stop_strings(first + second, len(second), ["END"], True) == ("The answer is 42. END", "END")
    assert first + second == text


def test_text_already_checked_is_not_searched_again() -> None:
    # "STOP" lies wholly in old text, so an earlier call would have caught it; only the new tail counts.
    assert check_stop_strings("a STOP b", 2, ["STOP"], False) is None
    assert check_stop_strings("a STOP b", 3, ["STOP"], False) == ("a ", "STOP")


def test_first_completed_stop_string_wins() -> None:
    # "b" completes before "abc" does, whatever the chunking.
    assert check_stop_strings("xabc", 3, ["abc", "b"], False) == ("xa", "b")
    # Same end: the longer (earlier-starting) one.
    assert check_stop_strings("xabc", 3, ["bc", "abc"], False) == ("x", "abc")
    # The earliest occurrence of a repeated stop string.
    assert check_stop_strings("zz.z.z", 6, [".z"], True) == ("zz.z", ".z")


def test_hold_back_is_the_longest_pending_prefix() -> None:
    assert stop_hold_back("Hello wor", ["world"], False) == 3
    assert stop_hold_back("Hello wor", ["world"], True) == 0
    assert stop_hold_back("Hello", ["world"], False) == 0
    assert stop_hold_back("aaa", ["aaab"], False) == 3
    assert stop_hold_back("xab", ["b!", "abc", "q"], False) == 2
    assert stop_hold_back("", ["abc"], False) == 0
    assert stop_hold_back("ab", ["abcdef"], False) == 2


def ref_stop(text: str, stop: list[str], include: bool) -> tuple[str, str] | None:
    """Scan one character at a time; the first end position where some stop string ends wins (longest on ties)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stop if text[:end].endswith(s)]
        if hits:
            s = max(hits, key=len)
            return (text[:end] if include else text[: end - len(s)]), s
    return None


def ref_hold_back(text: str, stop: list[str]) -> int:
    return max([n for s in stop for n in range(1, len(s)) if text.endswith(s[:n])], default=0)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("alphabet", ["ab", "abc ", "abcdefgh"])
def test_streaming_matches_char_by_char_reference(include: bool, alphabet: str) -> None:
    rng = random.Random(f"{include}-{alphabet}")
    stopped = 0
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        stop = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(1, 4))]
        want = ref_stop(text, stop, include)
        # Feed the text in random chunks, streaming whatever is not held back.
        acc, streamed, result, pos = "", "", None, 0
        while pos < len(text):
            chunk = text[pos : pos + rng.randrange(1, 6)]
            pos += len(chunk)
            acc += chunk
            result = check_stop_strings(acc, len(chunk), stop, include)
            if result is not None:
                break
            hold = stop_hold_back(acc, stop, include)
            if not include:
                assert hold == ref_hold_back(acc, stop)
            visible = acc[: len(acc) - hold]
            assert visible.startswith(streamed)  # streams only grow
            streamed = visible
        assert result == want, (text, stop)
        final = result[0] if result is not None else text
        assert final.startswith(streamed), (text, stop, streamed, final)  # nothing shown was later cut
        stopped += result is not None
    assert stopped > 50
