"""The built proxy image, started with podman and checked from outside the container.

Run by ``make image-test`` (``scripts/image_test.sh`` builds the image first and passes its tag in
``IMAGE_TEST_IMAGE``); skipped otherwise, since a build takes minutes and needs podman.

The container runs as a user would run it: the image's own CMD, user and HEALTHCHECK, a
read-only root filesystem, its port 8000 published on 127.0.0.1 only, two fake vLLM replicas on
the host's loopback (reached from the container through slirp4netns' host-loopback address,
10.0.2.2, so nothing here listens beyond 127.0.0.1).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fakes.net import free_port
from tests.integration.test_deploy_container import wait_for
from tests.integration.test_deploy_files import CONTRACT_METRICS, exposed_names
from tests.support.fake_vllm import FakeVllm
from tests.support.servers import ServerThread

IMAGE = os.environ.get("IMAGE_TEST_IMAGE", "")
pytestmark = [
    pytest.mark.skipif(not IMAGE, reason="builds and runs a container image: `make image-test`"),
    pytest.mark.slow,
]

# slirp4netns' fixed address for the host's loopback, seen from inside the container.
HOST_LOOPBACK = "10.0.2.2"
# The Dockerfile's uid, and what `docker stop` / `podman stop` wait before SIGKILL by default.
IMAGE_UID = 10001
STOP_TIMEOUT_S = 10
# What the image may weigh: the measured size (216 MB on the debootstrapped base, of which the
# base is 151 MB and the proxy's installed wheels 65 MB, the [kv-events] extra's pyzmq and msgpack
# included) plus headroom for dependency updates; a dependency that drags in torch or a compiler
# (hundreds of MB) trips it.
MAX_IMAGE_MB = 280
HEAVY_PACKAGES = ("torch", "trl", "peft", "transformers", "accelerate", "datasets", "gcc")


def podman(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and out.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} -> {out.returncode}\n{out.stderr}")
    return out


@dataclass
class Container:
    name: str
    url: str
    fakes: list[FakeVllm]

    def logs(self) -> str:
        out = podman("logs", self.name, check=False)
        return out.stdout + out.stderr

    def exec(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        return podman("exec", self.name, *cmd, check=False)


@pytest.fixture(scope="module")
def container() -> Iterator[Container]:
    if shutil.which("podman") is None:
        pytest.fail("IMAGE_TEST_IMAGE is set but podman is not installed")
    fakes = [FakeVllm(name=f"r{i}") for i in range(2)]
    servers = [ServerThread(f.app()).start() for f in fakes]
    name = f"rollout-proxy-image-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    replicas = ",".join(f"http://{HOST_LOOPBACK}:{s.port}" for s in servers)
    try:
        podman(
            "run",
            "--detach",
            "--name",
            name,
            "--read-only",
            "--network",
            "slirp4netns:allow_host_loopback=true",
            "--publish",
            f"127.0.0.1:{port}:8000",
            "--env",
            f"PROXY_REPLICAS={replicas}",
            # What every deployment of the image sets (compose, k8s, HF Jobs): the image ships
            # without it, so an unconfigured run refuses a keyless bind on 0.0.0.0.
            "--env",
            "PROXY_ALLOW_UNAUTHENTICATED=true",
            IMAGE,
        )
        box = Container(name, f"http://127.0.0.1:{port}", fakes)

        def healthy() -> bool:
            try:
                return httpx.get(f"{box.url}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        try:
            wait_for(healthy, 60, "/health 200 through the published port")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{box.logs()}") from None
        yield box
    finally:
        podman("rm", "--force", "--time", "0", name, check=False)
        for server in servers:
            server.stop()


def test_image_metadata_runs_as_non_root_with_a_healthcheck() -> None:
    (info,) = json.loads(podman("image", "inspect", IMAGE).stdout)
    config = info["Config"]
    assert config["User"] == f"{IMAGE_UID}:{IMAGE_UID}"
    assert config["Cmd"] == ["rollout-proxy"]
    assert "8000/tcp" in config["ExposedPorts"]
    assert {"PROXY_HOST=0.0.0.0", "PROXY_PORT=8000"} <= set(config["Env"])
    # Kept only by the Docker image format; an OCI-format build would drop it silently.
    check = info.get("Healthcheck") or config.get("Healthcheck")
    assert check and check["Test"][0] == "CMD" and "/health" in check["Test"][-1], info.keys()


def test_image_size_and_contents_stay_slim() -> None:
    size_mb = int(podman("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout) / 1e6
    print(f"[image-test] {IMAGE}: {size_mb:.0f} MB")
    assert size_mb < MAX_IMAGE_MB, f"{size_mb:.0f} MB"
    listed = podman(
        "run", "--rm", "--read-only", "--network", "none", IMAGE,
        "python", "-m", "pip", "list", "--format", "json",
    )  # fmt: skip
    installed = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert "rollout-proxy" in installed
    assert not installed & set(HEAVY_PACKAGES), installed & set(HEAVY_PACKAGES)
    # Nothing of the build stage (wheels, sources) and no compiler came along.
    stray = podman(
        "run", "--rm", "--network", "none", IMAGE,
        "sh", "-c", "ls -d /wheels /src 2>/dev/null; command -v gcc cc || true",
    )  # fmt: skip
    assert stray.stdout.strip() == "", stray.stdout


def test_health_and_metrics_answer_through_the_published_port(container: Container) -> None:
    metrics = httpx.get(f"{container.url}/metrics", timeout=5)
    assert metrics.status_code == 200
    families = list(text_string_to_metric_families(metrics.text))
    missing = set(CONTRACT_METRICS) - set(exposed_names(families))
    assert not missing, f"/metrics lacks {missing}"
    healthy = {
        s.labels["replica"]: s.value
        for f in families
        if f.name == "rollout_proxy_replica_healthy"
        for s in f.samples
    }
    assert healthy == {"0": 1.0, "1": 1.0}


def test_a_completion_is_routed_to_a_replica_and_keeps_its_affinity(
    container: Container,
) -> None:
    prompt = list(range(100, 164))  # four full 16-token blocks
    body = {"model": "tiny/base", "prompt": prompt, "max_tokens": 4}
    picked = []
    for _ in range(3):
        answer = httpx.post(f"{container.url}/v1/completions", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"], answer.text
        picked.append(answer.headers["x-proxy-replica"])
    assert picked[0] in ("0", "1")
    # The same prompt again lands where its prefix is cached (the proxy's routing, in the image).
    assert picked == [picked[0]] * 3, picked
    served = [len(f.served) for f in container.fakes]
    assert served[int(picked[0])] >= 3, served


def test_runs_as_non_root_on_a_read_only_root_filesystem(container: Container) -> None:
    (state,) = json.loads(podman("container", "inspect", container.name).stdout)
    assert state["HostConfig"]["ReadonlyRootfs"] is True
    # PID 1 is the proxy itself, as the image's user (no shell, no root wrapper).
    status = container.exec("cat", "/proc/1/status").stdout
    uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
    assert uids == [str(IMAGE_UID)] * 4, uids
    cmdline = container.exec("cat", "/proc/1/cmdline").stdout.split("\0")
    assert any(part.endswith("rollout-proxy") for part in cmdline), cmdline
    # Neither the root filesystem nor the proxy's own install can be written...
    for path in ("/probe", "/opt/python/lib/probe"):
        touched = container.exec("touch", path)
        assert touched.returncode != 0 and "Read-only file system" in touched.stderr, touched
    # ...and the proxy served all of the above without writing anywhere.
    assert "Traceback" not in container.logs()


def test_the_image_healthcheck_follows_the_fleet(container: Container) -> None:
    ok = podman("healthcheck", "run", container.name, check=False)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # /health is 200 while the fleet can serve (docs/reliability-publish.md): one failed replica
    # of two leaves it serving; the check fails once no replica can.
    for fake in container.fakes:
        fake.health_status = 503
    try:

        def degraded() -> bool:
            return httpx.get(f"{container.url}/health", timeout=5).status_code != 200

        wait_for(degraded, 30, "/health to report that no replica can serve")
        bad = podman("healthcheck", "run", container.name, check=False)
        assert bad.returncode != 0, bad.stdout
        assert "unhealthy" in bad.stdout + bad.stderr
        # /metrics, the Kubernetes liveness probe, keeps answering meanwhile.
        assert httpx.get(f"{container.url}/metrics", timeout=5).status_code == 200
    finally:
        for fake in container.fakes:
            fake.health_status = 200
    wait_for(
        lambda: podman("healthcheck", "run", container.name, check=False).returncode == 0,
        30,
        "the HEALTHCHECK to pass again",
    )


def test_sigterm_stops_it_cleanly_within_the_grace_period(container: Container) -> None:
    # Last in this module: it stops the container. `podman stop` sends SIGTERM (the image sets
    # no STOPSIGNAL) and SIGKILLs after --time; the proxy must exit on its own well before.
    started = time.monotonic()
    podman("stop", "--time", str(STOP_TIMEOUT_S), container.name, timeout=STOP_TIMEOUT_S + 30)
    elapsed = time.monotonic() - started
    print(f"[image-test] SIGTERM to exit: {elapsed:.1f}s")
    (state,) = json.loads(podman("container", "inspect", container.name).stdout)
    exit_code = state["State"]["ExitCode"]
    # uvicorn re-raises SIGTERM after a clean shutdown (143); 137 would be podman's SIGKILL.
    assert exit_code in (0, 143), (exit_code, container.logs()[-2000:])
    assert elapsed < STOP_TIMEOUT_S
    assert "Application shutdown complete" in container.logs()
