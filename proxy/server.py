"""The HTTP server: uvicorn, with the proxy's own signal handling (proxy/shutdown.py).

uvicorn alone waits for every request on SIGTERM and re-raises the signal once done (exit 143).
Here the first SIGTERM/SIGINT turns ``/health`` 503 at once and starts the grace period, the
second exits at once, and a graceful stop exits 0. Why uvicorn and these settings:
docs/decisions/front-protocol.md, docs/decisions/server-settings.md.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import signal
import threading
from collections.abc import Generator
from types import FrameType
from typing import Any

import uvicorn

from proxy.settings import Settings
from proxy.shutdown import Shutdown

log = logging.getLogger("rollout_proxy")

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# uvicorn's own deadline, a backstop behind the proxy's: requests still running at the grace
# period's end are answered 503 within a loop turn; 2 s more covers sending those answers.
BACKSTOP_S = 2.0
KEEP_ALIVE_S = 75


class ProxyServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, shutdown: Shutdown) -> None:
        super().__init__(config)
        self.proxy_shutdown = shutdown

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            log.warning("second signal (%s): exiting now", signal.Signals(sig).name)
            self.force_exit = True
            return
        log.info("%s received: /health answers 503 from now on", signal.Signals(sig).name)
        self.proxy_shutdown.begin()
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # uvicorn's version re-raises the captured signal after a graceful stop (exit status
        # 143); the proxy's stop is complete by then, so it exits 0.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: Any = None) -> None:
        self.proxy_shutdown.start_grace()
        await super().shutdown(sockets)


# Young generation 10x CPython's default, and start-up objects frozen out of the collector's
# walks, so a request's short-lived objects die before they are looked at
# (docs/decisions/server-settings.md).
GC_YOUNG_THRESHOLD = 7_000


def settle_garbage_collector() -> None:
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def http_protocol(app: Any) -> Any:
    """uvicorn's ``http`` setting for the proxy's ``app``: the protocol that serves completions
    itself (proxy/front.py). Refuses a uvicorn whose protocol lacks what the front relies on
    (pyproject.toml pins the tested range)."""
    from proxy.front import front_protocol, unsupported

    problem = unsupported()
    if problem is not None:
        raise RuntimeError(
            f"uvicorn {uvicorn.__version__} is outside the range rollout-proxy is tested with "
            f"(pyproject.toml): {problem}"
        )
    return front_protocol(app.data_path, app.shutdown)


def serve(app: Any, settings: Settings, shutdown: Shutdown) -> None:
    config = uvicorn.Config(
        app,
        http=http_protocol(app),
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        lifespan="on",
        # Bounds the bytes h11 buffers for an incomplete request head (with httptools, uvicorn's
        # default when installed, the guard's 431 check applies, after parsing).
        h11_max_incomplete_event_size=settings.max_header_bytes,
        server_header=False,
        proxy_headers=False,  # the client address is never used: no X-Forwarded-For rewrite
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace_s + BACKSTOP_S),
        # Above clients' idle timeouts (aiohttp's 15 s), so the client always closes first and
        # never reuses a connection the proxy is closing.
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    settle_garbage_collector()
    ProxyServer(config, shutdown).run()
