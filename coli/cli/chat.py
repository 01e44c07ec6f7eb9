"""`coli chat`: the Textual app in a terminal, one answer when piped, a line REPL with --plain.

Not a terminal (``echo "question" | coli chat``, or stdout redirected): the whole
input is one user message and only the answer goes to stdout. In a terminal: the
Textual app (coli.tui) with live routing and profiling panes; ``--plain`` is a line
REPL (prompt_toolkit) instead. Turns go through the shared scheduler, one
conversation per KV slot, so each turn only computes its new tokens, and a restarted
chat that repeats the conversation reuses the saved prefix. ``--url`` talks to a
running ``coli serve`` instead of loading a model.
"""
from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer
from rich.markup import escape

from coli.cli.common import (KvCacheDtypeOpt, CtxOpt, DraftModelOpt, KvDirOpt, MaxTokensOpt, ModelOpt, PersistOpt, PinOpt, QuantOpt,
                             RamBudgetOpt, SeedOpt, SpeculativeOpt, SystemOpt, TemperatureOpt, ThreadsOpt, TopKOpt, TopPOpt, fail, load_model,
                             load_options, messages_for, open_runner, stderr, user_errors)
from coli.cli.constrain import GrammarOpt, JsonSchemaOpt, local_constraint, read_options, request_fields
from coli.errors import ColiError
from coli.scheduler.events import Error, ReasoningDelta, TextDelta
from coli.tui.conversation import HISTORY_FILE

HELP = ("Commands: /clear (new conversation), /system TEXT, /help, /quit (or Ctrl-D). "
        "Alt-Enter (Esc, Enter) starts a new line; Ctrl-C stops an answer.")

PlainOpt = Annotated[bool, typer.Option("--plain", help="A line REPL (prompt_toolkit) instead of the full-screen app.")]
UrlOpt = Annotated[Optional[str], typer.Option(
    "--url", envvar="COLI_URL", show_envvar=True,
    help="Chat with a running `coli serve` (e.g. http://127.0.0.1:8000) instead of loading a model.")]
ApiKeyOpt = Annotated[Optional[str], typer.Option(
    "--api-key", envvar="COLI_API_KEY", show_envvar=True, help="The server's API key (with --url).")]
SlotsOpt = Annotated[int, typer.Option(
    "--slots", envvar="COLI_SLOTS", show_envvar=True, min=1, help="KV slots to switch between in the app, one conversation each (F5, /slot N).")]


