"""/metrics after real traffic and broadcasts: counters move as they should, and no label value
grows with traffic (adapter versions, prompts, request ids never become labels)."""

from __future__ import annotations

import random
import time

from prometheus_client.parser import text_string_to_metric_families

from tests.support.fake_vllm import FakeVllm


def scrape(h) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:  # type: ignore[no-untyped-def]
    out = {}
    for family in text_string_to_metric_families(h.client.get("/metrics").text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name: str, **labels: str) -> float:  # type: ignore[no-untyped-def]
    return sum(
        v
        for (n, ls), v in samples.items()
        if n == name and all(dict(ls).get(k) == x for k, x in labels.items())
    )


def test_counters_follow_traffic_and_broadcasts(make_fleet) -> None:
    fakes = [FakeVllm(name="a"), FakeVllm(name="b")]
    fakes[1].invisible_paths["/b/trl-policy-v1"] = 2
    h = make_fleet(fakes=fakes)
    rng = random.Random(0)
    h.client.post("/pause", params={"mode": "keep"})
    assert (
        h.client.post(
            "/v1/load_lora_adapter",
            json={"lora_name": "trl-policy-v1", "lora_path": "/b/trl-policy-v1"},
        ).status_code
        == 200
    )
    h.client.post("/resume")
    groups = 5
    for _ in range(groups):
        prompt = list(range(1000, 1048)) + [rng.randrange(50_000) for _ in range(100)]
        for s in range(8):
            h.client.post(
                "/v1/completions", json={"model": "trl-policy-v1", "prompt": prompt, "seed": s}
            )
    h.client.post("/v1/completions", content=b"{bad")
    m = scrape(h)

    assert value(m, "rollout_proxy_requests_total", route="completions", status="200") == 40
    assert value(m, "rollout_proxy_requests_total", route="completions", status="400") == 1
    decisions = {
        o: value(m, "rollout_proxy_routing_decisions_total", outcome=o)
        for o in ("affinity", "spilled", "unmatched")
    }
    assert sum(decisions.values()) == 40
    # 7 of each group of 8 follow the first. The second prompt's first request may also count as
    # affinity: before a second prompt has branched off it, the template looks specific.
    assert decisions["affinity"] >= 35 and decisions["unmatched"] >= groups - 1
    assert decisions["spilled"] == 0
    assert value(m, "rollout_proxy_matched_blocks_count") == 40
    assert value(m, "rollout_proxy_proxy_seconds_count", route="completions") == 40
    assert value(m, "rollout_proxy_upstream_seconds_count", route="completions") == 40
    assert value(m, "rollout_proxy_index_blocks") > 0
    for replica in ("0", "1"):
        assert (
            value(
                m,
                "rollout_proxy_broadcasts_total",
                endpoint="load_lora_adapter",
                replica=replica,
                outcome="ok",
            )
            == 1
        )
        assert (
            value(
                m, "rollout_proxy_broadcasts_total", endpoint="pause", replica=replica, outcome="ok"
            )
            == 1
        )
        assert value(m, "rollout_proxy_adapters_loaded", replica=replica) == 1
        assert value(m, "rollout_proxy_adapter_latest_version", replica=replica) == 1
        assert value(m, "rollout_proxy_replica_healthy", replica=replica) == 1
        assert value(m, "rollout_proxy_inflight", replica=replica) == 0
    assert value(m, "rollout_proxy_adapter_mount_lag_retries_total", replica="1") == 2
    assert (
        value(m, "rollout_proxy_adapter_load_attempts_total", replica="1", result="mount_lag") == 2
    )
    assert value(m, "rollout_proxy_adapter_publish_seconds_count") == 1
    # scraped from the replicas' own /metrics, in the background: wait for the next scrape
    deadline = time.monotonic() + 10
    while value(scrape(h), "rollout_proxy_replica_vllm_prefix_cache_hits") == 0:
        assert time.monotonic() < deadline, "the replicas' prefix-cache counters never arrived"
        time.sleep(0.05)
    assert value(scrape(h), "rollout_proxy_replica_vllm_prefix_cache_queries") > 0


def test_ejection_and_reconciliation_are_counted(make_fleet) -> None:

    h = make_fleet(2)
    h.fakes[1].health_status = 500
    deadline = time.monotonic() + 5
    while value(scrape(h), "rollout_proxy_replica_ejections_total", replica="1") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert value(scrape(h), "rollout_proxy_replica_healthy", replica="1") == 0
    h.fakes[1].health_status = 200
    # The first reconciliation happened at start-up; wait for the one after the ejection.
    while (
        value(scrape(h), "rollout_proxy_replica_reconciliations_total", replica="1", outcome="ok")
        < 2
    ):
        assert time.monotonic() < deadline + 5
        time.sleep(0.05)
    assert value(scrape(h), "rollout_proxy_replica_healthy", replica="1") == 1


def test_label_values_stay_bounded_as_traffic_grows(make_fleet) -> None:
    h = make_fleet(2)
    rng = random.Random(1)

    def series() -> int:
        return len(scrape(h))

    def churn(first: int, last: int) -> None:
        for v in range(first, last):
            name = f"trl-policy-v{v}"
            h.client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": f"/b/{v}"})
            for _ in range(4):
                h.client.post(
                    "/v1/completions",
                    json={"model": name, "prompt": [rng.randrange(9999) for _ in range(64)]},
                    headers={"x-request-id": f"req-{rng.random()}"},
                )
            h.client.post("/v1/completions", json={"model": f"nope-{v}", "prompt": [1]})
            if v > 3:
                h.client.post("/v1/unload_lora_adapter", json={"lora_name": f"trl-policy-v{v - 3}"})

    churn(1, 8)
    warm = series()
    churn(8, 30)
    assert series() == warm, "a label grew with adapter versions, prompts or request ids"
    labels = {v for (_, ls) in scrape(h) for _, v in ls}
    assert not [v for v in labels if "trl-policy" in v or "req-" in v or "nope-" in v]
