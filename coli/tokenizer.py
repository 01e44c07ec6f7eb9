"""Tokenizer: tokenizer.json through `tokenizers`, chat templates through Jinja2, streaming detokenization.

The oracle is transformers 5.x. For the same model directory, ``encode``/``decode`` match
``AutoTokenizer`` (the tokenizer.json post-processor decides BOS/EOS: transformers 5 ignores
tokenizer_config's ``add_bos_token``/``add_eos_token`` when tokenizer.json exists, and so do we), and
``apply_chat_template`` renders exactly what ``apply_chat_template(..., tokenize=False)`` renders.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken

from coli.errors import InvalidRequestError, ModelLoadError

# transformers' SPECIAL_TOKENS_ATTRIBUTES, in its order; further `*_token` keys are model-specific.
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
LONG_TEXT = 1 << 16  # characters: longer texts are encoded with the GIL released (Tokenizer.encode)
# Names a message's reasoning may come under; transformers copies it to all of the first two.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_TEMPLATE_DIR = "additional_chat_templates"

# Used when a model ships no template. Content may be a string or a list of text parts.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class Tokenizer:
    """A Hugging Face tokenizer (tokenizer.json) plus its special tokens, chat templates and stop ids.

    Attributes:
        vocab_size: number of ids, added tokens included.
        bos_token, eos_token, pad_token, unk_token: the named special tokens (``None`` if unset).
        special_tokens: every named special token, ``{"bos_token": "<s>", ...}``; these are also
            template variables.
        special_token_ids: ids that ``decode(..., skip_special_tokens=True)`` drops.
        eos_token_ids: ids that end a generation (generation_config's ``eos_token_id`` plus eos_token's id).
        chat_template: the default template source, or ``None`` (then ChatML is used).
        chat_templates: every named template (``"default"``, ``"tool_use"``, ...).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str | AddedToken] | None = None,
        extra_special_tokens: Sequence[str | AddedToken] = (),
        chat_template: str | Mapping[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
    ):
        """Wraps ``backend``; named and extra special tokens are registered on it as special added tokens,
        as transformers' ``from_pretrained`` does (a token missing from the vocabulary gets a new id)."""
        named = {k: _added_token(v) for k, v in (special_tokens or {}).items() if v is not None}
        extra = [_added_token(t) for t in extra_special_tokens]
        if named or extra:
            backend.add_special_tokens([*named.values(), *extra])
        self._backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.special_tokens: dict[str, str] = {k: t.content for k, t in named.items()}
        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.eos_token: str | None = self.special_tokens.get("eos_token")
        self.pad_token: str | None = self.special_tokens.get("pad_token")
        self.unk_token: str | None = self.special_tokens.get("unk_token")
        self.bos_token_id: int | None = self.token_to_id(self.bos_token) if self.bos_token else None
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special
        )
        # <0xXX> tokens that a ByteFallback decoder turns into raw bytes (Llama-2-style vocabularies).
        byte_ids = [backend.token_to_id(f"<0x{b:02X}>") for b in range(256)] if _has_byte_fallback(backend) else []
        self._byte_fallback_ids: frozenset[int] = frozenset(i for i in byte_ids if i is not None)
        eos = {int(i) for i in eos_token_ids}
        if self.eos_token and (eos_id := self.token_to_id(self.eos_token)) is not None:
            eos.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        if isinstance(chat_template, str):
            chat_template = {"default": chat_template}
        self.chat_templates: dict[str, str] = dict(chat_template or {})
        self.chat_template: str | None = self.chat_templates.get("default")

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Loads a Hugging Face model directory.

        Reads tokenizer.json (required); tokenizer_config.json (special tokens as strings or
        ``{"content": ...}`` dicts, ``added_tokens_decoder``, ``extra_special_tokens``, ``chat_template``
        as a string or a list of ``{name, template}``); chat_template.jinja and
        additional_chat_templates/*.jinja, which replace the config's templates, as in transformers;
        and generation_config.json's ``eos_token_id`` (an int or a list), else config.json's.
        Raises ModelLoadError naming the file and field at fault.
        """
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"{tok_file}: not found (colibri needs a fast tokenizer's tokenizer.json)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust error type is not exported
            raise ModelLoadError(f"{tok_file}: cannot be parsed: {_one_line(e)}") from None
        cfg_file = root / "tokenizer_config.json"
        cfg = _read_json(cfg_file) or {}

        # added_tokens_decoder entries absent from tokenizer.json are added first, in id order.
        declared = cfg.get("added_tokens_decoder") or {}
        if not isinstance(declared, Mapping) or not all(str(k).isdigit() for k in declared):
            raise ModelLoadError(f"{cfg_file}: added_tokens_decoder must be an object of id -> token")
        vocab = backend.get_vocab(with_added_tokens=True)
        new = []
        for key in sorted(declared, key=int):
            token = _added_token(declared[key], f"{cfg_file}: added_tokens_decoder[{key}]", special=None)
            if token.content not in vocab:
                new.append(token)
        if new:
            backend.add_tokens(new)

        named: dict[str, AddedToken] = {}
        for key in NAMED_SPECIAL_TOKENS:  # standard names first, then model-specific, as transformers orders them
            if cfg.get(key) is not None:
                named[key] = _added_token(cfg[key], f"{cfg_file}: {key}")
        for key, value in cfg.items():
            if key.endswith("_token") and key not in named and _is_token_like(value):
                named[key] = _added_token(value, f"{cfg_file}: {key}")
        extra_cfg = cfg.get("extra_special_tokens") or cfg.get("additional_special_tokens") or []
        extra: list[AddedToken] = []
        if isinstance(extra_cfg, Mapping):
            named.update({k: _added_token(v, f"{cfg_file}: extra_special_tokens.{k}") for k, v in extra_cfg.items()})
        elif isinstance(extra_cfg, list):
            extra = [_added_token(v, f"{cfg_file}: extra_special_tokens") for v in extra_cfg]
        else:
            raise ModelLoadError(f"{cfg_file}: extra_special_tokens must be a list or an object")

        templates = _read_chat_templates(root, cfg, cfg_file)
        return cls(
            backend,
            special_tokens=named,
            extra_special_tokens=extra,
            chat_template=templates,
            eos_token_ids=_read_eos_ids(root),
        )

    # -- tokens ---------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies tokenizer.json's post-processor (e.g. BOS).
        A long text goes through ``encode_batch``, which releases the GIL while it works (``encode``
        holds it), so a server thread tokenizing it does not stall the others."""
        if len(text) > LONG_TEXT:
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped when ``skip_special_tokens``."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text, special tokens registered here included
        (coli.grammar builds llguidance's token trie from it)."""
        return self._backend.to_str()

    def token_to_id(self, token: str) -> int | None:
        """The id of one token string (added tokens included), or ``None``."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The token string of one id, or ``None``."""
        return self._backend.id_to_token(int(token_id))

    # -- chat -----------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool | str = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Renders ``messages`` as transformers' ``apply_chat_template(..., tokenize=False)`` does.

        Messages are passed to the template unchanged except that keys whose value is ``None`` are
        dropped and reasoning given as ``reasoning``/``thinking``/``reasoning_content`` is available
        under all three names. ``tools`` must be JSON-schema dicts (passed as-is). Extra ``kwargs``
        (e.g. ``enable_thinking``) become template variables and override the special tokens.
        ``continue_final_message`` cuts the text right after the last message's content (a field name
        may be given instead of ``True``). ``chat_template`` picks a named template or gives a literal
        one. Raises InvalidRequestError for a malformed conversation or a template's ``raise_exception``.
        """
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message and add_generation_prompt cannot both be set: continue the last "
                "message, or prompt a new assistant turn"
            )
        source = self._pick_template(chat_template, tools)
        compiled = _compile(source)
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise InvalidRequestError("messages: expected a non-empty list of messages")
        chat = []
        for i, message in enumerate(messages):
            message = _plain(message)
            if not isinstance(message, dict):
                raise InvalidRequestError(f"messages[{i}]: expected an object, got {type(message).__name__}")
            chat.append(_alias_reasoning({k: v for k, v in message.items() if v is not None}))
        if tools is not None:
            for i, tool in enumerate(tools):
                if not isinstance(tool, Mapping):
                    raise InvalidRequestError(f"tools[{i}]: expected a JSON schema object, got {type(tool).__name__}")
        if documents is not None:
            for i, doc in enumerate(documents):
                if not isinstance(doc, Mapping):
                    raise InvalidRequestError(f"documents[{i}]: expected an object with title and text")
        variables = _plain({**self.special_tokens, **kwargs})
        final_text = _tag_final_message(chat, continue_final_message, source) if continue_final_message else None
        try:
            rendered = compiled.render(
                messages=chat,
                tools=_plain(list(tools)) if tools is not None else None,
                documents=_plain(list(documents)) if documents is not None else None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except _TemplateRaised as e:
            raise InvalidRequestError(_one_line(e.message)) from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
            raise InvalidRequestError(f"chat template failed on these messages: {_one_line(e)}") from None
        if final_text is not None:
            rendered = _cut_after_final_message(rendered, final_text)
        return rendered

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Renders the conversation and encodes it without adding special tokens (the template has them)."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def _pick_template(self, chat_template: str | None, tools: Any) -> str:
        # Same choice as transformers' get_chat_template, with ChatML where a model has none.
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if self.chat_template is not None:
            return self.chat_template
        if self.chat_templates:
            raise InvalidRequestError(
                f"this model has several chat templates and no default: pass one of {sorted(self.chat_templates)}"
            )
        return CHATML_TEMPLATE


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces, for streaming output.

    ``"".join(pushes) + flush() == tokenizer.decode(all_ids, skip_special_tokens)``. A piece never ends
    in an incomplete UTF-8 character: those bytes are held back until the character completes (or until
    ``flush``). With a ByteFallback decoder a run of <0xXX> tokens is held until a non-byte token ends
    it, because one invalid byte anywhere turns the whole run into U+FFFD.

    Each step decodes a short window: the ids from the start of the last emitted chunk that showed a
    token. That start lies on a character boundary, and the window's first visible token is already
    emitted, so decoders that treat the first token specially (Metaspace's or Strip's leading space)
    agree with a full decode. (tokenizers' DecodeStream works alike but cannot flush held-back bytes.)
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._hidden = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self.ids: list[int] = []
        self._window = 0  # ids[_window:] is decoded each step (see the class docstring)
        self._read = 0  # ids[:_read] have been turned into text

    def push(self, token_id: int) -> str:
        """Adds one token id; returns the text it completes (often ``""`` or a whole word)."""
        self.ids.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """Returns whatever is still held back (e.g. bytes of a character that never completed)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        decode = self._tokenizer.decode
        before = decode(self.ids[self._window : self._read], self._skip)
        after = decode(self.ids[self._window :], self._skip)
        if not final:
            if after.endswith("\ufffd"):
                return ""  # an incomplete character; wait for its remaining bytes
            # ByteFallback decodes a run of byte tokens as a whole (all of it becomes U+FFFD if any byte
            # is invalid), so a run is emitted only once a visible non-byte token ends it.
            last_visible = next((i for i in reversed(self.ids[self._read :]) if i not in self._hidden), None)
            if last_visible in self._tokenizer._byte_fallback_ids:
                return ""
        if any(i not in self._hidden for i in self.ids[self._read :]):
            self._window = self._read  # this chunk starts on a character boundary and shows a token
        self._read = len(self.ids)
        return after[len(before) :]


# -- loading helpers ----------------------------------------------------------------------------


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot be read: {_one_line(e)}") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object at the top level")
    return value


def _is_token_like(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, Mapping) and isinstance(value.get("content"), str))


def _added_token(value: Any, where: str = "special token", special: bool | None = True) -> AddedToken:
    """A special token given as a string, an AddedToken, or an AddedToken-like dict."""
    if isinstance(value, AddedToken):
        return value
    if isinstance(value, str):
        return AddedToken(value, special=True, normalized=False)
    if _is_token_like(value):
        flags = {k: bool(value[k]) for k in ("single_word", "lstrip", "rstrip", "normalized") if k in value}
        is_special = bool(value.get("special", False)) if special is None else special
        return AddedToken(value["content"], special=is_special, **flags)
    raise ModelLoadError(f"{where}: expected a string or an object with a \"content\" string")


def _read_chat_templates(root: Path, cfg: Mapping[str, Any], cfg_file: Path) -> dict[str, str]:
    templates: dict[str, str] = {}
    raw = cfg.get("chat_template")
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):
        for i, item in enumerate(raw):
            if not (isinstance(item, Mapping) and all(isinstance(item.get(k), str) for k in ("name", "template"))):
                raise ModelLoadError(f"{cfg_file}: chat_template[{i}] must be an object with string name and template")
            templates[item["name"]] = item["template"]
    elif raw is not None:
        raise ModelLoadError(f"{cfg_file}: chat_template must be a string or a list of {{name, template}}")
    # Template files, when present, replace the config's templates (transformers does the same).
    from_files: dict[str, Path] = {}
    if (root / "chat_template.jinja").is_file():
        from_files["default"] = root / "chat_template.jinja"
    if (root / _TEMPLATE_DIR).is_dir():
        from_files.update({p.name.removesuffix(".jinja"): p for p in sorted((root / _TEMPLATE_DIR).glob("*.jinja"))})
    if from_files:
        try:
            templates = {name: p.read_text(encoding="utf-8") for name, p in from_files.items()}
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{root}: cannot read a chat template file: {_one_line(e)}") from None
    for name, source in templates.items():
        try:
            _compile(source)
        except jinja2.TemplateSyntaxError as e:
            where = from_files.get(name, f"{cfg_file}: chat_template ({name})")
            message = f"{where}: chat template syntax error at line {e.lineno}: {_one_line(e.message)}"
            raise ModelLoadError(message) from None
    return templates


def _read_eos_ids(root: Path) -> list[int]:
    # generate() takes eos ids from generation_config.json, or from config.json when that is absent.
    gen = _read_json(root / "generation_config.json")
    where = "generation_config.json"
    if gen is None:
        gen = _read_json(root / "config.json") or {}
        where = "config.json"
        if "eos_token_id" not in gen and isinstance(gen.get("text_config"), Mapping):
            gen = gen["text_config"]
    value = gen.get("eos_token_id")
    values = value if isinstance(value, list) else [value] if value is not None else []
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ModelLoadError(f"{root / where}: eos_token_id must be an int or a list of ints, got {value!r}")
    return values


def _has_byte_fallback(backend: tokenizers.Tokenizer) -> bool:
    def walk(node: Any) -> bool:
        if isinstance(node, dict):
            return node.get("type") == "ByteFallback" or any(walk(v) for v in node.values())
        return isinstance(node, list) and any(walk(v) for v in node)

    return backend.decoder is not None and walk(json.loads(backend.decoder.__getstate__()))


def _one_line(e: Any) -> str:
    return " ".join(str(e).split())


# -- chat template machinery (mirrors transformers.utils.chat_template_utils) ----------------------


class _TemplateRaised(jinja2.TemplateError):
    """A template's own raise_exception(message)."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """``dict`` for templates, without attribute access to the type (as transformers)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace`` for templates; refuses underscore-prefixed attributes (as transformers)."""

    def __init__(*args: Any, **kwargs: Any):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # transformers' override: no HTML escaping, non-ASCII kept, json.dumps options exposed.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """A deep copy made of plain JSON-like types, as transformers gives templates (`_plain_template_data`)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return _plain(value.item())  # numpy scalars
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())  # pydantic models (e.g. OpenAI SDK messages)
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: dict) -> dict:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tag_final_message(chat: list[dict], field: bool | str, source: str) -> str:
    """Appends a marker to the last message's text so the render can be cut there; returns that text."""
    field = field if isinstance(field, str) else "content"
    final = chat[-1].get(field)
    if final is None:
        raise InvalidRequestError(f'continue_final_message: the last message has no "{field}" to continue')
    fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final] if field in _REASONING_FIELDS else [field]
    if not any(f in source for f in fields):
        raise InvalidRequestError(f'continue_final_message: this chat template does not render "{field}"')
    if isinstance(final, (list, tuple)):
        for part in reversed(final):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                text = part["text"]
                part["text"] = text + _CONTINUE_TAG
                return text
        raise InvalidRequestError("continue_final_message: the last message has no text part to continue")
    if not isinstance(final, str):
        raise InvalidRequestError(f'continue_final_message: the last message\'s "{field}" is not text')
    for f in fields:
        chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return final


def _cut_after_final_message(rendered: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise InvalidRequestError(
            "continue_final_message: the chat template changed the last message, so it cannot be continued"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed trailing space after the tag
