"""Subprocess helpers for the trainer e2e test: start in a new session, stop the whole group.

Every process is started with ``start_new_session=True`` so that stopping it also stops what it
spawned (TRL's rollout child, uvicorn workers), by process group id - never by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"


def start(
    name: str,
    cmd: Sequence[str],
    log: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> Proc:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        popen = subprocess.Popen(
            list(cmd),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )
    return Proc(name, popen, log)


def stop(proc: Proc, grace_s: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL it if it does not exit within ``grace_s``."""
    if proc.popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.popen.pid, signal.SIGTERM)
        try:
            proc.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait(grace_s)
    # The leader may be gone while children of its group linger (TRL's rollout child).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.popen.pid, signal.SIGKILL)


@contextlib.contextmanager
def running(procs: list[Proc]) -> Iterator[list[Proc]]:
    """Stop every process in ``procs`` (appended to inside the block) on exit, failure included."""
    try:
        yield procs
    finally:
        for proc in reversed(procs):
            stop(proc)


def wait_for(
    predicate: Callable[[], bool], timeout_s: float, what: str, procs: Sequence[Proc] = ()
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        for proc in procs:
            if proc.popen.poll() is not None:
                raise AssertionError(
                    f"{proc.name} exited ({proc.popen.returncode}) while waiting for {what}:\n"
                    + proc.tail()
                )
        time.sleep(0.2)
    details = "\n".join(f"--- {p.name}:\n{p.tail()}" for p in procs)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}\n{details}")


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
