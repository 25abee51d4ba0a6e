"""Prometheus collectors on the app's own registry (never the process-global one, so two apps in
one process -- tests, benchmarks -- never collide).

Label values are bounded by construction: ``replica`` is an index < max_replicas, ``route`` is one
of the proxy's own route names (proxy/hotpath.py's HOT_ROUTES, proxy/app.py's ``_route_of``),
``status`` is an HTTP status class or code from a fixed set, ``outcome``/``result`` come from
fixed tuples. No adapter name or prompt is ever a label value:
adapter versions are exported as a number (``rollout_proxy_adapter_latest_version``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

# Buckets: proxy-side work is tens of microseconds to a few milliseconds; upstream calls are
# milliseconds (probes) to minutes (3,000-token rollouts); adapter publishes are ~0.1 s (local
# disk) to minutes (a lagging bucket mount; the published recipe's p50 is 8.5 s).
PROXY_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05, 0.25)
UPSTREAM_BUCKETS = (0.005, 0.025, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
PUBLISH_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
MATCH_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)


EXACT_STATUSES = (200, 400, 401, 403, 404, 413, 429, 500, 502, 503, 504)
_STATUS_LABELS = {status: str(status) for status in EXACT_STATUSES}


def status_label(status: int) -> str:
    """Exact code for the few that matter to TRL users, else the class (bounded set)."""
    return _STATUS_LABELS.get(status) or f"{status // 100}xx"


class Tally:
    """A labelled counter kept as plain numbers and exported when ``/metrics`` is scraped.

    Why not prometheus-client's ``Counter`` on the data path: each ``inc`` takes a lock and
    goes through two method calls (``MutexValue.inc``), a cost paid on every request;
    the proxy updates its counters from one event loop, so a dict of floats is exact, and the
    exposition is the library's own (``CounterMetricFamily``), same names and labels."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labels = tuple(labels)
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        values = self.values
        values[labels] = values.get(labels, 0.0) + amount

    def collect(self) -> Iterator[Metric]:
        """The exposition at scrape (a collector of its own, registered on the app's registry;
        the registry also reads its name from here to check for collisions)."""
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labels)
        for labels, value in self.values.items():
            family.add_metric(labels, value)
        yield family


class HistogramTally:
    """A labelled histogram kept as plain numbers (bucket found by bisection), exported when
    ``/metrics`` is scraped as the library's ``HistogramMetricFamily``.

    Why not prometheus-client's ``Histogram`` on the data path: its ``observe`` walks the buckets in
    Python and takes a lock per bucket it touches, three calls per completion. Same buckets, same
    ``le`` labels, same cumulative counts and sum (tests/unit/test_metrics_tally.py compares the two
    expositions)."""

    def __init__(
        self, name: str, documentation: str, labels: Sequence[str], buckets: Sequence[float]
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labels = tuple(labels)
        self.bounds = [float(b) for b in buckets]
        # Each series: one count per bucket, then the +Inf overflow, then the sum.
        self.series: dict[tuple[str, ...], list[float]] = {}

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        series = self.series.get(labels)
        if series is None:
            series = self.series[labels] = [0.0] * (len(self.bounds) + 2)
        # bisect_left finds the first bound >= value: Prometheus buckets count value <= le.
        series[bisect_left(self.bounds, value)] += 1
        series[-1] += value

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labels)
        les = [*map(floatToGoString, self.bounds), "+Inf"]
        for labels, series in self.series.items():
            cumulative, total = [], 0.0
            for le, count in zip(les, series[:-1], strict=True):
                total += count
                cumulative.append((le, total))
            family.add_metric(list(labels), cumulative, series[-1])
        yield family


