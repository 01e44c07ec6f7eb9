"""What the server tests share: a tiny Qwen3-style chat model, a running server, scripts.

The model is a seeded random qwen3_moe checkpoint (written by transformers) with a
byte-level BPE tokenizer trained here on a few sentences, so any text encodes and decodes
exactly, and a Qwen3-like chat template with tools and <think>. A random model writes
noise, so tests that need a particular answer (a tool call, a reasoning block) *script*
it: a request whose ``seed`` is a key of ``SCRIPTS`` gets that text as its sampled tokens
(``ScriptedSampler`` replaces the runner's sampler). Everything else — the engine steps,
detokenizer, stop strings, parser, HTTP layer and the real clients — runs for real, so a
scripted test proves the serving path, not the model's ability.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

import coli
import coli.runner
from coli.runner import Runner
from coli.sampling import Sampler
from coli.server import Server, ServerConfig, ServerThread

WAIT = 120  # seconds: a bound only a hang reaches
SCRIPTS: dict[int, str] = {}  # seed -> the text the "model" writes
_built: dict[str, Path] = {}
_lock = threading.Lock()

CORPUS = [
    "The weather in Paris is sunny today, with a light wind from the west.",
    "Tokyo is warm and humid; bring an umbrella in the afternoon.",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "def add(a, b):\n    return a + b\n",
    "Hello! How can I help you today? I can answer questions, write code, and call tools.",
    "The capital of France is Paris. The capital of Japan is Tokyo.",
    "Let me think about this step by step before answering the question.",
    "yes no maybe true false red green blue one two three four five",
] * 4
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def write_bpe_tokenizer(out: Path, extra: list[str] = ()) -> int:
    """A byte-level BPE tokenizer (Qwen's kind) with ChatML specials; returns its size.
    ``extra`` texts become whole tokens, and so does each of their lines: a recorded
    client's system prompt, tools and instructions are then a handful of tokens (any
    other text still encodes byte by byte, and every token decodes to its text)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    pieces = {p for text in extra for p in (text, *text.splitlines()) if len(p.strip()) >= 8}
    pieces -= set(ADDED) | set(SPECIAL)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in sorted(pieces)])
    tok.save(str(out / "tokenizer.json"))
    return tok.get_vocab_size()


def fixture_texts() -> list[str]:
    """Every string in the recorded client requests (tests/fixtures/clients/)."""
    out: list[str] = []

    def walk(v):
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, dict):
            schema = v.get("input_schema", v.get("parameters"))
            if isinstance(v.get("name"), str) and isinstance(schema, dict):  # a tool, as templates render it
                fn = {"name": v["name"], "parameters": schema}
                if isinstance(v.get("description"), str):
                    fn["description"] = v["description"]
                out.append(json.dumps({"type": "function", "function": fn}, ensure_ascii=False))
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    for f in sorted((Path(__file__).parent / "fixtures" / "clients").glob("*.json")):
        walk(json.loads(f.read_text())["requests"])
    return out


def build_agent_model(root: Path) -> Path:
    """The tiny chat model for the coding agents: a 64k context, and the clients' recorded
    prompts as whole tokens (write_bpe_tokenizer), so Claude Code's ~80k characters of
    system prompt and tools take a few thousand tokens, not 55k (minutes of prefill)."""
    return build_chat_model(root, "qwen3-agents", max_positions=65536, extra=fixture_texts())


