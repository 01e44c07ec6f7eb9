"""`coli serve`: OpenAI- and Anthropic-compatible HTTP API over the shared scheduler.

``Server(model, runner, config)`` holds what handlers need; ``build_app`` makes the
aiohttp application; ``serve`` runs it until cancelled; ``ServerThread`` runs it in a
background thread (tests, benchmarks). See docs/SERVER.md.
"""
from coli.server.app import Server, ServerThread, build_app, serve, start
from coli.server.config import ServerConfig

__all__ = ["Server", "ServerConfig", "ServerThread", "build_app", "serve", "start"]
