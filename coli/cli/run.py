"""`coli run`: one prompt in, the streamed answer out."""
from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from coli.cli.common import (CtxOpt, DraftModelOpt, KvDirOpt, MaxTokensOpt, ModelOpt, PersistOpt, PinOpt, QuantOpt,
                             RamBudgetOpt, SeedOpt, SpeculativeOpt, SystemOpt, TemperatureOpt, ThreadsOpt, TopKOpt, TopPOpt, fail, load_model,
                             load_options, messages_for, open_runner, user_errors)


@user_errors
def run(
    prompt: Annotated[Optional[str], typer.Argument(help="The prompt. Read from stdin when omitted.")] = None,
    model: ModelOpt = None,
    max_tokens: MaxTokensOpt = 256,
    temperature: TemperatureOpt = None,
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    seed: SeedOpt = None,
    system: SystemOpt = None,
    raw: Annotated[bool, typer.Option("--raw", help="Send the prompt as-is, without the chat template.")] = False,
    threads: ThreadsOpt = None,
    quant: QuantOpt = None,
    ram_budget: RamBudgetOpt = None,
    pin: PinOpt = None,
    ctx: CtxOpt = None,
    kv_dir: KvDirOpt = None,
    kv_persist: PersistOpt = True,
    speculative: SpeculativeOpt = None,
    draft_model: DraftModelOpt = None,
) -> None:
    """Answer one prompt and stream the answer to stdout.

    Examples: coli run "What does 'harbor' mean?"  ·  echo "hi" | coli run --model ./Qwen3-0.6B
    """
    if prompt is None:
        if sys.stdin.isatty():
            raise fail("no prompt: pass one as an argument or pipe it on stdin (echo \"hi\" | coli run)")
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise fail("the prompt is empty")
    if raw and system:
        raise fail("--system needs the chat template; drop --raw")
    m = load_model(model, threads, **load_options(quant, ram_budget, pin))
    ids = m.prompt_ids(prompt if raw else messages_for(prompt.strip(), system), raw=raw)
    sampling = m.sampling_params(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    last = ""
    with open_runner(m, ctx=ctx, kv_dir=kv_dir, persist=kv_persist, speculative=speculative,
                     draft_model=draft_model) as runner:
        for piece in runner.generate(ids, max_tokens=max_tokens, sampling=sampling, cache_slot=0):
            sys.stdout.write(piece)
            sys.stdout.flush()
            last = piece or last
    m.close()
    if not last.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
