"""`coli chat`: a conversation in the terminal, or one answer when piped.

Not a terminal (``echo "question" | coli chat``, or stdout redirected): the whole
input is one user message and only the answer goes to stdout. In a terminal: a
line REPL (prompt_toolkit) with history; the conversation's KV cache is kept
between turns so each turn only computes its new tokens.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from coli.cli.common import (MaxTokensOpt, ModelOpt, SeedOpt, SystemOpt, TemperatureOpt, ThreadsOpt, TopKOpt,
                             TopPOpt, QuantOpt, RamBudgetOpt, PinOpt, fail, load_model, load_options, messages_for, stderr, user_errors)

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
) -> None:
    """Chat with a model (the built-in one by default).

    In a terminal: a conversation with history. Piped: `echo "What does 'ocean' mean?" | coli chat`
    prints only the answer."""
    sampling = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        prompt = sys.stdin.read() if not sys.stdin.isatty() else None
        if prompt is None:
            raise fail("stdout is not a terminal: pipe the question on stdin (echo \"hi\" | coli chat > answer.txt)")
        if not prompt.strip():
            raise fail("the prompt on stdin is empty")
        m = load_model(model, threads, **load_options(quant, ram_budget, pin))
        for piece in m.generate(messages_for(prompt.strip(), system), **sampling):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return
    _repl(load_model(model, threads, **load_options(quant, ram_budget, pin)), system, sampling)


def _repl(m, system: str | None, sampling: dict) -> None:
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory

    history = Path.home() / ".cache" / "coli" / "chat_history"
    history.parent.mkdir(parents=True, exist_ok=True)
    session = PromptSession(history=FileHistory(str(history)))
    stderr.print(f"[dim]{m!r}[/]\n[dim]{HELP}[/]")
    messages = [{"role": "system", "content": system}] if system else []
    cache = m.engine.new_cache()
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
            messages = [m_ for m_ in messages if m_["role"] == "system"]
            stderr.print("[dim]new conversation[/]")
            continue
        if text.startswith("/system"):
            messages = [{"role": "system", "content": text[len("/system"):].strip()}] + \
                [m_ for m_ in messages if m_["role"] != "system"]
            continue
        messages.append({"role": "user", "content": text})
        answer = []
        try:
            for piece in m.generate(messages, cache=cache, **sampling):
                answer.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            stderr.print("\n[dim](stopped)[/]")
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(answer)})
