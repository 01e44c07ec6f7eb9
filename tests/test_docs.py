"""The docs say what is true: README's commands are the ones CI runs, and the
architecture list matches the registry."""
from pathlib import Path

from coli.models import SUPPORTED

ROOT = Path(__file__).resolve().parents[1]


def readme_commands():
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.strip().splitlines()]


def test_readme_starts_with_install_run_and_test_commands():
    run, test = readme_commands()[:2]
    assert run == "pip install . && coli chat"
    assert "[test]" in test and "pytest" in test


def test_ci_runs_readme_test_command_verbatim():
    test = readme_commands()[1]
    ci_lines = [l.strip() for l in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test in ci_lines


def test_readme_lists_every_supported_architecture():
    text = (ROOT / "README.md").read_text()
    for arch in SUPPORTED:
        assert f"`{arch}`" in text, arch