def build_chat_model(root: Path, name: str = "qwen3-chat", max_positions: int = 1024,
                     extra: list[str] = ()) -> Path:
    """The tiny chat model (built once per test process)."""
    from conftest import make_hf_model
    from test_tokenizer import QWEN3

    with _lock:
        if name in _built:
            return _built[name]
        out = root / name
        out.mkdir(parents=True, exist_ok=True)
        vocab = write_bpe_tokenizer(out, extra)
        make_hf_model("qwen3_moe", out / "hf", vocab_size=vocab, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=48, head_dim=16, max_position_embeddings=max_positions,
                      norm_topk_prob=True)
        for f in (out / "hf").iterdir():
            if f.name not in ("tokenizer.json", "tokenizer_config.json"):
                f.rename(out / f.name)
        ids = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
        by_name = {t["content"]: t["id"] for t in ids}
        (out / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
            "chat_template": QWEN3}))
        (out / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": [by_name["<|im_end|>"], by_name["<|endoftext|>"]]}))
        _built[name] = out
        return out


class ScriptedSampler(Sampler):
    """Samples normally, unless the request's seed names a script: then it writes that.

    The script is followed by text (what was generated so far, forced tokens included, is
    a prefix of it), so a constraint that forces some of it (coli.grammar) stays in step.
    Under a constraint's mask the scripted "model" is a model like any other: when the
    mask refuses the script's next token it takes the allowed token that writes the most
    of the script, and when none does, it samples."""

    tokenizer = None
    eos: int | None = None
    default: list[str] = []  # scripts of requests without a scripted seed, in turn; the last one stays

    def __init__(self, params):
        super().__init__(params)
        script = SCRIPTS.get(params.seed) if params.seed is not None else None
        if script is None and self.default:
            script = self.default.pop(0) if len(self.default) > 1 else self.default[0]
        self.script = script
        # a script is not the argmax: the runner must call sample
        self.is_greedy = self.is_greedy and self.script is None

    def sample(self, logits, generated=(), allowed=None):
        if self.script is None:
            return super().sample(logits, generated, allowed)
        done = self.tokenizer.decode(list(generated), skip_special_tokens=False)
        rest = self.script[len(done):] if self.script.startswith(done) else ""
        tok = self.tokenizer.encode(rest, add_special_tokens=False)[0] if rest else self.eos
        if allowed is None or allowed[tok]:
            return tok
        texts = {int(t): self.tokenizer.decode([int(t)], skip_special_tokens=False) for t in allowed.nonzero()[0]}
        fits = [t for t, text in texts.items() if text and rest.startswith(text)]
        return max(fits, key=lambda t: len(texts[t])) if fits else super().sample(logits, generated, allowed)


class Running:
    """A model, its runner and server, listening on 127.0.0.1 at ``url``."""

    def __init__(self, model_dir: Path, *, kv_slots=4, max_queue=8, ctx=512, config: dict | None = None,
                 runner: dict | None = None):
        self.model = coli.load(model_dir, threads=1)
        self.runner = Runner(self.model, kv_slots=kv_slots, max_queue=max_queue, ctx=ctx, persist=False,
                             notice=lambda text: None, **(runner or {}))
        self.server = Server(self.model, self.runner, ServerConfig(model_id="tiny", **(config or {})))
        self.thread = ServerThread(self.server)
        self.url = self.thread.start()
        self.tokenizer = self.model.tokenizer

    def close(self) -> None:
        self.thread.stop()
        self.runner.close()

    def openai(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "local"), max_retries=0, timeout=WAIT,
                      **kw)

    def anthropic(self, **kw):
        from anthropic import Anthropic

        return Anthropic(base_url=self.url, api_key=kw.pop("api_key", "local"), max_retries=0, timeout=WAIT, **kw)

    def metric(self, name: str, labels: dict | None = None) -> float | None:
        return self.runner.metrics.value(name, labels)


def scripted_sampler(tokenizer, eos: int, default: str | list[str] | None = None):
    scripts = [] if default is None else [default] if isinstance(default, str) else list(default)
    ScriptedSampler.tokenizer, ScriptedSampler.eos, ScriptedSampler.default = tokenizer, eos, scripts
    return ScriptedSampler


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory) -> Path:
    return build_chat_model(tmp_path_factory.getbasetemp())


def running(chat_model_dir: Path, default_script: str | None = None, **kw):
    """A module-scoped server with the scripted sampler installed (use in a fixture);
    ``default_script``: what every request without a scripted seed gets (a list: one after
    another, the last for the rest; ``ScriptedSampler.default`` can be refilled)."""
    with pytest.MonkeyPatch.context() as mp:
        srv = Running(chat_model_dir, **kw)
        eos = srv.tokenizer.token_to_id("<|im_end|>")
        mp.setattr(coli.runner, "Sampler", scripted_sampler(srv.tokenizer, eos, default_script))
        try:
            yield srv
        finally:
            srv.close()


def http(srv_or_url, method: str, path: str, body=None, headers: dict | None = None, raw: bytes | None = None):
    """One plain HTTP request: (status, headers, parsed JSON body or text)."""
    import http.client
    from urllib.parse import urlsplit

    url = srv_or_url if isinstance(srv_or_url, str) else srv_or_url.url
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=WAIT)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    hdrs = {"Content-Type": "application/json"} if data is not None else {}
    hdrs.update(headers or {})
    conn.request(method, path, body=data, headers=hdrs)
    resp = conn.getresponse()
    text = resp.read().decode("utf-8", "replace")
    conn.close()
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = text
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, parsed
