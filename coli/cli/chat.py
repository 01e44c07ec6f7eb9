"""`coli chat`: a conversation in the terminal, or one answer when piped.

Not a terminal (``echo "question" | coli chat``, or stdout redirected): the whole
input is one user message and only the answer goes to stdout. In a terminal: a
line REPL (prompt_toolkit) with history. Turns go through the shared scheduler in
KV slot 0, so each turn only computes its new tokens, and a restarted chat that
repeats the conversation reuses the saved prefix.
"""
from __future__ import annotations

import sys
from pathlib import Path

from coli.cli.common import (CtxOpt, KvDirOpt, MaxTokensOpt, ModelOpt, PersistOpt, PinOpt, QuantOpt, RamBudgetOpt,
                             SeedOpt, SystemOpt, TemperatureOpt, ThreadsOpt, TopKOpt, TopPOpt, fail, load_model,
                             load_options, messages_for, open_runner, stderr, user_errors)

HELP = "Commands: /clear (new conversation), /system TEXT, /help, /quit (or Ctrl-D). Ctrl-C stops an answer."


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
    ctx: CtxOpt = None,
    kv_dir: KvDirOpt = None,
    kv_persist: PersistOpt = True,
) -> None:
    """Chat with a model (the built-in one by default).

    In a terminal: a conversation with history. Piped: `echo "What does 'ocean' mean?" | coli chat`
    prints only the answer."""
    piped = not (sys.stdin.isatty() and sys.stdout.isatty())
    prompt = None
    if piped:
        if sys.stdin.isatty():
            raise fail("stdout is not a terminal: pipe the question on stdin (echo \"hi\" | coli chat > answer.txt)")
        prompt = sys.stdin.read()
        if not prompt.strip():
            raise fail("the prompt on stdin is empty")
    m = load_model(model, threads, **load_options(quant, ram_budget, pin))
    sampling = m.sampling_params(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    with open_runner(m, ctx=ctx, kv_dir=kv_dir, persist=kv_persist) as runner:
        def answer(messages):
            ids = m.prompt_ids(messages)
            yield from runner.generate(ids, max_tokens=max_tokens, sampling=sampling, cache_slot=0)

        if piped:
            for piece in answer(messages_for(prompt.strip(), system)):
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
        else:
            _repl(m, system, answer)
    m.close()


def _repl(m, system: str | None, answer) -> None:
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory

    history = Path.home() / ".cache" / "coli" / "chat_history"
    history.parent.mkdir(parents=True, exist_ok=True)
    session = PromptSession(history=FileHistory(str(history)))
    stderr.print(f"[dim]{m!r}[/]\n[dim]{HELP}[/]")
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
        if text.startswith("/system"):
            messages = [{"role": "system", "content": text[len("/system"):].strip()}] + \
                [x for x in messages if x["role"] != "system"]
            continue
        messages.append({"role": "user", "content": text})
        parts = []
        try:
            for piece in answer(messages):
                parts.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            stderr.print("\n[dim](stopped)[/]")
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(parts)})
