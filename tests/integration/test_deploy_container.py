"""The proxy image's start command, run here the way the container runs it.

No Docker engine is needed: the test reads the runtime stage of ./Dockerfile (its ENV, its CMD,
its HEALTHCHECK command), starts that command as a process with that environment (only the port
moved to a free one) in front of a fake vLLM replica on 127.0.0.1, and checks what a container
runtime and an orchestrator would see: /health and /metrics answer, the socket listens on all
interfaces, the image's own HEALTHCHECK passes and then fails when a replica fails, /metrics
(the Kubernetes probe) keeps answering meanwhile, and SIGTERM (`docker stop`) ends it cleanly.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fakes.net import free_port
from tests.integration.test_deploy_files import CONTRACT_METRICS, exposed_names
from tests.support.fake_vllm import FakeVllm
from tests.support.servers import ServerThread

ROOT = Path(__file__).resolve().parents[2]


def _proxy_cli_works() -> bool:
    try:
        out = subprocess.run(
            [sys.executable, "-m", "proxy", "--help"], capture_output=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0


pytestmark = pytest.mark.skipif(
    not _proxy_cli_works(), reason="`python -m proxy --help` does not work yet (proxy/ not ready)"
)


def runtime_stage() -> list[str]:
    """Logical lines (continuations joined) of the Dockerfile's last stage."""
    logical: list[str] = []
    pending = ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    last_from = max(i for i, line in enumerate(logical) if line.startswith("FROM "))
    return logical[last_from:]


def image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for line in runtime_stage():
        if line.startswith("ENV "):
            for pair in shlex.split(line[4:]):
                key, value = pair.split("=", 1)
                env[key] = value
    return env


def image_cmd() -> list[str]:
    (line,) = [ln for ln in runtime_stage() if ln.startswith("CMD ")]
    return list(json.loads(line[4:]))


def image_healthcheck() -> list[str]:
    (line,) = [ln for ln in runtime_stage() if ln.startswith("HEALTHCHECK ")]
    return list(json.loads(line.split(" CMD ", 1)[1]))


def listening_on_all_interfaces(port: int) -> bool:
    """True when /proc/net/tcp has a LISTEN socket on 0.0.0.0:<port>."""
    table = Path("/proc/net/tcp")
    if not table.exists():
        pytest.skip("needs /proc/net/tcp (Linux) to see the bound address")
    for row in table.read_text().splitlines()[1:]:
        local, state = row.split()[1], row.split()[3]
        if local == f"00000000:{port:04X}" and state == "0A":
            return True
    return False


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


def get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=5)
    except httpx.TransportError:
        return None


@pytest.fixture
def replica() -> Iterator[tuple[FakeVllm, ServerThread]]:
    fake = FakeVllm(name="r0")
    server = ServerThread(fake.app()).start()
    yield fake, server
    server.stop()


def test_dockerfile_runtime_stage_is_what_this_test_runs() -> None:
    env = image_env()
    assert env["PROXY_HOST"] == "0.0.0.0"
    assert env["PROXY_PORT"] == "8000"
    assert image_cmd() == ["rollout-proxy"]
    assert image_healthcheck()[:2] == ["python", "-c"]


def test_container_start_command_serves_health_and_metrics(
    replica: tuple[FakeVllm, ServerThread], tmp_path: Path
) -> None:
    fake, server = replica
    port = free_port()
    bindir = Path(sys.executable).parent
    env = {
        "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(tmp_path),
        **image_env(),
        "PROXY_PORT": str(port),
        "PROXY_REPLICAS": server.url,
        # What every deployment of the image sets (compose, k8s, HF Jobs): the image itself
        # ships without it, so an unconfigured `docker run` refuses a keyless public bind.
        "PROXY_ALLOW_UNAUTHENTICATED": "true",
    }
    assert env["PROXY_HOST"] == "0.0.0.0"
    log = (tmp_path / "proxy.log").open("w")
    proc = subprocess.Popen(
        image_cmd(), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            lambda: (
                proc.poll() is not None
                or ((r := get(f"{base}/health")) is not None and r.status_code == 200)
            ),
            30,
            "/health 200",
        )
        assert proc.poll() is None, (tmp_path / "proxy.log").read_text()
        assert listening_on_all_interfaces(port), "the container must listen beyond loopback"

        metrics = httpx.get(f"{base}/metrics", timeout=5)
        assert metrics.status_code == 200
        assert metrics.headers["content-type"].startswith("text/plain")
        families = list(text_string_to_metric_families(metrics.text))
        exposed = exposed_names(families)
        missing = set(CONTRACT_METRICS) - set(exposed)
        assert not missing, f"/metrics lacks {missing}"
        healthy = {
            s.labels["replica"]: s.value
            for f in families
            if f.name == "rollout_proxy_replica_healthy"
            for s in f.samples
        }
        assert healthy == {"0": 1.0}

        # The image's HEALTHCHECK, run with the image's environment, passes...
        check = image_healthcheck()
        ok = subprocess.run(check, env=env, capture_output=True, timeout=30, check=False)
        assert ok.returncode == 0, ok.stderr

        # ...and fails once the replica does, while /metrics (the Kubernetes probe) still answers.
        fake.health_status = 503
        wait_for(
            lambda: (r := get(f"{base}/health")) is not None and r.status_code != 200,
            30,
            "/health to fail",
        )
        bad = subprocess.run(check, env=env, capture_output=True, timeout=30, check=False)
        assert bad.returncode != 0
        assert httpx.get(f"{base}/metrics", timeout=5).status_code == 200

        # `docker stop`: SIGTERM, then SIGKILL after 10 s. The proxy must be gone well before.
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=15)
        assert time.monotonic() - started < 10
        # uvicorn re-raises the signal after a clean shutdown, so 143 (or -15) is the clean exit.
        assert rc in (0, 143, -signal.SIGTERM), rc
        assert "Application shutdown complete" in (tmp_path / "proxy.log").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


def test_the_proxy_package_needs_no_trainer_dependencies() -> None:
    # The slim image installs only [project.dependencies]; importing the app must not pull in
    # anything from the [trainer] extra or the trainer package.
    code = (
        "import sys, proxy.app, proxy.__main__; "
        "heavy = {'torch', 'trl', 'peft', 'transformers', 'accelerate', 'datasets', 'trainer'}; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in heavy); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
