"""``DataPath``, a completion's way from guard to answer, and ``ProxyApp``: the FastAPI app whose
``__call__`` hands ``POST /v1/completions`` and ``POST /v1/chat/completions`` straight to
``DataPath.serve``, and everything else (control plane, probes, admin routes, the OpenAPI
schema) to FastAPI.

Why. Every rollout crosses the proxy, so its CPU per request is the proxy's cost, and FastAPI's
stack dominates the profile of a completion even when its routing is skipped: its ServerError,
ExceptionTelemetry and BodyLimit middlewares and the security middleware's send wrapper run on
every request. ``DataPath`` applies exactly what the stack applied: the security guard (header
size, canonical path, key, declared and actual body size; proxy/security/guard.py), parsing and
prompt limits, routing and retries, the upstream token masked out of answers, the same
OpenAI-shaped, redacted errors and the same metrics. The request's way, file by file: hotpath
(guard, parse) -> dataplane (route, retry) -> pool (upstream) -> dataplane (answer).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson
from fastapi import FastAPI

from proxy.asgi import Receive, Scope, Send
from proxy.core.extract import (
    RoutingKey,
    Tokenizer,
    extract_chat,
    extract_completion,
    extract_packed_completion,
)
from proxy.core.native import module_for
from proxy.dataplane import DataPlane, RelayedBody, RelayedStream, send_whole
from proxy.errors import InvalidRequest, ProxyError
from proxy.metrics import Metrics
from proxy.security.guard import Guard, error_response_parts
from proxy.security.limits import BodyTooLarge, PromptLimits, too_large
from proxy.security.schemas import CHAT_BODY, COMPLETION_BODY
from proxy.shutdown import Shutdown

log = logging.getLogger("rollout_proxy.hotpath")


HOT_ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}
EXTRACTORS: dict[str, Callable[[Any, Tokenizer | None], RoutingKey]] = {
    "completions": extract_completion,
    "chat_completions": extract_chat,
}


def parse_json(raw: bytes) -> Any:
    """orjson: several times faster than the standard library on a token-id prompt, same result
    for valid JSON; invalid JSON is a 400 that says where it broke."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None


def packed_key(split: Callable[[bytes], tuple[Any, bytes] | None], raw: bytes) -> RoutingKey | None:
    """The native path of a completion: proxy/core/_native.c's ``split_prompt`` packs a
    token-id prompt straight from ``raw`` and orjson parses the rest (~250 bytes instead of
    3.5 KB and 512 int objects). None: not a flat token-id prompt, or not valid JSON; the
    reference path then parses ``raw`` itself, so every error keeps its exact message."""
    parts = split(raw)
    if parts is None:
        return None
    tokens, rest = parts
    try:
        body = orjson.loads(rest)
    except orjson.JSONDecodeError:
        return None
    return extract_packed_completion(body, tokens)


# Generated ids: a random per-process prefix and a counter. As unique as uuid4 for tracing one
# proxy's requests, at a fraction of its cost per request.
_ID_PREFIX = uuid.uuid4().hex[:12]
_ids = itertools.count(1)


