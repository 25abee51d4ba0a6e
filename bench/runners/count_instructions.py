"""Instructions per routed completion in process, counted by valgrind (callgrind): the same count
for the same code and inputs whatever else the machine runs, where CPU time on a shared machine
swings by 1.5x between rounds. It compares trees (a change against its base) and does not replace
bench.runners.run_overhead: it leaves out sockets, the event loop and cache misses under load.

    python -m bench.runners.count_instructions     # -> bench/results/instructions.md
    BENCH_TREES=base=/path/to/checkout python -m bench.runners.count_instructions --out /tmp/i

Each tree runs in its own ``.venv`` (``make setup`` there) the request of
``python -m bench.runners.run_micro --request``: ``DataPath.respond`` on run_overhead's
``distinct64`` bodies, with two ready replicas and an upstream that answers at once. The count is
taken twice, after the same warm-up, with 0 and with ``--requests`` more requests: the difference
divided by ``--requests`` is one request's. The upstream's answer carries ``--completion-tokens``
generated ids (with logprobs, as TRL asks for them): learning a rollout's completion costs per
generated id, which run_overhead's 16-token answer hardly shows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.analysis.report import table
from bench.harness.procs import REPO, machine_description
from bench.harness.routers import trees

DEFAULT_OUT = REPO / "bench" / "results"
WARM_REQUESTS = 1000  # every distinct64 prompt routed and learned ~15 times

# Run inside the measured tree (its own interpreter, its proxy/ and bench/). Checkouts from before
# bench/ was split into harness/ and runners/ keep the same helpers at the top of bench/.
DRIVER = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
try:
    from bench.harness import request_micro as micro
    from bench.runners import run_overhead as overhead
except ImportError:
    from bench import request_micro as micro, run_overhead as overhead
warm, n, mode, tokens = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
overhead.COMPLETION_TOKENS = tokens  # the upstream's answer: this many generated ids, logprobs
micro.ANSWER = overhead._fixed_completion().encode()
rt, path = micro._runtime(mode)
raws = [json.dumps(overhead.completion_request(False, s), separators=(",", ":")).encode()
        for s in range(overhead.DISTINCT_PROMPTS)]
scope = {"type": "http", "method": "POST", "path": "/v1/completions",
         "raw_path": b"/v1/completions", "query_string": b"",
         "headers": [(b"host", b"proxy"), (b"content-type", b"application/json")]}
for i in range(warm + n):
    raw = raws[i % len(raws)]
    answer = micro.drive(path.respond("completions", scope, raw, time.perf_counter()))
    if answer.status_code != 200:
        raise SystemExit(f"request failed: {answer.body!r}")
"""

_COLLECTED = re.compile(r"Collected\s*:\s*([\d,]+)")


def count(python: Path, tree: Path, warm: int, requests: int, mode: str, tokens: int) -> int:
    """Instructions the driver runs in ``tree`` with ``requests`` requests after the warm-up."""
    argv = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", str(python), "-P"]
    argv += ["-c", DRIVER, str(tree), str(warm), str(requests), mode, str(tokens)]
    # One hash seed for every run: string hashes (and so dict layouts) differ between processes
    # otherwise, and the two counts by a few million instructions.
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(argv, capture_output=True, text=True, cwd=tree, env=env, check=False)
    found = _COLLECTED.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"{python} in {tree} failed:\n{done.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def per_request(
    python: Path, tree: Path, warm: int, requests: int, mode: str, tokens: int
) -> float:
    more = count(python, tree, warm, requests, mode, tokens)
    return (more - count(python, tree, warm, 0, mode, tokens)) / requests


def main(argv: Sequence[str] | None = None) -> int:
    prog = "python -m bench.runners.count_instructions"
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    p.add_argument("--requests", type=int, default=2000, help="requests counted (2000)")
    p.add_argument(
        "--warm", type=int, default=WARM_REQUESTS, help=f"warm-up requests ({WARM_REQUESTS})"
    )
    p.add_argument("--modes", default="auto", help="PROXY_NATIVE values, e.g. auto,off (auto)")
    p.add_argument(
        "--completion-tokens",
        default="16,600",
        help="generated ids per answer, one count each (16: run_overhead's answer; 600: the "
        "recipe's median completion)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    targets = {"this tree": (Path(sys.executable), REPO)}
    targets |= {label: (path / ".venv" / "bin" / "python", path) for label, path in trees().items()}
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    lengths = [int(t) for t in args.completion_tokens.split(",") if t.strip()]
    results = []
    rows = []
    for tokens in lengths:
        for mode in modes:
            first = None
            for label, (python, tree) in targets.items():
                ir = per_request(python, tree, args.warm, args.requests, mode, tokens)
                first = first or ir
                print(f"{label:>12} PROXY_NATIVE={mode:<4} {tokens:5d} generated: {ir:10,.0f}")
                results.append(
                    dict(target=label, tree=str(tree), native=mode, tokens=tokens, per_request=ir)
                )
                rows.append([label, mode, str(tokens), f"{ir:,.0f}", f"{ir / first:.3f}"])
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    command = "python -m bench.runners.count_instructions " + " ".join(argv or sys.argv[1:])
    text = (
        "# Instructions per routed completion, in process\n\n"
        f"Measured {stamp} with `{command.strip()}` (valgrind callgrind; {args.requests} requests "
        f"after {args.warm} warm-up requests, run_overhead's distinct64 bodies). Machine: "
        f"{machine_description()['cpu']}. Instruction counts do not depend on the machine's "
        "load; they leave out sockets, the event loop and cache misses (bench/results/overhead.md "
        "has those). ratio: to the first target's count in the same setting.\n\n"
        + table(
            ["target", "PROXY_NATIVE", "generated ids", "instructions per request", "ratio"],
            rows,
        )
        + "\n"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "instructions.md").write_text(text)
    (args.out / "instructions.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out / 'instructions.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
