"""StopStringMatcher: streamed output equals the full text cut at the first stop, whatever the chunking."""

from __future__ import annotations

import random

import pytest

from services.gateway.stop_strings import StopStringMatcher


def _reference(text: str, stops: list[str]) -> tuple[str, str | None]:
    # The first stop to complete (earliest end; longest if several end together) cuts the text at its start.
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = text.find(stop)
        if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
            best = (start + len(stop), start, stop)
    return (text, None) if best is None else (text[: best[1]], best[2])


def _random_chunks(text: str, rng: random.Random) -> list[str]:
    chunks: list[str] = []
    i = 0
    while i < len(text):
        n = rng.choice([0, 1, 1, 2, 3, 5, 8])
        chunks.append(text[i : i + n])
        i += n
    return chunks


def _run(stops: list[str], chunks: list[str]) -> tuple[str, str | None]:
    matcher = StopStringMatcher(stops)
    out: list[str] = []
    for chunk in chunks:
        emitted, stop = matcher.feed(chunk)
        out.append(emitted)
        if stop is not None:
            assert matcher.stopped == stop
            return "".join(out), stop
    out.append(matcher.flush())
    return "".join(out), None


def test_random_chunkings_match_reference() -> None:
    rng = random.Random(42)
    alphabet = "abcab \n日🙂"
    for _ in range(3000):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        assert _run(stops, _random_chunks(text, rng)) == _reference(text, stops), (stops, text)


def test_holds_back_only_possible_stop_prefixes() -> None:
    m = StopStringMatcher(["</s>", "STOP"])
    assert m.feed("Hello <") == ("Hello ", None)
    assert m.feed("/") == ("", None)
    assert m.feed("x") == ("</x", None)  # not a stop after all: released
    assert m.feed(" ST") == (" ", None)
    assert m.feed("OP and more") == ("", "STOP")
    assert m.feed("ignored") == ("", None)  # nothing after a match is emitted


def test_flush_returns_held_text() -> None:
    m = StopStringMatcher(["###"])
    assert m.feed("answer ##") == ("answer ", None)
    assert m.flush() == "##"
    assert m.flush() == ""


def test_overlapping_stops() -> None:
    # "bcd" starts first but "c" completes first: the stream stops as soon as a stop is certain.
    assert _run(["bcd", "c"], ["ab", "cd"]) == ("ab", "c")
    assert _run(["bcd", "c"], ["abcd"]) == ("ab", "c")
    # Two stops ending together: the longer one's start is the cut.
    assert _run(["xyz", "z"], ["x", "y", "z"]) == ("", "xyz")


def test_no_stops_passes_everything_through() -> None:
    m = StopStringMatcher([])
    assert m.feed("anything") == ("anything", None)
    assert m.flush() == ""


def test_empty_stop_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        StopStringMatcher(["ok", ""])
