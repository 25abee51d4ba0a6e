"""Smoke runs of each benchmark (seconds each): they start, finish, and write a report whose rows
carry numbers. What the numbers say is the benchmarks' business, not the test suite's.

The Rust routers, nginx and wrk are optional installs (see bench/README.md); their parts are
skipped with the reason when missing.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness.procs import REPO, find_tool
from bench.runners import count_instructions, run_overhead
from fakes.net import free_port

RUST_ROUTERS = ("vllm-router", "sglang-router")


def _run(module: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{module} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _finite(*values: object) -> bool:
    return all(isinstance(v, int | float) and math.isfinite(v) for v in values)


def _check_routing(out: Path, routers: list[str]) -> None:
    data = json.loads((out / "routing.json").read_text())
    rows = {(r["router"], r["replicas"]): r for r in data["results"]}
    report = (out / "routing.md").read_text()
    for name in routers:
        r = rows[(name, 2)]
        assert r["status"] == "ok", r["reason"]
        assert r["errors"] == 0, r["reason"]
        assert r["requests"] > 0
        assert _finite(
            r["hit_rate"],
            r["oracle_rate"],
            r["oracle_ratio"],
            r["imbalance_busy"],
            r["imbalance_load"],
            r["throughput_tok_s"],
            r["p50_s"],
            r["p99_s"],
            r["server_p50_s"],
            r["server_p99_s"],
        ), r
        assert _finite(
            r["sync_mean_real_s"],
            r["paused_sim_s"],
            r["added_p50_ms"],
            r["added_p99_ms"],
            r["ceiling_tok_s"],
            r["router_cpu_ms"],
            r["sim_cpu_ms"],
            r["client_cpu_ms"],
        ), r
        # Every process of the run did work for each request (a router that forwards bytes
        # included), and the report shows it.
        assert min(r["router_cpu_ms"], r["sim_cpu_ms"], r["client_cpu_ms"]) > 0, r
        # The smoke plan publishes three adapter versions: two syncs, each freezing replicas.
        assert r["syncs"] == 2 and r["paused_sim_s"] > 0
        assert r["sync_max_real_s"] >= r["sync_mean_real_s"] > 0
        assert 0 < r["throughput_tok_s"] <= r["ceiling_tok_s"]
        assert 0 < r["hit_rate"] <= 1 and 0 < r["oracle_rate"] <= 1
        assert r["imbalance_busy"] >= 1 and r["p99_s"] >= r["p50_s"] > 0
        assert sum(p["requests"] for p in r["per_replica"]) >= r["requests"]
        assert f"| {name} | " in report
    assert (out / "routing.png").stat().st_size > 10_000


def test_routing_smoke_with_our_proxy(tmp_path: Path) -> None:
    routers = ["proxy", "proxy-prefix", "proxy-rr", "proxy-ll"]
    _run(
        "bench.runners.run_routing",
        "--smoke",
        "--routers",
        ",".join(routers),
        "--out",
        str(tmp_path),
    )
    _check_routing(tmp_path, routers)
    data = json.loads((tmp_path / "routing.json").read_text())
    ours = next(r for r in data["results"] if r["router"] == "proxy")
    # The proxy broadcasts TRL's control calls, so the driver sent them through it.
    assert ours["control"] == "through router"
    assert sum(ours["decisions"].values()) >= ours["requests"]
    # The report can be written again from the JSON alone: the same tables and figures, only
    # the header says it was rewritten.
    again = tmp_path / "again"
    _run(
        "bench.runners.run_routing",
        "--report-from",
        str(tmp_path / "routing.json"),
        "--out",
        str(again),
    )

    def body(path: Path) -> list[str]:
        return [x for x in path.read_text().splitlines() if not x.startswith("Measured ")]

    assert body(again / "routing.md") == body(tmp_path / "routing.md")
    assert "report rewritten" in (again / "routing.md").read_text()


@pytest.mark.parametrize("router", RUST_ROUTERS)
def test_routing_smoke_with_rust_router(tmp_path: Path, router: str) -> None:
    if find_tool(router) is None:
        pytest.skip(f"{router} not installed (.venv-bench, see bench/README.md)")
    _run("bench.runners.run_routing", "--smoke", "--routers", router, "--out", str(tmp_path))
    _check_routing(tmp_path, [router])


def _check_overhead(out: Path, targets: list[str], name: str = "overhead") -> None:
    data = json.loads((out / f"{name}.json").read_text())
    rows = {(r["target"], r["body"]): r for r in data["rows"]}
    report = (out / f"{name}.md").read_text()
    for name in targets:
        for body in ("repeated", "distinct64"):
            r = rows[(name, body)]
            assert r["status"] == "ok", r["reason"]
            assert r["errors"] == 0, r["reason"]
            assert _finite(r["rps_64"], r["p50_1_us"], r["p99_1_us"], r["cpu_us_per_req"]), r
            assert r["rps_64"] > 0 and r["cpu_us_per_req"] > 0
        assert f"| {name} | " in report
    assert "## Workload `repeated`" in report and "## Workload `distinct64`" in report


def _need_overhead_tools() -> None:
    for tool in ("nginx", "wrk"):
        if find_tool(tool) is None:
            pytest.skip(f"{tool} not installed (apt-get install -y nginx wrk)")


def test_overhead_smoke_with_our_proxy(tmp_path: Path) -> None:
    _need_overhead_tools()
    targets = [
        "direct",
        "proxy",
        "proxy-python",
        "proxy-rr",
        "nginx",
        "floor",
        "floor-protocol",
        "floor-min",
        "floor-min-routed",
    ]
    _run(
        "bench.runners.run_overhead",
        "--smoke",
        "--targets",
        ",".join(targets),
        "--out",
        str(tmp_path),
    )
    _check_overhead(tmp_path, targets)


def test_overhead_smoke_with_rust_routers(tmp_path: Path) -> None:
    _need_overhead_tools()
    targets = [r for r in RUST_ROUTERS if find_tool(r) is not None]
    if not targets:
        pytest.skip("neither vllm-router nor sglang-router installed (.venv-bench)")
    _run(
        "bench.runners.run_overhead",
        "--smoke",
        "--targets",
        ",".join(targets),
        "--out",
        str(tmp_path),
    )
    _check_overhead(tmp_path, targets)


def test_overhead_smoke_with_a_rollout_sized_answer(tmp_path: Path) -> None:
    """600 generated ids with their logprobs: longer than an nginx config string, so the
    backend serves the answer from a file; reported beside the default answer's report."""
    _need_overhead_tools()
    _run(
        "bench.runners.run_overhead",
        "--smoke",
        "--targets",
        "direct,proxy",
        "--completion-tokens",
        "600",
        "--out",
        str(tmp_path),
    )
    _check_overhead(tmp_path, ["direct", "proxy"], name="overhead_completion600")
    assert "a fixed 600-token completion" in (tmp_path / "overhead_completion600.md").read_text()
    assert not (tmp_path / "overhead.md").exists()


