"""deploy/train_with_proxy.sh (the trainer image's command) with the real rollout-proxy in front
of a fake vLLM replica, and a stand-in trainer that records what it was given.

What must hold on HF Jobs: the trainer starts only once the proxy says every replica is healthy;
the trainer's exit status is the Job's; a proxy that dies stops the trainer instead of letting
it fail slowly through TRL's retries; a cancel (SIGTERM) reaches the trainer; nothing is left
running afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fakes.net import free_port
from tests.integration.test_deploy_container import _proxy_cli_works
from tests.support.fake_vllm import FakeVllm
from tests.support.servers import ServerThread
from tests.support.traffic import wait_until

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "train_with_proxy.sh"

pytestmark = pytest.mark.skipif(
    not _proxy_cli_works(), reason="`python -m proxy --help` does not work yet (proxy/ not ready)"
)

FAKE_TRAINER = r"""
import json, os, signal, sys, time, urllib.request

record = os.environ["FAKE_TRAINER_RECORD"]
url = os.environ.get("ROLLOUT_PROXY_URL", "")
seen = {"argv": sys.argv[1:], "env_url": url}
try:
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        seen["health"] = r.status
except Exception as exc:
    seen["health"] = repr(exc)
with open(record + ".tmp", "w") as f:
    json.dump(seen, f)
os.rename(record + ".tmp", record)

mode = os.environ.get("FAKE_TRAINER_MODE", "exit:0")
if mode.startswith("exit:"):
    sys.exit(int(mode[5:]))


def on_term(signum, frame):
    open(record + ".sigterm", "w").close()
    sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
time.sleep(120)
sys.exit(9)
"""


@dataclass
class Run:
    proc: subprocess.Popen[str]
    record: Path
    port: int

    def wait(self, timeout: float = 60) -> tuple[int, str]:
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            _, err = self.proc.communicate()
            raise AssertionError(f"train-with-proxy hung:\n{err}") from None
        return self.proc.returncode, err

    def seen(self) -> dict[str, Any]:
        return dict(json.loads(self.record.read_text()))


@pytest.fixture
def replica() -> Iterator[tuple[FakeVllm, ServerThread]]:
    fake = FakeVllm(name="r0")
    server = ServerThread(fake.app()).start()
    yield fake, server
    server.stop()


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Any]:
    runs: list[Run] = []
    trainer = tmp_path / "fake_trainer.py"
    trainer.write_text(FAKE_TRAINER)

    def _start(*args: str, **env: str) -> Run:
        port = free_port()
        record = tmp_path / f"trainer{len(runs)}.json"
        full_env = {
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "HOME": str(tmp_path),
            "PROXY_PORT": str(port),
            # Probe the fake replica fast so the test does not wait on the production period.
            "PROXY_HEALTH_INTERVAL_S": "0.2",
            "TRAIN_CMD": f"{sys.executable} {trainer}",
            "FAKE_TRAINER_RECORD": str(record),
            **env,
        }
        proc = subprocess.Popen(
            ["bash", str(SCRIPT), *args],
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        run = Run(proc, record, port)
        runs.append(run)
        return run

    yield _start
    for run in runs:
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
            run.proc.communicate()


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def children(pid: int) -> list[tuple[int, str]]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                out.append((int(stat.parent.name), cmd))
        except (OSError, IndexError, ValueError):
            continue
    return out


def test_starts_the_proxy_then_the_trainer_and_returns_its_status(
    replica: tuple[FakeVllm, ServerThread], start: Any
) -> None:
    _, server = replica
    run = start("--max-steps", "3", PROXY_REPLICAS=server.url, FAKE_TRAINER_MODE="exit:7")
    rc, err = run.wait()
    assert rc == 7, err
    seen = run.seen()
    url = f"http://127.0.0.1:{run.port}"
    assert seen["health"] == 200, "the trainer started before the proxy was healthy"
    assert seen["env_url"] == url
    assert seen["argv"] == ["--vllm-server-base-url", url, "--max-steps", "3"]
    assert not port_open(run.port), "the proxy outlived the trainer"
    assert "trainer exited with status 7" in err


def test_a_fleet_that_never_gets_healthy_fails_before_the_trainer_starts(
    replica: tuple[FakeVllm, ServerThread], start: Any
) -> None:
    fake, server = replica
    fake.health_status = 503
    run = start(PROXY_REPLICAS=server.url, PROXY_WAIT_S="3")
    rc, err = run.wait()
    assert rc == 2
    assert "rollout-proxy not healthy after 3s" in err
    assert not run.record.exists(), "the trainer must not start against an unhealthy fleet"
    assert not port_open(run.port)


def test_a_proxy_that_cannot_start_is_reported(start: Any) -> None:
    run = start(PROXY_REPLICAS="not-a-url")
    rc, err = run.wait()
    assert rc == 2
    assert "rollout-proxy exited (status 1) before it became healthy" in err
    assert "malformed" in err, "the proxy's own explanation must reach the Job's log"


def test_a_dying_proxy_stops_the_trainer(
    replica: tuple[FakeVllm, ServerThread], start: Any
) -> None:
    _, server = replica
    run = start(PROXY_REPLICAS=server.url, FAKE_TRAINER_MODE="sleep")
    wait_until(run.record.exists, 30, "the trainer to start")
    (proxy_pid,) = [pid for pid, cmd in children(run.proc.pid) if "rollout-proxy" in cmd]
    os.kill(proxy_pid, signal.SIGKILL)
    rc, err = run.wait()
    assert rc == 3
    assert "rollout-proxy exited (status 137) while the trainer was running" in err
    assert run.record.with_suffix(".json.sigterm").exists(), "the trainer was not asked to stop"


def test_sigterm_reaches_the_trainer_and_everything_stops(
    replica: tuple[FakeVllm, ServerThread], start: Any
) -> None:
    _, server = replica
    run = start(PROXY_REPLICAS=server.url, FAKE_TRAINER_MODE="sleep")
    wait_until(run.record.exists, 30, "the trainer to start")
    run.proc.send_signal(signal.SIGTERM)
    rc, err = run.wait()
    assert rc == 0, err  # the trainer's own exit status after a clean stop
    assert run.record.with_suffix(".json.sigterm").exists()
    assert not port_open(run.port)
    assert children(run.proc.pid) == []


def test_uses_a_running_proxy_when_given_its_url(
    replica: tuple[FakeVllm, ServerThread], start: Any
) -> None:
    _, server = replica
    run = start("--x", "1", PROXY_URL=server.url + "/", TRAINER_URL_FLAG="")
    rc, err = run.wait()
    assert rc == 0, err
    seen = run.seen()
    assert seen == {"argv": ["--x", "1"], "env_url": server.url, "health": 200}
    assert "starting rollout-proxy" not in err


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "set PROXY_REPLICAS"),
        ({"PROXY_REPLICAS": "http://a:1", "PROXY_URL": "http://b:2"}, "not both"),
        ({"PROXY_URL": "http://b:2", "PROXY_WAIT_S": "soon"}, "PROXY_WAIT_S must be"),
    ],
)
def test_bad_settings_are_refused(start: Any, env: dict[str, str], message: str) -> None:
    run = start(**env)
    rc, err = run.wait()
    assert rc == 2 and message in err
    assert not run.record.exists()
