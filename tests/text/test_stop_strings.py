"""StopMatcher: stop strings across deltas, overlapping prefixes, hold-back and flush."""

from __future__ import annotations

import random

import pytest

from moed.errors import InvalidRequestError
from moed.text.stop_strings import StopMatcher


def _run(stop: list[str], deltas: list[str]) -> tuple[list[str], bool]:
    m = StopMatcher(stop)
    out, hit = [], False
    for d in deltas:
        text, hit = m.push(d)
        out.append(text)
        if hit:
            break
    out.append(m.flush())
    return out, hit


def _reference(stop: list[str], text: str) -> tuple[str, bool]:
    # Char-by-char answer: the first stop string to complete ends the text, cut before its start.
    for end in range(1, len(text) + 1):
        done = [end - len(s) for s in stop if text[:end].endswith(s)]
        if done:
            return text[: min(done)], True
    return text, False


def test_no_stops_passes_through() -> None:
    m = StopMatcher([])
    assert m.push("abc") == ("abc", False)
    assert m.flush() == ""


def test_stop_inside_one_delta() -> None:
    out, hit = _run(["END"], ["hello END world"])
    assert hit and "".join(out) == "hello "


def test_stop_spanning_deltas_is_held_back() -> None:
    m = StopMatcher(["</answer>"])
    assert m.push("42 </an") == ("42 ", False)  # "</an" could still become the stop string
    assert m.push("sw") == ("", False)
    assert m.push("er> trailing") == ("", True)
    assert m.push("more") == ("", True)  # nothing after a stop
    assert m.flush() == ""


def test_false_alarm_prefix_is_released() -> None:
    m = StopMatcher(["\n\nUser:"])
    assert m.push("a\n") == ("a", False)
    assert m.push("\nUs") == ("", False)
    assert m.push("ually") == ("\n\nUsually", False)
    assert m.flush() == ""


def test_flush_returns_held_tail() -> None:
    m = StopMatcher(["STOP"])
    assert m.push("almost ST") == ("almost ", False)
    assert m.flush() == "ST"
    assert m.flush() == ""


def test_overlapping_stops_earliest_wins() -> None:
    out, hit = _run(["abc", "bcd"], ["xa", "b", "cd"])
    assert hit and "".join(out) == "x"
    out, hit = _run(["bcd", "abc"], ["xab", "cd"])
    assert hit and "".join(out) == "x"


def test_self_overlapping_prefix() -> None:
    # "aab" in "aaab": the first 'a' is released only once it can no longer start the stop string.
    m = StopMatcher(["aab"])
    assert m.push("a") == ("", False)
    assert m.push("a") == ("", False)
    assert m.push("a") == ("a", False)
    assert m.push("b!") == ("", True)


def test_first_completed_stop_wins_regardless_of_chunking() -> None:
    # "c" completes before "abcd" does, so the text ends before "c" however the deltas are cut.
    for deltas in (["abcd"], ["abc", "d"], ["a", "b", "c", "d"]):
        out, hit = _run(["abcd", "c"], deltas)
        assert hit and "".join(out) == "ab"
    # Same end: the longer (earlier-starting) stop wins.
    out, hit = _run(["xyz", "yz"], ["axyz"])
    assert hit and "".join(out) == "a"


def test_multibyte_and_single_char_stops() -> None:
    out, hit = _run(["。", "🙂"], ["日本", "語", "🙂 x"])
    assert hit and "".join(out) == "日本語"


def test_random_splits_match_char_by_char_reference() -> None:
    for seed in range(300):
        rng = random.Random(seed)
        alphabet = "ab c\n"
        stop = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice(alphabet) for _ in range(60))
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 20)))
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        out, hit = _run(stop, deltas)
        assert ("".join(out), hit) == _reference(stop, text), (seed, stop, deltas)


@pytest.mark.parametrize("stop", ["END", [""], [None]])
def test_invalid_stop(stop: object) -> None:
    with pytest.raises(InvalidRequestError, match="stop"):
        StopMatcher(stop)  # type: ignore[arg-type]
