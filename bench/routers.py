"""The routers compared, and how each is started.

- ``proxy``: rollout-proxy with its default prefix-affine policy.
- ``proxy-events``: rollout-proxy routing on the replicas' KV-cache events (``PROXY_KV_EVENTS``);
  the simulator then publishes them (vLLM's wire format, bench/kv_events_publisher.py).
- ``proxy-rr`` / ``proxy-ll``: the same process with ``PROXY_POLICY=round_robin|least_loaded``,
  the naive baselines (same HTTP path, so only the policy differs).
- ``vllm-router``: the vLLM project's Rust router (PyPI ``vllm-router``), ``--policy cache_aware``.
- ``sglang-router``: SGLang's Rust router (PyPI ``sglang-router``), ``--policy cache_aware``.

Both Rust routers keep their defaults otherwise (cache threshold 0.3, balance thresholds 64 / 1.5),
which is what a user switching to them gets. They are installed in a separate venv
(``.venv-bench``, see bench/README.md) and skipped with a reason when absent.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from bench.procs import find_tool, free_port
from bench.workload import PromptFormat


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

    def unavailable(self) -> str | None:
        """Why this router cannot run here, or None."""
        if self.tool is not None and find_tool(self.tool) is None:
            return (
                f"`{self.tool}` not found (install it into .venv-bench: "
                f"`python -m venv .venv-bench && .venv-bench/bin/pip install {self.tool}`)"
            )
        return None

    def argv(self, replica_urls: Sequence[str], port: int) -> list[str]:
        if self.tool is None:
            return [
                sys.executable,
                "-m",
                "proxy",
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
        return rust_router_argv(self.tool, exe, replica_urls, port)


ROUTERS: dict[str, RouterSpec] = {
    spec.name: spec
    for spec in (
        RouterSpec(
            "proxy", "rollout-proxy, prefix policy (default)", env={"PROXY_POLICY": "prefix"}
        ),
        RouterSpec(
            "proxy-events",
            "rollout-proxy, prefix policy on the replicas' KV-cache events",
            env={"PROXY_POLICY": "prefix", "PROXY_KV_EVENTS": "true"},
            kv_events=True,
        ),
        RouterSpec("proxy-rr", "rollout-proxy, round_robin", env={"PROXY_POLICY": "round_robin"}),
        RouterSpec("proxy-ll", "rollout-proxy, least_loaded", env={"PROXY_POLICY": "least_loaded"}),
        RouterSpec("vllm-router", "vllm-router --policy cache_aware", tool="vllm-router"),
        RouterSpec(
            "sglang-router",
            "sglang-router launch --policy cache_aware (prompts sent as text, see notes)",
            tool="sglang-router",
            prompt_format="text",
        ),
    )
}


def select(names: Sequence[str]) -> list[RouterSpec]:
    unknown = [n for n in names if n not in ROUTERS]
    if unknown:
        raise ValueError(f"unknown router(s) {unknown}; known: {sorted(ROUTERS)}")
    return [ROUTERS[n] for n in names]


def rust_router_argv(tool: str, exe: str, replica_urls: Sequence[str], port: int) -> list[str]:
    """Command line of vllm-router or sglang-router in cache-aware mode on 127.0.0.1 (the
    routing and the overhead benchmarks start them the same way)."""
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
    ]
