"""`--json-schema` and `--grammar` for `coli run` and `coli chat`: the answer is constrained
(coli.grammar), so `coli run --json-schema s.json "…" | jq .` works in scripts."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from coli.cli.common import fail

JsonSchemaOpt = Annotated[Optional[str], typer.Option(
    "--json-schema", metavar="FILE|JSON",
    help="Constrain the answer to JSON valid against this JSON schema (a file, or the schema inline). "
         "The output is exactly the JSON document.")]
GrammarOpt = Annotated[Optional[Path], typer.Option(
    "--grammar", metavar="FILE",
    help="Constrain the answer to a grammar file: Lark (llguidance's dialect; start is the answer), "
         "GBNF when it ends in .gbnf, a regular expression when it ends in .regex.")]

KINDS = {".gbnf": "gbnf", ".regex": "regex", ".re": "regex"}


def read_options(json_schema: str | None, grammar: Path | None) -> tuple[str, object] | None:
    """("json_schema", schema) or (kind, grammar text), or None; bad files and JSON fail (exit 2)."""
    if json_schema is not None and grammar is not None:
        raise fail("give --json-schema or --grammar, not both")
    if json_schema is not None:
        text = json_schema
        if not json_schema.lstrip().startswith(("{", "true", "false")):
            path = Path(json_schema)
            if not path.is_file():
                raise fail(f"--json-schema: {json_schema}: no such file (or give the schema inline, as JSON)")
            text = path.read_text()
        try:
            schema = json.loads(text)
        except ValueError as e:
            raise fail(f"--json-schema: not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise fail("--json-schema: a JSON schema is an object")
        return "json_schema", schema
    if grammar is not None:
        if not grammar.is_file():
            raise fail(f"--grammar: {grammar}: no such file")
        return KINDS.get(grammar.suffix.lower(), "lark"), grammar.read_text()
    return None


def local_constraint(spec):
    """The Constraint for a local runner (None without one)."""
    if spec is None:
        return None
    from coli.grammar import Constraint

    kind, value = spec
    param = "--json-schema" if kind == "json_schema" else "--grammar"
    if kind == "json_schema":
        return Constraint.json_schema(value, param=param)
    return getattr(Constraint, kind)(value, param=param)


def request_fields(spec) -> dict:
    """The same constraint as request fields for a `coli serve` (`coli chat --url`)."""
    if spec is None:
        return {}
    kind, value = spec
    if kind == "json_schema":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": value}}}
    return {"x_colibri_grammar": {"type": kind, "grammar": value}}
