"""The application: the runtime it owns, and FastAPI's routes (probes, control plane, admin),
each group in its own function. Completions are served before FastAPI sees them
(proxy/front.py, proxy/hotpath.py), which also documents them in the OpenAPI schema.

``create_app(settings, transport=None, make_relay=None)``: ``transport`` lets tests put fake
replicas behind the proxy through an httpx transport without sockets, with ``make_relay`` the data
path's client over it (fakes/httpx_relay.py) in the lean pool's place.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from proxy.control import ControlPlane, Reply
from proxy.core import native
from proxy.core.extract import Tokenizer
from proxy.core.fleet import Fleet, Replica, Status
from proxy.core.hashing import make_hasher
from proxy.core.policy import Policy, make_policy
from proxy.core.prefix_index import PrefixIndex
from proxy.core.router import Router
from proxy.dataplane import DataPlane, generated_ids_finder
from proxy.errors import ConfigError, InvalidRequest, NotSupported, ProxyError, UpstreamUnavailable
from proxy.health import HealthMonitor
from proxy.hotpath import HOT_ROUTES, DataPath, ProxyApp, parse_json
from proxy.membership import Membership, describe
from proxy.metrics import Metrics
from proxy.pool import LeanPool, Relay
from proxy.probes import Probes, agreed
from proxy.reconciler import Reconciler, wait_for_replica
from proxy.security.adapter_roots import AdapterRoots
from proxy.security.guard import Guard, SecurityMiddleware
from proxy.security.keys import KeyRing
from proxy.security.limits import PromptLimits
from proxy.security.redaction import redact
from proxy.security.schemas import LOAD_BODY, UNLOAD_BODY
from proxy.settings import Settings
from proxy.shutdown import Shutdown
from proxy.upstream import Upstream
from proxy.weight_sync import WeightSync

if TYPE_CHECKING:
    from proxy.kv_events import KvEvents

log = logging.getLogger("rollout_proxy")

DEFAULT_BLOCK_SIZE = 16  # vLLM's default on GPU, and the published recipe's --block-size


@dataclass
class Runtime:
    """Everything one app instance owns (no module-level state), built whole by
    ``build_runtime``."""

    settings: Settings
    metrics: Metrics
    fleet: Fleet
    upstream: Upstream
    router: Router
    control: ControlPlane
    health: HealthMonitor
    data: DataPlane
    probes: Probes
    membership: Membership
    tokenizer: Tokenizer | None
    shutdown: Shutdown
    guard: Guard
    weights: WeightSync
    kv_events: KvEvents | None
    # PROXY_NATIVE resolved: the C extension runs the per-request work (proxy/core/native.py)
    native: bool


def _load_tokenizer(path: str) -> Tokenizer:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError("PROXY_TOKENIZER needs the [tokenizer] extra (transformers)") from exc
    hf = AutoTokenizer.from_pretrained(path, local_files_only=True)

    class _Adapter:
        def encode_text(self, text: str) -> list[int]:
            return list(hf.encode(text, add_special_tokens=True))

        def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
            # return_dict pins the shape across transformers versions (5.x returns a
            # BatchEncoding by default, 4.x a list); TRL renders prompts the same way.
            encoded: Any = hf.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )
            return list(encoded["input_ids"])

    return _Adapter()


def build_runtime(
    settings: Settings,
    transport: httpx.AsyncBaseTransport | None,
    make_relay: Callable[[Upstream], Relay] | None = None,
) -> Runtime:
    """Every collaborator, built in dependency order and handed to what uses it. Raises
    ConfigError for settings only the domain can check (the policy name)."""
    use_native = native.resolve(settings.native)  # PROXY_NATIVE=on without the module: refused
    log.info(
        "per-request parse and hashing: %s (PROXY_NATIVE=%s)",
        "C extension proxy.core._native" if use_native else "pure Python",
        settings.native,
    )
    metrics = Metrics()
    metrics.native.labels("c" if use_native else "python").set(1)
    fleet = Fleet(settings.replicas, eject_after=settings.eject_after)
    upstream = Upstream(settings, transport)
    kv_events: KvEvents | None = None
    if settings.kv_events:  # precise routing: proxy/kv_events.py
        try:
            from proxy.kv_events import KvEvents
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError(
                "PROXY_KV_EVENTS needs the [kv-events] extra (pyzmq, msgpack)"
            ) from exc
        # Read each time they are used: the router adopts the replicas' block size and hasher at
        # start-up (configure_routing).
        kv_events = KvEvents(settings, fleet, lambda: router.block_size, lambda: router.hasher)
    router = Router(
        make_hasher(
            settings.hash_mode,
            settings.block_size or DEFAULT_BLOCK_SIZE,
            settings.vllm_hash_algo or "sha256",
            settings.vllm_hash_seed,
            use_native,
        ),
        PrefixIndex(settings.index_capacity, settings.max_replicas),
        _policy(settings),
        precise=kv_events.matcher if kv_events is not None else None,
    )
    if kv_events is not None:
        kv_events.register(metrics.registry)
    checker = AdapterRoots(settings.adapter_roots).check if settings.adapter_roots else None
    reconciler = Reconciler(settings, fleet, router, upstream, metrics)
    control = ControlPlane(reconciler, path_check=checker)
    health = HealthMonitor(settings, fleet, control, upstream, metrics)
    token = settings.upstream_token.get_secret_value() if settings.upstream_token else ""
    guard = Guard(
        KeyRing(
            (k.get_secret_value() for k in settings.api_keys),
            (k.get_secret_value() for k in settings.admin_keys),
        ),
        settings.max_body_bytes,
        settings.max_header_bytes,
        (token.encode(),) if token else (),
    )
    relay = make_relay(upstream) if make_relay else LeanPool.from_settings(settings)

    async def wait_for(model: str) -> None:
        await wait_for_replica(
            fleet, reconciler.changes, model, settings.adapter_wait_s, reconciler.clock
        )

    data = DataPlane(
        fleet,
        router,
        relay,
        metrics,
        reconciler.eject,
        guard,
        kv_events,
        wait_for,
        generated_ids_finder(native.module_for(use_native)),
    )
    return Runtime(
        settings=settings,
        metrics=metrics,
        fleet=fleet,
        upstream=upstream,
        router=router,
        control=control,
        health=health,
        data=data,
        probes=Probes(fleet, upstream, (token,) if token else ()),
        membership=Membership(settings, fleet, control, health, metrics),
        tokenizer=_load_tokenizer(settings.tokenizer) if settings.tokenizer else None,
        shutdown=Shutdown(settings.shutdown_grace_s),
        guard=guard,
        weights=WeightSync(settings, fleet, upstream, control, metrics),
        kv_events=kv_events,
        native=use_native,
    )


def _policy(settings: Settings) -> Policy:
    """PROXY_POLICY from the core's registry, which names what to use instead of any other."""
    try:
        return make_policy(settings.policy, settings.imbalance)
    except ValueError as exc:
        raise ConfigError(f"PROXY_POLICY: {exc}") from None


