"""Graceful shutdown over a real process (issue 11, defect 3): ``python -m proxy`` with a fake
replica that holds completions, then SIGTERM. Before the fix the proxy waited for the held
completion (an hour here) and, once done, died by the re-raised signal (status -15)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from fakes.net import free_port
from proxy.app import create_app
from proxy.settings import Settings
from tests.support.fake_vllm import FakeVllm
from tests.support.servers import ServerThread
from tests.support.traffic import wait_until

ROOT = Path(__file__).resolve().parents[2]
BODY = {"model": "tiny/base", "prompt": [1, 2, 3], "max_tokens": 4}


class ProxyProcess:
    def __init__(self, replica_url: str, grace_s: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PROXY_")}
        env.update(
            PROXY_REPLICAS=replica_url,
            PROXY_PORT=str(self.port),
            PROXY_SHUTDOWN_GRACE_S=str(grace_s),
            PROXY_HEALTH_INTERVAL_S="0.2",
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "proxy"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("the proxy did not become healthy:\n" + self.output())

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def output(self) -> str:
        if self.proc.poll() is None:
            return ""
        if self.proc.stdout is None or self.proc.stdout.closed:
            return ""
        return self.proc.stdout.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def post_in_background(url: str) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["response"] = httpx.post(url + "/v1/completions", json=BODY, timeout=60)
        except httpx.HTTPError as exc:
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def completion_arrived(fake: FakeVllm) -> bool:
    return any(path == "/v1/completions" for _, path, _ in fake.calls)


@pytest.fixture
def held_replica() -> Any:
    fake = FakeVllm(name="r0", hang_completions=True)
    server = ServerThread(fake.app()).start()
    yield fake, server
    server.kill()


def test_sigterm_answers_a_held_request_503_after_the_grace_and_exits_0(held_replica) -> None:
    fake, server = held_replica
    proxy = ProxyProcess(server.url, grace_s=1.5)
    try:
        thread, result = post_in_background(proxy.url)
        wait_until(lambda: completion_arrived(fake), timeout=10)
        signalled = time.monotonic()
        proxy.signal(signal.SIGTERM)
        status = proxy.wait(timeout=15)
        took = time.monotonic() - signalled
        thread.join(timeout=10)
        assert status == 0, proxy.output()
        # the grace period was given, and not much more (generous bound: a shared 2-core box)
        assert 1.5 <= took < 10, took
        response = result["response"]
        assert response.status_code == 503
        error = response.json()["error"]
        assert "shutting down" in error["message"]
        assert "PROXY_SHUTDOWN_GRACE_S" in error["message"]
    finally:
        proxy.stop()


def test_a_request_that_finishes_within_the_grace_is_answered(held_replica) -> None:
    fake, server = held_replica
    fake.hang_completions = False
    fake.completion_delay_s = 1.0
    proxy = ProxyProcess(server.url, grace_s=20)
    try:
        thread, result = post_in_background(proxy.url)
        wait_until(lambda: fake.in_flight == 1, timeout=10)
        proxy.signal(signal.SIGTERM)
        status = proxy.wait(timeout=15)
        thread.join(timeout=10)
        assert status == 0, proxy.output()
        assert result["response"].status_code == 200
    finally:
        proxy.stop()


def test_a_second_signal_exits_at_once(held_replica) -> None:
    fake, server = held_replica
    proxy = ProxyProcess(server.url, grace_s=60)
    try:
        post_in_background(proxy.url)
        wait_until(lambda: completion_arrived(fake), timeout=10)
        proxy.signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proxy.proc.poll() is None  # still in its grace period
        signalled = time.monotonic()
        proxy.signal(signal.SIGTERM)
        assert proxy.wait(timeout=10) is not None
        assert time.monotonic() - signalled < 5
    finally:
        proxy.stop()


def test_health_is_503_as_soon_as_shutdown_begins() -> None:
    fake = FakeVllm(name="r0")
    replica = ServerThread(fake.app()).start()
    app = create_app(Settings(replicas=[replica.url]))
    proxy = ServerThread(app).start()
    try:
        with httpx.Client(base_url=proxy.url, timeout=10) as client:
            assert client.get("/health").status_code == 200
            app.state.rt.shutdown.begin()
            r = client.get("/health")
            assert r.status_code == 503 and r.json() == {"status": "shutting down"}
            assert client.get("/livez").status_code == 200  # the process itself is fine
    finally:
        proxy.stop()
        replica.stop()
