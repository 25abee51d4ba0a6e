"""Record how a real vLLM CPU server answers the calls the proxy makes and relays.

    python scripts/record_vllm_fixtures.py [--out tests/fixtures/vllm_cpu_0.32.0]

Starts one replica of the tiny model (``trainer.tiny_model``) with KV-cache events published over
ZMQ, drives it through every endpoint TRL and the proxy use (health, server_info, models,
adapter load/unload incl. the error cases, pause/resume, prefix-cache reset, completions for the
base model and a runtime-loaded PEFT adapter, metrics), and writes what it answered as JSON files,
one per observation. Those files are the ground truth the fake replicas of the integration tests
are checked against, so re-record them (and review the diff) when the pinned vLLM changes.

Volatile values are normalised so that a re-recording diffs cleanly: the temporary directory
becomes ``<tmp>``, ports ``<port>``, ids and timestamps stay as shapes (their values are
meaningless). Nothing secret is recorded: ``/server_info``'s ``system_env`` (host details) is
dropped and ``vllm_env`` keeps only the variables this project sets.

Needs the main venv (httpx, pyzmq, msgpack, torch/transformers/peft from the ``trainer`` extra)
and ``.venv-vllm`` (``make setup-vllm``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
import tiny_lora  # sibling modules: scripts/ is not a package
import vllm_replicas as vr

from tests.e2e.vllm_support.events import (
    EventBatch,
    EventSink,
    reference_block_hashes,
    stored,
    stored_hashes_for,
)

DEFAULT_OUT = vr.REPO_ROOT / "tests" / "fixtures" / "vllm_cpu_0.32.0"
# A fixed path rather than a random temporary one: the adapter's lora_path is part of vLLM's block
# hash, and a stable path makes the recorded KV-event hashes reproducible from the fixture alone.
DEFAULT_WORK = Path("/tmp/rollout-proxy-vllm-fixtures")
SERVED_NAME = "tiny"
# The recipe's rank. Adapters of rank 1 are what TRL publishes with r=1.
ADAPTER_RANK = 1
# Above the replica's --max-lora-rank, to record the refusal.
TOO_HIGH_RANK = 16
# Token-id prompt: 100 tokens = 3 full blocks of 32 + 4, so prefix caching and KV events both show.
PROMPT = [(7 * i + 11) % 1000 + 3 for i in range(100)]
VLLM_ENV_KEPT = (
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    "VLLM_SERVER_DEV_MODE",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES",
)
METRIC_FAMILIES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:lora_requests_info",
    "vllm:cache_config_info",
)


def trl_completion(model: str, *, max_tokens: int = 8, **overrides: Any) -> dict[str, Any]:
    """The body TRL's AsyncGRPOTrainer posts for one rollout (REFERENCE.md section 1)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "repetition_penalty": 1.0,
        "n": 1,
        "return_token_ids": True,
        "logprobs": 0,
        "seed": 6917529027641081856,
    }
    body.update(overrides)
    return body


# --- recording helpers ---


