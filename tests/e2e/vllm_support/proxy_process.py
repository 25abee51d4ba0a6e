"""Run the proxy as its own process (``python -m proxy``), the way a user starts it.

A subprocess rather than an in-process app: these tests check the product as shipped (CLI flags,
settings, uvicorn, background probes) against real replicas. Its own process group, stopped on
exit, also after a failure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from fakes.net import free_port
from tests.e2e.vllm_support import REPO_ROOT

# The proxy answers /health 200 once every replica does; its probes run every few seconds.
START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ProxyProcess:
    url: str
    log_path: Path
    proc: subprocess.Popen[bytes]

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])


@contextlib.contextmanager
def running_proxy(
    replica_urls: Sequence[str], log_path: Path, extra_args: Sequence[str] = ()
) -> Iterator[ProxyProcess]:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "proxy",
        "--replicas",
        ",".join(replica_urls),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra_args,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROXY_") and k != "HF_TOKEN"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            argv,
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        proxy = ProxyProcess(f"http://127.0.0.1:{port}", log_path, proc)
        try:
            _wait_healthy(proxy)
            yield proxy
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)


def _wait_healthy(proxy: ProxyProcess) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    last = "no answer"
    with httpx.Client(timeout=5) as client:
        while time.monotonic() < deadline:
            if proxy.proc.poll() is not None:
                raise RuntimeError(
                    f"proxy exited with {proxy.proc.returncode}:\n{proxy.log_tail()}"
                )
            try:
                resp = client.get(f"{proxy.url}/health")
                if resp.status_code == 200:
                    return
                last = f"{resp.status_code} {resp.text[:200]}"
            except httpx.TransportError as exc:
                last = repr(exc)
            time.sleep(0.3)
    raise RuntimeError(
        f"proxy not healthy after {START_TIMEOUT_S:.0f} s (last: {last}):\n{proxy.log_tail()}"
    )
