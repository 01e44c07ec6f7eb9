"""What a model family writes around its answer: reasoning and tool-call markers.

A chat model's raw output can mix three things: reasoning (Qwen3's ``<think>...</think>``),
the answer, and tool calls in the family's own syntax (Qwen's Hermes-style
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``). ``FORMATS`` is the table of
families: the markers each uses, how one tool-call block is parsed, the text that forces a
call (``tool_choice``), and the role markers that start a new turn (implicit stops). A new
family is one row plus, if its tool calls look new, one block parser.

``OutputParser`` splits streamed text into ``ReasoningDelta``, ``TextDelta`` and
``ToolCallDelta`` events as it arrives, holding back only what could still be the start
of a marker. A tool-call block is emitted once it is closed and parses: a malformed block
is never dropped and never raises, it comes back as answer text and the finish reason
becomes ``malformed_tool_call``.

    fmt = chat_format.detect(model)                  # from model_type and chat template
    parser = OutputParser(fmt, tools=True, in_reasoning=...)
    runner.submit(ids, parser=parser)                # the runner feeds it the text
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

from coli.scheduler.events import ReasoningDelta, TextDelta, ToolCallDelta

ToolCall = tuple[str, str]  # (function name, arguments as a JSON object text)


# -- tool-call block parsers: the text between a family's begin and end markers -> calls, or None ---


def parse_hermes(block: str) -> list[ToolCall] | None:
    """Qwen / Hermes: ``{"name": "f", "arguments": {...}}`` (arguments may also be a JSON string)."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    args = _arguments(args)
    return None if args is None else [(obj["name"], args)]


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def parse_glm45(block: str) -> list[ToolCall] | None:
    """GLM-4.5: ``name\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>...`` (values JSON or plain text)."""
    name, _, rest = block.strip().partition("\n")
    name = name.strip()
    if not name or "<" in name:
        return None
    args = {}
    for key, value in _GLM_ARG.findall(rest):
        try:
            args[key.strip()] = json.loads(value)
        except ValueError:
            args[key.strip()] = value
    if _GLM_ARG.sub("", rest).strip():
        return None  # text that is not an argument pair
    return [(name, json.dumps(args, ensure_ascii=False))]


_DS_SEP = "<｜tool▁sep｜>"
_DS_FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.S)


def parse_deepseek_v3(block: str) -> list[ToolCall] | None:
    """DeepSeek-V3: ``function<｜tool▁sep｜>name\\n```json\\n{...}\\n```` (V3.1: ``name<｜tool▁sep｜>{...}``)."""
    left, sep, right = block.partition(_DS_SEP)
    if not sep:
        return None
    if left.strip() == "function":
        name, _, body = right.partition("\n")
        m = _DS_FENCE.match(body)
        body = m.group(1) if m else body
    else:
        name, body = left, right
    name = name.strip()
    try:
        args = _arguments(json.loads(body))
    except ValueError:
        return None
    return None if not name or args is None else [(name, args)]


def _arguments(args) -> str | None:
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None


# -- the table -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolSyntax:
    begin: str  # opens one call
    end: str  # closes it
    parse: Callable[[str], list[ToolCall] | None]
    required: str  # text that makes the model start a call (tool_choice "required")
    named: str  # ... a call of one function; "{name}" is replaced
    wrappers: tuple[str, ...] = ()  # markers around a run of calls, dropped from the text


@dataclass(frozen=True)
class ChatFormat:
    name: str
    reasoning: tuple[str, str] | None = None  # (open, close)
    tools: ToolSyntax | None = None
    role_markers: tuple[str, ...] = ()  # start a new turn: implicit stops for chat requests
    turn_end: tuple[str, ...] = ()  # end the assistant turn (stops where not already end-of-turn ids)


HERMES = ToolSyntax("<tool_call>", "</tool_call>", parse_hermes, required="<tool_call>\n",
                    named='<tool_call>\n{{"name": "{name}", "arguments": ')
