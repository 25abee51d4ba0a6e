"""pytest fixtures: two real vLLM CPU replicas of the tiny model, started once per session.

Load with ``pytest_plugins = ["tests.e2e.vllm_support.fixtures"]``. Every fixture skips (with the
reason) when ``.venv-vllm`` or the trainer extra is missing, so a plain ``pytest`` run stays green
on a machine without them.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from scripts import tiny_lora
from scripts import vllm_replicas as vr
from tests.e2e.vllm_support import VLLM_VENV, skip_reason
from tests.e2e.vllm_support.events import EventSink
from tests.e2e.vllm_support.pair import (
    ADAPTERS,
    BLOCK_SIZE,
    HASH_SEED,
    MAX_LORA_RANK,
    MAX_LORAS,
    SERVED_NAME,
    VllmPair,
)


@pytest.fixture(scope="session")
def vllm_assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The trainer's tiny model and two PEFT adapters for it (built in ~20 s, no download)."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    return tiny_lora.build_assets(tmp_path_factory.mktemp("vllm-assets"), ADAPTERS)


@pytest.fixture(scope="session")
def vllm_pair(
    vllm_assets: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmPair]:
    """Two replicas on 127.0.0.1 (free ports), one core each, KV events to one sink.

    Stopped (whole process groups) at session end, also after a failure or Ctrl-C.
    """
    log_dir = tmp_path_factory.mktemp("vllm-logs")
    sink = EventSink()
    topics = [f"replica-{i}" for i in range(2)]
    base = vr.ReplicaConfig(
        model=vllm_assets["model"],
        served_model_name=SERVED_NAME,
        max_lora_rank=MAX_LORA_RANK,
        max_loras=MAX_LORAS,
        block_size=BLOCK_SIZE,
        python_hash_seed=HASH_SEED,
        prefix_caching_hash_algo="sha256",
        kv_events_endpoint=sink.endpoint,
        venv=VLLM_VENV,
    )
    configs = [
        replace(cfg, kv_events_topic=topic)
        for cfg, topic in zip(vr.replica_configs(base, 2), topics, strict=True)
    ]
    t0 = time.monotonic()
    try:
        with vr.running_replicas(configs, log_dir, progress=sys.stderr) as replicas:
            pair = VllmPair(
                replicas=replicas,
                model_dir=vllm_assets["model"],
                adapters={k: v for k, v in vllm_assets.items() if k != "model"},
                sink=sink,
                started_in_s=time.monotonic() - t0,
                log_dir=log_dir,
                topics=topics,
            )
            yield pair
    finally:
        sink.close()
