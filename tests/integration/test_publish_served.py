"""Publish means served: the reported run (both replicas restart at once behind a lagging mount,
TRL's weight sync answers 200, the rollouts right after are all served), the bounded wait and its
503, /health's two meanings, and ``python -m proxy status`` against a real proxy over HTTP."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.core.fleet import Status
from proxy.status import main as status_main

ROOT = Path(__file__).resolve().parents[2]
V1, V2 = "trl-policy-v1", "trl-policy-v2"
ROLLOUTS = 32
ADMIN_KEY = "admin-key-for-the-status-test-0123456789"


def wait_until(check: Any, what: str, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


def load(client: httpx.Client, name: str) -> httpx.Response:
    body = {"lora_name": name, "lora_path": f"/adapters/{name}", "load_inplace": False}
    return client.post("/v1/load_lora_adapter", json=body)


def rollout(client: httpx.Client, model: str, i: int) -> httpx.Response:
    body = {"model": model, "prompt": [i, 2, 3, 4], "max_tokens": 4, "return_token_ids": True}
    return client.post("/v1/completions", json=body)


def restart_both_behind_a_lagging_mount(h: Any, v2_lag: int) -> None:
    """Both replicas die and come back empty at once; their mount never shows v1 again during
    the test (so they stay reconciling) and answers "No adapter found" to v2's first loads."""
    for server in h.replicas:
        server.kill()
    wait_until(
        lambda: all(r.status is Status.EJECTED for r in h.rt.fleet.members()), "both ejected"
    )
    for i, fake in enumerate(h.fakes):
        fake.reset_state()
        fake.invisible_paths = {f"/adapters/{V1}": -1, f"/adapters/{V2}": v2_lag}
        h.replicas[i] = h.replicas[i].restart(fake.app())
    wait_until(
        lambda: all(
            r.status is Status.RECONCILING and r.failures == 0 and r.paused is False
            for r in h.rt.fleet.members()
        ),
        "both back and reconciling",
    )


def test_the_rollouts_after_a_sync_are_served_while_replicas_reconcile(make_fleet) -> None:
    h = make_fleet(2, health_interval_s=0.2)
    assert load(h.client, V1).status_code == 200
    restart_both_behind_a_lagging_mount(h, v2_lag=10)

    # TRL's weight sync: pause, load v2 (through 10 "No adapter found" per replica), resume.
    assert h.client.post("/pause", params={"mode": "keep"}).status_code == 200
    assert load(h.client, V2).status_code == 200
    assert h.client.post("/resume").status_code == 200
    assert all(r.status is Status.RECONCILING for r in h.rt.fleet.members())  # v1 still missing

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: rollout(h.client, V2, i), range(ROLLOUTS)))
    assert [a.status_code for a in answers] == [200] * ROLLOUTS, answers[0].text
    assert sum(len([s for s in f.served if s.get("model") == V2]) for f in h.fakes) == ROLLOUTS
    assert all(f.missing_adapter_hits == 0 for f in h.fakes)

    # The fleet serves: plain /health is 200 and says what each replica waits for; strict is not.
    health = h.client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    for entry in health.json()["replicas"].values():
        assert entry["status"] == "reconciling" and V1 in entry["waiting_for"]
    strict = h.client.get("/health", params={"strict": "true"})
    assert strict.status_code == 503 and "not ready" in strict.json()["message"]


def test_a_desired_adapter_nobody_holds_waits_then_503_and_an_unknown_one_is_404(
    make_fleet,
) -> None:
    h = make_fleet(2, health_interval_s=0.2, adapter_wait_s=0.5)
    assert load(h.client, V1).status_code == 200
    restart_both_behind_a_lagging_mount(h, v2_lag=0)
    # Nobody holds v1 and nobody can serve anything: /health says so.
    assert h.client.get("/health").status_code == 503

    started = time.monotonic()
    refused = rollout(h.client, V1, 0)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "2"
    message = refused.json()["error"]["message"]
    assert V1 in message and "reconciling" in message and f"load {V1}" in message
    assert time.monotonic() - started >= 0.5  # it waited its bound before refusing

    unknown = rollout(h.client, "trl-policy-v99", 0)
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "NotFoundError"


def test_a_waiting_rollout_is_served_once_a_replica_gets_its_adapter(make_fleet) -> None:
    """A rollout of v2 sent while v2's load is still meeting the lagging mount is held, not
    refused, and served once the load lands (the fleet's change wakes it)."""
    h = make_fleet(2, health_interval_s=0.2, lora_retry_s=0.2)
    assert load(h.client, V1).status_code == 200
    restart_both_behind_a_lagging_mount(h, v2_lag=10)
    with ThreadPoolExecutor(2) as pool:
        loading = pool.submit(load, h.client, V2)
        wait_until(lambda: V2 in h.rt.fleet.desired_adapters, "v2 desired")
        early = pool.submit(rollout, h.client, V2, 7)
        assert loading.result().status_code == 200
        assert early.result().status_code == 200


def test_plain_health_stays_200_while_one_replica_fails_strict_does_not(make_fleet) -> None:
    h = make_fleet(2)
    assert h.client.get("/health").json()["status"] == "ok"
    assert h.client.get("/health", params={"strict": "true"}).status_code == 200
    h.fakes[1].health_status = 500
    plain = h.client.get("/health")
    assert plain.status_code == 200 and plain.json()["serving"] == [0]
    assert plain.json()["replicas"]["1"]["healthy"] is False
    strict = h.client.get("/health", params={"strict": "true"})
    assert strict.status_code == 503 and "[1]" in strict.json()["message"]
    h.fakes[0].health_status = 500
    assert h.client.get("/health").status_code == 503


def test_status_shows_the_fleet_with_the_admin_key_and_never_prints_it(
    make_fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    h = make_fleet(2, admin_keys=[ADMIN_KEY])
    admin = httpx.Client(
        base_url=h.proxy.url, timeout=30, headers={"authorization": f"Bearer {ADMIN_KEY}"}
    )
    with admin:
        assert load(admin, V1).status_code == 200
        assert status_main(["--url", h.proxy.url, "--admin-key", ADMIN_KEY]) == 0
    out = capsys.readouterr().out
    assert "REPLICA" in out and "WAITING-FOR" in out and V1 in out
    rows = [line for line in out.splitlines() if line.startswith(("0 ", "1 "))]
    assert len(rows) == 2 and all("ready" in row and "in sync" in row for row in rows)
    assert ADMIN_KEY not in out

    assert status_main(["--url", h.proxy.url, "--admin-key", "wrong-key-0123456789abcdef"]) == 1
    captured = capsys.readouterr()
    assert "refused the admin key" in captured.err and "wrong-key" not in captured.err

    # The real command line, the key from the environment.
    env = {"PROXY_ADMIN_KEY": ADMIN_KEY, "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "proxy",
            "status",
            "--url",
            h.proxy.url,
            "--watch",
            "--count",
            "2",
            "--interval",
            "0.05",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("WAITING-FOR") == 2 and ADMIN_KEY not in done.stdout + done.stderr
