"""deploy/hf_jobs/*.sh run end to end against a fake `hf` CLI and fake replicas on 127.0.0.1.

The fake `hf` answers the subcommands the scripts use the way huggingface_hub 2.4's CLI does
(`run --detach --quiet` prints the id, `inspect --json` prints a list of jobs with
status.stage / status.expose_urls, `ps --quiet --label` lists ids, `cancel`, `wait`) and records
every call. Each fake replica is an HTTP server whose /health demands the HF token as Bearer.
A last group of tests runs the scripts' printed commands through the real `hf jobs run --dry-run`
so a flag the CLI does not know fails here, not on a user's GPU bill.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
HF_JOBS = ROOT / "deploy" / "hf_jobs"
TOKEN = "hf_test_token_4f1c9"

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("curl") is None, reason="needs bash and curl"
)

FAKE_HF = r'''#!PYTHON
"""A fake `hf` CLI: the subset of huggingface_hub 2.4's `hf jobs` the deploy scripts use."""
import json, os, sys

state_path = os.environ["FAKE_HF_STATE"]
with open(state_path) as f:
    state = json.load(f)
argv = sys.argv[1:]
state["calls"].append({"argv": argv, "hf_token_in_env": bool(os.environ.get("HF_TOKEN"))})


def save():
    with open(state_path, "w") as f:
        json.dump(state, f)


def opt_values(args, name):
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == name]


def positional(args):
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("--namespace", "--label", "--format"):
            skip = True
        elif not a.startswith("-"):
            out.append(a)
    return out


def find(job_id):
    for job in state["jobs"]:
        if job["id"] == job_id:
            return job
    print(f"Error: job {job_id} not found", file=sys.stderr)
    save()
    sys.exit(1)


rc = 0
if argv[:2] == ["auth", "token"]:
    print(state["token"])
elif argv[:2] == ["jobs", "run"]:
    args = argv[2:]
    assert "--detach" in args and "--quiet" in args, "the scripts must not block on a job"
    name = opt_values(args, "--name")[0]
    labels = dict(l.split("=", 1) for l in opt_values(args, "--label"))
    job = {"id": f"job{len(state['jobs'])}abc", "name": name, "labels": labels, "argv": args,
           "inspects": 0, "cancelled": False}
    state["jobs"].append(job)
    print(job["id"])
elif argv[:2] == ["jobs", "inspect"]:
    assert "--json" in argv
    (job_id,) = positional(argv[2:])
    job = find(job_id)
    job["inspects"] += 1
    sc = state["scenario"].get(job["name"], {})
    stage = sc.get("stage", "RUNNING")
    if job["inspects"] <= sc.get("scheduling_polls", 0):
        stage = "SCHEDULING"
    if job["cancelled"]:
        stage = "CANCELED"
    status = {"stage": stage}
    if sc.get("message"):
        status["message"] = sc["message"]
    if stage == "RUNNING" and sc.get("url"):
        status["expose_urls"] = [sc["url"]]
    print(json.dumps([{"name": job["name"], "id": job["id"], "labels": job["labels"],
                       "status": status, "owner": {"id": "1", "name": "me", "type": "user"}}]))
elif argv[:2] == ["jobs", "ps"]:
    assert "--quiet" in argv
    wanted = dict(l.split("=", 1) for l in opt_values(argv, "--label"))
    for job in state["jobs"]:
        if not job["cancelled"] and wanted.items() <= job["labels"].items():
            print(job["id"])
elif argv[:2] == ["jobs", "cancel"]:
    (job_id,) = positional(argv[2:])
    find(job_id)["cancelled"] = True
elif argv[:2] == ["jobs", "wait"]:
    rc = state.get("wait_rc", 0)
else:
    print(f"fake hf: unsupported {argv}", file=sys.stderr)
    rc = 2