def configure_routing(rt: Runtime) -> None:
    """Adopt the replicas' block size and hash algorithm unless set explicitly; refuse to
    route when they disagree (a prefix index keyed on the wrong block size is useless)."""
    members = rt.fleet.members()
    size, err_size = agreed(
        {r.index: r.block_size for r in members},
        "replicas disagree on block size ({}); refusing to route",
    )
    algo, err_algo = agreed(
        {r.index: r.hash_algo for r in members},
        "replicas disagree on prefix hash algorithm ({}); refusing to route",
    )
    rt.data.routing_error = err_size or err_algo
    s = rt.settings
    block_size = s.block_size or size or DEFAULT_BLOCK_SIZE
    if s.block_size and size and s.block_size != size:
        log.warning("PROXY_BLOCK_SIZE=%d but replicas use %d", s.block_size, size)
    if block_size != rt.router.block_size or (s.hash_mode == "exact" and not s.vllm_hash_algo):
        rt.router.use_hasher(
            make_hasher(
                s.hash_mode,
                block_size,
                s.vllm_hash_algo or algo or "sha256",
                s.vllm_hash_seed,
                rt.native,
            )
        )
    if rt.data.routing_error:
        log.error(rt.data.routing_error)


def create_app(
    settings: Settings,
    transport: httpx.AsyncBaseTransport | None = None,
    *,
    make_relay: Callable[[Upstream], Relay] | None = None,
    background: bool = True,
) -> FastAPI:
    rt = build_runtime(settings, transport, make_relay)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await start_runtime(rt, background)
        try:
            yield
        finally:
            await stop_runtime(rt)

    app = ProxyApp(title="rollout-proxy", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.rt = rt
    # Error messages echo replicas' own error text; a replica (or a gateway in front of it)
    # could quote the token back, so every error body is redacted on its way out.
    echo_secrets = tuple(settings.secrets())
    app.data_path = _data_path(rt, echo_secrets)
    app.shutdown = rt.shutdown
    _guard_routes(app, rt)
    _error_handlers(app, rt, echo_secrets)
    _probe_routes(app, rt)
    _control_routes(app, rt)
    _forward_routes(app, rt)
    _admin_routes(app, rt)
    return app


async def start_runtime(rt: Runtime, background: bool = True) -> None:
    """What the app does before its first request: the upstream client, a first probe of every
    replica, routing configured from what they said, then (``background``) the health loop and
    the KV-event subscribers. The simulation starts its proxies with this too."""
    await rt.data.relay.start()
    await rt.health.start_up()
    configure_routing(rt)
    if background:
        rt.health.start()
    if rt.kv_events is not None:
        await rt.kv_events.start()


async def stop_runtime(rt: Runtime) -> None:
    """``start_runtime`` undone, in reverse."""
    if rt.kv_events is not None:
        await rt.kv_events.stop()
    await rt.health.stop()
    await rt.data.relay.aclose()
    await rt.upstream.aclose()


def _data_path(rt: Runtime, echo_secrets: tuple[str, ...]) -> DataPath:
    limits = PromptLimits(
        rt.settings.max_prompt_tokens,
        rt.settings.max_batch_prompts,
        lambda: rt.fleet.max_len_bound,  # kept up to date by the fleet (proxy/core/fleet.py)
    )
    return DataPath(
        rt.guard,
        limits,
        rt.data,
        rt.metrics,
        rt.tokenizer,
        rt.shutdown,
        lambda exc: redact(exc.to_body(), echo_secrets),
        rt.native,
    )


def _guard_routes(app: FastAPI, rt: Runtime) -> None:
    """Keys, canonical paths and size limits for FastAPI's routes (proxy/security/guard.py);
    the data path applies the same guard itself."""

    def rejected(scope: Any, status: int) -> None:
        rt.metrics.count_request(_route_of(Request(scope)), "none", status)

    app.add_middleware(SecurityMiddleware, guard=rt.guard, on_reject=rejected)


def _error_handlers(app: FastAPI, rt: Runtime, echo_secrets: tuple[str, ...]) -> None:
    @app.exception_handler(ProxyError)
    async def proxy_error(request: Request, exc: ProxyError) -> JSONResponse:
        rt.metrics.count_request(_route_of(request), "none", exc.status_code)
        headers = {"retry-after": str(exc.retry_after)} if exc.retry_after is not None else None
        return JSONResponse(redact(exc.to_body(), echo_secrets), exc.status_code, headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = ProxyError(str(exc.detail), status_code=exc.status_code)
        err.error_type = "NotFoundError" if exc.status_code == 404 else "BadRequestError"
        return JSONResponse(err.to_body(), exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own 422 {"detail": [...]} for typed parameters (/admin/replicas/{index}):
        # a 400 in the OpenAI shape like every other error, as vLLM does. Inputs not echoed.
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', 'invalid')}"
            for e in exc.errors()
        )
        return await proxy_error(request, InvalidRequest(f"invalid request: {problems}"))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(ProxyError("internal proxy error").to_body(), 500)


def _probe_routes(app: FastAPI, rt: Runtime) -> None:
    @app.get("/health")
    async def health(strict: bool = False) -> JSONResponse:
        """200 while the fleet can serve (TRL and readiness probes); ``?strict=true``: 200 only
        when every replica is ready in the desired state (docs/reliability-publish.md)."""
        if rt.shutdown.draining:
            return JSONResponse({"status": "shutting down"}, 503)
        status, body = await rt.probes.health(strict)
        if rt.fleet.weights.active:  # merged-weight sync: which replicas hold which weights
            body["weights"] = rt.fleet.weights.describe(rt.fleet.weight_states())
        return JSONResponse(body, status)

    @app.get("/livez")
    async def livez() -> JSONResponse:
        """The proxy process itself answers (for liveness probes: unlike /health it does not
        fail when a replica does, so an orchestrator never restarts a healthy proxy)."""
        return JSONResponse({"status": "alive"})

    @app.get("/server_info")
    async def server_info(request: Request) -> JSONResponse:
        return JSONResponse(await rt.probes.server_info(request.url.query))

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(await rt.probes.models())

    @app.get("/is_paused")
    async def is_paused() -> JSONResponse:
        return JSONResponse(await rt.probes.is_paused())

    @app.get("/metrics")
    async def metrics() -> Response:
        # In-flight counts are read here rather than set on every request (two gauge updates
        # per completion otherwise); a replica seen once keeps its series, at 0 when idle.
        for replica in rt.fleet.replicas:
            rt.metrics.inflight.labels(str(replica.index)).set(replica.in_flight)
        rt.weights.refresh_gauges()
        rt.metrics.index_blocks.set(len(rt.router.index))
        evicted = rt.router.index.evictions - rt.metrics.index_evictions._value.get()
        if evicted > 0:
            rt.metrics.index_evictions.inc(evicted)
        return Response(generate_latest(rt.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _control_routes(app: FastAPI, rt: Runtime) -> None:
    """TRL's control calls (proxy/control.py) and its merged-weight sync, vLLM's weight
    transfer to every replica (proxy/weight_sync.py). A route's name, and so its OpenAPI
    operation id, is its path's last segment."""

    def route(
        path: str,
        call: Callable[[bytes, str], Awaitable[Reply]],
        method: str = "POST",
        body: dict[str, Any] | None = None,
    ) -> None:
        async def endpoint(request: Request) -> Response:
            reply = await call(await request.body(), request.url.query)
            if reply.media_type == "text/plain":
                return PlainTextResponse(str(reply.body), reply.status)
            return JSONResponse(reply.body, reply.status)

        name = path.rsplit("/", 1)[-1]
        app.add_api_route(path, endpoint, methods=[method], name=name, openapi_extra=body)

    route("/v1/load_lora_adapter", lambda body, _: rt.control.load_adapter(body), body=LOAD_BODY)
    route(
        "/v1/unload_lora_adapter", lambda body, _: rt.control.unload_adapter(body), body=UNLOAD_BODY
    )
    route("/pause", lambda _, query: rt.control.pause(query))
    route("/resume", lambda *_: rt.control.resume())
    route("/reset_prefix_cache", lambda _, query: rt.control.reset_prefix_cache(query))
    route("/get_world_size", lambda _, query: rt.weights.get_world_size(query), "GET")
    route("/init_weight_transfer_engine", lambda body, _: rt.weights.init(body))
    route("/start_weight_update", lambda body, _: rt.weights.start(body))
    route("/update_weights", lambda body, _: rt.weights.update(body))
    route("/finish_weight_update", lambda body, _: rt.weights.finish(body))


def _forward_routes(app: FastAPI, rt: Runtime) -> None:
    """Any other ``/v1/*`` path, forwarded to one ready replica."""

    async def forward_other(request: Request, rest: str) -> Response:
        ready = [r for r in rt.fleet.members() if r.status is Status.READY and r.weights.ok]
        if not ready:
            raise UpstreamUnavailable("no replica is ready", status_code=503)
        replica = min(ready, key=lambda r: r.in_flight)
        response = await rt.upstream.call(
            replica.index,
            replica.url,
            request.method,
            request.url.path,
            content=await request.body(),
            params=request.url.query or None,
            headers={"content-type": request.headers.get("content-type", "application/json")},
        )
        headers = {"x-proxy-replica": str(replica.index)}
        if "content-type" in response.headers:
            headers["content-type"] = response.headers["content-type"]
        return Response(response.content, response.status_code, headers)

    # One route per method: a multi-method route gives every method the same OpenAPI operation
    # id, and FastAPI warns on each /openapi.json (an error under the tests' warning filter).
    for method in ("GET", "POST", "PUT", "DELETE", "PATCH"):
        app.add_api_route(
            "/v1/{rest:path}",
            forward_other,
            methods=[method],
            name=f"forward_other_{method.lower()}",
        )


def _admin_routes(app: FastAPI, rt: Runtime) -> None:
    @app.get("/admin/fleet")
    async def fleet_state() -> JSONResponse:
        return JSONResponse(fleet_snapshot(rt))

    @app.get("/admin/kv_events")
    async def kv_events_state(blocks: bool = False) -> JSONResponse:
        """Each replica's events view; ``?blocks=true`` adds its block keys (large)."""
        if rt.kv_events is None:
            raise NotSupported("KV-event routing is off (PROXY_KV_EVENTS)")
        return JSONResponse({"replicas": rt.kv_events.snapshot(blocks)})

    @app.post("/admin/replicas")
    async def add_replica(request: Request) -> JSONResponse:
        body = parse_json(await request.body())
        if not isinstance(body, dict):
            raise InvalidRequest("request body must be a JSON object with 'url'")
        return JSONResponse(await rt.membership.add(body.get("url")), 201)

    @app.post("/admin/replicas/{index}/drain")
    async def drain_replica(index: int) -> JSONResponse:
        return JSONResponse(rt.membership.drain(index))

    @app.post("/admin/replicas/{index}/undrain")
    async def undrain_replica(index: int) -> JSONResponse:
        return JSONResponse(rt.membership.undrain(index))

    @app.delete("/admin/replicas/{index}")
    async def remove_replica(index: int, timeout_s: float = 60.0) -> JSONResponse:
        return JSONResponse(await rt.membership.remove(index, timeout_s))


def _route_of(request: Request) -> str:
    path = request.url.path
    return {
        **HOT_ROUTES,
        "/v1/models": "models",
        "/health": "health",
        "/server_info": "server_info",
        "/v1/load_lora_adapter": "load_lora_adapter",
        "/v1/unload_lora_adapter": "unload_lora_adapter",
        "/pause": "pause",
        "/resume": "resume",
        "/reset_prefix_cache": "reset_prefix_cache",
        "/is_paused": "is_paused",
        "/metrics": "metrics",
        "/get_world_size": "weight_sync",
        "/init_weight_transfer_engine": "weight_sync",
        "/start_weight_update": "weight_sync",
        "/update_weights": "weight_sync",
        "/finish_weight_update": "weight_sync",
    }.get(path, "admin" if path.startswith("/admin") else "forward")


def fleet_snapshot(rt: Runtime) -> dict[str, Any]:
    return {
        "base_model": rt.fleet.base_model,
        "desired": {"adapters": dict(rt.fleet.desired_adapters), "paused": rt.fleet.desired_paused},
        "routing": {
            "policy": rt.settings.policy,
            "hash_mode": rt.router.hasher.mode,
            "block_size": rt.router.block_size,
            "index_blocks": len(rt.router.index),
            "error": rt.data.routing_error,
        },
        "replicas": [_replica_view(rt.fleet, r) for r in rt.fleet.replicas],
    }


def _replica_view(fleet: Fleet, replica: Replica) -> dict[str, Any]:
    """One replica in /admin/fleet (what ``python -m proxy status`` shows)."""
    view = describe(replica)
    plan = fleet.plan(replica)
    view["waiting_for"] = fleet.waiting_for(replica)
    view["missing"] = sorted(plan.load)
    view["extra"] = sorted(n for n in plan.unload if n not in plan.load)
    view["serving"] = fleet.serves_anything(replica)
    view["hit_rate"] = replica.hit_rate
    view["weight_version"] = replica.weights.version  # None: launch weights, or no group
    return view
