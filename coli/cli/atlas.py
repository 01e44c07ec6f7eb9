"""`coli atlas`: measure what each expert of a MoE model does; write experts.json."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from coli.cli.common import ExitCode, ModelOpt, QuantOpt, ThreadsOpt, fail, load_model, stderr, user_errors


@user_errors
def atlas(
    model: ModelOpt = None,
    corpus: Annotated[Optional[str], typer.Option(
        "--corpus", "-c", help="Text to measure with: a .jsonl file ({\"text\", \"category\"} per line), a text file "
                               "(blank-line passages, category = file name), a directory (category = sub-directory "
                               "or file name), or - for stdin. Default: the labelled corpus shipped with coli.")] = None,
    out: Annotated[Optional[str], typer.Option(
        "--out", "-o", help="Where to write experts.json; - prints it. Default: beside the model when its directory "
                            "is writable, else ~/.cache/coli/atlas/<fingerprint>/ (where coli serve looks).")] = None,
    regions: Annotated[int, typer.Option("--regions", min=1, max=64,
                                         help="How many regions to group the experts into.")] = 10,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1,
                                            help="Tokens read from each passage (the rest is cut).")] = 256,
    batch_tokens: Annotated[int, typer.Option("--batch-tokens", min=1,
                                              help="Tokens per forward pass (several passages in one batch).")] = 1024,
    restart: Annotated[bool, typer.Option("--restart", help="Ignore a partial run of the same corpus and start over.")]
    = False,
    threads: ThreadsOpt = None,
    quant: QuantOpt = None,
) -> None:
    """Map the experts: run a corpus through the model (prefill only) and write experts.json.

    Records per MoE layer and expert: routing frequency, mean gate weight, the tokens that
    route to it most (with example contexts), the corpus categories it prefers,
    co-activation within the layer and with the next layer; then groups the experts of all
    layers into regions. An interrupted run resumes from its last checkpoint when run again.
    `coli serve` / `coli web` serve the result at GET /experts/atlas, drawn in the dashboard's
    Brain → Explore. Format: docs/ATLAS.md."""
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from coli import atlas as A

    passages = A.read_corpus(corpus)
    m = load_model(model, threads, **({"quant": quant} if quant else {}))
    try:
        info = A.model_info(m)
        target = None if out == "-" else Path(out).expanduser() if out else A.atlas_path(m.path, info["fingerprint"])
        state_dir = target.parent if target is not None else A.atlas_path(m.path, info["fingerprint"]).parent
        state = state_dir / f".{A.ATLAS_FILE}.partial.npz"
        if restart:
            state.unlink(missing_ok=True)
        state_dir.mkdir(parents=True, exist_ok=True)
        name = "default" if corpus is None else ("stdin" if corpus == "-" else Path(corpus).name)
        kwargs = dict(corpus_name=name, n_regions=regions, max_tokens=max_tokens, batch_tokens=batch_tokens,
                      state=state, info=info)
        if stderr.is_terminal:
            with Progress(TextColumn("[bold]atlas[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("passages"),
                          TextColumn("· {task.fields[tokens]} tokens"), TimeRemainingColumn(),
                          console=stderr, transient=True) as bar:
                task = bar.add_task("atlas", total=len(passages), tokens=0)
                doc = A.make(m, passages, on_step=lambda r, total: bar.update(
                    task, completed=r.passages_done, tokens=f"{r.tokens:,}"), **kwargs)
        else:
            doc = A.make(m, passages, **kwargs)
    finally:
        m.close()
    if target is None:
        typer.echo(json.dumps(doc, ensure_ascii=False, indent=1))
        return
    try:
        A.save(doc, target)
    except OSError as e:
        raise fail(f"cannot write {target}: {e.strerror or e}", code=ExitCode.ERROR) from None
    c = doc["corpus"]
    stderr.print(f"{len(doc['regions'])} regions over {doc['model']['moe_layer_count']} MoE layers × "
                 f"{doc['model']['experts_per_layer']} experts, from {c['passages']} passages ({c['tokens']:,} tokens)",
                 soft_wrap=True)
    for r in doc["regions"]:
        stderr.print(f"  [bold]{escape(r['name'])}[/] ({len(r['experts'])} expert{'s' if len(r['experts']) != 1 else ''})", soft_wrap=True)
    stderr.print(f"wrote {target}", soft_wrap=True)
