"""What a metrics scrape leaves for the router: the load it adds to a replica counts only the
requests this proxy did not send (proxy/core/fleet.py ``unaccounted_requests``)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from proxy.core.fleet import Fleet
from proxy.health import HealthMonitor
from proxy.metrics import Metrics
from proxy.settings import Settings


def _metrics_text(running: int, waiting: int) -> str:
    return (
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}.0\n'
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}.0\n'
    )


class _Upstream:
    probe_timeout = None

    def __init__(self, text: str) -> None:
        self.text = text

    async def call(self, *_args: Any, **_kwargs: Any) -> Any:
        return SimpleNamespace(status_code=200, text=self.text)


def _scrape(in_flight: int, running: int, waiting: int) -> tuple[float, float]:
    """(router load of the replica after the scrape, the exported waiting gauge)."""
    fleet = Fleet(["http://r0"])
    replica = fleet.replicas[0]
    replica.in_flight = in_flight
    metrics = Metrics()
    control: Any = SimpleNamespace(router=SimpleNamespace(kv_capacity_tokens={}))
    upstream: Any = _Upstream(_metrics_text(running, waiting))
    monitor = HealthMonitor(Settings(replicas=["http://r0"]), fleet, control, upstream, metrics)
    asyncio.run(monitor.scrape(replica))
    gauge = metrics.registry.get_sample_value(
        "rollout_proxy_replica_vllm_requests_waiting", {"replica": "0"}
    )
    return replica.in_flight + replica.queue_depth, float(gauge or 0.0)


def test_the_proxys_own_queued_requests_are_not_counted_twice() -> None:
    # 6 in flight through the proxy; the replica runs 4 and queues 2 of them for memory.
    load, waiting_gauge = _scrape(in_flight=6, running=4, waiting=2)
    assert load == 6.0
    assert waiting_gauge == 2.0  # the exported gauge still says what vLLM said


def test_another_clients_requests_at_the_replica_are_added() -> None:
    load, _ = _scrape(in_flight=2, running=5, waiting=3)
    assert load == 8.0
