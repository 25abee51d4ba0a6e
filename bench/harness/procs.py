"""Process plumbing shared by the runners: start in a new session, stop by process group, read
CPU time from /proc, wait for HTTP readiness, find tools.

Every process is started with ``start_new_session=True`` and stopped by signalling its own process
group, so a benchmark never touches processes it did not start, and a router's helper processes
go down with it, also when the benchmark fails half-way.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The Rust routers live in their own venv so their pinned deps never touch the project's.
BENCH_VENV = Path(os.environ.get("BENCH_VENV", REPO / ".venv-bench"))

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def find_tool(name: str) -> str | None:
    """A tool from the bench venv first, then PATH (nginx also lives in /usr/sbin)."""
    candidate = BENCH_VENV / "bin" / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    for d in ("/usr/sbin", "/usr/local/sbin"):
        p = Path(d) / name
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return None


def _proc_stat(pid: int) -> tuple[int, float] | None:
    """(ppid, utime+stime seconds) of one process, None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name sits in parentheses and may contain spaces; fields follow the last ')'.
    rest = raw[raw.rindex(")") + 2 :].split()
    ppid = int(rest[1])
    ticks = int(rest[11]) + int(rest[12])  # utime, stime (all threads)
    return ppid, ticks / _CLK_TCK


def tree_cpu_seconds(root: int) -> float:
    """utime+stime of ``root`` and all its live descendants, from /proc."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _proc_stat(int(entry))
        if st is not None:
            parents[int(entry)], cpu[int(entry)] = st
    total = 0.0
    for pid in cpu:
        p = pid
        while p > 1:
            if p == root:
                total += cpu[pid]
                break
            p = parents.get(p, 0)
    return total


@dataclass
class ManagedProcess:
    """A child in its own session; ``stop()`` signals the whole group."""

    name: str
    argv: Sequence[str]
    log_path: Path
    env: Mapping[str, str] | None = None
    capture_stdout: bool = False
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        env = dict(os.environ)
        if self.env:
            env.update(self.env)
        try:
            self.proc = subprocess.Popen(
                list(self.argv),
                stdout=subprocess.PIPE if self.capture_stdout else log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=REPO,
                start_new_session=True,
            )
        finally:
            log.close()
        return self

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.name} was not started")
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def read_json_line(self, timeout_s: float) -> dict[str, object]:
        """First stdout line as JSON (the simulator announces its ports this way)."""
        if self.proc is None or self.proc.stdout is None:
            raise RuntimeError(f"{self.name}: stdout is not captured")
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise TimeoutError(f"{self.name} printed nothing in {timeout_s} s; {self.tail()}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited before announcing itself; {self.tail()}")
        data = json.loads(line)
        if not isinstance(data, dict):
            raise RuntimeError(f"{self.name}: expected a JSON object, got {line!r}")
        return data

    def tail(self, n: int = 2000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return f"log {self.log_path} ends with:\n{text[-n:]}"

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.pid)

    def stop(self, grace_s: float = 5.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(grace_s)
        else:
            # The leader exited; helpers in its group may not have.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@contextlib.contextmanager
def managed(
    name: str,
    argv: Sequence[str],
    log_path: Path,
    env: Mapping[str, str] | None = None,
    capture_stdout: bool = False,
) -> Iterator[ManagedProcess]:
    p = ManagedProcess(name, argv, log_path, env, capture_stdout).start()
    try:
        yield p
    finally:
        p.stop()


def wait_http(
    url: str,
    timeout_s: float,
    *,
    proc: ManagedProcess | None = None,
    method: str = "GET",
    body: bytes | None = None,
    expect: int = 200,
) -> None:
    """Poll ``url`` until it answers ``expect``; fail early if ``proc`` died."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.name} exited while starting; {proc.tail()}")
        req = urllib.request.Request(url, data=body, method=method)
        if body is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=2) as resp:
                if resp.status == expect:
                    return
                last = f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
            if exc.code == expect:
                return
        except (OSError, urllib.error.URLError) as exc:
            last = repr(exc)
        time.sleep(0.1)
    tail = proc.tail() if proc is not None else ""
    raise TimeoutError(f"{url} not ready in {timeout_s} s (last: {last}); {tail}")


def machine_description() -> dict[str, str]:
    """nproc, CPU model and memory, for the reports."""
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 2**20:.1f} GiB"
                break
    return {
        "nproc": str(len(os.sched_getaffinity(0))),
        "cpu": model,
        "memory": mem,
        "python": sys.version.split()[0],
        "kernel": os.uname().release,
    }
