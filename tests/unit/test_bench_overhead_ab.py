"""run_overhead's ``proxy@LABEL`` targets (another checkout's proxy, side by side) and
latency_split's per-request segments, without starting anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.runners import run_overhead
from bench.runners.latency_split import split


def test_proxy_at_label_runs_the_named_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BENCH_TREES", f"base={tmp_path}")
    spec = run_overhead.target("proxy@base")
    assert spec.kind == "proxy" and spec.tree == tmp_path.resolve()
    assert spec.env == run_overhead.TARGETS["proxy"].env  # the default proxy, as measured
    assert "make setup" in (spec.unavailable() or "")  # no .venv there yet
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").touch()
    assert spec.unavailable() is None
    assert run_overhead.target("proxy") is run_overhead.TARGETS["proxy"]
    for unknown in ("proxy@other", "floor@base", "nope"):
        with pytest.raises(KeyError):
            run_overhead.target(unknown)


def test_split_reads_one_request_per_cycle() -> None:
    client, up = 7, 9
    events = []
    t = 0.0
    for _ in range(3):  # read request, write upstream, read answer, write answer
        for name, fd, dt in (
            ("read", client, 40),
            ("write", up, 100),
            ("recvfrom", up, 60),
            ("writev", client, 30),
        ):
            t += dt
            events.append((t, name, fd))
    events.insert(1, (events[0][0] + 1, "write", 3))  # a log write between: not a step
    seg = split(events, client)
    assert seg["A"] == [100.0] * 3
    assert seg["B"] == [30.0] * 3
    assert seg["T"] == [40.0] * 2  # answer -> next request
    assert len(seg["W"]) == 3
