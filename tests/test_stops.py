import pytest

from coli.errors import InvalidRequestError
from coli.stops import StopMatcher


def run(stops, pieces):
    m = StopMatcher(stops)
    out, done = [], False
    for p in pieces:
        text, done = m.push(p)
        out.append(text)
        if done:
            break
    if not done:
        out.append(m.flush())
    return "".join(out), out, m.stopped


def test_stop_spanning_pieces_is_removed():
    text, _, hit = run(["</end>"], ["Hello wor", "ld</e", "nd> more"])
    assert text == "Hello world" and hit == "</end>"


def test_partial_match_is_held_then_released():
    text, pieces, hit = run(["STOP"], ["abc ST", "ART"])
    assert pieces[0] == "abc "  # "ST" held back: it could start STOP
    assert text == "abc START" and hit is None


def test_earliest_of_several_stops_wins():
    text, _, hit = run(["bb", "a"], ["xxbba"])
    assert text == "xx" and hit == "bb"


def test_no_stops_passes_everything():
    assert run(None, ["a", "b"])[0] == "ab"


def test_empty_stop_is_refused():
    with pytest.raises(InvalidRequestError):
        StopMatcher([""])


def run_leading(stops, pieces):
    m = StopMatcher(stops, ignore_leading=True)
    out, done = [], False
    for p in pieces:
        text, done = m.push(p)
        out.append(text)
        if done:
            break
    if not done:
        out.append(m.flush())
    return "".join(out), m.stopped


def test_leading_stops_are_dropped_when_asked():
    assert run_leading(["<|user|>"], ["<|us", "er|>", "\nHello", " <|user|> more"]) == ("\nHello ", "<|user|>")
    assert run_leading(["<|user|>"], ["  <|user|><|user|>", "Hi"]) == ("  Hi", None)
    # without the option a leading stop ends the text at once
    assert run(["<|user|>"], ["<|user|>Hi"])[0] == ""
    # a stop after real content still stops
    assert run_leading(["STOP"], ["ok", " STOP", "x"]) == ("ok ", "STOP")