GLM45 = ToolSyntax("<tool_call>", "</tool_call>", parse_glm45, required="<tool_call>", named="<tool_call>{name}\n")
DEEPSEEK_V3 = ToolSyntax("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", parse_deepseek_v3,
                         required="<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>",
                         named="<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n",
                         wrappers=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"))
THINK = ("<think>", "</think>")

FORMATS: dict[str, ChatFormat] = {f.name: f for f in (
    # Qwen2.5 / Qwen3 (ChatML turns, Hermes tool calls, <think> reasoning)
    ChatFormat("qwen", THINK, HERMES, ("<|im_start|>",), ("<|im_end|>",)),
    ChatFormat("chatml", None, None, ("<|im_start|>",), ("<|im_end|>",)),
    ChatFormat("glm45", THINK, GLM45, ("<|user|>", "<|observation|>"), ()),
    ChatFormat("deepseek_v3", THINK, DEEPSEEK_V3, ("<｜User｜>",), ("<｜end▁of▁sentence｜>",)),
    ChatFormat("tulu", None, None, ("<|user|>", "<|system|>"), ()),  # OLMoE-Instruct
    ChatFormat("llama3", None, None, ("<|start_header_id|>",), ("<|eot_id|>",)),
    ChatFormat("mistral", None, None, ("[INST]",), ()),
    ChatFormat("plain"),
)}


def detect(model_type: str, template: str | None) -> ChatFormat:
    """The family of a model, from its chat template (``None``: the ChatML fallback) and
    model_type. Tool calling and reasoning are kept only where the template uses them."""
    t = template if template is not None else "<|im_start|>"
    if model_type == "deepseek_v3" or "tool▁calls▁begin" in t:
        fmt = FORMATS["deepseek_v3"]
    elif model_type in ("glm4_moe", "glm4") or "<arg_key>" in t:
        fmt = FORMATS["glm45"]
    elif "<|im_start|>" in t:
        fmt = FORMATS["qwen"] if "<tool_call>" in t or "<think>" in t else FORMATS["chatml"]
    elif "<|start_header_id|>" in t:
        fmt = FORMATS["llama3"]
    elif "<|user|>" in t:
        fmt = FORMATS["tulu"]
    elif "[INST]" in t:
        fmt = FORMATS["mistral"]
    else:
        fmt = FORMATS["plain"]
    if fmt.tools is not None and not ("tools" in t and fmt.tools.begin.strip("<>") in t):
        fmt = replace(fmt, tools=None)  # the template cannot tell the model about tools
    if fmt.reasoning is not None and fmt.reasoning[0] not in t:
        fmt = replace(fmt, reasoning=None)
    return fmt


def opens_reasoning(fmt: ChatFormat, prompt: str) -> bool:
    """Whether ``prompt`` (the rendered prompt) ends inside an open reasoning block, as
    templates that start the model thinking do."""
    if fmt.reasoning is None:
        return False
    return prompt.rfind(fmt.reasoning[0]) > prompt.rfind(fmt.reasoning[1])


def forced_prefix(fmt: ChatFormat, name: str | None) -> str:
    """Text appended to the prompt so that the answer starts with a tool call (of ``name``)."""
    assert fmt.tools is not None
    return fmt.tools.required if name is None else fmt.tools.named.format(name=name)


# -- the streaming parser ------------------------------------------------------------------------


class OutputParser:
    """Splits generated text into reasoning, answer text and tool calls (see the module
    docstring); the runner calls ``push`` with each piece and ``finish`` at the end.

    ``tools``: parse tool calls (else their markers are plain text). ``in_reasoning``: the
    prompt opened a reasoning block. ``parallel``: with False, ``done`` turns True after
    the first call so generation stops there. ``primed``: text the prompt already put at
    the start of the answer (a forced tool-call opening), parsed but not emitted."""

    def __init__(self, fmt: ChatFormat, *, tools: bool = False, in_reasoning: bool = False,
                 parallel: bool = True, primed: str = ""):
        self.fmt = fmt
        self.syntax = fmt.tools if tools else None
        self.parallel = parallel
        self.mode = "reasoning" if in_reasoning and fmt.reasoning else "text"
        self._buf = ""
        self._strip = self.mode == "reasoning"  # drop whitespace right after a marker
        self._content = False  # non-whitespace answer text was emitted
        self.calls = 0
        self.malformed = False
        self.truncated = False  # the answer ended inside a call that does not parse (yet)
        self.done = False
        if primed:
            self.push(primed)

    # -- public -------------------------------------------------------------------------------

    def push(self, text: str) -> list:
        if self.done:
            return []
        self._buf += text
        out: list = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list:
        """Whatever is still held: text, an unclosed reasoning block, an unclosed call."""
        out: list = []
        if self.done:
            return out
        while self._step(out, final=False):
            pass
        buf, self._buf = self._buf, ""
        if self.mode == "reasoning":
            if buf.strip():
                out.append(ReasoningDelta(buf.rstrip() if not self._strip else buf.strip()))
        elif self.mode == "tool":
            was = self.malformed
            self._close_call(buf, out, closed=False)
            self.truncated = self.malformed and not was  # an unclosed call that does not parse
        elif buf and not (self.calls and not buf.strip()):
            out.append(self._text(buf))
        return [e for e in out if not isinstance(e, TextDelta) or e.text]

    def finish_reason(self, reason: str) -> str:
        if self.truncated and reason == "length":  # cut by max_tokens, not written wrong
            return reason
        if self.malformed:
            return "malformed_tool_call"
        return "tool_calls" if self.calls else reason

    # -- internals ----------------------------------------------------------------------------

    def _markers(self) -> list[str]:
        if self.mode == "reasoning":
            return [self.fmt.reasoning[1]]
        found = []
        if self.fmt.reasoning and not self._content and not self.calls:
            found.append(self.fmt.reasoning[0])
        if self.syntax is not None:
            found += [self.syntax.begin, *self.syntax.wrappers]
        return found

    def _step(self, out: list, final: bool) -> bool:
        """Consume what can be decided from the buffer; True if it changed state."""
        buf = self._buf
        if self._strip:
            buf = buf.lstrip()
            if not buf:
                self._buf = ""
                return False
            self._strip = False
        if self.mode == "tool":
            end = buf.find(self.syntax.end)
            if end < 0:
                self._buf = buf
                return False
            self._buf = buf[end + len(self.syntax.end):]
            self._close_call(buf[:end], out, closed=True)
            return not self.done
        markers = self._markers()
        hits = [(buf.find(m), m) for m in markers if m in buf]
        if hits:
            at, m = min(hits)
            if self.mode == "text" and self.fmt.reasoning and m == self.fmt.reasoning[0] and buf[:at].strip():
                self._flush_plain(buf[:at], out, whole=True)  # answer text came first: no reasoning now
                self._buf = buf[at:]
                return True
            if self.mode == "reasoning" or self._content or buf[:at].strip():
                self._flush_plain(buf[:at], out, whole=True)  # (whitespace before a first marker is dropped)
            self._buf = buf[at + len(m):]
            if self.mode == "reasoning":  # the close marker
                self.mode, self._strip = "text", True
            elif self.fmt.reasoning and m == self.fmt.reasoning[0]:
                self.mode, self._strip = "reasoning", True
            elif self.syntax is not None and m == self.syntax.begin:
                self.mode = "tool"
            return True  # wrappers are dropped
        hold = _partial_marker(buf, markers)
        if self.mode == "text" and not self._content and not buf.strip():
            hold = len(buf)  # leading whitespace: wait for what follows it
        elif self.mode == "reasoning" or self.calls:
            hold = max(hold, len(buf) - len(buf[: len(buf) - hold].rstrip()))  # trailing whitespace
        self._flush_plain(buf[: len(buf) - hold], out, whole=False)
        self._buf = buf[len(buf) - hold:]
        return False

    def _flush_plain(self, text: str, out: list, whole: bool) -> None:
        if not text:
            return
        if self.mode == "reasoning":
            text = text.rstrip() if whole else text
            if text:
                out.append(ReasoningDelta(text))
        elif not (self.calls and not text.strip()):
            out.append(self._text(text))

    def _text(self, text: str) -> TextDelta:
        if text.strip():
            self._content = True
        return TextDelta(text)

    def _close_call(self, block: str, out: list, closed: bool) -> None:
        calls = self.syntax.parse(block.strip()) if block.strip() else None
        if calls is None:  # never drop what the model wrote: it becomes text
            self.malformed = True
            out.append(self._text(self.syntax.begin + block + (self.syntax.end if closed else "")))
            self.mode = "text"
            return
        for name, args in calls:
            out.append(ToolCallDelta(self.calls, f"call_{uuid.uuid4().hex[:24]}", name, ""))
            out.append(ToolCallDelta(self.calls, arguments=args))
            self.calls += 1
        self.mode = "text"
        if not self.parallel:
            self.done = True


def _partial_marker(buf: str, markers: list[str]) -> int:
    """Length of the longest tail of ``buf`` that is a proper prefix of a marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:n]):
                best = n
                break
    return best
