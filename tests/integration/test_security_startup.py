"""``python -m proxy`` as a process: the start-up posture line, the refusal to listen beyond
loopback without keys, keys from the environment, and no secret in the process's own output.
Every proxy here binds 127.0.0.1 (the refused one never binds at all)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fakes.net import free_port
from tests.support.fake_vllm import FakeVllm
from tests.support.servers import ServerThread

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hf_" + "Q" * 34
ADMIN_KEY = "admin-key-0123456789abcdef"
DATA_KEY = "data-key-0123456789abcdef"


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROXY_") and k != "HF_TOKEN"}
    return env | extra


@pytest.fixture
def replica() -> Iterator[ServerThread]:
    server = ServerThread(FakeVllm(name="r0").app()).start()
    yield server
    server.stop()


def test_non_loopback_without_keys_refuses_to_start(replica: ServerThread) -> None:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "proxy", "--replicas", replica.url, "--host", "0.0.0.0"],
        cwd=ROOT,
        env=clean_env(PROXY_PORT=str(free_port())),
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,
    )
    assert proc.returncode != 0
    assert "refusing to listen on '0.0.0.0' without keys" in proc.stderr
    assert "PROXY_ALLOW_UNAUTHENTICATED=true" in proc.stderr
    assert time.monotonic() - started < 30


def test_invalid_key_is_refused_without_echo(replica: ServerThread) -> None:
    short = "tiny-key-99"
    proc = subprocess.run(
        [sys.executable, "-m", "proxy", "--replicas", replica.url],
        cwd=ROOT,
        env=clean_env(PROXY_API_KEYS=short, PROXY_PORT=str(free_port())),
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,
    )
    assert proc.returncode != 0 and "at least 16 characters" in proc.stderr
    assert short not in proc.stderr + proc.stdout


def run_until_live(env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy", "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(log.read_text())
        try:
            if httpx.get(f"{url}/livez", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError("proxy did not start: " + log.read_text())


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_loopback_without_keys_says_so(replica: ServerThread, tmp_path: Path) -> None:
    log = tmp_path / "proxy.log"
    proc, url = run_until_live(clean_env(PROXY_REPLICAS=replica.url), log)
    try:
        assert httpx.post(f"{url}/resume", timeout=10).status_code == 200  # open, by design
    finally:
        stop(proc)
    text = log.read_text()
    assert "no PROXY_API_KEYS/PROXY_ADMIN_KEYS: listening on loopback only" in text
    assert "PROXY_ADAPTER_ROOTS is not set" in text


def test_keys_from_the_environment_and_no_secret_in_the_output(
    replica: ServerThread, tmp_path: Path
) -> None:
    log = tmp_path / "proxy.log"
    env = clean_env(
        PROXY_REPLICAS=replica.url,
        PROXY_API_KEYS=f"{DATA_KEY},{DATA_KEY}-2",
        PROXY_ADMIN_KEYS=ADMIN_KEY,
        PROXY_ADAPTER_ROOTS="/bucket",
        PROXY_LOG_LEVEL="debug",
        HF_TOKEN=TOKEN,
    )
    proc, url = run_until_live(env, log)
    try:
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
        for key in (DATA_KEY, f"{DATA_KEY}-2"):
            r = httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 200
        r = httpx.post(f"{url}/pause", headers={"authorization": f"Bearer {DATA_KEY}"})
        assert r.status_code == 403
        r = httpx.post(f"{url}/resume", headers={"authorization": f"Bearer {ADMIN_KEY}"})
        assert r.status_code == 200
        r = httpx.get(f"{url}/health")
        assert r.status_code == 200 and "server" not in r.headers  # no "server: uvicorn"
    finally:
        stop(proc)
    text = log.read_text()
    assert "inbound auth on (2 data key(s), 1 admin key(s))" in text
    assert "adapters may be loaded from: /bucket" in text
    for secret in (TOKEN, DATA_KEY, ADMIN_KEY):
        assert secret not in text
