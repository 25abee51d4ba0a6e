"""Precise routing against two real vLLM CPU replicas: the proxy's events view equals what vLLM
reports cached, after adapters, evictions and a cache-clearing pause.

This module starts its own pair (the session pair's cache is too large to evict and its events
go to the test sink): a KV cache of a few dozen 32-token blocks, events and replay on ipc://
sockets (vLLM binds them; nothing listens beyond this machine), and
``--enable-prompt-tokens-details`` so that every answer says how many prompt tokens hit the
cache. The reference for "what vLLM reports cached" is independent of the proxy: the replica's
whole event history fetched from its replay socket and folded with a plain set; and, per request,
vLLM's own ``usage.prompt_tokens_details.cached_tokens`` against the proxy's prediction.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from scripts import vllm_replicas as vr
from tests.e2e.vllm_support import VLLM_VENV
from tests.e2e.vllm_support.client import (
    complete,
    load_adapter,
    metric_sum,
    random_prompt,
    trl_completion_body,
)
from tests.e2e.vllm_support.pair import BLOCK_SIZE, HASH_SEED, MAX_LORA_RANK, SERVED_NAME
from tests.e2e.vllm_support.proxy_process import ProxyProcess, running_proxy

pytest_plugins = ["tests.e2e.vllm_support.fixtures"]
pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

# The tiny model keeps 2 layers x 1 KV head x 64 dims x K,V in float32 = 1 KiB per token, so a
# 32-token block is 32 KiB. 48 blocks (1,536 tokens) hold about ten of this test's prompts per
# replica, so the second phase evicts; max_model_len 512 still fits one sequence (16 blocks).
KV_BLOCKS = 48
MAX_MODEL_LEN = 512
PROMPT_TOKENS = (100, 200)


@dataclass
class EventPair:
    urls: list[str]
    events: list[str]
    replays: list[str]
    adapters: dict[str, Path]


@pytest.fixture(scope="module")
def event_pair(
    vllm_assets: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EventPair]:
    sockets = tmp_path_factory.mktemp("kv")
    log_dir = tmp_path_factory.mktemp("vllm-kv-logs")
    events = [f"ipc://{sockets}/events-{i}" for i in range(2)]
    replays = [f"ipc://{sockets}/replay-{i}" for i in range(2)]
    base = vr.ReplicaConfig(
        model=vllm_assets["model"],
        served_model_name=SERVED_NAME,
        max_lora_rank=MAX_LORA_RANK,
        max_loras=4,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_bytes=KV_BLOCKS * BLOCK_SIZE * 1024,
        python_hash_seed=HASH_SEED,
        venv=VLLM_VENV,
    )
    configs = [
        replace(
            cfg,
            extra_args=(
                "--enable-prompt-tokens-details",
                "--kv-events-config",
                json.dumps(
                    {
                        "enable_kv_cache_events": True,
                        "publisher": "zmq",
                        "endpoint": events[i],
                        "replay_endpoint": replays[i],
                    }
                ),
            ),
        )
        for i, cfg in enumerate(vr.replica_configs(base, 2))
    ]
    with vr.running_replicas(configs, log_dir, progress=sys.stderr) as replicas:
        yield EventPair(
            [r.url for r in replicas],
            events,
            replays,
            {k: v for k, v in vllm_assets.items() if k != "model"},
        )


@pytest.fixture(scope="module")
def proxy(
    event_pair: EventPair, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProxyProcess]:
    log = tmp_path_factory.mktemp("kv-proxy") / "proxy.log"
    endpoints = ",".join(
        f"{e}|{r}" for e, r in zip(event_pair.events, event_pair.replays, strict=True)
    )
    args = ["--kv-events", "--kv-events-endpoints", endpoints, "--vllm-hash-seed", HASH_SEED]
    with running_proxy(event_pair.urls, Path(log), args) as proc:
        yield proc


def replay_history(endpoint: str) -> list[tuple[int, Any]]:
    """Every batch the replica still buffers (all of them, in a test this short), decoded."""
    import msgpack
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        out = []
        while True:
            *_, seq, payload = sock.recv_multipart()  # [b"", topic, seq, payload]
            number = int.from_bytes(seq, "big", signed=True)
            if number < 0:
                return out
            out.append((number, msgpack.unpackb(payload, raw=False, strict_map_key=False)))
    finally:
        sock.close(linger=0)
        ctx.term()


def fold(history: list[tuple[int, Any]]) -> tuple[set[int], dict[str, int]]:
    """The cached set the events describe, with a plain set; and how many of each kind."""
    held: set[int] = set()
    kinds = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0, "lora": 0}
    for _, (_ts, events, *_rank) in history:
        for event in events:
            kinds[event["type"]] += 1
            if event["type"] == "BlockStored":
                held.update(event["block_hashes"])
                kinds["lora"] += bool(event.get("lora_name"))
            elif event["type"] == "BlockRemoved":
                held.difference_update(event["block_hashes"])
            else:
                held.clear()
    return held, kinds


def views(http: httpx.Client, proxy: ProxyProcess, blocks: bool = False) -> dict[str, Any]:
    resp = http.get(f"{proxy.url}/admin/kv_events", params={"blocks": blocks})
    assert resp.status_code == 200, resp.text
    return dict(resp.json()["replicas"])


def settle(http: httpx.Client, proxy: ProxyProcess) -> dict[str, Any]:
    """The views once no batch arrived for half a second (vLLM publishes only when it works)."""
    last = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = {k: v["next_seq"] for k, v in views(http, proxy).items()}
        if now == last:
            return views(http, proxy, blocks=True)
        last = now
        time.sleep(0.5)
    raise AssertionError(f"KV events never settled: {last}")


def predictions(http: httpx.Client, proxy: ProxyProcess) -> dict[str, float]:
    text = http.get(f"{proxy.url}/metrics").text
    out = {
        result: metric_sum(
            text, "rollout_proxy_kv_prediction_requests_total", source="events", result=result
        )
        for result in ("exact", "over", "under")
    }
    out["predicted_tokens"] = metric_sum(
        text, "rollout_proxy_kv_prediction_predicted_tokens_total", source="events"
    )
    return out


def test_proxy_view_equals_what_vllm_reports_cached(
    event_pair: EventPair, proxy: ProxyProcess
) -> None:
    rng = random.Random("kv-events")
    http = httpx.Client(timeout=120)
    adapters = {"kv-a": event_pair.adapters["lora_a"], "kv-b": event_pair.adapters["lora_b"]}
    for name, path in adapters.items():
        assert load_adapter(http, proxy.url, name, str(path)).status_code == 200
    models = [SERVED_NAME, *adapters]

    def send(prompts: list[tuple[str, list[int]]]) -> None:
        # Two rollouts per prompt, concurrently, the way a GRPO group arrives.
        bodies = [trl_completion_body(m, p, seed=s) for m, p in prompts for s in (1, 2)]
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda b: complete(http, proxy.url, b), bodies))

    def prompts(n: int) -> list[tuple[str, list[int]]]:
        return [
            (models[i % 3], random_prompt(rng, rng.randrange(*PROMPT_TOKENS))) for i in range(n)
        ]

    send(prompts(9))
    assert http.post(f"{proxy.url}/pause", params={"mode": "keep"}).status_code == 200
    assert http.post(f"{proxy.url}/resume").status_code == 200
    late = prompts(24)
    send(late)

    state = settle(http, proxy)
    removed = 0
    for i, endpoint in enumerate(event_pair.replays):
        view = state[str(i)]
        history = replay_history(endpoint)
        assert [seq for seq, _ in history] == list(range(len(history))), "replay lost batches"
        held, kinds = fold(history)
        assert view["live"], view
        assert view["next_seq"] == len(history)
        assert kinds["AllBlocksCleared"] >= 1, f"replica {i}: the pause cleared nothing"
        assert kinds["lora"] > 0, f"replica {i}: no adapter blocks"
        assert set(view["block_keys"]) == held, f"replica {i}: view differs from vLLM's events"
        assert view["malformed"] == 0 and view["dropped"] == 0
        removed += kinds["BlockRemoved"]
    assert removed > 0, "the small KV cache never evicted: the test lost its point"

    # vLLM's own per-request report agrees with what the view predicts, prompt after prompt:
    # recent prompts (cached), early ones of the second phase (evicted), adapters and base.
    before = predictions(http, proxy)
    probes = late[:4] + late[-4:]
    for model, prompt in probes:
        complete(http, proxy.url, trl_completion_body(model, prompt, seed=9))
        settle(http, proxy)
    after = predictions(http, proxy)
    assert after["exact"] - before["exact"] == len(probes), (before, after)
    assert after["over"] == before["over"] and after["under"] == before["under"]
    assert after["predicted_tokens"] > before["predicted_tokens"], "no probe was a cache hit"
    http.close()
