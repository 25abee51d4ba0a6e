"""Runtime membership: a new replica is reconciled before it takes traffic; a drained one
finishes what it has and takes nothing new; removal waits for in-flight requests."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.support.fake_vllm import FakeVllm
from tests.support.servers import ServerThread
from tests.support.traffic import settled


def rollout(model: str, seed: int, prompt: list[int] | None = None) -> dict:
    return {"model": model, "prompt": prompt or [seed % 97 + 1] * 64, "max_tokens": 4, "seed": seed}


def test_added_replica_is_reconciled_before_traffic(make_fleet) -> None:
    h = make_fleet(1)
    h.client.post("/pause", params={"mode": "keep"})
    for v in (1, 2):
        h.client.post(
            "/v1/load_lora_adapter", json={"lora_name": f"trl-policy-v{v}", "lora_path": f"/b/{v}"}
        )
    h.client.post("/resume")
    newcomer = FakeVllm(name="new")
    newcomer.adapters["stale-thing"] = "/old"
    server = ServerThread(newcomer.app()).start()
    h.extra.append(server)

    r = h.client.post("/admin/replicas", json={"url": server.url})
    assert r.status_code == 201
    added = r.json()
    assert added["index"] == 1 and added["status"] == "ready"
    assert newcomer.adapters == {"trl-policy-v1": "/b/1", "trl-policy-v2": "/b/2"}
    assert not newcomer.paused
    served = {
        h.client.post("/v1/completions", json=rollout("trl-policy-v2", s, [s] * 40)).headers[
            "x-proxy-replica"
        ]
        for s in range(12)
    }
    assert served == {"0", "1"}


def test_added_replica_with_a_bad_url_or_duplicate_is_refused(make_fleet) -> None:
    h = make_fleet(1)
    assert h.client.post("/admin/replicas", json={"url": "ftp://x"}).status_code == 400
    r = h.client.post("/admin/replicas", json={"url": h.replicas[0].url})
    assert r.status_code == 400 and "already a member" in r.json()["error"]["message"]


async def test_drain_finishes_in_flight_and_takes_nothing_new(make_fleet) -> None:
    fakes = [FakeVllm(name="a", completion_delay_s=0.6), FakeVllm(name="b")]
    h = make_fleet(fakes=fakes)
    async with httpx.AsyncClient(base_url=h.proxy.url, timeout=30) as client:
        slow = [
            asyncio.create_task(client.post("/v1/completions", json=rollout("tiny/base", s)))
            for s in range(6)
        ]
        await settled(lambda: h.rt.fleet.replicas[0].in_flight > 0, what="work on replica 0")
        on_a = h.rt.fleet.replicas[0].in_flight
        drained = (await client.post("/admin/replicas/0/drain")).json()
        assert drained["status"] == "draining"
        after = [
            (await client.post("/v1/completions", json=rollout("tiny/base", 100 + s))).headers[
                "x-proxy-replica"
            ]
            for s in range(6)
        ]
        results = await asyncio.gather(*slow)
    assert on_a > 0
    assert all(r.status_code == 200 for r in results)  # in-flight work on the drained one finished
    assert set(after) == {"1"}
    assert h.client.post("/admin/replicas/0/undrain").json()["status"] in ("reconciling", "ready")


async def test_remove_waits_for_in_flight_then_forgets(make_fleet) -> None:
    fakes = [FakeVllm(name="a", completion_delay_s=0.5), FakeVllm(name="b")]
    h = make_fleet(fakes=fakes)
    async with httpx.AsyncClient(base_url=h.proxy.url, timeout=30) as client:
        busy = [
            asyncio.create_task(client.post("/v1/completions", json=rollout("tiny/base", s)))
            for s in range(4)
        ]
        await settled(lambda: h.rt.fleet.replicas[0].in_flight > 0, what="work on replica 0")
        started = time.monotonic()
        removed = (await client.delete("/admin/replicas/0")).json()
        waited = time.monotonic() - started
        results = await asyncio.gather(*busy)
        fleet = (await client.get("/admin/fleet")).json()
    assert removed["status"] == "removed" and removed["abandoned_in_flight"] == 0
    assert waited > 0.1  # it waited for the in-flight requests
    assert all(r.status_code == 200 for r in results)
    assert fleet["replicas"][0]["status"] == "removed"
    assert h.client.get("/health").status_code == 200  # a removed replica is not probed
    h.client.post("/pause", params={"mode": "keep"})
    assert fakes[0].control_calls() == []  # nor sent broadcasts
    assert h.client.delete("/admin/replicas/1").status_code == 400  # never the last one
    assert h.client.delete("/admin/replicas/7").status_code == 404


def test_replica_losing_adapters_while_up_is_caught_by_its_404(make_fleet) -> None:
    """Outside the guarantee (nothing observable happened to the replica), but still no loss:
    the replica's 404 sends it for reconciliation and the request to another replica."""
    h = make_fleet(2)
    h.client.post("/v1/load_lora_adapter", json={"lora_name": "trl-policy-v1", "lora_path": "/b"})
    h.fakes[1].adapters.clear()  # e.g. an operator unloaded it behind the proxy's back
    codes = [
        h.client.post("/v1/completions", json=rollout("trl-policy-v1", s, [s] * 48)).status_code
        for s in range(10)
    ]
    assert codes == [200] * 10
    assert h.fakes[1].missing_adapter_hits <= 1
    deadline = time.monotonic() + 5
    while h.fakes[1].adapters != {"trl-policy-v1": "/b"}:
        assert time.monotonic() < deadline, "never reconciled"
        time.sleep(0.02)
