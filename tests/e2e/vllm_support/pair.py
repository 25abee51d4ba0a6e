"""The two-replica handle the fixtures yield, and the settings the replicas are launched with.

Kept apart from ``fixtures.py`` so test modules can import these names without importing the
pytest plugin module itself (pytest must import that one first, to rewrite its asserts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from scripts import vllm_replicas as vr
from tests.e2e.vllm_support.events import EventSink

SERVED_NAME = "tiny"
# What the replicas are launched with; tests derive expectations from these, not from literals.
BLOCK_SIZE = 32
HASH_SEED = "0"
MAX_LORAS = 6
MAX_LORA_RANK = 8
# Two rank-1 adapters (the recipe's rank) with different weights: name -> (rank, seed).
ADAPTERS = {"lora_a": (1, 1), "lora_b": (1, 2)}


@dataclass
class VllmPair:
    """Two running replicas and what they were started with."""

    replicas: list[vr.Replica]
    model_dir: Path
    adapters: dict[str, Path]
    sink: EventSink
    started_in_s: float
    log_dir: Path
    served_name: str = SERVED_NAME
    block_size: int = BLOCK_SIZE
    hash_seed: str = HASH_SEED
    max_loras: int = MAX_LORAS
    topics: list[str] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]