def request_id(headers: list[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name == b"x-request-id":
            # Echoed into logs and upstream headers: accept only short, printable ASCII ids.
            if 0 < len(value) <= 128 and all(32 <= b < 127 for b in value):
                return value.decode("ascii")
            break
    return f"{_ID_PREFIX}-{next(_ids)}"


class WholeAnswer:
    """An answer written in one go: status, headers (with content-length), body. The proxy's
    own errors are these (and bench/passthrough.py's floor answers with them)."""

    __slots__ = ("body", "raw_headers", "status_code")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status_code = status
        self.raw_headers = headers
        self.body = body


class DataPath:
    """Guard, parse, check and route one completion, and send the answer."""

    def __init__(
        self,
        guard: Guard,
        limits: PromptLimits,
        data: DataPlane,
        metrics: Metrics,
        tokenizer: Tokenizer | None,
        shutdown: Shutdown,
        render_error: Callable[[ProxyError], dict[str, Any]],
        use_native: bool = False,
    ) -> None:
        module = module_for(use_native)
        # proxy/core/_native.c: a token-id prompt scanned and packed from the bytes (PROXY_NATIVE)
        self.split_prompt: Callable[[bytes], tuple[Any, bytes] | None] | None = (
            module.split_prompt if module is not None else None
        )
        self.guard = guard
        self.limits = limits
        self.data = data
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.shutdown = shutdown
        self.render_error = render_error

    def prepare(
        self, route: str, raw: bytes, headers: list[tuple[bytes, bytes]]
    ) -> tuple[RoutingKey, str]:
        """Parse and check one completion: its routing key and request id.

        Not a coroutine, so the parsed body (a 512-token prompt is 512 int objects) is freed
        here, before the upstream wait, rather than held by a suspended frame for the whole
        request: 64 rollouts in flight then keep 64 packed arrays alive instead of 64 parsed
        bodies, and a request costs one coroutine fewer."""
        split = self.split_prompt
        if split is not None and route == "completions":
            key = packed_key(split, raw)
            if key is not None:
                self.limits.check(None, key)
                return key, request_id(headers)
        body = parse_json(raw)
        key = EXTRACTORS[route](body, self.tokenizer)
        self.limits.check(body, key)
        return key, request_id(headers)

    async def respond(
        self, route: str, scope: Scope, raw: bytes, started: float
    ) -> RelayedBody | RelayedStream | WholeAnswer:
        """The answer to one completion whose head passed the guard: a relayed answer, or the
        OpenAI-shaped error that explains why there is none. Raises only a cancellation that is
        not the shutdown's (the client left)."""
        try:
            key, rid = self.prepare(route, raw, scope["headers"])
            return await self.data.forward(route, scope["path"], raw, key, rid, started)
        except ProxyError as exc:
            return self.error(route, exc)
        except asyncio.CancelledError:
            if not self.shutdown.cut_short():
                raise
            return self.error(route, self.shutdown.error())
        except Exception:
            log.exception("unhandled error on %s", scope["path"])
            return self.error(route, ProxyError("internal proxy error"))

    def error(self, route: str, exc: ProxyError) -> WholeAnswer:
        self.metrics.count_request(route, "none", exc.status_code)
        status, headers, _ = error_response_parts(exc)
        body = orjson.dumps(self.render_error(exc))
        headers[1] = (b"content-length", str(len(body)).encode())
        return WholeAnswer(status, headers, body)

    async def serve(self, scope: Scope, receive: Receive, send: Send, route: str) -> None:
        """The ASGI entry (any ASGI server; proxy/front.py serves the same from uvicorn's
        protocol without the ASGI messages)."""
        started = time.perf_counter()
        try:
            problem = self.guard.check_head(scope)
            if problem is not None:
                raise problem
            raw = await self._body(receive)
        except ProxyError as exc:
            answer: RelayedBody | RelayedStream | WholeAnswer = self.error(route, exc)
        else:
            if raw is None:
                return  # the client left before sending its body
            answer = await self.respond(route, scope, raw, started)
        if isinstance(answer, WholeAnswer):
            await send_whole(send, answer.status_code, answer.raw_headers, answer.body)
            return
        try:
            await answer(scope, receive, send)
        except asyncio.CancelledError:
            if not self.shutdown.cut_short():
                raise
            log.warning("a stream was cut off: the shutdown grace period ended")

    async def _body(self, receive: Receive) -> bytes | None:
        limit = self.guard.max_body_bytes
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body: bytes = message.get("body", b"")
        if not message.get("more_body", False):
            if len(body) > limit:
                raise BodyTooLarge(too_large(limit), param="body")
            return body
        chunks = [body]
        received = len(body)
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > limit:
                raise BodyTooLarge(too_large(limit), param="body")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


# The OpenAPI operations of the completions: served by ``DataPath``, not by FastAPI routes,
# they are added to FastAPI's schema as its own routes would appear there.
HOT_OPERATIONS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "/v1/completions": ("Completions", "completions_v1_completions_post", COMPLETION_BODY),
    "/v1/chat/completions": (
        "Chat Completions",
        "chat_completions_v1_chat_completions_post",
        CHAT_BODY,
    ),
}


class ProxyApp(FastAPI):
    """The FastAPI app, with completions taken off the front of its ``__call__``.

    Every HTTP request is also registered with the shutdown state, so that on SIGTERM the ones
    still running when the grace period ends are answered 503 (proxy/shutdown.py)."""

    data_path: DataPath | None = None
    shutdown: Shutdown | None = None

    def openapi(self) -> dict[str, Any]:
        """FastAPI's schema, with the completions documented first."""
        if self.openapi_schema is None:
            schema = super().openapi()
            answer = {
                "description": "Successful Response",
                "content": {"application/json": {"schema": {}}},
            }
            documented = {
                path: {
                    "post": {
                        "summary": summary,
                        "operationId": operation,
                        **body,
                        "responses": {"200": answer},
                    }
                }
                for path, (summary, operation, body) in HOT_OPERATIONS.items()
            }
            schema["paths"] = {**documented, **schema.get("paths", {})}
            self.openapi_schema = schema
        return self.openapi_schema

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        shutdown = self.shutdown
        if scope["type"] != "http" or shutdown is None:
            await super().__call__(scope, receive, send)
            return
        task = asyncio.current_task()
        shutdown.running.add(task)
        try:
            route = HOT_ROUTES.get(scope["path"]) if scope["method"] == "POST" else None
            if route is not None and self.data_path is not None:
                await self.data_path.serve(scope, receive, send, route)
            else:
                await shutdown.guarded(super().__call__, scope, receive, send)
        finally:
            shutdown.running.discard(task)
