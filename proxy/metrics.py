"""Prometheus collectors on the app's own registry (never the process-global one, so two apps in
one process -- tests, benchmarks -- never collide).

Label values are bounded by construction: ``replica`` is an index < max_replicas, ``route`` is one
of the proxy's own route names, ``status`` is an HTTP status class or code from a fixed set,
``outcome``/``result`` come from fixed tuples. No adapter name or prompt is ever a label value:
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

ROUTES = (
    "completions",
    "chat_completions",
    "models",
    "health",
    "server_info",
    "load_lora_adapter",
    "unload_lora_adapter",
    "pause",
    "resume",
    "reset_prefix_cache",
    "is_paused",
    "forward",
    "admin",
    "metrics",
    "weight_sync",
)


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

    def family(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labels)
        for labels, value in self.values.items():
            family.add_metric(labels, value)
        return family


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

    def family(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labels)
        les = [*map(floatToGoString, self.bounds), "+Inf"]
        for labels, series in self.series.items():
            cumulative, total = [], 0.0
            for le, count in zip(les, series[:-1], strict=True):
                total += count
                cumulative.append((le, total))
            family.add_metric(list(labels), cumulative, series[-1])
        return family


class _Tallies:
    """Collector exporting the tallies (registered on the app's registry)."""

    def __init__(self, tallies: Sequence[Tally | HistogramTally]) -> None:
        self.tallies = tuple(tallies)

    def collect(self) -> Iterator[Metric]:
        for tally in self.tallies:
            yield tally.family()

    def describe(self) -> Iterator[Metric]:
        # Names only (the registry checks them for collisions when this is registered).
        return self.collect()


class Metrics:
    """The collectors. What every completion updates is a tally (``Tally``,
    ``HistogramTally``); the rest are prometheus-client collectors, whose children are cached
    (``labels()`` validates and joins its label values on every call; a dict lookup on the same
    tuple is a tenth of that). Label sets are bounded (see the module docstring), so the tallies
    and caches are too."""

    def __init__(self) -> None:
        self._children: dict[tuple[Any, ...], Any] = {}
        # The *_created series double the exposition for nothing a dashboard uses. The switch is
        # process-wide in prometheus-client; every registry in this process is ours anyway.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        p = "rollout_proxy_"
        # Updated on every completion: plain tallies, exported at scrape (see Tally).
        self.requests = Tally(
            p + "requests",
            "Requests answered, by route, replica and status.",
            ["route", "replica", "status"],
        )
        self.proxy_seconds = HistogramTally(
            p + "proxy_seconds",
            "Time spent inside the proxy per request (excl. upstream).",
            ["route"],
            PROXY_BUCKETS,
        )
        self.upstream_seconds = HistogramTally(
            p + "upstream_seconds",
            "Time waiting on the replica (to full response).",
            ["route", "replica"],
            UPSTREAM_BUCKETS,
        )
        self.inflight = Gauge(
            p + "inflight", "Requests in flight per replica.", ["replica"], registry=r
        )
        self.decisions = Tally(
            p + "routing_decisions",
            "Routing decisions: affinity (specific prefix matched), spilled "
            "(matched but too busy), unmatched (no specific prefix).",
            ["outcome"],
        )
        self.matched_blocks = HistogramTally(
            p + "matched_blocks",
            "Specific prefix blocks matched on the chosen replica.",
            [],
            MATCH_BUCKETS,
        )
        r.register(
            _Tallies(
                [
                    self.requests,
                    self.proxy_seconds,
                    self.upstream_seconds,
                    self.decisions,
                    self.matched_blocks,
                ]
            )
        )
        # 1 on the implementation that runs the per-request parse and hashing (PROXY_NATIVE)
        self.native = Gauge(
            p + "native_info",
            "Which implementation runs the per-request prompt parsing and block hashing: "
            "implementation=c (the C extension) or python (the reference).",
            ["implementation"],
            registry=r,
        )
        self.index_blocks = Gauge(
            p + "index_blocks", "Prefix blocks tracked by the index.", registry=r
        )
        self.index_evictions = Counter(
            p + "index_evictions", "Prefix blocks evicted from the index.", registry=r
        )
        self.broadcasts = Counter(
            p + "broadcasts",
            "Control-plane broadcasts by endpoint and per-replica outcome.",
            ["endpoint", "replica", "outcome"],
            registry=r,
        )
        self.load_attempts = Counter(
            p + "adapter_load_attempts",
            "Adapter load calls sent to replicas, by result.",
            ["replica", "result"],
            registry=r,
        )
        self.mount_lag_retries = Counter(
            p + "adapter_mount_lag_retries",
            "Load retries because the replica could not see the "
            "adapter files yet (404 No adapter found).",
            ["replica"],
            registry=r,
        )
        self.publish_seconds = Histogram(
            p + "adapter_publish_seconds",
            "Load request received to adapter routable on all replicas.",
            buckets=PUBLISH_BUCKETS,
            registry=r,
        )
        self.adapters_loaded = Gauge(
            p + "adapters_loaded", "Adapters confirmed loaded.", ["replica"], registry=r
        )
        self.adapter_latest = Gauge(
            p + "adapter_latest_version",
            "N of the newest trl-policy-vN loaded on the replica.",
            ["replica"],
            registry=r,
        )
        self.weight_seq = Gauge(
            p + "replica_weight_version",
            "Merged-weight syncs the replica completed whole under the current weight-transfer "
            "group (0: launch weights); the label TRL or the proxy gave it is in /health.",
            ["replica"],
            registry=r,
        )
        self.weights_stale = Gauge(
            p + "replica_weights_stale",
            "1 when the replica does not hold the fleet's merged weights (it takes no traffic).",
            ["replica"],
            registry=r,
        )
        self.replica_healthy = Gauge(
            p + "replica_healthy",
            "1 when the replica takes traffic (READY), else 0.",
            ["replica"],
            registry=r,
        )
        self.ejections = Counter(
            p + "replica_ejections", "Replicas ejected from routing.", ["replica"], registry=r
        )
        self.reconciliations = Counter(
            p + "replica_reconciliations",
            "Reconciliations of a replica with the desired state.",
            ["replica", "outcome"],
            registry=r,
        )
        self.vllm_waiting = Gauge(
            p + "replica_vllm_requests_waiting",
            "vllm:num_requests_waiting scraped from the replica.",
            ["replica"],
            registry=r,
        )
        self.vllm_kv_usage = Gauge(
            p + "replica_vllm_kv_cache_usage",
            "vllm:kv_cache_usage_perc scraped from the replica.",
            ["replica"],
            registry=r,
        )
        self.vllm_prefix_queries = Gauge(
            p + "replica_vllm_prefix_cache_queries",
            "vllm:prefix_cache_queries_total (tokens) scraped.",
            ["replica"],
            registry=r,
        )
        self.vllm_prefix_hits = Gauge(
            p + "replica_vllm_prefix_cache_hits",
            "vllm:prefix_cache_hits_total (tokens) scraped.",
            ["replica"],
            registry=r,
        )

    def _child(self, collector: Any, *labels: str) -> Any:
        key = (id(collector), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = collector.labels(*labels)
        return child

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

    def inflight_for(self, replica: str) -> Any:
        return self._child(self.inflight, replica)
