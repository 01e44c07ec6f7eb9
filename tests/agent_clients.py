"""The coding agents and CLIs tested against `coli serve`: how to find, run and configure each.

Each ``Client`` knows its executable, how to install it, and the command line and
environment that point it at a server's base URL, non-interactively, in a scratch
directory (its own HOME, so nothing of the user's setup is read or written). Used by
tests/record_clients.py (records the requests each client sends: the fixtures under
tests/fixtures/clients/) and tests/test_real_clients.py (the opt-in end-to-end run).

Executables are looked up on PATH and in COLI_CLIENT_PATH (a PATH-like list, e.g. a
scratch npm prefix's node_modules/.bin).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

MODEL = "tiny"
PROMPT = "Reply with a short greeting."


@dataclass(frozen=True)
class Client:
    name: str  # also the fixture's file name
    exe: str
    install: str
    api: str  # the endpoint its requests go to
    version_args: tuple[str, ...] = ("--version",)

    def path(self) -> str | None:
        extra = os.environ.get("COLI_CLIENT_PATH", "")
        return shutil.which(self.exe, path=os.pathsep.join(p for p in (extra, os.environ.get("PATH", "")) if p))

    def version(self) -> str:
        out = subprocess.run([self.path(), *self.version_args], capture_output=True, text=True, timeout=60)
        lines = (out.stdout or out.stderr).strip().splitlines()
        return lines[-1].strip() if lines else "?"

    def command(self, url: str, work: Path, prompt: str = PROMPT, turns: int = 1) -> tuple[list[str], dict]:
        """(argv, environment) running one non-interactive task against ``url`` in ``work``
        (``turns``: model turns allowed where the client takes a limit)."""
        home = work / "home"
        home.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_", "CLAUDE_"))}
        env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local/share"),
                   XDG_CACHE_HOME=str(home / ".cache"), NO_COLOR="1", CI="1")
        exe = self.path()
        argv, env = getattr(self, f"_{self.name}")(exe, url, work, prompt, env)
        return [str(turns) if a == "{turns}" else a for a in argv], env

    # one method per client: its documented base-URL setting ---------------------------------

    def _claude_code(self, exe, url, work, prompt, env):
        env.update(ANTHROPIC_BASE_URL=url, ANTHROPIC_API_KEY="local", ANTHROPIC_MODEL=MODEL,
                   ANTHROPIC_SMALL_FAST_MODEL=MODEL, ANTHROPIC_DEFAULT_HAIKU_MODEL=MODEL,
                   CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_AUTOUPDATER="1", DISABLE_TELEMETRY="1")
        return [exe, "-p", prompt, "--max-turns", "{turns}", "--model", MODEL], env

    def _codex(self, exe, url, work, prompt, env):
        home = work / "codex"
        home.mkdir(exist_ok=True)
        (home / "config.toml").write_text(  # the README's config.toml
            f'model = "{MODEL}"\nmodel_provider = "coli"\n\n[model_providers.coli]\nname = "coli"\n'
            f'base_url = "{url}/v1"\nwire_api = "responses"\n')
        env.update(CODEX_HOME=str(home))
        return [exe, "exec", "--skip-git-repo-check", prompt], env

    def _opencode(self, exe, url, work, prompt, env):
        config = {"$schema": "https://opencode.ai/config.json", "model": f"coli/{MODEL}", "autoupdate": False,
                  "share": "disabled",
                  "provider": {"coli": {"npm": "@ai-sdk/openai-compatible", "name": "coli",
                                        "options": {"baseURL": f"{url}/v1"},
                                        "models": {MODEL: {"name": MODEL}}}}}
        (work / "opencode.json").write_text(json.dumps(config))
        env.update(OPENCODE_DISABLE_AUTOUPDATE="1", OPENCODE_DISABLE_MODELS_FETCH="1",
                   OPENCODE_CONFIG=str(work / "opencode.json"))
        return [exe, "run", "-m", f"coli/{MODEL}", prompt], env

    def _qwen_code(self, exe, url, work, prompt, env):
        env.update(OPENAI_BASE_URL=f"{url}/v1", OPENAI_API_KEY="local", OPENAI_MODEL=MODEL)
        return [exe, "-p", prompt], env

    def _aider(self, exe, url, work, prompt, env):
        env.update(OPENAI_API_BASE=f"{url}/v1", OPENAI_API_KEY="local", AIDER_ANALYTICS="false")
        return [exe, "--message", prompt, "--no-git", "--model", f"openai/{MODEL}", "--yes-always",
                "--no-show-model-warnings", "--no-check-update", "--no-analytics", "--map-tokens", "0",
                "--no-stream", "--no-pretty"], env

    def _llm(self, exe, url, work, prompt, env):
        user = work / "llm"
        user.mkdir(exist_ok=True)
        (user / "extra-openai-models.yaml").write_text(
            f"- model_id: {MODEL}\n  model_name: {MODEL}\n  api_base: \"{url}/v1\"\n")
        env.update(LLM_USER_PATH=str(user))  # no key: the README's setup
        return [exe, "-m", MODEL, "--no-log", prompt], env


CLIENTS = [
    Client("claude_code", "claude", "npm install -g @anthropic-ai/claude-code", "/v1/messages"),
    Client("codex", "codex", "npm install -g @openai/codex", "/v1/responses"),
    Client("opencode", "opencode", "npm install -g opencode-ai", "/v1/chat/completions"),
    Client("qwen_code", "qwen", "npm install -g @qwen-code/qwen-code", "/v1/chat/completions"),
    Client("aider", "aider", "pip install aider-chat", "/v1/chat/completions"),
    Client("llm", "llm", "pip install llm", "/v1/chat/completions"),
]
BY_NAME = {c.name: c for c in CLIENTS}
