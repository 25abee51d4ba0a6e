"""A canary for proxy/front.py's reliance on uvicorn's internals: FrontProtocol subclasses
uvicorn's httptools protocol, overrides some of its methods and reads its per-connection state.
This fails on a uvicorn whose protocol no longer has them, before anything misbehaves; the
range in pyproject.toml is the one it passes with."""

from __future__ import annotations

import asyncio
import inspect
import tomllib
from collections import deque
from pathlib import Path
from typing import Any

import uvicorn
from packaging.requirements import Requirement
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from proxy import front


def test_every_hook_exists_with_the_parameters_front_py_expects() -> None:
    assert front.unsupported() is None, front.unsupported()
    for name, params in front.UVICORN_HOOKS.items():
        assert tuple(inspect.signature(getattr(HttpToolsProtocol, name)).parameters) == params


def test_unsupported_names_a_changed_hook(monkeypatch) -> None:
    monkeypatch.setattr(HttpToolsProtocol, "on_body", lambda self, body, more: None)
    assert "on_body" in (front.unsupported() or "")
    monkeypatch.undo()
    monkeypatch.delattr(HttpToolsProtocol, "_start_asgi_task")
    assert "_start_asgi_task" in (front.unsupported() or "")


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 5000)}.get(name, default)

    def write(self, data: Any) -> None:
        self.written += bytes(data)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True


async def _app(scope: Any, receive: Any, send: Any) -> None:  # never called
    raise AssertionError("the canary does not run the app")


async def test_the_per_connection_state_front_py_reads() -> None:
    config = uvicorn.Config(_app, http="httptools", lifespan="off", log_level="warning")
    config.load()
    state = ServerState()
    protocol = HttpToolsProtocol(config, state, {}, _loop=asyncio.get_running_loop())
    protocol.connection_made(_Transport())
    # Server-wide state: the connection set the idle sweep walks, the request counter,
    # the default headers every answer carries.
    assert protocol.server_state is state and protocol in state.connections
    assert isinstance(state.total_requests, int)
    assert isinstance(state.default_headers, list)
    assert isinstance(protocol.tasks, set)
    # Per-connection state.
    assert isinstance(protocol.timeout_keep_alive, int | float)
    assert isinstance(protocol.pipeline, deque)
    assert isinstance(protocol.flow, FlowControl)
    for name in ("read_paused", "write_paused"):
        assert isinstance(getattr(protocol.flow, name), bool), name
    for name in ("pause_reading", "resume_reading", "drain"):
        assert callable(getattr(protocol.flow, name)), name
    assert protocol.cycle is None and protocol.loop is asyncio.get_running_loop()
    for name in ("get_method", "get_http_version", "should_keep_alive", "should_upgrade"):
        assert callable(getattr(protocol.parser, name)), name
    # on_message_begin resets what front.py's _asgi_scope carries over, and builds the scope.
    protocol.url, protocol.expect_100_continue = b"/x", True
    protocol.on_message_begin()
    assert (protocol.url, protocol.expect_100_continue, protocol.headers) == (b"", False, [])
    assert protocol.scope["headers"] is protocol.headers
    # A parsed request line reaches the parser callbacks front.py overrides.
    protocol.data_received(b"POST /v1/completions HTTP/1.1\r\nhost: p\r\ncontent-length: 0\r\n")
    assert protocol.url == b"/v1/completions"
    assert protocol.parser.get_method() == b"POST"


def test_the_installed_uvicorn_is_in_the_pinned_range() -> None:
    """The pin and the canary move together: the version this passes with is in the range."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    (pin,) = [Requirement(d) for d in deps if Requirement(d).name == "uvicorn"]
    assert pin.specifier, "uvicorn is pinned to a tested range"
    assert uvicorn.__version__ in pin.specifier
