"""A fake vLLM OpenAI server, faithful to how vLLM 0.33 answers the endpoints the proxy uses
(shared/REFERENCE.md §2), with switches for every fault the proxy must survive.

It is a plain Starlette app: run it in-process over real HTTP (``ServerThread``) or as an ASGI
transport. Every request it receives is appended to ``calls`` so tests can assert what reached
which replica, in what order. Its adapter table and its answers (/v1/models, /server_info,
/metrics, vLLM's errors) are the ones every fake replica shares (``fakes.vllm``); what is its own
is the fault switches and the record.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from fakes.vllm import (
    Adapters,
    VllmError,
    error_body,
    metrics_text,
    models_payload,
    server_info_json,
    server_info_text,
)


def _error(message: str, type_: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, status, param), status)


def _sampling_problem(body: Any, max_model_len: int) -> str | None:
    """What vLLM's request validation refuses among the fields this fake reads, as its
    message (vLLM answers 400 for each: never a 500, and never a max_tokens past the context)."""
    if not isinstance(body, dict):
        return "request body must be a JSON object"
    for key in ("seed", "max_tokens"):
        value = body.get(key)
        if value is not None and type(value) is not int:
            return f"{key} must be an integer or null, got {value!r:.80}"
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and not 0 <= max_tokens <= max_model_len:
        return f"max_tokens must be between 0 and {max_model_len}, got {max_tokens}"
    return None


def _vllm_error(exc: VllmError) -> JSONResponse:
    return JSONResponse(exc.body(), exc.status)


@dataclass
class FakeVllm:
    name: str = "replica"
    base_model: str = "tiny/base"
    max_model_len: int = 4096
    block_size: int = 16
    num_gpu_blocks: int | None = None  # the KV cache in blocks; None: not in cache_config_info
    max_loras: int = 6
    max_lora_rank: int = 1
    lora_enabled: bool = True
    data_parallel_size: int = 1
    env_secret: str = ""  # put into /server_info's env dump, to test redaction
    # state
    adapters: Adapters = field(default_factory=Adapters)
    paused: bool = False
    calls: list[tuple[str, str, Any]] = field(default_factory=list)
    served: list[dict[str, Any]] = field(default_factory=list)  # completions answered
    # faults
    health_status: int = 200
    invisible_paths: dict[str, int] = field(default_factory=dict)  # path -> 404s left (-1: forever)
    mount_lag: int = 0  # every path not seen before answers this many 404s first
    load_failure: tuple[int, str] | None = None  # (status, message) for every load
    completion_delay_s: float = 0.0
    hang: bool = False  # every request hangs (a wedged replica)
    hang_completions: bool = False  # only completions hang (a stuck engine, /health fine)
    pause_status: int = 200
    seen_headers: list[dict[str, str]] = field(default_factory=list)
    streams_completed: int = 0
    streams_closed: int = 0
    stream_chunks: int = 4
    stream_delay_s: float = 0.01
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    _cached_prefixes: set[bytes] = field(default_factory=set)
    in_flight: int = 0
    max_seen_in_flight: int = 0
    missing_adapter_hits: int = 0  # completions that named an adapter this replica lacks
    completion_status: int = 200  # e.g. 500: the engine is broken but HTTP still answers
    # Endpoints this server does not have (404 like any unknown route): a vLLM started without
    # VLLM_SERVER_DEV_MODE has no /is_paused or /server_info; one with metrics off, no /metrics.
    missing_paths: set[str] = field(default_factory=set)

    def reset_state(self) -> None:
        """A restart: adapters, pause and cache gone."""
        self.adapters.clear()
        self.paused = False
        self._cached_prefixes.clear()

    # -- helpers ----------------------------------------------------------------------------

    def _record(self, request: Request, body: Any) -> None:
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        self.calls.append((request.method, path, body))

    async def _maybe_hang(self) -> None:
        if self.hang:
            await asyncio.sleep(3600)

    def control_calls(self) -> list[tuple[str, Any]]:
        keep = (
            "/v1/load_lora_adapter",
            "/v1/unload_lora_adapter",
            "/pause",
            "/resume",
            "/reset_prefix_cache",
        )
        return [(p, b) for _, p, b in self.calls if p.split("?")[0] in keep]

    # -- endpoints --------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        await self._maybe_hang()
        return Response(status_code=self.health_status)

    async def models(self, request: Request) -> Response:
        await self._maybe_hang()
        return JSONResponse(models_payload(self.base_model, self.max_model_len, self.adapters))

    async def server_info(self, request: Request) -> Response:
        await self._maybe_hang()
        env = {"vllm_env": {"HF_TOKEN": self.env_secret, "VLLM_SERVER_DEV_MODE": "1"}}
        if request.query_params.get("config_format") != "json":
            return JSONResponse({**server_info_text(self.base_model, self.max_model_len), **env})
        info = server_info_json(
            self.base_model,
            self.max_model_len,
            block_size=self.block_size,
            max_loras=self.max_loras if self.lora_enabled else None,
            max_lora_rank=self.max_lora_rank,
            data_parallel_size=self.data_parallel_size,
        )
        return JSONResponse({**info, **env})

    async def load(self, request: Request) -> Response:
        body = await request.json()
        self._record(request, body)
        await self._maybe_hang()
        path = body.get("lora_path")
        if self.mount_lag and path not in self.invisible_paths:
            self.invisible_paths[path] = self.mount_lag
        left = self.invisible_paths.get(path)
        if left is not None and left != 0:
            if left > 0:
                self.invisible_paths[path] = left - 1
            return _error(f"No adapter found for {path}", "NotFoundError", 404)
        if self.load_failure is not None:
            status, message = self.load_failure
            return _error(
                message, "BadRequestError" if status == 400 else "InternalServerError", status
            )
        try:
            return PlainTextResponse(self.adapters.load(body))
        except VllmError as exc:
            return _vllm_error(exc)

    async def unload(self, request: Request) -> Response:
        body = await request.json()
        self._record(request, body)
        await self._maybe_hang()
        try:
            return PlainTextResponse(self.adapters.unload(body))
        except VllmError as exc:
            return _vllm_error(exc)

    async def pause(self, request: Request) -> Response:
        self._record(request, None)
        await self._maybe_hang()
        if self.pause_status != 200:
            return _error("pause failed", "InternalServerError", self.pause_status)
        self.paused = True
        if request.query_params.get("clear_cache", "true").lower() != "false":
            self._cached_prefixes.clear()
        return JSONResponse({"status": "paused"})

    async def resume(self, request: Request) -> Response:
        self._record(request, None)
        await self._maybe_hang()
        self.paused = False
        return JSONResponse({"status": "resumed"})

    async def is_paused(self, request: Request) -> Response:
        await self._maybe_hang()
        return JSONResponse({"is_paused": self.paused})

    async def reset_prefix_cache(self, request: Request) -> Response:
        self._record(request, None)
        self._cached_prefixes.clear()
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        text = metrics_text(
            self.base_model,
            running=self.in_flight,
            block_size=self.block_size,
            num_gpu_blocks=self.num_gpu_blocks,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    def _account_cache(self, model: str, tokens: list[int]) -> None:
        """Token-level prefix-cache counters like vLLM's (full blocks only)."""
        usable = (len(tokens) - 1) // self.block_size
        self.prefix_cache_queries += len(tokens)
        h = hashlib.sha256(model.encode())
        for i in range(len(tokens) // self.block_size):
            h.update(json.dumps(tokens[i * self.block_size : (i + 1) * self.block_size]).encode())
            digest = h.copy().digest()
            if i < usable and digest in self._cached_prefixes:
                self.prefix_cache_hits += self.block_size
            self._cached_prefixes.add(digest)

    async def completions(self, request: Request) -> Response:
        raw = await request.body()
        body = json.loads(raw)
        problem = _sampling_problem(body, self.max_model_len)
        if problem:  # vLLM's request validation answers 400, never 500
            return _error(problem, "BadRequestError", 400)
        self._record(request, body)
        self.seen_headers.append(dict(request.headers))
        await self._maybe_hang()
        if self.hang_completions:
            await asyncio.sleep(3600)
        model = body.get("model") or self.base_model
        try:
            self.adapters.resolve(model, self.base_model)
        except VllmError as exc:
            self.missing_adapter_hits += 1
            return _vllm_error(exc)
        if self.completion_status != 200:
            return _error("engine failed", "InternalServerError", self.completion_status)
        prompt = body.get("prompt")
        tokens = (
            prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) else []
        )
        self._account_cache(model, tokens)
        self.in_flight += 1
        self.max_seen_in_flight = max(self.max_seen_in_flight, self.in_flight)
        try:
            while self.paused:  # noqa: ASYNC110 - flipped from the test thread
                await asyncio.sleep(0.005)
            if self.completion_delay_s:
                await asyncio.sleep(self.completion_delay_s)
        finally:
            self.in_flight -= 1
        self.served.append({"model": model, "body": body})
        rng = random.Random(body.get("seed", 0))
        n_out = int(body.get("max_tokens") or 8)
        out = [rng.randrange(1000) for _ in range(n_out)]
        logprobs = [-rng.random() for _ in out]
        if body.get("stream"):
            return StreamingResponse(self._stream(model, out), media_type="text/event-stream")
        choice = {
            "index": 0,
            "text": " ".join(map(str, out)),
            "finish_reason": "length",
            "token_ids": out if body.get("return_token_ids") else None,
            "logprobs": {"token_logprobs": logprobs, "tokens": [str(t) for t in out]}
            if body.get("logprobs") is not None
            else None,
        }
        return JSONResponse(
            {
                "id": "cmpl-fake",
                "object": "text_completion",
                "model": model,
                "choices": [choice],
                "served_by": self.name,
                "echo_seed": body.get("seed"),
                "usage": {"prompt_tokens": len(tokens), "completion_tokens": n_out},
            }
        )

    async def _stream(self, model: str, out: list[int]):  # type: ignore[no-untyped-def]
        per = max(1, len(out) // max(1, self.stream_chunks))
        try:
            for i in range(0, len(out), per):
                chunk = {
                    "id": "cmpl-fake",
                    "object": "text_completion",
                    "model": model,
                    "choices": [{"index": 0, "text": " ".join(map(str, out[i : i + per]))}],
                }
                yield f"data: {json.dumps(chunk)}\n\n".encode()
                await asyncio.sleep(self.stream_delay_s)
            yield b"data: [DONE]\n\n"
            self.streams_completed += 1
        finally:
            self.streams_closed += 1

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        self._record(request, body)
        model = body.get("model") or self.base_model
        try:
            self.adapters.resolve(model, self.base_model)
        except VllmError as exc:
            return _vllm_error(exc)
        self.served.append({"model": model, "body": body})
        return JSONResponse(
            {
                "id": "chat-fake",
                "object": "chat.completion",
                "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
                "served_by": self.name,
            }
        )

    async def tokenize(self, request: Request) -> Response:
        body = await request.json()
        self._record(request, body)
        return JSONResponse({"tokens": [1, 2, 3], "served_by": self.name})

    def app(self) -> Starlette:
        async def missing(request: Request, call_next: Any) -> Response:
            if request.url.path in self.missing_paths:
                return JSONResponse({"detail": "Not Found"}, 404)
            response: Response = await call_next(request)
            return response

        return Starlette(
            middleware=[Middleware(BaseHTTPMiddleware, dispatch=missing)],
            routes=[
                Route("/health", self.health),
                Route("/v1/models", self.models),
                Route("/server_info", self.server_info),
                Route("/v1/load_lora_adapter", self.load, methods=["POST"]),
                Route("/v1/unload_lora_adapter", self.unload, methods=["POST"]),
                Route("/pause", self.pause, methods=["POST"]),
                Route("/resume", self.resume, methods=["POST"]),
                Route("/is_paused", self.is_paused),
                Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"]),
                Route("/metrics", self.metrics),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/tokenize", self.tokenize, methods=["POST"]),
            ],
        )
