"""Constraints: what the answer must match, compiled by llguidance for one vocabulary.

    c = Constraint.json_schema({"type": "object", ...}, param="response_format")
    c = Constraint.regex(r"\\d{3}-\\d{4}")      # or .lark(text), .gbnf(text), .any_json()
    vocab = Vocabulary.of(model)                 # once per model (builds llguidance's token trie)
    c.check(vocab)                               # GrammarError (a 400) naming ``param`` and llguidance's reason
    m = c.matcher(vocab)                         # a fresh llguidance.LLMatcher for one sequence

JSON answers are compact by default (``", "`` between items, ``": "`` after keys, no other
whitespace), as ``json.dumps`` writes them: a model cannot run away in whitespace. A
schema's own ``"x-guidance"`` object overrides that (llguidance's JSON options).
"""
from __future__ import annotations

import json
import threading

import llguidance
from llguidance import LLMatcher, LLTokenizer

from coli.errors import InvalidRequestError

JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
LENIENT = {**JSON_DEFAULTS, "lenient": True}


class GrammarError(InvalidRequestError):
    """A schema or grammar llguidance cannot compile; ``param`` names the request field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Vocabulary:
    """llguidance's view of a model's tokenizer: its token trie, the model's vocabulary
    size (the mask's length) and end-of-turn ids (allowed wherever the grammar is complete).
    Building it reads every token once (about a second for 150k tokens): one per model."""

    def __init__(self, tokenizer_json: str, size: int, eos_ids):
        eos = sorted(int(t) for t in eos_ids)
        self.size = int(size)
        self.eos_ids = frozenset(eos)
        try:
            self.lltok = LLTokenizer(tokenizer_json, n_vocab=self.size, eos_token=eos or None)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 -- a word-level vocabulary (no bytes to match), or a
            # tokenizer whose token trie llguidance cannot hold (its Rust code panics: pyo3's
            # PanicException derives from BaseException)
            raise GrammarError(f"this model's tokenizer cannot be used for constrained decoding: {_one_line(e)}") \
                from None
        # added tokens (markers such as <tool_call>): grammars refer to them as tokens, not text
        self.added = frozenset(t["content"] for t in json.loads(tokenizer_json).get("added_tokens", ()))

    @classmethod
    def of(cls, model) -> Vocabulary:
        """A loaded model's vocabulary (the runner keeps one: ``Runner.vocabulary``)."""
        tok = model.tokenizer
        return cls(tok.to_json(), max(model.config.vocab_size, tok.vocab_size), model.eos_ids)


class Constraint:
    """A grammar in llguidance's serialized form, plus a description for messages and the
    request field it came from (``param``) for errors."""

    def __init__(self, grammar: str, kind: str, param: str | None = None):
        self.grammar, self.kind, self.param = grammar, kind, param
        self._compiled: dict[int, LLMatcher] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Constraint({self.kind}, param={self.param!r})"

    # -- builders -------------------------------------------------------------------------------

    @classmethod
    def json_schema(cls, schema: dict | bool, *, param: str | None = None, strict: bool = True) -> Constraint:
        """Answers that are JSON documents valid against ``schema``. ``strict=False`` ignores
        schema keywords llguidance does not implement instead of refusing them."""
        if schema is True or schema == {}:
            schema = {}
        if not isinstance(schema, dict):
            raise GrammarError(f"{param or 'schema'}: a JSON schema must be an object", param)
        try:
            grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_DEFAULTS if strict
                                                         else LENIENT)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"{param or 'schema'}: {_one_line(e)}", param) from None
        return cls(grammar, "json_schema", param)

    @classmethod
    def any_json(cls, *, param: str | None = None) -> Constraint:
        """Any JSON object (OpenAI's ``json_object``)."""
        return cls.json_schema({"type": "object"}, param=param)

    @classmethod
    def regex(cls, pattern: str, *, param: str | None = None) -> Constraint:
        return cls(LLMatcher.grammar_from_regex(_text(pattern, param)), "regex", param)

    @classmethod
    def lark(cls, text: str, *, param: str | None = None) -> Constraint:
        """A Lark grammar in llguidance's dialect (``start`` is the answer; ``%json {...}``
        embeds a JSON schema)."""
        return cls(LLMatcher.grammar_from_lark(_text(text, param)), "lark", param)

    @classmethod
    def gbnf(cls, text: str, *, param: str | None = None) -> Constraint:
        """A llama.cpp GBNF grammar, converted to Lark by llguidance's converter."""
        try:
            grammar = llguidance.grammar_from("gbnf", _text(text, param))
        except (ValueError, TypeError) as e:
            raise GrammarError(f"{param or 'grammar'}: {_one_line(e)}", param) from None
        return cls(grammar, "gbnf", param)

    # -- use ------------------------------------------------------------------------------------

    def check(self, vocab: Vocabulary) -> None:
        """Compile for ``vocab`` (once); raises GrammarError with llguidance's reason."""
        self._prototype(vocab)

    def matcher(self, vocab: Vocabulary) -> LLMatcher:
        """A fresh matcher at the start of the answer."""
        return self._prototype(vocab).deep_copy()

    def _prototype(self, vocab: Vocabulary) -> LLMatcher:
        with self._lock:
            m = self._compiled.get(id(vocab))
            if m is None:
                m = LLMatcher(vocab.lltok, self.grammar, log_level=0)
                if m.is_error():
                    raise GrammarError(f"{self.param or 'grammar'}: the {_KIND_NAMES.get(self.kind, self.kind)} "
                                       f"does not compile: {_one_line(m.get_error())}", self.param)
                self._compiled[id(vocab)] = m
            return m


_KIND_NAMES = {"json_schema": "JSON schema", "regex": "regular expression", "lark": "Lark grammar",
               "gbnf": "GBNF grammar", "tools": "tool-call grammar"}


def _text(value, param: str | None) -> str:
    if not isinstance(value, str) or not value:
        raise GrammarError(f"{param or 'grammar'}: expected a non-empty string", param)
    return value


def _one_line(e) -> str:
    text = " ".join(str(e).split())
    return text[:500] + ("…" if len(text) > 500 else "")
