"""scripts/demo.py's process hygiene: a stopped child takes its whole group with it, and anything
that escaped its group is still found (by the run's environment marker) and killed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts import demo

# A leader that forks a child into its own group and one into a new session, prints both PIDs,
# then waits. The group child ignores SIGTERM (so the SIGKILL path runs too) and says so before
# the PIDs are printed: signalled earlier, it would die of the SIGTERM and prove nothing.
FORKER = r"""
import subprocess, sys, time
stay = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ignoring', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
stay.stdout.readline()
away = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
    start_new_session=True)
print(stay.pid, away.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not demo.vr.is_zombie(pid)


@pytest.fixture
def forked(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes], int, int]]:
    run_id = uuid.uuid4().hex
    env = {**os.environ, demo.RUN_ENV: run_id}
    proc = subprocess.Popen(
        [sys.executable, "-c", FORKER],
        env=env,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None
    stay, away = (int(x) for x in proc.stdout.readline().split())
    try:
        yield run_id, proc, stay, away
    finally:
        # Whatever the test left: everything carrying this test's marker.
        demo.kill_leftovers(run_id)
        proc.wait(5)
        proc.stdout.close()


def test_stop_group_stops_every_member_and_kill_leftovers_finds_the_escaped_one(
    forked: tuple[str, subprocess.Popen[bytes], int, int],
) -> None:
    run_id, proc, stay, away = forked
    assert sorted(demo.marked_processes(run_id)) == sorted([proc.pid, stay, away])
    t0 = time.monotonic()
    demo.stop_group(proc, grace_s=1.0)
    # The leader exits on SIGTERM; its SIGTERM-proof child is SIGKILLed after the grace period.
    assert 0.9 <= time.monotonic() - t0 < 10
    assert proc.returncode is not None and not _alive(stay)
    # The child in its own session is outside the group: only the marker finds it.
    assert _alive(away)
    assert demo.marked_processes(run_id) == [away]
    assert demo.kill_leftovers(run_id) == [away]
    deadline = time.monotonic() + 5
    while _alive(away) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(away)
    assert demo.marked_processes(run_id) == []


def test_the_marker_is_per_run(forked: tuple[str, subprocess.Popen[bytes], int, int]) -> None:
    assert demo.marked_processes(uuid.uuid4().hex) == []
    assert demo.kill_leftovers(uuid.uuid4().hex) == []