@user_errors
def chat(
    model: ModelOpt = None,
    max_tokens: MaxTokensOpt = 512,
    temperature: TemperatureOpt = None,
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    seed: SeedOpt = None,
    system: SystemOpt = None,
    threads: ThreadsOpt = None,
    quant: QuantOpt = None,
    ram_budget: RamBudgetOpt = None,
    pin: PinOpt = None,
    kv_cache_dtype: KvCacheDtypeOpt = None,
    ctx: CtxOpt = None,
    kv_dir: KvDirOpt = None,
    kv_persist: PersistOpt = True,
    speculative: SpeculativeOpt = None,
    draft_model: DraftModelOpt = None,
    plain: PlainOpt = False,
    slots: SlotsOpt = 4,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    json_schema: JsonSchemaOpt = None,
    grammar: GrammarOpt = None,
) -> None:
    """Chat with a model (the built-in one by default).

    In a terminal: a full-screen chat with live expert routing and profiling panes (`--plain`:
    a line REPL). Piped: `echo "What does 'ocean' mean?" | coli chat` prints only the answer.
    `--json-schema` / `--grammar` constrain every answer (piped and `--plain`)."""
    spec = read_options(json_schema, grammar)
    piped = not (sys.stdin.isatty() and sys.stdout.isatty())
    if spec is not None and not (plain or piped):
        raise fail("--json-schema and --grammar work piped or with --plain, not in the full-screen app")
    prompt = None
    if piped:
        if sys.stdin.isatty():
            raise fail("stdout is not a terminal: pipe the question on stdin (echo \"hi\" | coli chat > answer.txt)")
        prompt = sys.stdin.read()
        if not prompt.strip():
            raise fail("the prompt on stdin is empty")
    if url is not None:
        _remote(url, api_key, piped, prompt, plain, system, max_tokens,
                {**{k: v for k, v in dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed).items()
                    if v is not None}, **request_fields(spec)})
        return
    m = load_model(model, threads, **load_options(quant, ram_budget, pin, kv_cache_dtype))
    sampling = m.sampling_params(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    with open_runner(m, ctx=ctx, kv_dir=kv_dir, persist=kv_persist, kv_slots=1 if piped or plain else slots,
                     speculative=speculative, draft_model=draft_model) as runner:
        if piped:
            ids = m.prompt_ids(messages_for(prompt.strip(), system), **({"enable_thinking": False} if spec else {}))
            for piece in runner.generate(ids, max_tokens=max_tokens, sampling=sampling, cache_slot=0,
                                         constraint=local_constraint(spec)):
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
        else:
            from coli.tui.backend import LocalBackend

            backend = LocalBackend(m, runner, max_tokens=max_tokens, sampling=sampling,
                                   constraint=local_constraint(spec))
            if plain:
                _repl(backend, system)
            else:
                _app(backend, system)
    m.close()


def _remote(url, api_key, piped, prompt, plain, system, max_tokens, sampling) -> None:
    from coli.tui.backend import RemoteBackend

    backend = RemoteBackend(url, api_key, max_tokens=max_tokens, sampling=sampling)
    if piped:
        for ev in backend.stream(messages_for(prompt.strip(), system), 0):
            if isinstance(ev, TextDelta):
                sys.stdout.write(ev.text)
                sys.stdout.flush()
            elif isinstance(ev, Error):
                raise ColiError(ev.message)
        sys.stdout.write("\n")
    elif plain:
        _repl(backend, system)
    else:
        _app(backend, system)


def _app(backend, system) -> None:
    from coli.tui.app import ChatApp

    ChatApp(backend, system=system).run()


def _answer(backend, messages) -> tuple[str, bool]:
    """Stream one answer to stdout; Ctrl-C stops it. Returns (text, stopped)."""
    parts, thinking = [], False
    stream = backend.stream(messages, 0)
    try:
        for ev in stream:
            if isinstance(ev, ReasoningDelta):
                if not thinking:
                    thinking = True
                sys.stdout.write(f"\x1b[2m{ev.text}\x1b[0m")
            elif isinstance(ev, TextDelta):
                if thinking:
                    thinking = False
                    sys.stdout.write("\n")
                parts.append(ev.text)
                sys.stdout.write(ev.text)
            elif isinstance(ev, Error) and ev.code != "cancelled":
                raise ColiError(ev.message)
            sys.stdout.flush()
    except KeyboardInterrupt:
        backend.cancel()
        stream.close()
        stderr.print("\n[dim](stopped)[/]")
        return "".join(parts), True
    return "".join(parts), False


def _repl(backend, system: str | None) -> None:
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory
    from prompt_toolkit.key_binding import KeyBindings

    HISTORY_FILE.parent.mkdir(parents=True, exist_ok=True)
    keys = KeyBindings()

    @keys.add("escape", "enter")
    def _newline(event):
        event.current_buffer.insert_text("\n")

    session = PromptSession(history=FileHistory(str(HISTORY_FILE)), key_bindings=keys,
                            prompt_continuation=lambda width, *_: "." * (width - 1) + " ")
    stderr.print(f"[dim]{backend.name}[/]\n[dim]{HELP}[/]")
    messages = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            line = session.prompt("› ")
        except KeyboardInterrupt:
            continue
        except EOFError:
            return
        text = line.strip()
        if not text:
            continue
        if text in ("/quit", "/exit"):
            return
        if text == "/help":
            stderr.print(HELP)
            continue
        if text == "/clear":
            messages = [x for x in messages if x["role"] == "system"]
            stderr.print("[dim]new conversation[/]")
            continue
        if text == "/system" or text.startswith(("/system ", "/system\n")):
            prompt = text[len("/system"):].strip()
            messages = ([{"role": "system", "content": prompt}] if prompt else []) + \
                [x for x in messages if x["role"] != "system"]
            stderr.print(f"[dim]system prompt set ({len(prompt)} characters)[/]" if prompt
                         else "[dim]system prompt cleared[/]")
            continue
        if text.startswith("/") and not text.startswith("//"):
            stderr.print(f"unknown command {escape(text.split()[0])}: {HELP} (start a message with // to send "
                         "a leading /)")
            continue
        if text.startswith("//"):
            text = text[1:]
        messages.append({"role": "user", "content": text})
        answer, _ = _answer(backend, messages)
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": answer})
