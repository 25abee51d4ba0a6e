"""The data path's tallies (proxy/metrics.py) export exactly what prometheus-client's own
Counter and Histogram export for the same observations."""

from __future__ import annotations

import random

import pytest
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from proxy.metrics import (
    MATCH_BUCKETS,
    PROXY_BUCKETS,
    UPSTREAM_BUCKETS,
    HistogramTally,
    Metrics,
    Tally,
)


def _exposition(tally: object) -> str:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(tally)  # type: ignore[arg-type]
    return generate_latest(registry).decode()


def _reference(build: object) -> str:
    disable_created_metrics()  # type: ignore[no-untyped-call]  # as Metrics() does
    registry = CollectorRegistry(auto_describe=True)
    build(registry)  # type: ignore[operator]
    return generate_latest(registry).decode()


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("buckets", [PROXY_BUCKETS, UPSTREAM_BUCKETS, MATCH_BUCKETS])
def test_histogram_tally_matches_prometheus_histogram(
    seed: int, buckets: tuple[float, ...]
) -> None:
    rng = random.Random(seed)
    top = buckets[-1] * 2
    # Values on the bounds themselves (le is inclusive), below the first, past the last.
    values = [rng.choice([*buckets, 0.0, top, rng.uniform(0, top)]) for _ in range(200)]
    labels = [
        (rng.choice(["completions", "chat_completions"]), str(rng.randrange(3))) for _ in values
    ]
    tally = HistogramTally("x_seconds", "Help text.", ["route", "replica"], buckets)
    for label, value in zip(labels, values, strict=True):
        tally.observe(label, value)

    def build(registry: CollectorRegistry) -> None:
        hist = Histogram(
            "x_seconds", "Help text.", ["route", "replica"], buckets=buckets, registry=registry
        )
        for label, value in zip(labels, values, strict=True):
            hist.labels(*label).observe(value)

    assert _exposition(tally) == _reference(build)


def test_tally_matches_prometheus_counter() -> None:
    tally = Tally("x_requests", "Requests.", ["route", "status"])
    calls = [("completions", "200"), ("completions", "200"), ("pause", "502")]
    for labels in calls:
        tally.inc(labels)

    def build(registry: CollectorRegistry) -> None:
        counter = Counter("x_requests", "Requests.", ["route", "status"], registry=registry)
        for labels in calls:
            counter.labels(*labels).inc()

    assert _exposition(tally) == _reference(build)


def test_metrics_expose_the_tallies_by_their_public_names() -> None:
    metrics = Metrics()
    metrics.answered("completions", "0", 200, 0.2, 0.0003)
    metrics.count_request("completions", "0", 418)
    metrics.count_decision("affinity", 5)
    text = generate_latest(metrics.registry).decode()
    assert 'rollout_proxy_requests_total{replica="0",route="completions",status="200"} 1.0' in text
    assert 'rollout_proxy_requests_total{replica="0",route="completions",status="4xx"} 1.0' in text
    assert (
        'rollout_proxy_upstream_seconds_bucket{le="0.5",replica="0",route="completions"} 1.0'
        in text
    )
    assert 'rollout_proxy_proxy_seconds_count{route="completions"} 1.0' in text
    assert 'rollout_proxy_routing_decisions_total{outcome="affinity"} 1.0' in text
    assert 'rollout_proxy_matched_blocks_bucket{le="8.0"} 1.0' in text
    assert "# TYPE rollout_proxy_matched_blocks histogram" in text
