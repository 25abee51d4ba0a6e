"""SecurityMiddleware on a bare ASGI app (no FastAPI handlers, no sockets): what it refuses, in
which order, how much of a body it reads before refusing, and the last-line token mask."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from proxy.security.guard import Guard, SecurityMiddleware
from proxy.security.keys import KeyRing

DATA_KEY = "data-key-0123456789abcdef"
ADMIN_KEY = "admin-key-0123456789abcdef"
TOKEN = b"upstream-token-0123456789"


def make(
    *,
    keys: bool = True,
    max_body: int = 1024,
    max_header: int = 4096,
    secrets: tuple[bytes, ...] = (),
) -> tuple[Starlette, list[tuple[str, int]], dict[str, Any]]:
    """A bare Starlette app with the middleware where the proxy puts it (inside Starlette's
    error middleware, outside the exception handlers), and no ProxyError handler: the
    middleware itself must turn a body overflow into a 413."""
    seen: dict[str, Any] = {"bodies": []}

    async def echo(request: Request) -> Response:
        body = await request.body()
        seen["bodies"].append(len(body))
        return PlainTextResponse(f"ok {len(body)}")

    async def leak(request: Request) -> Response:
        return PlainTextResponse(b"tok=" + TOKEN, headers={"x-debug": TOKEN.decode()})

    rejected: list[tuple[str, int]] = []
    ring = KeyRing([DATA_KEY], [ADMIN_KEY]) if keys else KeyRing()
    app = Starlette(
        routes=[Route("/leak", leak), Route("/{path:path}", echo, methods=["GET", "POST"])],
        middleware=[
            Middleware(
                SecurityMiddleware,
                guard=Guard(ring, max_body, max_header, secrets),
                on_reject=lambda scope, status: rejected.append((scope["path"], status)),
            )
        ],
    )
    return app, rejected, seen


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy")


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_auth_matrix() -> None:
    mw, rejected, _ = make()
    async with client(mw) as c:
        for path in ("/health", "/livez", "/metrics"):
            assert (await c.get(path)).status_code == 200, path
        r = await c.post("/v1/completions")
        assert r.status_code == 401
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert r.json()["error"]["type"] == "AuthenticationError"
        assert (await c.post("/v1/completions", headers=bearer("nope" * 5))).status_code == 401
        assert (await c.post("/v1/completions", headers=bearer(DATA_KEY))).status_code == 200
        assert (await c.post("/v1/completions", headers=bearer(ADMIN_KEY))).status_code == 200
        r = await c.post("/pause", headers=bearer(DATA_KEY))
        assert r.status_code == 403 and "PROXY_ADMIN_KEYS" in r.json()["error"]["message"]
        assert (await c.post("/pause", headers=bearer(ADMIN_KEY))).status_code == 200
        assert (await c.post("/pause")).status_code == 401  # no key: 401 before 403
        basic = httpx.BasicAuth("trl", ADMIN_KEY)
        assert (await c.post("/v1/load_lora_adapter", auth=basic)).status_code == 200
    assert rejected == [
        ("/v1/completions", 401),
        ("/v1/completions", 401),
        ("/pause", 403),
        ("/pause", 401),
    ]


async def raw_call(mw: Any, path: str, raw_path: bytes, headers: list[tuple[bytes, bytes]]) -> int:
    """One request straight through the ASGI interface, with a path no HTTP client would send
    unnormalised (httpx itself resolves '..' before sending)."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "scheme": "http",
        "server": ("proxy", 80),
        "root_path": "",
        "method": "POST",
        "path": path,
        "raw_path": raw_path,
        "query_string": b"",
        "headers": headers,
    }
    await mw(scope, receive, send)
    return int(sent[0]["status"])


async def test_no_keys_means_open_but_paths_are_still_checked() -> None:
    mw, _, seen = make(keys=False)
    async with client(mw) as c:
        assert (await c.post("/pause")).status_code == 200
    # The plane check depends on canonical paths, and so does what the replica receives.
    assert await raw_call(mw, "/v1/../pause", b"/v1/../pause", []) == 400
    assert seen["bodies"] == [0]


