"""The inbound guard (header size, canonical path, key, body size) and the last-line masking of
the upstream token in responses, shared by the ASGI middleware (FastAPI's routes) and the data
path (proxy/hotpath.py). Order and reasons: docs/security.md."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from proxy.asgi import ASGIApp, Message, Receive, Scope, Send
from proxy.errors import Forbidden, InvalidRequest, PayloadTooLarge, ProxyError, Unauthorized
from proxy.security.keys import KeyRing, credential_from
from proxy.security.limits import BodyTooLarge, HeadersTooLarge, too_large
from proxy.security.planes import Plane, classify, path_problem
from proxy.security.redaction import mask

log = logging.getLogger("rollout_proxy.security")


@dataclass(frozen=True)
class Guard:
    """What the middleware and the data path enforce: the inbound keys, the body and header
    limits, and the upstream token to mask out of answers (``secrets``)."""

    keys: KeyRing
    max_body_bytes: int
    max_header_bytes: int
    secrets: tuple[bytes, ...] = ()

    def check_head(self, scope: Scope) -> ProxyError | None:
        """The first reason to refuse this request before reading its body, cheapest check
        first: header size (431), canonical path (400), key (401/403), declared
        Content-Length (413)."""
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        for k, v in scope.get("headers", ()):
            size += len(k) + len(v) + 4  # ": " and CRLF, as on the wire
        if size > self.max_header_bytes:
            return HeadersTooLarge(
                f"request line and headers are {size} bytes; at most "
                f"{self.max_header_bytes} are accepted (PROXY_MAX_HEADER_BYTES)"
            )
        path: str = scope.get("path", "")
        bad = path_problem(path, scope.get("raw_path"))
        if bad is not None:
            return InvalidRequest(bad)
        return self._check_key_and_length(
            path, classify(path), header(scope, b"authorization"), header(scope, b"content-length")
        )

    def check_data_route_head(self, scope: Scope) -> ProxyError | None:
        """``check_head`` for a path the caller matched exactly against one of the proxy's own
        canonical data-plane routes: the path checks pass, the plane is DATA. The one pass that
        sizes the headers also picks up the first of the two headers it reads."""
        size = len(scope["raw_path"])
        authorization = declared = None
        for k, v in scope["headers"]:
            size += len(k) + len(v) + 4
            if k == b"content-length":
                if declared is None:
                    declared = v
            elif k == b"authorization" and authorization is None:
                authorization = v
        if size > self.max_header_bytes:
            return self.check_head(scope)  # the same 431, said the same way
        return self._check_key_and_length(scope["path"], Plane.DATA, authorization, declared)

    def _check_key_and_length(
        self, path: str, plane: Plane, authorization: bytes | None, declared: bytes | None
    ) -> ProxyError | None:
        if plane is not Plane.OPEN and self.keys.enabled:
            raw = authorization
            role = self.keys.role(credential_from(raw.decode("latin-1") if raw else None))
            if role is None:
                return Unauthorized(
                    "a valid key is required: send 'Authorization: Bearer <key>' (or HTTP Basic "
                    "auth with the key as the password, e.g. http://user:<key>@host in a URL)"
                )
            if plane is Plane.ADMIN and role is not Plane.ADMIN:
                return Forbidden(
                    f"{path} is a control-plane endpoint: it needs a key from PROXY_ADMIN_KEYS"
                )
        if declared is not None:
            if not declared.isdigit():
                return InvalidRequest("Content-Length must be a non-negative integer")
            if int(declared) > self.max_body_bytes:
                return PayloadTooLarge(too_large(self.max_body_bytes), param="body")
        return None

    def mask_body(self, body: bytes) -> bytes:
        """``body`` with the upstream token masked (same length, so Content-Length stays
        right); a warning says it happened. The common case is one ``in`` per secret."""
        for secret in self.secrets:
            if secret in body:
                log.warning("a response body contained the upstream token; masked it")
                return mask(body, self.secrets)
        return body

    def mask_headers(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        if any(s in v for _, v in headers for s in self.secrets):
            log.warning("a response header contained the upstream token; masked it")
            return [(k, mask(bytes(v), self.secrets)) for k, v in headers]
        return headers


def header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return bytes(v)
    return None


def error_response_parts(err: ProxyError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    body = json.dumps(err.to_body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if err.status_code == 401:
        headers.append((b"www-authenticate", b'Bearer realm="rollout-proxy"'))
    if err.retry_after is not None:
        headers.append((b"retry-after", str(err.retry_after).encode()))
    return err.status_code, headers, body


class SecurityMiddleware:
    """Pure ASGI (BaseHTTPMiddleware buffers and re-wraps streamed responses): ``check_head``,
    then the body counted as it streams in (413 once it passes the limit), and the upstream
    token masked out of responses."""

    def __init__(
        self,
        app: ASGIApp,
        guard: Guard,
        on_reject: Callable[[Scope, int], None] | None = None,
    ) -> None:
        self.app = app
        self.guard = guard
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        problem = self.guard.check_head(scope)
        if problem is not None:
            await self._reject(scope, send, problem)
            return
        if self.guard.secrets:
            send = self._masking(send)
        limit = self.guard.max_body_bytes
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(too_large(limit), param="body")
            return message

        started = False

        async def tracking(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited, tracking)
        except BodyTooLarge as exc:
            # Reached only when the app has no handler for ProxyError (the proxy's app has one).
            if started:
                raise
            await self._reject(scope, send, exc)

    async def _reject(self, scope: Scope, send: Send, err: ProxyError) -> None:
        if self.on_reject is not None:
            self.on_reject(scope, err.status_code)
        status, headers, body = error_response_parts(err)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _masking(self, send: Send) -> Send:
        guard = self.guard

        async def masked(message: Message) -> None:
            if message["type"] == "http.response.body":
                body = message.get("body", b"")
                masked_body = guard.mask_body(body)
                if masked_body is not body:
                    message = {**message, "body": masked_body}
            elif message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                masked_headers = guard.mask_headers(headers)
                if masked_headers is not headers:
                    message = {**message, "headers": masked_headers}
            await send(message)

        return masked
