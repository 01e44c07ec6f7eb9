"""The server's settings: CLI options, else COLI_* environment variables, else defaults."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from coli.errors import InvalidRequestError

# Browser origins allowed by default: the Vite dev server and Tauri's local origins.
DEFAULT_CORS_ORIGINS = ("http://localhost:5173", "http://127.0.0.1:5173", "tauri://localhost",
                        "http://tauri.localhost", "https://tauri.localhost")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # --host, COLI_HOST
    port: int = 8000  # --port, COLI_PORT (0: any free port)
    model_id: str | None = None  # --model-id, COLI_MODEL_ID (default: the model directory's name)
    api_key: str | None = None  # --api-key, COLI_API_KEY
    allowed_hosts: tuple[str, ...] = ()  # --allowed-host, COLI_ALLOWED_HOSTS (comma-separated)
    cors_origins: tuple[str, ...] = ()  # --cors-origin, COLI_CORS_ORIGINS (comma-separated; "*": any)
    max_body: int = 4 << 20  # --max-body, COLI_MAX_BODY: request bodies above it get 413
    request_timeout: float = 30.0  # --request-timeout, COLI_REQUEST_TIMEOUT: to send a request's head, then its body
    idle_timeout: float = 30.0  # --idle-timeout, COLI_IDLE_TIMEOUT: a keep-alive connection idle this long is closed
    max_connections: int = 512  # --max-connections, COLI_MAX_CONNECTIONS (kept below the open-file limit)
    continue_assistant: bool = True  # COLI_CONTINUE_ASSISTANT=0: a trailing assistant turn is closed, not continued
    keepalive: float = 10.0  # seconds without output before an SSE keepalive (Anthropic: a ping event)
    stream_high: int = 64 << 10  # a stream's socket buffer above this pauses its writer ...
    stream_low: int = 16 << 10  # ... until it drains below this
    stream_ceiling: int = 4 << 20  # bytes queued for one stream past which it is dropped and its request cancelled
    send_buffer: int | None = None  # SO_SNDBUF of streaming sockets (None: the kernel's, which autotunes)
    profile_window: int = 64  # turns kept for GET /profile
    log_format: str = "text"  # --log-format, COLI_LOG_FORMAT: the access log on stderr (text, json or off)

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise InvalidRequestError(f"--port must be from 0 to 65535, got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise InvalidRequestError("--api-key must not be empty")
        if not 0 < self.stream_low <= self.stream_high < self.stream_ceiling:
            raise InvalidRequestError("stream buffers must satisfy 0 < low <= high < ceiling")
        if self.max_body < 1024:
            raise InvalidRequestError(f"--max-body must be at least 1024 bytes, got {self.max_body}")
        for name in ("request_timeout", "idle_timeout"):
            if not getattr(self, name) > 0:
                raise InvalidRequestError(f"--{name.replace('_', '-')} must be more than 0 seconds, "
                                          f"got {getattr(self, name)}")
        if self.max_connections < 1:
            raise InvalidRequestError(f"--max-connections must be at least 1, got {self.max_connections}")
        if self.log_format not in ("text", "json", "off"):
            raise InvalidRequestError(f"--log-format must be text, json or off, got {self.log_format!r}")
        if any(h == "*" or "*" in h for h in self.allowed_hosts):
            raise InvalidRequestError("--allowed-host takes exact host names or addresses; there is no wildcard")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **given) -> ServerConfig:
        """Values given (not None) win; then the COLI_* variables; then the defaults."""
        env = os.environ if env is None else env
        kinds = {f.name: f.type for f in fields(cls)}
        names = {"host": "COLI_HOST", "port": "COLI_PORT", "model_id": "COLI_MODEL_ID", "api_key": "COLI_API_KEY",
                 "allowed_hosts": "COLI_ALLOWED_HOSTS", "cors_origins": "COLI_CORS_ORIGINS",
                 "max_body": "COLI_MAX_BODY", "continue_assistant": "COLI_CONTINUE_ASSISTANT",
                 "request_timeout": "COLI_REQUEST_TIMEOUT", "idle_timeout": "COLI_IDLE_TIMEOUT",
                 "max_connections": "COLI_MAX_CONNECTIONS", "log_format": "COLI_LOG_FORMAT"}
        for key, var in names.items():
            if given.get(key) is None and env.get(var):
                given[key] = _parse(var, env[var], kinds[key])
        return cls(**{k: v for k, v in given.items() if v is not None})


def split_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _parse(var: str, value: str, kind: str):
    if "tuple" in kind:
        return split_list(value)
    if kind.startswith("bool"):
        return value.strip().lower() not in ("0", "false", "no", "off")
    if kind.startswith("int"):
        if var == "COLI_MAX_BODY":
            from coli.experts.store import parse_size

            try:
                return parse_size(value)
            except ValueError as e:
                raise InvalidRequestError(f"{var}: {e}") from None
        try:
            return int(value)
        except ValueError:
            raise InvalidRequestError(f"{var}={value!r} is not a whole number") from None
    if kind.startswith("float"):
        try:
            return float(value)
        except ValueError:
            raise InvalidRequestError(f"{var}={value!r} is not a number") from None
    return value
