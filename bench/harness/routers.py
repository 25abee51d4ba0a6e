"""The routers compared, and how each is started.

- ``proxy``: rollout-proxy with its default policy (``cost``; the process gets no
  ``PROXY_POLICY``, so the row follows whatever the default is).
- ``proxy-prefix`` / ``proxy-rr`` / ``proxy-ll``: the same process with
  ``PROXY_POLICY=prefix|round_robin|least_loaded`` (same HTTP path, so only the policy differs);
  the two baselines are the bench's own (bench/harness/baseline_policies.py), so those two run
  the proxy through ``python -m bench.harness.proxy_with_baselines``.
- ``proxy-events``: rollout-proxy, default policy, scoring replicas on their KV-cache events
  (``PROXY_KV_EVENTS``); the simulator then publishes them (vLLM's wire format,
  bench/harness/kv_events_publisher.py).
- ``proxy-exact``: ``proxy`` with vLLM's exact block hashes (``PROXY_HASH_MODE=exact``), the
  hashing ``proxy-events`` needs, without its views: separates the events router's CPU cost
  from its routing decisions.
- ``vllm-router``: the vLLM project's Rust router (PyPI ``vllm-router``), ``--policy cache_aware``.
- ``sglang-router``: SGLang's Rust router (PyPI ``sglang-router``), ``--policy cache_aware``.

Both Rust routers keep their defaults otherwise (cache threshold 0.3, balance thresholds 64 / 1.5),
which is what a user switching to them gets. They are installed in a separate venv
(``.venv-bench``, see bench/README.md) and skipped with a reason when absent.

Health probes: every router probes its replicas at the same period, given in *simulated* seconds
(``probe_interval_s``, real = simulated * time_scale). On this shared 2-core machine the probes'
CPU competes with the simulated engines, which real replicas' GPUs never do, and any real delay is
magnified 1/time_scale times; so the benchmark gives every router the Rust routers' own default,
60 s, instead of each router's default in real seconds (the proxy's 2 s real would be 20 s
simulated at time_scale 0.1, 30x more often than vllm-router's 60 s real = 600 s simulated).

- ``proxy@LABEL``: rollout-proxy, default policy, as another checkout of this repository runs it
  (``BENCH_TREES=LABEL=PATH,...``; PATH's own ``.venv``, made by its ``make setup``): a change
  measured against its base in the same run, side by side, without a switch in the product.
  ``proxy-events@LABEL`` and ``proxy-exact@LABEL`` likewise.

To add a router, add a :class:`RouterSpec` to ``ROUTERS`` (name, how to start it); the runner
iterates over whatever is registered.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.harness.procs import find_tool
from bench.harness.workload import PromptFormat
from fakes.net import free_port


@dataclass(frozen=True)
class RouterSpec:
    name: str
    description: str
    # The executable it needs (None: the project's own proxy, always present).
    tool: str | None = None
    # How prompts must be sent: sglang-router rejects token-id prompts (422), so it gets the same
    # ids as a string, which the simulator accepts; see the report.
    prompt_format: PromptFormat = "ids"
    env: Mapping[str, str] = field(default_factory=dict)
    # Subscribes to the replicas' KV-cache events (the simulator must publish them).
    kv_events: bool = False
    # Another checkout whose proxy runs instead of this one's (``proxy@LABEL``).
    tree: Path | None = None
    # The module run as our proxy: ``proxy``, or the launcher adding the bench's baselines.
    module: str = "proxy"

    def unavailable(self) -> str | None:
        """Why this router cannot run here, or None."""
        if self.tree is not None and not self.python().is_file():
            return f"{self.python()} not found (run `make setup` in {self.tree})"
        if self.tool is not None and find_tool(self.tool) is None:
            return (
                f"`{self.tool}` not found (install it into .venv-bench: "
                f"`python -m venv .venv-bench && .venv-bench/bin/pip install {self.tool}`)"
            )
        return None

    def python(self) -> Path:
        """The interpreter that runs this proxy: this checkout's, or ``tree``'s venv."""
        return Path(sys.executable) if self.tree is None else self.tree / ".venv" / "bin" / "python"

    def environment(self, probe_interval_real_s: float | None = None) -> dict[str, str]:
        """The process environment overrides, with the probe period for our proxy."""
        env = dict(self.env)
        if self.tool is None and probe_interval_real_s is not None:
            env["PROXY_HEALTH_INTERVAL_S"] = f"{probe_interval_real_s:g}"
        return env

    def argv(
        self, replica_urls: Sequence[str], port: int, probe_interval_real_s: float | None = None
    ) -> list[str]:
        if self.tool is None:
            return [
                str(self.python()),
                # -P: not this checkout's proxy/ from the working directory, the venv's own
                # (editable) install
                *(["-P"] if self.tree is not None else []),
                "-m",
                self.module,
                "--replicas",
                ",".join(replica_urls),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ]
        exe = find_tool(self.tool)
        if exe is None:
            raise RuntimeError(self.unavailable() or self.tool)
        return rust_router_argv(self.tool, exe, replica_urls, port, probe_interval_real_s)


ROUTERS: dict[str, RouterSpec] = {
    spec.name: spec
    for spec in (
        RouterSpec("proxy", "rollout-proxy, default policy (cost)"),
        RouterSpec("proxy-prefix", "rollout-proxy, prefix", env={"PROXY_POLICY": "prefix"}),
        RouterSpec(
            "proxy-events",
            "rollout-proxy, default policy on the replicas' KV-cache events",
            env={"PROXY_KV_EVENTS": "true"},
            kv_events=True,
        ),
        # proxy-events' CPU without its views: vLLM's exact (sha256) block hashes on the index,
        # to tell what the events router loses to its real-time cost from what its decisions do.
        RouterSpec(
            "proxy-exact",
            "rollout-proxy, default policy, exact vLLM hashes (index only)",
            env={"PROXY_HASH_MODE": "exact"},
        ),
        RouterSpec(
            "proxy-rr",
            "rollout-proxy, round_robin",
            env={"PROXY_POLICY": "round_robin"},
            module="bench.harness.proxy_with_baselines",
        ),
        RouterSpec(
            "proxy-ll",
            "rollout-proxy, least_loaded",
            env={"PROXY_POLICY": "least_loaded"},
            module="bench.harness.proxy_with_baselines",
        ),
        RouterSpec("vllm-router", "vllm-router --policy cache_aware", tool="vllm-router"),
        RouterSpec(
            "sglang-router",
            "sglang-router launch --policy cache_aware (prompts sent as text, see notes)",
            tool="sglang-router",
            prompt_format="text",
        ),
    )
}


def trees(setting: str | None = None) -> dict[str, Path]:
    """``BENCH_TREES`` (``LABEL=PATH,...``) as {label: path}."""
    if setting is None:
        setting = os.environ.get("BENCH_TREES", "")
    out: dict[str, Path] = {}
    for item in filter(None, (x.strip() for x in setting.split(","))):
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            raise ValueError(f"BENCH_TREES entry {item!r} is not LABEL=PATH")
        out[label] = Path(path).resolve()
    return out


def select(names: Sequence[str]) -> list[RouterSpec]:
    known = dict(ROUTERS)
    for label, path in trees().items():
        # The events router and its exact-hash control too, so a change to the events path is
        # measured against its base in one run as well.
        for variant in ("proxy", "proxy-events", "proxy-exact"):
            spec, name = ROUTERS[variant], f"{variant}@{label}"
            known[name] = replace(
                spec, name=name, description=f"{spec.description}, as at {path}", tree=path
            )
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(
            f"unknown router(s) {unknown}; known: {sorted(known)} "
            "(proxy@LABEL needs BENCH_TREES=LABEL=PATH)"
        )
    return [known[n] for n in names]


def rust_router_argv(
    tool: str,
    exe: str,
    replica_urls: Sequence[str],
    port: int,
    probe_interval_real_s: float | None = None,
) -> list[str]:
    """Command line of vllm-router or sglang-router in cache-aware mode on 127.0.0.1 (the
    routing and the overhead benchmarks start them the same way); ``probe_interval_real_s``
    sets their health-check period (whole seconds, at least 1: they take an integer)."""
    launch = ["launch"] if tool == "sglang-router" else []
    if tool not in ("vllm-router", "sglang-router"):
        raise ValueError(f"unknown router {tool!r}")
    return [
        exe,
        *launch,
        "--worker-urls",
        *replica_urls,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        "cache_aware",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
    ] + (
        []
        if probe_interval_real_s is None
        else ["--health-check-interval-secs", str(max(1, round(probe_interval_real_s)))]
    )