save()
sys.exit(rc)
'''


class _Replica(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        server: FakeReplica = self.server  # type: ignore[assignment]
        server.auth_seen.append(self.headers.get("Authorization", ""))
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            code = 401
        elif server.unhealthy_answers > 0:
            server.unhealthy_answers -= 1
            code = 503
        else:
            code = server.health_code
        self.send_response(code if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


class FakeReplica(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, unhealthy_answers: int = 0, health_code: int = 200) -> None:
        super().__init__(("127.0.0.1", 0), _Replica)
        self.unhealthy_answers = unhealthy_answers
        self.health_code = health_code
        self.auth_seen: list[str] = []
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()


@dataclass
class Env:
    tmp: Path
    state_path: Path
    env: dict[str, str]
    replicas: list[FakeReplica] = field(default_factory=list)

    def state(self) -> dict[str, Any]:
        return dict(json.loads(self.state_path.read_text()))

    def set_scenario(self, scenario: dict[str, Any], **extra: Any) -> None:
        state = self.state()
        state["scenario"] = scenario
        state.update(extra)
        self.state_path.write_text(json.dumps(state))

    def replica(self, **kwargs: Any) -> FakeReplica:
        r = FakeReplica(**kwargs)
        self.replicas.append(r)
        return r

    def run(self, script: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        proc = subprocess.Popen(
            ["bash", str(HF_JOBS / script), *args],
            env={**self.env, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(f"{script} hung\nstdout:\n{out}\nstderr:\n{err}") from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def hf_calls(self) -> list[list[str]]:
        return [c["argv"] for c in self.state()["calls"]]

    def runs(self) -> list[list[str]]:
        return [c[2:] for c in self.hf_calls() if c[:2] == ["jobs", "run"]]

    def cancelled(self) -> list[str]:
        return [c[-1] for c in self.hf_calls() if c[:2] == ["jobs", "cancel"]]


@pytest.fixture
def hfenv(tmp_path: Path) -> Iterator[Env]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "hf"
    fake.write_text(FAKE_HF.replace("PYTHON", sys.executable, 1))
    fake.chmod(0o755)
    state_path = tmp_path / "hf_state.json"
    state_path.write_text(json.dumps({"jobs": [], "calls": [], "scenario": {}, "token": TOKEN}))
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "LC_ALL": "C.UTF-8",
        "FAKE_HF_STATE": str(state_path),
        "RUN_NAME": "grpo-test",
        "BUCKET": "me/rl-bucket",
        "TRAINER_IMAGE": "registry.example/rollout-trainer:1",
        "POLL_S": "1",
        "HEALTH_TIMEOUT_S": "20",
    }
    e = Env(tmp_path, state_path, env)
    yield e
    for r in e.replicas:
        r.close()


def two_healthy_replicas(hfenv: Env, **first: Any) -> list[FakeReplica]:
    reps = [hfenv.replica(**first), hfenv.replica()]
    hfenv.set_scenario(
        {
            "grpo-test-vllm-0": {"url": reps[0].url, "scheduling_polls": 1},
            "grpo-test-vllm-1": {"url": reps[1].url},
        }
    )
    return reps


def kv_lines(stdout: str) -> dict[str, str]:
    return dict(
        line.split("=", 1)
        for line in stdout.splitlines()
        if "=" in line and not line.startswith("+")
    )


def opt(args: list[str], name: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == name]


def assert_replica_job(args: list[str], index: int, bucket: str = "me/rl-bucket") -> None:
    assert opt(args, "--name") == [f"grpo-test-vllm-{index}"]
    assert set(opt(args, "--label")) == {"rollout-proxy-run=grpo-test", "rollout-proxy-role=vllm"}
    assert opt(args, "--secrets") == ["HF_TOKEN"]
    assert set(opt(args, "--env")) == {
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1",
        "VLLM_SERVER_DEV_MODE=1",
    }
    assert opt(args, "--volume") == [f"hf://buckets/{bucket}:/bucket:rw"]
    assert opt(args, "--expose") == ["8000"]
    image_at = args.index("vllm/vllm-openai:v0.33.0")
    serve = args[image_at + 1 :]
    assert serve[:3] == ["vllm", "serve", "Qwen/Qwen2.5-Math-1.5B"]
    for flag, value in [
        ("--max-lora-rank", "1"),
        ("--max-loras", "6"),
        ("--max-model-len", "4096"),
        ("--block-size", "16"),
        ("--host", "0.0.0.0"),
        ("--port", "8000"),
    ]:
        assert serve[serve.index(flag) + 1] == value, flag
    assert "--enable-lora" in serve


# ---- up.sh ------------------------------------------------------------------------------------


def test_up_starts_replicas_waits_for_health_then_starts_the_trainer(hfenv: Env) -> None:
    reps = two_healthy_replicas(hfenv, unhealthy_answers=2)
    res = hfenv.run("up.sh", "--max-steps", "500")
    assert res.returncode == 0, res.stderr

    runs = hfenv.runs()
    assert len(runs) == 3
    assert_replica_job(runs[0], 0)
    assert_replica_job(runs[1], 1)
    trainer = runs[2]
    assert opt(trainer, "--name") == ["grpo-test-trainer"]
    assert opt(trainer, "--flavor") == ["h200x2"]
    envs = dict(e.split("=", 1) for e in opt(trainer, "--env"))
    assert envs["PROXY_REPLICAS"] == f"{reps[0].url},{reps[1].url}", "replica order is kept"
    assert envs["PROXY_BLOCK_SIZE"] == "16"
    assert envs["PROXY_ADAPTER_ROOTS"] == "/bucket"
    assert "--expose" not in trainer, "the proxy is not exposed unless asked"
    tail = trainer[trainer.index("registry.example/rollout-trainer:1") :]
    assert tail == [
        "registry.example/rollout-trainer:1",
        "train-with-proxy",
        "--output-dir",
        "/bucket/grpo-test",
        "--max-steps",
        "500",
    ]
    # The wait really waited: replica 0 answered 503 twice before 200, and every probe carried
    # the token, which never appeared on a command line.
    assert reps[0].auth_seen.count(f"Bearer {TOKEN}") == 3
    assert reps[1].auth_seen and set(reps[1].auth_seen) == {f"Bearer {TOKEN}"}
    assert TOKEN not in json.dumps(hfenv.hf_calls())
    assert all(
        c["hf_token_in_env"] for c in hfenv.state()["calls"] if c["argv"][:2] == ["jobs", "run"]
    )

    out = kv_lines(res.stdout)
    assert out["PROXY_REPLICAS"] == envs["PROXY_REPLICAS"]
    assert out["TRAINER_JOB_ID"] == "job2abc"
    assert out["REPLICA_JOB_IDS"] == "job0abc,job1abc"
    assert hfenv.cancelled() == []
    assert "down.sh" in res.stderr


def test_up_fails_fast_when_a_replica_job_errors_and_cancels_what_it_started(hfenv: Env) -> None:
    rep = hfenv.replica()
    hfenv.set_scenario(
        {
            "grpo-test-vllm-0": {"url": rep.url},
            "grpo-test-vllm-1": {
                "stage": "ERROR",
                "message": "CUDA out of memory",
                "scheduling_polls": 1,
            },
        }
    )
    res = hfenv.run("up.sh", HEALTH_TIMEOUT_S="600")
    assert res.returncode == 1
    assert "replica 1 (job job1abc) ended with stage ERROR: CUDA out of memory" in res.stderr
    assert "hf jobs logs job1abc" in res.stderr
    assert len(hfenv.runs()) == 2, "no trainer after a failed replica"
    assert sorted(hfenv.cancelled()) == ["job0abc", "job1abc"]


def test_up_gives_up_after_the_health_timeout(hfenv: Env) -> None:
    two_healthy_replicas(hfenv, health_code=503)
    res = hfenv.run("up.sh", HEALTH_TIMEOUT_S="2")
    assert res.returncode == 1
    assert "not all healthy after 2s (1/2)" in res.stderr
    assert sorted(hfenv.cancelled()) == ["job0abc", "job1abc"]


def test_keep_on_failure_leaves_the_jobs_running(hfenv: Env) -> None:
    two_healthy_replicas(hfenv, health_code=503)
    res = hfenv.run("up.sh", HEALTH_TIMEOUT_S="2", KEEP_ON_FAILURE="1")
    assert res.returncode == 1
    assert hfenv.cancelled() == []
    assert "KEEP_ON_FAILURE=1 leaves running: job0abc job1abc" in res.stderr


def test_up_stops_at_once_when_the_token_is_refused(hfenv: Env) -> None:
    two_healthy_replicas(hfenv)
    state = hfenv.state()
    state["token"] = "hf_wrong"
    hfenv.state_path.write_text(json.dumps(state))
    res = hfenv.run("up.sh", HEALTH_TIMEOUT_S="600")  # from `hf auth token`: no HF_TOKEN set
    assert res.returncode == 1
    assert "answered 401" in res.stderr and "HF_TOKEN" in res.stderr
    assert sorted(hfenv.cancelled()) == ["job0abc", "job1abc"]


def test_wait_and_teardown_cancels_the_replicas_when_the_trainer_ends(hfenv: Env) -> None:
    two_healthy_replicas(hfenv)
    hfenv.set_scenario(hfenv.state()["scenario"], wait_rc=1)
    res = hfenv.run("up.sh", WAIT_AND_TEARDOWN="1", HF_TOKEN=TOKEN)
    assert res.returncode == 1, "the trainer's failure is up.sh's exit status"
    waits = [c for c in hfenv.hf_calls() if c[:2] == ["jobs", "wait"]]
    assert waits == [["jobs", "wait", "job2abc"]]
    assert sorted(hfenv.cancelled()) == ["job0abc", "job1abc"], "the trainer is not cancelled"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"BUCKET": ""}, "BUCKET is required"),
        ({"BUCKET": "no-slash"}, "BUCKET must look like"),
        ({"RUN_NAME": "Bad_Name"}, "RUN_NAME must be"),
        ({"NUM_REPLICAS": "0"}, "NUM_REPLICAS must be a positive integer"),
        ({"TRAINER_IMAGE": ""}, "TRAINER_IMAGE is required"),
        ({"OUTPUT_DIR": "/elsewhere/run"}, "must be under MOUNT_PATH"),
        ({"MOUNT_PATH": "relative"}, "MOUNT_PATH must be an absolute path"),
        ({"DRY_RUN": "yes"}, "DRY_RUN must be 0 or 1"),
        ({"REPLICA_MOUNT_MODE": "rwx"}, "REPLICA_MOUNT_MODE must be rw or ro"),
    ],
)
def test_bad_settings_are_refused_before_anything_is_submitted(
    hfenv: Env, env: dict[str, str], message: str
) -> None:
    res = hfenv.run("up.sh", **env)
    assert res.returncode == 1
    assert message in res.stderr
    assert hfenv.hf_calls() == []


# ---- replicas.sh, trainer.sh, down.sh ---------------------------------------------------------


def test_replicas_then_trainer_split_the_deployment(hfenv: Env) -> None:
    reps = two_healthy_replicas(hfenv)
    res = hfenv.run("replicas.sh", HF_TOKEN=TOKEN)
    assert res.returncode == 0, res.stderr
    urls = kv_lines(res.stdout)["PROXY_REPLICAS"]
    assert urls == f"{reps[0].url},{reps[1].url}"
    assert len(hfenv.runs()) == 2

    res = hfenv.run(
        "trainer.sh", "--max-steps", "3", PROXY_REPLICAS=urls, HF_TOKEN=TOKEN, EXPOSE_PROXY="1"
    )
    assert res.returncode == 0, res.stderr
    trainer = hfenv.runs()[2]
    assert f"PROXY_REPLICAS={urls}" in opt(trainer, "--env")
    assert "PROXY_HOST=0.0.0.0" in opt(trainer, "--env") and opt(trainer, "--expose") == ["8000"]
    assert trainer[-2:] == ["--max-steps", "3"]
    assert kv_lines(res.stdout)["TRAINER_JOB_ID"] == "job2abc"


def test_trainer_refuses_replica_urls_that_are_not_urls(hfenv: Env) -> None:
    res = hfenv.run(
        "trainer.sh", PROXY_REPLICAS="https://a--8000.hf.jobs,not a url", HF_TOKEN=TOKEN
    )
    assert res.returncode == 1
    assert "not a replica URL in PROXY_REPLICAS: 'not a url'" in res.stderr
    assert hfenv.runs() == []


def test_down_cancels_only_the_jobs_of_its_run(hfenv: Env) -> None:
    two_healthy_replicas(hfenv)
    assert hfenv.run("replicas.sh", HF_TOKEN=TOKEN).returncode == 0
    state = hfenv.state()
    state["jobs"].append(
        {
            "id": "otherjob",
            "name": "x",
            "labels": {"rollout-proxy-run": "someone-else"},
            "argv": [],
            "inspects": 0,
            "cancelled": False,
        }
    )
    hfenv.state_path.write_text(json.dumps(state))
    res = hfenv.run("down.sh")
    assert res.returncode == 0, res.stderr
    assert sorted(hfenv.cancelled()) == ["job0abc", "job1abc"]
    assert "ps" in hfenv.hf_calls()[-3][1]
    res = hfenv.run("down.sh")
    assert res.returncode == 0 and "no running or scheduled Job" in res.stderr


# ---- dry run ----------------------------------------------------------------------------------


def dry_run_commands(stdout: str) -> list[list[str]]:
    return [shlex.split(line[2:]) for line in stdout.splitlines() if line.startswith("+ ")]


def test_dry_run_prints_the_recipe_commands_and_submits_nothing(hfenv: Env) -> None:
    res = hfenv.run("up.sh", DRY_RUN="1", NUM_REPLICAS="3", HF_NAMESPACE="my-org")
    assert res.returncode == 0, res.stderr
    assert hfenv.hf_calls() == [], "a dry run calls no hf command, not even auth"
    cmds = dry_run_commands(res.stdout)
    runs = [c[3:] for c in cmds if c[:3] == ["hf", "jobs", "run"]]
    assert len(runs) == 4
    for i in range(3):
        assert runs[i][:4] == ["--detach", "--quiet", "--namespace", "my-org"]
        assert_replica_job(runs[i], i)
    probes = [c for c in cmds if c[0] == "curl"]
    assert [p[-1] for p in probes] == [
        f"https://DRYRUN-vllm-{i}--8000.hf.jobs/health" for i in range(3)
    ]
    assert all("Bearer <HF_TOKEN>" in p[2] for p in probes)
    envs = dict(e.split("=", 1) for e in opt(runs[3], "--env"))
    assert envs["PROXY_REPLICAS"] == ",".join(
        f"https://DRYRUN-vllm-{i}--8000.hf.jobs" for i in range(3)
    )
    assert kv_lines(res.stdout)["TRAINER_JOB_ID"] == "DRYRUN-trainer"


def test_dry_run_of_down(hfenv: Env) -> None:
    res = hfenv.run("down.sh", DRY_RUN="1")
    assert res.returncode == 0
    assert dry_run_commands(res.stdout) == [
        ["hf", "jobs", "ps", "--quiet", "--label", "rollout-proxy-run=grpo-test"]
    ]
    assert hfenv.hf_calls() == []


def test_help_describes_each_script() -> None:
    for script in ("up.sh", "replicas.sh", "trainer.sh", "down.sh"):
        res = subprocess.run(
            ["bash", str(HF_JOBS / script), "--help"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert res.returncode == 0
        assert "Usage:" in res.stdout and "set -euo" not in res.stdout


# ---- against the real hf CLI ------------------------------------------------------------------


def real_hf() -> str:
    hf = shutil.which("hf", path=str(Path(sys.executable).parent)) or shutil.which("hf")
    if hf is None:
        pytest.skip("the hf CLI (huggingface_hub) is not installed")
    return hf


def real_hf_env(tmp_path: Path) -> dict[str, str]:
    # Offline, no token, no colours: `--dry-run` resolves the Job locally and submits nothing.
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "NO_COLOR": "1",
    }


def test_the_printed_commands_parse_with_the_real_hf_cli(hfenv: Env, tmp_path: Path) -> None:
    hf = real_hf()
    res = hfenv.run("up.sh", DRY_RUN="1", EXPOSE_PROXY="1")
    runs = [c for c in dry_run_commands(res.stdout) if c[:3] == ["hf", "jobs", "run"]]
    assert len(runs) == 3
    for cmd in runs:
        # --quiet prints nothing in a dry run; ask for the human summary to check what it resolved.
        args = [a for a in cmd[3:] if a != "--quiet"]
        out = subprocess.run(
            [hf, "jobs", "run", "--dry-run", "--format", "human", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=real_hf_env(tmp_path),
            check=False,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert "(dry run) Job not submitted." in out.stdout
        assert "hf://buckets/me/rl-bucket:/bucket:rw" in out.stdout
        assert "HF_TOKEN" in out.stdout


@pytest.mark.parametrize(
    ("subcommand", "flags"),
    [
        (
            ["jobs", "run"],
            [
                "--detach",
                "--quiet",
                "--name",
                "--label",
                "--flavor",
                "--timeout",
                "--secrets",
                "--env",
                "--volume",
                "--expose",
                "--namespace",
            ],
        ),
        (["jobs", "inspect"], ["--json", "--namespace"]),
        (["jobs", "ps"], ["--quiet", "--label", "--namespace"]),
        (["jobs", "cancel"], ["--namespace"]),
        (["jobs", "wait"], ["--namespace"]),
        (["auth", "token"], []),
    ],
)
def test_the_real_hf_cli_has_every_flag_the_scripts_use(
    tmp_path: Path, subcommand: list[str], flags: list[str]
) -> None:
    hf = real_hf()
    out = subprocess.run(
        [hf, *subcommand, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=real_hf_env(tmp_path),
        check=False,
    )
    assert out.returncode == 0, out.stderr
    for flag in flags:
        assert flag in out.stdout, f"hf {' '.join(subcommand)} has no {flag}"