async def test_path_check_runs_before_auth() -> None:
    mw, _, seen = make()
    auth = [(b"authorization", f"Bearer {DATA_KEY}".encode())]
    assert await raw_call(mw, "/v1/../pause", b"/v1/../pause", auth) == 400
    assert await raw_call(mw, "/v1/../pause", b"/v1/%2e%2e/pause", []) == 400
    assert await raw_call(mw, "/v1/x/pause", b"/v1/x%2Fpause", auth) == 400
    assert await raw_call(mw, "/v1/completions", b"/v1/completions", auth) == 200
    assert seen["bodies"] == [0]


async def test_declared_content_length_is_refused_before_reading() -> None:
    mw, rejected, seen = make(max_body=1024)
    async with client(mw) as c:
        r = await c.post("/v1/completions", content=b"x" * 1025, headers=bearer(DATA_KEY))
        assert r.status_code == 413 and "PROXY_MAX_BODY_BYTES" in r.json()["error"]["message"]
        r = await c.post("/v1/completions", content=b"x" * 1024, headers=bearer(DATA_KEY))
        assert r.status_code == 200 and r.text == "ok 1024"
    assert seen["bodies"] == [1024]
    assert rejected == [("/v1/completions", 413)]


async def test_streamed_body_stops_at_the_limit() -> None:
    """A chunked body with no Content-Length: refused with 413 once it passes the limit, and
    the rest of the stream is never pulled (the app would otherwise buffer all of it)."""
    mw, rejected, seen = make(max_body=10 * 1024)
    pulled = 0

    async def endless() -> AsyncIterator[bytes]:
        nonlocal pulled
        for _ in range(10_000):  # 40 MiB if read to the end
            pulled += 1
            yield b"y" * 4096

    async with client(mw) as c:
        r = await c.post("/v1/completions", content=endless(), headers=bearer(DATA_KEY))
    assert r.status_code == 413
    assert r.json()["error"]["type"] == "RequestTooLargeError"
    assert pulled <= 4, pulled  # 3 chunks pass 10 KiB; httpx may have one more in hand
    assert seen["bodies"] == []
    assert rejected == [("/v1/completions", 413)]


async def test_bad_content_length_is_400() -> None:
    mw, _, seen = make()
    assert await raw_call(mw, "/health", b"/health", [(b"content-length", b"-5")]) == 400
    assert await raw_call(mw, "/health", b"/health", [(b"content-length", b"1e3")]) == 400
    assert seen["bodies"] == []


async def test_header_size() -> None:
    mw, rejected, _ = make(max_header=2048)
    async with client(mw) as c:
        r = await c.get("/health", headers={"x-big": "a" * 4096})
        assert r.status_code == 431
        assert "PROXY_MAX_HEADER_BYTES" in r.json()["error"]["message"]
        r = await c.get("/health", params={"q": "a" * 4096})  # the request line counts too
        assert r.status_code == 431
        assert (await c.get("/health", headers={"x-small": "a" * 512})).status_code == 200
    assert [s for _, s in rejected] == [431, 431]


async def test_token_in_a_response_is_masked_and_logged(caplog) -> None:
    mw, _, _ = make(keys=False, secrets=(TOKEN,))
    async with client(mw) as c:
        r = await c.get("/leak")
    assert TOKEN not in r.content and TOKEN.decode() not in r.headers["x-debug"]
    assert r.content == b"tok=" + b"*" * len(TOKEN)
    assert int(r.headers["content-length"]) == len(r.content)
    messages = [rec.getMessage() for rec in caplog.records]
    assert any("response body contained the upstream token" in m for m in messages)
    assert any("response header contained the upstream token" in m for m in messages)


async def test_lifespan_and_other_scopes_pass_through() -> None:
    calls: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        calls.append(scope["type"])

    mw = SecurityMiddleware(app, Guard(KeyRing([DATA_KEY]), 1024, 1024))
    await mw({"type": "lifespan"}, None, None)  # type: ignore[arg-type]
    await mw({"type": "websocket", "path": "/x"}, None, None)  # type: ignore[arg-type]
    assert calls == ["lifespan", "websocket"]
