"""The output parser splits reasoning, text and tool calls the same way however the text
is cut into pieces; malformed calls come back as text; the family table detects formats."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from coli.chat_format import (FORMATS, OutputParser, detect, forced_prefix, opens_reasoning, parse_deepseek_v3,
                              parse_glm45, parse_hermes)
from coli.scheduler import ReasoningDelta, TextDelta, ToolCallDelta

QWEN = FORMATS["qwen"]


def collect(events):
    """(reasoning, text, [(name, arguments)]) from a list of events."""
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    calls: dict[int, list] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            c = calls.setdefault(e.index, [None, ""])
            if e.name:
                assert c[0] is None and e.id.startswith("call_")
                c[0] = e.name
            c[1] += e.arguments
    return reasoning, text, [tuple(calls[i]) for i in sorted(calls)]


def parse(pieces, fmt=QWEN, **kw):
    p = OutputParser(fmt, **kw)
    events = []
    for piece in pieces:
        events += p.push(piece)
    events += p.finish()
    return collect(events), p


ANSWER = ('<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n{"name": "get_weather", '
          '"arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
          '</tool_call>\n')


def test_reasoning_text_and_parallel_calls():
    (reasoning, text, calls), p = parse([ANSWER], tools=True)
    assert reasoning == "The user wants weather."
    assert text == "Let me check.\n"
    assert calls == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert p.finish_reason("stop") == "tool_calls"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(ANSWER)), max_size=12))
def test_any_chunking_gives_the_same_result(cuts):
    cuts = sorted(set(cuts))
    pieces = [ANSWER[a:b] for a, b in zip([0, *cuts], [*cuts, len(ANSWER)])]
    assert parse(pieces, tools=True)[0] == parse([ANSWER], tools=True)[0]


def test_one_call_only_when_not_parallel():
    p = OutputParser(QWEN, tools=True, parallel=False)
    events = p.push(ANSWER)
    assert p.done and collect(events)[2] == [("get_weather", '{"city": "Paris"}')]
    assert p.push("more") == [] and p.finish() == []


@pytest.mark.parametrize("block", ['{"name": "f", "arguments": {"a": 1}', "not json at all", '{"arguments": {}}',
                                   '{"name": "f", "arguments": [1, 2]}'])
def test_malformed_calls_come_back_as_text(block):
    raw = f"Sure.\n<tool_call>\n{block}\n</tool_call>"
    (reasoning, text, calls), p = parse([raw], tools=True)
    assert calls == [] and text == raw and p.finish_reason("stop") == "malformed_tool_call"


def test_unclosed_call_is_accepted_when_it_parses_and_text_when_not():
    (_, text, calls), p = parse(['<tool_call>\n{"name": "f", "arguments": {"x": "y"}}'], tools=True)
    assert calls == [("f", '{"x": "y"}')] and text == "" and p.finish_reason("length") == "tool_calls"
    (_, text, calls), p = parse(['<tool_call>\n{"name": "f", "argu'], tools=True)
    assert calls == [] and text == '<tool_call>\n{"name": "f", "argu' and p.malformed


def test_without_tools_markers_are_text_and_plain_text_passes_through():
    (_, text, calls), p = parse(['<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'], tools=False)
    assert calls == [] and text.startswith("<tool_call>") and p.finish_reason("stop") == "stop"
    assert parse(["a < b and", " c <t", "ool"], tools=True)[0] == ("", "a < b and c <tool", [])


def test_prompt_that_opens_reasoning_and_an_unclosed_block():
    (reasoning, text, _), _ = parse(["thinking", " still\n\n"], in_reasoning=True)
    assert reasoning == "thinking still" and text == ""
    assert opens_reasoning(QWEN, "<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning(QWEN, "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_reasoning_marker_only_counts_before_the_answer():
    (reasoning, text, _), _ = parse(["The tag <think> opens reasoning."])
    assert reasoning == "" and text == "The tag <think> opens reasoning."


def test_forced_named_call_is_primed():
    prefix = forced_prefix(QWEN, "get_weather")
    (_, text, calls), p = parse(['{"city": "Oslo"}}\n</tool_call>'], tools=True, primed=prefix)
    assert calls == [("get_weather", '{"city": "Oslo"}')] and text == ""
    (_, text, calls), p = parse(["oops"], tools=True, primed=prefix)
    assert calls == [] and text == prefix + "oops" and p.malformed


def test_block_parsers_of_other_families():
    assert parse_hermes('{"name": "f", "arguments": "{\\"a\\": 2}"}') == [("f", '{"a": 2}')]
    glm = "get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n" \
          "<arg_value>3</arg_value>\n"
    assert parse_glm45(glm) == [("get_weather", json.dumps({"city": "Paris", "days": 3}))]
    assert parse_glm45("get_weather\nstray text") is None
    ds = 'function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```'
    assert parse_deepseek_v3(ds) == [("get_weather", '{"city": "Paris"}')]
    assert parse_deepseek_v3('get_weather<｜tool▁sep｜>{"city": "Paris"}') == [("get_weather", '{"city": "Paris"}')]
    raw = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```<｜tool▁call▁end｜>'
           '<｜tool▁calls▁end｜>')
    assert parse([raw], FORMATS["deepseek_v3"], tools=True)[0] == ("", "", [("f", "{}")])


def test_detect_reads_the_template():
    from test_tokenizer import QWEN3

    assert detect("qwen3_moe", QWEN3).name == "qwen" and detect("qwen3_moe", QWEN3).tools is not None
    plain_chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    fmt = detect("qwen3_moe", plain_chatml)
    assert fmt.name == "chatml" and fmt.tools is None and fmt.role_markers == ("<|im_start|>",)
    assert detect("qwen3_moe", None).name == "chatml"  # the ChatML fallback template
    assert detect("olmoe", "{{ '<|user|>\n' + m['content'] }}").tools is None
