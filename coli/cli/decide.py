"""`coli decide`: typed decisions (yes/no, choice, score) about a state, for shell scripts.

The request and the answers are those of POST /v1/systemone (coli.server.systemone); with
``--url`` they go to a running server, otherwise the model is loaded here.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from coli.cli.common import (CtxOpt, ModelOpt, QuantOpt, ThreadsOpt, fail, load_model, load_options, open_runner,
                             user_errors)

NO = 1  # the exit status when a yes/no answer falls below --threshold (0: all at or above it)

UrlOpt = Annotated[Optional[str], typer.Option(
    "--url", envvar="COLI_URL", show_envvar=True,
    help="Ask a running server (coli serve) at this address instead of loading a model here.")]
ApiKeyOpt = Annotated[Optional[str], typer.Option(
    "--api-key", envvar="COLI_API_KEY", show_envvar=True, help="The server's API key (with --url).")]


@user_errors
def decide(
    noul: Annotated[Optional[list[str]], typer.Option(
        "--noul", "-y", help="A yes/no question (repeatable).")] = None,
    choice: Annotated[Optional[list[str]], typer.Option(
        "--choice", "-c", help="A choice: 'QUESTION|OPTION|OPTION...' (2 to 255 options; repeatable).")] = None,
    score: Annotated[Optional[list[str]], typer.Option(
        "--score", "-S", help="A score: 'QUESTION|LEVEL 0|LEVEL 1...' (2 to 10 levels; repeatable).")] = None,
    questions: Annotated[Optional[Path], typer.Option(
        "--questions", "-f", help="A JSON file of questions, as /v1/systemone takes them: "
                                  '{"id": {"type": "noul", "instructions": "..."}, ...}.')] = None,
    state: Annotated[Optional[str], typer.Option(
        "--state", help="The state to decide about. Default: stdin.")] = None,
    threshold: Annotated[float, typer.Option(
        "--threshold", min=0.0, max=1.0,
        help=f"Exit {NO} when a yes/no answer's probability is below this, 0 when all reach it.")] = 0.5,
    as_json: Annotated[Optional[bool], typer.Option(
        "--json/--table", help="JSON (the /v1/systemone reply) or a table. Default: a table on a terminal, "
                               "JSON in a pipe.")] = None,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    model: ModelOpt = None,
    threads: ThreadsOpt = None,
    quant: QuantOpt = None,
    ctx: CtxOpt = None,
) -> None:
    """Answer typed questions about a state with probabilities; nothing is generated.

    Exit status: 0 when every yes/no answer is at least --threshold, 1 when one is below it,
    2 for bad input or a failed request — so it works in `if`.

    Examples:
      echo "I was charged twice" | coli decide --noul "Is this about billing?"
      coli decide --state "$MSG" --choice "Which team?|billing|technical|other" --score "Urgency?|low|mid|high"
      if coli decide -y "Is this spam?" --threshold 0.8 < mail.txt; then mv mail.txt spam/; fi
      coli decide -f questions.json --url http://127.0.0.1:8000 < ticket.txt | jq .answers
    """
    body = {"state": _state(state), "questions": _questions(noul or [], choice or [], score or [], questions)}
    if url is not None:
        reply = _remote(url, api_key, body)
    else:
        reply = _local(body, model, threads, quant, ctx)
    table = sys.stdout.isatty() if as_json is None else not as_json
    if table:
        _table(reply)
    else:
        sys.stdout.write(json.dumps(reply, ensure_ascii=False) + "\n")
    nouls = [a["noul"] for a in reply["answers"].values() if a["type"] == "noul"]
    if any(p < threshold for p in nouls):
        raise typer.Exit(NO)


def _state(state: str | None) -> str:
    if state is None:
        if sys.stdin.isatty():
            raise fail("no state: pass --state TEXT or pipe it on stdin (echo \"...\" | coli decide ...)")
        state = sys.stdin.read()
    if not state.strip():
        raise fail("the state is empty")
    return state


def _questions(nouls: list[str], choices: list[str], scores: list[str], path: Path | None) -> dict:
    out: dict = {}
    if path is not None:
        try:
            out = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise fail(f"--questions {path}: {e}") from None
        if not isinstance(out, dict):
            raise fail(f"--questions {path}: expected a JSON object of questions")

    def add(q: dict, text: str) -> None:
        qid, n = text, 2
        while qid in out:
            qid, n = f"{text} ({n})", n + 1
        out[qid] = q

    for text in nouls:
        add({"type": "noul", "instructions": text}, text)
    for kind, items, lo in (("choice", choices, 2), ("score", scores, 2)):
        for spec in items:
            parts = [p.strip() for p in spec.split("|")]
            if len(parts) < 1 + lo or not parts[0] or not all(parts[1:]):
                raise fail(f"--{kind} {spec!r}: expected 'QUESTION|{'OPTION|OPTION' if kind == 'choice' else 'LEVEL|LEVEL'}"
                           "...'")
            criteria = {p: None for p in parts[1:]} if kind == "choice" else parts[1:]
            add({"type": kind, "instructions": parts[0], "criteria": criteria}, parts[0])
    if not out:
        raise fail("no questions: give --noul, --choice, --score or --questions FILE")
    return out


def _local(body: dict, model, threads, quant, ctx) -> dict:
    import asyncio

    from coli.server import Server, ServerConfig
    from coli.server.errors import ApiError
    from coli.server.systemone import evaluate

    m = load_model(model, threads, **load_options(quant))
    try:
        with open_runner(m, ctx=ctx, persist=False) as runner:
            try:
                reply, _ = asyncio.run(evaluate(Server(m, runner, ServerConfig()), body))
            except ApiError as e:
                raise fail(_message(e.jev())) from None
    finally:
        m.close()
    return reply


def _remote(url: str, api_key: str | None, body: dict) -> dict:
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url.rstrip("/") + "/v1/systemone", data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        try:
            detail = json.loads(e.read())
        except ValueError:
            detail = None
        raise fail(f"{url}: {e.code} {_message(detail) if detail else e.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise fail(f"{url}: {getattr(e, 'reason', e)}") from None


def _message(body) -> str:
    """The text of a Jev error body (detail[] or detail.message; OpenAI's envelope too)."""
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, list):
        return "; ".join(f"{'.'.join(str(x) for x in d.get('loc', [])[1:])}: {d.get('msg')}" for d in detail)
    if isinstance(detail, dict):
        return str(detail.get("message"))
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message"))
    return str(body)


def _table(reply: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(show_header=True, header_style="bold")
    for col in ("question", "answer", "confidence", "probabilities"):
        t.add_column(col)
    for qid, a in reply["answers"].items():
        if a["type"] == "noul":
            t.add_row(qid, "yes" if a["noul"] >= 0.5 else "no", "", f"yes {a['noul']:.3f}")
            continue
        top = sorted(a["probabilities"].items(), key=lambda kv: -kv[1])[:5]
        shown = "  ".join(f"{k} {v:.3f}" for k, v in top)
        best = a["choice"] if a["type"] == "choice" else f"{a['score']:.2f}"
        t.add_row(qid, best, f"{a['confidence']:.3f}", shown)
    Console().print(t)