def test_instruction_count_driver_runs_the_request() -> None:
    """What count_instructions runs under valgrind, run here without it (valgrind costs a
    minute of CPU per count): every request answered 200, with short and rollout-sized answers."""
    for tokens in ("16", "600"):
        done = subprocess.run(
            [sys.executable, "-P", "-c", count_instructions.DRIVER, str(REPO), "3", "30", "auto"]
            + [tokens],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]


def test_whole_process_count_drives_every_target(tmp_path: Path) -> None:
    """What ``count_instructions --whole-process`` runs under valgrind, run here without it:
    each target (this tree's proxy, vllm-router when installed) started in front of the
    backend and every request answered 200, with short and rollout-sized answers."""
    _need_overhead_tools()
    for tokens in (16, 600):
        with count_instructions.backend(tokens, tmp_path) as urls:
            port = free_port()
            targets = count_instructions.process_targets(urls, port)
            assert "this tree" in targets
            for label, argv in targets.items():
                count_instructions.serve_and_drive(
                    f"{label.replace(' ', '_')}-{tokens}",
                    argv,
                    port,
                    count_instructions.PROCESS_ENV,
                    tmp_path,
                    warm=10,
                    requests=40,
                    connections=4,
                )
    # The answer size was set for the backend's config only: reports written later in this
    # process (their file name depends on it) see the default.
    assert run_overhead.COMPLETION_TOKENS == run_overhead.DEFAULT_COMPLETION_TOKENS


def test_profile_smoke(tmp_path: Path) -> None:
    _need_overhead_tools()
    if find_tool("py-spy") is None:
        pytest.skip("py-spy not installed (.venv-bench, see bench/README.md)")
    _run("bench.runners.profile_proxy", "--duration", "2", "--out", str(tmp_path))
    report = (tmp_path / "overhead_profile.md").read_text()
    assert "## By component" in report
    assert "proxy/" in report  # the proxy's own frames were sampled


def test_micro_smoke(tmp_path: Path) -> None:
    _run("bench.runners.run_micro", "--smoke", "--out", str(tmp_path))
    data = json.loads((tmp_path / "micro.json").read_text())
    names = [t["name"] for t in data["hashing"]]
    assert any(n.startswith("fast") for n in names) and any(n.startswith("exact") for n in names)
    for t in data["hashing"]:
        assert _finite(t["median_us"], t["min_us"]) and t["median_us"] > 0
    for m in data["index"]:
        assert m["blocks"] > 0 and _finite(m["bytes_per_block"]) and m["bytes_per_block"] > 0
    assert "bytes per block" in (tmp_path / "micro.md").read_text()
