"""completions/ and man/ are generated from the Typer app and must be current."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import gen_cli_docs  # noqa: E402


def test_generated_files_are_current():
    stale = gen_cli_docs.stale()
    assert not stale, f"out of date: {stale}; run `python tools/gen_cli_docs.py` and commit the result"


def test_every_command_and_option_is_in_each_file():
    root = gen_cli_docs.read_app()
    files = {rel: (ROOT / rel).read_text(encoding="utf-8") for rel in gen_cli_docs.OUTPUTS}
    for c in root.walk():
        for o in c.opts:
            for name in o.names:
                assert name in files["completions/coli.bash"], name
                assert name.lstrip("-") in files["completions/coli.fish"], name
                assert name in files["completions/_coli"], name
                assert name.replace("-", "\\-") in files["man/coli.1"], name
    assert {"chat", "run"} <= {c.path[-1] for c in root.subs}
    chat = next(c for c in root.subs if c.path[-1] == "chat")
    assert {"--plain", "--url", "--api-key", "--slots"} <= {n for o in chat.opts for n in o.names}


def bash_complete(words: list[str]) -> list[str]:
    script = (f"source {ROOT / 'completions/coli.bash'}\n"
              f"COMP_WORDS=({' '.join(repr(w) for w in words)}); COMP_CWORD={len(words) - 1}\n"
              "_coli; printf '%s\\n' \"${COMPREPLY[@]}\"\n")
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True, cwd=ROOT)
    return r.stdout.split()


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_bash_completion_works():
    assert "chat" in bash_complete(["coli", "ch"])
    assert set(bash_complete(["coli", "chat", "--p"])) >= {"--plain", "--pin"}
    assert bash_complete(["coli", "kv", ""]) == ["inspect"]
    assert "--json" in bash_complete(["coli", "kv", "inspect", "--j"])
    assert "pyproject.toml" in bash_complete(["coli", "chat", "--model", "pyproj"])  # a path
    assert bash_complete(["coli", "chat", "--max-tokens", ""]) == []  # a number: nothing to offer


@pytest.mark.parametrize("shell,rel", [("zsh", "completions/_coli"), ("fish", "completions/coli.fish"),
                                       ("bash", "completions/coli.bash")])
def test_scripts_parse(shell, rel):
    if shutil.which(shell) is None:
        pytest.skip(f"no {shell}")
    subprocess.run([shell, "-n", str(ROOT / rel)], check=True)


@pytest.mark.skipif(shutil.which("groff") is None, reason="no groff")
def test_man_page_renders_without_warnings():
    r = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-P-cbou", str(ROOT / "man/coli.1")],
                       capture_output=True, text=True)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
    text = r.stdout
    for heading in ("NAME", "SYNOPSIS", "COMMANDS", "INTERACTIVE CHAT", "ENVIRONMENT", "EXIT STATUS"):
        assert heading in text
    assert "COLI_MODEL" in text and "coli chat" in text