# Every collector, in exposition order: (attribute, kind, name after "rollout_proxy_", label
# names, help[, buckets]). Tally and HistogramTally: updated on every completion (see Tally).
DECLARED: tuple[tuple[Any, ...], ...] = (
    ("inflight", Gauge, "inflight", "replica", "Requests in flight per replica."),
    ("requests", Tally, "requests", "route replica status",
     "Requests answered, by route, replica and status."),
    ("proxy_seconds", HistogramTally, "proxy_seconds", "route",
     "Time spent inside the proxy per request (excl. upstream).", PROXY_BUCKETS),
    ("upstream_seconds", HistogramTally, "upstream_seconds", "route replica",
     "Time waiting on the replica (to full response).", UPSTREAM_BUCKETS),
    ("decisions", Tally, "routing_decisions", "outcome",
     "Routing decisions: affinity (specific prefix matched), spilled "
     "(matched but too busy), unmatched (no specific prefix)."),
    ("matched_blocks", HistogramTally, "matched_blocks", "",
     "Specific prefix blocks matched on the chosen replica.", MATCH_BUCKETS),
    # 1 on the implementation that runs the per-request parse and hashing (PROXY_NATIVE)
    ("native", Gauge, "native_info", "implementation",
     "Which implementation runs the per-request prompt parsing and block hashing: "
     "implementation=c (the C extension) or python (the reference)."),
    ("index_blocks", Gauge, "index_blocks", "", "Prefix blocks tracked by the index."),
    ("index_evictions", Counter, "index_evictions", "", "Prefix blocks evicted from the index."),
    ("broadcasts", Counter, "broadcasts", "endpoint replica outcome",
     "Control-plane broadcasts by endpoint and per-replica outcome."),
    ("load_attempts", Counter, "adapter_load_attempts", "replica result",
     "Adapter load calls sent to replicas, by result."),
    ("mount_lag_retries", Counter, "adapter_mount_lag_retries", "replica",
     "Load retries because the replica could not see the "
     "adapter files yet (404 No adapter found)."),
    ("publish_seconds", Histogram, "adapter_publish_seconds", "",
     "Load request received to adapter routable on all replicas.", PUBLISH_BUCKETS),
    ("adapters_loaded", Gauge, "adapters_loaded", "replica", "Adapters confirmed loaded."),
    ("adapter_latest", Gauge, "adapter_latest_version", "replica",
     "N of the newest trl-policy-vN loaded on the replica."),
    ("weight_seq", Gauge, "replica_weight_version", "replica",
     "Merged-weight syncs the replica completed whole under the current weight-transfer "
     "group (0: launch weights); the label TRL or the proxy gave it is in /health."),
    ("weights_stale", Gauge, "replica_weights_stale", "replica",
     "1 when the replica does not hold the fleet's merged weights (it takes no traffic)."),
    ("replica_healthy", Gauge, "replica_healthy", "replica",
     "1 when the replica takes traffic (READY), else 0."),
    ("ejections", Counter, "replica_ejections", "replica", "Replicas ejected from routing."),
    ("reconciliations", Counter, "replica_reconciliations", "replica outcome",
     "Reconciliations of a replica with the desired state."),
    ("vllm_waiting", Gauge, "replica_vllm_requests_waiting", "replica",
     "vllm:num_requests_waiting scraped from the replica."),
    ("vllm_kv_usage", Gauge, "replica_vllm_kv_cache_usage", "replica",
     "vllm:kv_cache_usage_perc scraped from the replica."),
    ("vllm_prefix_queries", Gauge, "replica_vllm_prefix_cache_queries", "replica",
     "vllm:prefix_cache_queries_total (tokens) scraped."),
    ("vllm_prefix_hits", Gauge, "replica_vllm_prefix_cache_hits", "replica",
     "vllm:prefix_cache_hits_total (tokens) scraped."),
)  # fmt: skip


class Metrics:
    """The collectors (``DECLARED``). What every completion updates is a tally (``Tally``,
    ``HistogramTally``); the rest are prometheus-client collectors, updated off the data path
    (control calls, probes, scrapes). Label sets are bounded (see the module docstring), so the
    tallies are too."""

    inflight: Gauge
    requests: Tally
    proxy_seconds: HistogramTally
    upstream_seconds: HistogramTally
    decisions: Tally
    matched_blocks: HistogramTally
    native: Gauge
    index_blocks: Gauge
    index_evictions: Counter
    broadcasts: Counter
    load_attempts: Counter
    mount_lag_retries: Counter
    publish_seconds: Histogram
    adapters_loaded: Gauge
    adapter_latest: Gauge
    weight_seq: Gauge
    weights_stale: Gauge
    replica_healthy: Gauge
    ejections: Counter
    reconciliations: Counter
    vllm_waiting: Gauge
    vllm_kv_usage: Gauge
    vllm_prefix_queries: Gauge
    vllm_prefix_hits: Gauge

    def __init__(self) -> None:
        # The *_created series double the exposition for nothing a dashboard uses. The switch is
        # process-wide in prometheus-client; every registry in this process is ours anyway.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=True)
        for attr, kind, name, labels, doc, *buckets in DECLARED:
            kw = {"buckets": buckets[0]} if buckets else {}
            if kind not in (Tally, HistogramTally):
                kw["registry"] = None  # registered below, in DECLARED's order
            collector = kind("rollout_proxy_" + name, doc, labels.split(), **kw)
            self.registry.register(collector)
            setattr(self, attr, collector)

    def count_request(self, route: str, replica: str, status: int) -> None:
        self.requests.inc((route, replica, status_label(status)))

    def answered(
        self, route: str, replica: str, status: int, upstream_s: float, proxy_s: float
    ) -> None:
        """One relayed answer: its request count, its time upstream and the proxy's own time,
        in one call (the data path tallies every completion this way, three frames fewer than
        one method per metric)."""
        self.requests.inc((route, replica, status_label(status)))
        self.upstream_seconds.observe((route, replica), upstream_s)
        self.proxy_seconds.observe((route,), proxy_s)

    def count_decision(self, outcome: str, matched_blocks: int) -> None:
        self.decisions.inc((outcome,))
        self.matched_blocks.observe((), matched_blocks)