class Recorder:
    def __init__(self, out: Path, replacements: dict[str, str]) -> None:
        self.out = out
        self.replacements = replacements
        self.index: dict[str, str] = {}

    def normalise(self, value: Any) -> Any:
        if isinstance(value, str):
            for old, new in self.replacements.items():
                value = value.replace(old, new)
            return value
        if isinstance(value, dict):
            return {self.normalise(k): self.normalise(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.normalise(v) for v in value]
        return value

    def save(self, name: str, what: str, data: dict[str, Any]) -> dict[str, Any]:
        record = self.normalise({"what": what, **data})
        path = self.out / f"{name}.json"
        path.write_text(dump_json(record) + "\n")
        self.index[name] = what
        print(f"  {name}: {_summary(data)}", file=sys.stderr)
        return record


def dump_json(value: Any, indent: int = 0) -> str:
    """JSON with one key per line but lists of scalars (token ids, hashes) kept on one line."""
    pad = " " * (indent + 1)
    if isinstance(value, dict) and value:
        items = [f"{pad}{json.dumps(k)}: {dump_json(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    if isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        items = [pad + dump_json(v, indent + 1) for v in value]
        return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"
    return json.dumps(value)


def _summary(data: dict[str, Any]) -> str:
    if "status" in data:
        return f"HTTP {data['status']}"
    return ", ".join(sorted(data))[:80]


def exchange(
    client: httpx.Client, method: str, path: str, body: Any = None, raw: bytes | None = None
) -> dict[str, Any]:
    """One request and the parts of its answer a fake must reproduce."""
    t0 = time.perf_counter()
    if raw is not None:
        resp = client.request(
            method, path, content=raw, headers={"Content-Type": "application/json"}
        )
    else:
        resp = client.request(method, path, json=body)
    elapsed = time.perf_counter() - t0
    try:
        parsed: Any = resp.json()
        kind = "json"
    except ValueError:
        parsed = resp.text
        kind = "text"
    return {
        "request": {"method": method, "path": path, "body": body if raw is None else raw.decode()},
        "status": resp.status_code,
        "content_type": resp.headers.get("content-type"),
        "body_kind": kind,
        "body": parsed,
        "latency_s": round(elapsed, 4),
    }


def metric_lines(text: str, families: Sequence[str] = METRIC_FAMILIES) -> list[str]:
    return [
        line
        for line in text.splitlines()
        if not line.startswith("#") and line.split("{", 1)[0].split(" ", 1)[0] in families
    ]


def metric_value(text: str, family: str) -> float:
    total = 0.0
    for line in metric_lines(text, (family,)):
        total += float(line.rsplit(" ", 1)[1])
    return total


def build_assets(work: Path) -> dict[str, Path]:
    """The trainer's tiny model, two rank-1 adapters and one adapter above --max-lora-rank."""
    return tiny_lora.build_assets(
        work,
        {"lora_a": (ADAPTER_RANK, 1), "lora_b": (ADAPTER_RANK, 2), "lora_big": (TOO_HIGH_RANK, 1)},
    )


def record(out: Path, work: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    print("building tiny model and adapters ...", file=sys.stderr)
    assets = build_assets(work)
    sink = EventSink()
    seed = "0"
    config = vr.ReplicaConfig(
        model=assets["model"],
        served_model_name=SERVED_NAME,
        cpus=vr.default_cpus(0),
        max_lora_rank=8,
        max_loras=2,  # small on purpose, to record what happens past the limit
        python_hash_seed=seed,
        kv_events_endpoint=sink.endpoint,
    )
    print(f"starting one replica (assets ready after {time.monotonic() - t0:.0f} s) ...")
    try:
        with vr.running_replicas([config], work / "logs", progress=sys.stderr) as (replica,):
            # The work directory is a fixed path, kept verbatim: adapter paths enter vLLM's block
            # hashes, so the recorded event hashes can be recomputed from the recorded paths.
            rec = Recorder(out, {f":{replica.port}": ":<port>", f":{sink.port}": ":<port>"})
            started = {
                "ready_after_s": round(replica.ready_after_s or 0, 1),
                "memory_after_start": replica.memory(),
                "argv": [
                    a if a != str(replica.port) else "<port>" for a in config.command(replica.port)
                ],
                "env": {
                    k: v
                    for k, v in config.environment({}).items()
                    if k.startswith(("VLLM", "TORCH", "PYTHONHASH"))
                },
            }
            with httpx.Client(base_url=replica.url, timeout=60) as client:
                _drive(client, rec, assets, sink, seed, replica)
            started["memory_after_drive"] = replica.memory()
            rec.save("launch", "how the replica was started, how long it took, its memory", started)
    finally:
        sink.close()
    (out / "INDEX.json").write_text(json.dumps(rec.index, indent=1) + "\n")
    print(f"wrote {len(rec.index)} fixtures to {out} in {time.monotonic() - t0:.0f} s")


def _drive(
    client: httpx.Client,
    rec: Recorder,
    assets: dict[str, Path],
    sink: EventSink,
    seed: str,
    replica: vr.Replica,
) -> None:
    lora_a, lora_b = str(assets["lora_a"]), str(assets["lora_b"])

    rec.save("health", "GET /health on a ready replica", exchange(client, "GET", "/health"))
    info = exchange(client, "GET", "/server_info?config_format=json")
    body = info["body"]
    body["vllm_env"] = {k: body["vllm_env"].get(k) for k in VLLM_ENV_KEPT}
    body["system_env"] = "<dropped: host details>"
    rec.save("server_info", "GET /server_info?config_format=json (dev mode)", info)
    text_info = exchange(client, "GET", "/server_info")
    text_info["body"] = {
        "vllm_config": text_info["body"]["vllm_config"][:1500] + " ...<cut>",
        "other_keys": sorted(set(text_info["body"]) - {"vllm_config"}),
    }
    rec.save(
        "server_info_text",
        "GET /server_info without config_format: vllm_config is one repr string (cut here)",
        text_info,
    )
    rec.save(
        "kv_event_sources", "GET /kv_event_sources", exchange(client, "GET", "/kv_event_sources")
    )
    rec.save(
        "models_base", "GET /v1/models before any adapter", exchange(client, "GET", "/v1/models")
    )

    # --- completions and prefix cache on the base model ---
    sink.take()
    metrics0 = client.get("/metrics").text
    base = exchange(client, "POST", "/v1/completions", trl_completion(SERVED_NAME))
    rec.save("completion_base", "TRL-shaped completion, base model, temperature 0", base)
    again = exchange(client, "POST", "/v1/completions", trl_completion(SERVED_NAME))
    sink.wait_for(lambda b: bool(stored_hashes_for(b, PROMPT)), 10)
    metrics1 = client.get("/metrics").text
    base_events = sink.take()
    rec.save(
        "prefix_cache_base",
        "the same 100-token prompt twice: vLLM's prefix-cache counters (tokens) before/after; "
        "a hit covers (len(prompt)-1)//block_size full blocks",
        {
            "prompt_len": len(PROMPT),
            "block_size": 32,
            "queries_delta": metric_value(metrics1, "vllm:prefix_cache_queries_total")
            - metric_value(metrics0, "vllm:prefix_cache_queries_total"),
            "hits_delta": metric_value(metrics1, "vllm:prefix_cache_hits_total")
            - metric_value(metrics0, "vllm:prefix_cache_hits_total"),
            "same_tokens_both_times": base["body"]["choices"][0]["token_ids"]
            == again["body"]["choices"][0]["token_ids"],
        },
    )

    # --- adapter load / unload ---
    load = {"lora_name": "trl-policy-v1", "lora_path": lora_a, "load_inplace": False}
    rec.save(
        "load_ok",
        "POST /v1/load_lora_adapter, new name",
        exchange(client, "POST", "/v1/load_lora_adapter", load),
    )
    rec.save(
        "load_duplicate",
        "POST /v1/load_lora_adapter, name already loaded, load_inplace false",
        exchange(client, "POST", "/v1/load_lora_adapter", load),
    )
    rec.save(
        "load_inplace",
        "POST /v1/load_lora_adapter, name already loaded, load_inplace true (same path)",
        exchange(client, "POST", "/v1/load_lora_adapter", {**load, "load_inplace": True}),
    )
    rec.save(
        "load_missing_path",
        "POST /v1/load_lora_adapter, lora_path does not exist (the shared-mount lag case)",
        exchange(
            client,
            "POST",
            "/v1/load_lora_adapter",
            {"lora_name": "trl-policy-v9", "lora_path": lora_a + "-not-there"},
        ),
    )
    rec.save(
        "load_not_an_adapter",
        "POST /v1/load_lora_adapter, lora_path is a directory without adapter_config.json",
        exchange(
            client,
            "POST",
            "/v1/load_lora_adapter",
            {"lora_name": "trl-policy-v8", "lora_path": str(assets["model"])},
        ),
    )
    rec.save(
        "load_rank_too_high",
        f"POST /v1/load_lora_adapter, adapter rank {TOO_HIGH_RANK} > --max-lora-rank 8",
        exchange(
            client,
            "POST",
            "/v1/load_lora_adapter",
            {"lora_name": "too-big", "lora_path": str(assets["lora_big"])},
        ),
    )
    rec.save(
        "load_missing_field",
        "POST /v1/load_lora_adapter without lora_path",
        exchange(client, "POST", "/v1/load_lora_adapter", {"lora_name": "x"}),
    )
    rec.save(
        "load_bad_json",
        "POST /v1/load_lora_adapter with a body that is not JSON",
        exchange(client, "POST", "/v1/load_lora_adapter", raw=b"not json"),
    )
    rec.save(
        "models_after_load",
        "GET /v1/models after loading trl-policy-v1 (failed loads are not listed)",
        exchange(client, "GET", "/v1/models"),
    )

    # --- completions with the adapter, KV events with the adapter in the hash ---
    sink.take()
    metrics0 = client.get("/metrics").text
    with_adapter = exchange(client, "POST", "/v1/completions", trl_completion("trl-policy-v1"))
    rec.save(
        "completion_adapter",
        "TRL-shaped completion, runtime-loaded adapter, temperature 0",
        with_adapter,
    )
    exchange(client, "POST", "/v1/completions", trl_completion("trl-policy-v1"))
    sink.wait_for(lambda b: bool(stored_hashes_for(b, PROMPT)), 10)
    metrics1 = client.get("/metrics").text
    adapter_events = sink.take()
    rec.save(
        "prefix_cache_adapter",
        "same prompt twice with the adapter: the adapter's blocks are separate from the base's",
        {
            "queries_delta": metric_value(metrics1, "vllm:prefix_cache_queries_total")
            - metric_value(metrics0, "vllm:prefix_cache_queries_total"),
            "hits_delta": metric_value(metrics1, "vllm:prefix_cache_hits_total")
            - metric_value(metrics0, "vllm:prefix_cache_hits_total"),
            "tokens_differ_from_base": with_adapter["body"]["choices"][0]["token_ids"]
            != base["body"]["choices"][0]["token_ids"],
        },
    )
    _record_kv_events(rec, base_events, adapter_events, seed, lora_a)

    rec.save(
        "completion_unknown_model",
        "completion naming a model/adapter the replica does not have",
        exchange(client, "POST", "/v1/completions", trl_completion("trl-policy-v404")),
    )
    rec.save(
        "completion_too_long",
        "completion whose prompt + max_tokens exceeds --max-model-len",
        _truncate(
            exchange(
                client, "POST", "/v1/completions", trl_completion(SERVED_NAME, max_tokens=2000)
            ),
            1500,
        ),
    )
    rec.save("completion_stream", "streamed completion (SSE), raw body", _stream(client))

    # --- more adapters than --max-loras (2 here) ---
    for i in range(2, 5):
        exchange(
            client,
            "POST",
            "/v1/load_lora_adapter",
            {"lora_name": f"trl-policy-v{i}", "lora_path": lora_b if i % 2 else lora_a},
        )
    models = exchange(client, "GET", "/v1/models")
    oldest = exchange(client, "POST", "/v1/completions", trl_completion("trl-policy-v1"))
    rec.save(
        "over_max_loras",
        "4 adapters loaded with --max-loras 2: all listed, the oldest still serves (LRU reload)",
        {
            "listed": [m["id"] for m in models["body"]["data"]],
            "oldest_completion_status": oldest["status"],
            "oldest_tokens_unchanged": oldest["body"]["choices"][0]["token_ids"]
            == with_adapter["body"]["choices"][0]["token_ids"],
        },
    )
    rec.save(
        "unload_ok",
        "POST /v1/unload_lora_adapter of a loaded name",
        exchange(client, "POST", "/v1/unload_lora_adapter", {"lora_name": "trl-policy-v2"}),
    )
    rec.save(
        "unload_unknown",
        "POST /v1/unload_lora_adapter of a name never loaded (TRL ignores the answer)",
        exchange(client, "POST", "/v1/unload_lora_adapter", {"lora_name": "trl-policy-v77"}),
    )
    rec.save(
        "completion_after_unload",
        "completion naming an unloaded adapter",
        exchange(client, "POST", "/v1/completions", trl_completion("trl-policy-v2")),
    )

    # --- pause / resume / prefix cache reset ---
    rec.save("is_paused_initial", "GET /is_paused", exchange(client, "GET", "/is_paused"))
    rec.save("pause_keep", "POST /pause?mode=keep", exchange(client, "POST", "/pause?mode=keep"))
    rec.save(
        "is_paused_after_pause",
        "GET /is_paused while paused",
        exchange(client, "GET", "/is_paused"),
    )
    rec.save("health_while_paused", "GET /health while paused", exchange(client, "GET", "/health"))
    rec.save(
        "pause_again",
        "POST /pause?mode=keep when already paused",
        exchange(client, "POST", "/pause?mode=keep"),
    )
    rec.save("resume", "POST /resume", exchange(client, "POST", "/resume"))
    rec.save("resume_again", "POST /resume when not paused", exchange(client, "POST", "/resume"))
    rec.save(
        "pause_bad_mode", "POST /pause?mode=bogus", exchange(client, "POST", "/pause?mode=bogus")
    )
    exchange(client, "POST", "/resume")
    rec.save(
        "reset_prefix_cache",
        "POST /reset_prefix_cache",
        exchange(client, "POST", "/reset_prefix_cache"),
    )
    rec.save("pause_clears_cache", "does /pause clear the prefix cache?", _pause_cache(client))
    rec.save(
        "pause_keep_inflight",
        "requests in flight and arriving during /pause?mode=keep",
        _pause_inflight(client),
    )

    metrics = client.get("/metrics").text
    rec.save(
        "metrics",
        "GET /metrics: the families the proxy scrapes, after the traffic above",
        {
            "lines": metric_lines(metrics),
            "content_type": client.get("/metrics").headers.get("content-type"),
        },
    )
    (rec.out / "metrics.prom").write_text(rec.normalise(metrics))


def _truncate(record: dict[str, Any], limit: int) -> dict[str, Any]:
    body = record["body"]
    if isinstance(body, str) and len(body) > limit:
        record["body"] = body[:limit] + f"... <{len(body) - limit} more chars>"
    return record


def _stream(client: httpx.Client) -> dict[str, Any]:
    body = trl_completion(SERVED_NAME, max_tokens=3, stream=True)
    with client.stream("POST", "/v1/completions", json=body) as resp:
        raw = resp.read().decode()
        return {
            "request": {"method": "POST", "path": "/v1/completions", "body": body},
            "status": resp.status_code,
            "content_type": resp.headers.get("content-type"),
            "body_kind": "sse",
            "body": raw,
        }


def _record_kv_events(
    rec: Recorder,
    base_batches: list[EventBatch],
    adapter_batches: list[EventBatch],
    seed: str,
    lora_path: str,
) -> None:
    block = 32
    lora = ("trl-policy-v1", lora_path)
    predicted_base = reference_block_hashes(PROMPT, block, seed)
    predicted_adapter = reference_block_hashes(PROMPT, block, seed, lora)
    rec.save(
        "kv_events",
        "ZMQ KV-cache events for the 100-token prompt (base, then adapter), decoded from msgpack, "
        "with the hashes REFERENCE.md section 3 predicts (sha256 + pickle, PYTHONHASHSEED=0, "
        "low 64 bits big-endian)",
        {
            "prompt": PROMPT,
            "block_size": block,
            "prefix_caching_hash_algo": "sha256",
            "python_hash_seed": seed,
            "adapter": {"lora_name": lora[0], "lora_path": lora_path},
            "base_batches": [asdict(b) for b in base_batches],
            "adapter_batches": [asdict(b) for b in adapter_batches],
            "base_stored_events": len(stored(base_batches)),
            "predicted_prompt_blocks_base": predicted_base,
            "predicted_prompt_blocks_adapter": predicted_adapter,
            "prompt_blocks_match_base": stored_hashes_for(base_batches, PROMPT) == predicted_base,
            "prompt_blocks_match_adapter": stored_hashes_for(adapter_batches, PROMPT)
            == predicted_adapter,
        },
    )


def _pause_cache(client: httpx.Client) -> dict[str, Any]:
    def hits_after_repeat(pause_path: str) -> float:
        exchange(client, "POST", "/v1/completions", trl_completion(SERVED_NAME))
        client.post(pause_path).raise_for_status()
        client.post("/resume").raise_for_status()
        before = metric_value(client.get("/metrics").text, "vllm:prefix_cache_hits_total")
        exchange(client, "POST", "/v1/completions", trl_completion(SERVED_NAME))
        return metric_value(client.get("/metrics").text, "vllm:prefix_cache_hits_total") - before

    return {
        "hits_after_pause_keep": hits_after_repeat("/pause?mode=keep"),
        "hits_after_pause_keep_clear_cache_false": hits_after_repeat(
            "/pause?mode=keep&clear_cache=false"
        ),
    }


def _pause_inflight(client: httpx.Client) -> dict[str, Any]:
    """A long request in flight, then pause(keep), then a new request; resume after 1.5 s."""
    long_body = trl_completion(SERVED_NAME, max_tokens=400, ignore_eos=True, temperature=1.0)
    with ThreadPoolExecutor(2) as pool:
        t0 = time.perf_counter()
        first = pool.submit(exchange, client, "POST", "/v1/completions", long_body)
        time.sleep(0.3)
        pause = exchange(client, "POST", "/pause?mode=keep")
        second = pool.submit(
            exchange, client, "POST", "/v1/completions", trl_completion(SERVED_NAME)
        )
        time.sleep(1.5)
        done_while_paused = {"first": first.done(), "second": second.done()}
        resume_at = time.perf_counter() - t0
        exchange(client, "POST", "/resume")
        a, b = first.result(), second.result()
        return {
            "pause_answered_after_s": pause["latency_s"],
            "pause_status": pause["status"],
            "done_while_paused": done_while_paused,
            "resumed_at_s": round(resume_at, 2),
            "first": {
                "status": a["status"],
                "finished_at_s": round(a["latency_s"], 2),
                "completion_tokens": a["body"]["usage"]["completion_tokens"],
                "finish_reason": a["body"]["choices"][0]["finish_reason"],
            },
            "second": {"status": b["status"], "latency_s": b["latency_s"]},
        }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/record_vllm_fixtures.py")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="scratch dir (emptied)")
    parser.add_argument("--keep-work", action="store_true", help="keep the scratch directory")
    args = parser.parse_args(argv)
    try:
        vr.ReplicaConfig(model=Path(".")).python()
    except vr.ReplicaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    work: Path = args.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        record(args.out, work)
    finally:
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
