"""The routing benchmark's second client (bench/harness/foreign.py), end to end in seconds: the
first turns of a share of the groups reach the replicas without passing the router, and the run
still reports every request."""

from __future__ import annotations

import json
from pathlib import Path

from tests.integration.test_bench_smoke import _check_routing, _run


def test_a_second_client_bypasses_the_router(tmp_path: Path) -> None:
    routers = ["proxy", "proxy-events"]
    _run(
        "bench.runners.run_routing",
        "--smoke",
        "--foreign-share",
        "0.5",
        "--routers",
        ",".join(routers),
        "--out",
        str(tmp_path),
    )
    _check_routing(tmp_path, routers)
    data = json.loads((tmp_path / "routing.json").read_text())
    assert "--foreign-share 0.5" in data["command"]
    for r in data["results"]:
        routed = sum(r["decisions"].values())
        served = sum(p["requests"] for p in r["per_replica"])
        # The smoke plan's 6 groups x 8 rollouts: groups 0, 2 and 4 sent their 24 first turns
        # straight to a replica, so the router decided fewer requests than the replicas served
        # (less the readiness probes, which the router decided but /sim/reset forgot).
        assert served - routed >= 20, (r["router"], served, routed)
