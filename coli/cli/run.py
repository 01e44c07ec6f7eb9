"""`coli run`: one prompt in, the streamed answer out."""
from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from coli.cli.common import (KvCacheDtypeOpt, CtxOpt, DraftModelOpt, KvDirOpt, MaxTokensOpt, ModelOpt, PersistOpt, PinOpt, QuantOpt,
                             RamBudgetOpt, SeedOpt, SpeculativeOpt, SystemOpt, TemperatureOpt, ThreadsOpt, TopKOpt,
                             TopPOpt, fail, load_model, load_options, messages_for, open_runner, stderr,
                             user_errors)
from coli.cli.constrain import GrammarOpt, JsonSchemaOpt, local_constraint, read_options
from coli.scheduler import Error, Finished, TextDelta, Usage


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
    kv_cache_dtype: KvCacheDtypeOpt = None,
    ctx: CtxOpt = None,
    kv_dir: KvDirOpt = None,
    kv_persist: PersistOpt = True,
    json_schema: JsonSchemaOpt = None,
    grammar: GrammarOpt = None,
    speculative: SpeculativeOpt = None,
    draft_model: DraftModelOpt = None,
) -> None:
    """Answer one prompt and stream the answer to stdout.

    Examples: coli run "What does 'harbor' mean?"  ·  echo "hi" | coli run --model ./Qwen3-0.6B  ·
    coli run --json-schema person.json "Invent a person" | jq .
    """
    spec = read_options(json_schema, grammar)
    if prompt is None:
        if sys.stdin.isatty():
            raise fail("no prompt: pass one as an argument or pipe it on stdin (echo \"hi\" | coli run)")
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise fail("the prompt is empty")
    if raw and system:
        raise fail("--system needs the chat template; drop --raw")
    m = load_model(model, threads, **load_options(quant, ram_budget, pin, kv_cache_dtype))
    # a constrained answer starts without reasoning (templates that know enable_thinking)
    kwargs = {"enable_thinking": False} if spec is not None and not raw else {}
    ids = m.prompt_ids(prompt if raw else messages_for(prompt.strip(), system), raw=raw, **kwargs)
    sampling = m.sampling_params(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    last, finish, generated = "", None, 0
    with open_runner(m, ctx=ctx, kv_dir=kv_dir, persist=kv_persist, speculative=speculative,
                     draft_model=draft_model) as runner:
        if ctx is not None and runner.ctx < ctx:
            stderr.print(f"note: --ctx {ctx} is more than this model holds: using {runner.ctx}", soft_wrap=True)
        handle = runner.submit(ids, max_tokens=max_tokens, sampling=sampling, cache_slot=0,
                               constraint=local_constraint(spec))
        try:
            for ev in handle:
                if isinstance(ev, TextDelta):
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
                    last = ev.text or last
                elif isinstance(ev, Usage):
                    generated = ev.completion_tokens
                elif isinstance(ev, Finished):
                    finish = ev.finish_reason
                elif isinstance(ev, Error):
                    raise ev.exception()
        finally:
            handle.cancel()
    m.close()
    if not last.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
    if finish == "length":  # cut short: say so, where a pipe's reader will not mistake it for the answer
        why = (f"--max-tokens {max_tokens}" if generated >= max_tokens
               else f"the end of the context ({runner.ctx} tokens; raise --ctx)")
        stderr.print(f"note: the answer was cut at {why}", soft_wrap=True)
