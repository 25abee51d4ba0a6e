"""vLLM's KV-cache events over ZMQ, and the block hashes REFERENCE.md section 3 predicts for them.

Wire format (vLLM 0.32.0, ``vllm/distributed/kv_events.py``): each message is three frames,
``[topic, seq (8 bytes big-endian), payload]``; the payload is msgpack of an array-like
``EventBatch`` ``[ts, events, dp_rank]`` whose events are maps tagged by ``"type"``
(``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``). Block hashes arrive as ints: the low
64 bits (big-endian) of vLLM's digest.

Endpoint direction matters: vLLM *binds* its PUB socket only for wildcard (``tcp://*:P``) and
ipc/inproc endpoints and *connects* for a concrete address. Here every replica is given
``tcp://127.0.0.1:P`` and connects to the one SUB socket this sink binds, so one sink hears all
replicas without opening a port on any other interface; each replica gets its own topic.
"""

from __future__ import annotations

import hashlib
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EventBatch:
    topic: str
    seq: int
    ts: float
    events: list[dict[str, Any]]
    dp_rank: int | None


class EventSink:
    """A ZMQ SUB socket bound on 127.0.0.1 collecting every batch in a background thread."""

    def __init__(self) -> None:
        # Imported here: the dev extra brings pyzmq and msgpack, but merely collecting the tests
        # (e.g. `pytest -m "not vllm"`) must not need them.
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._batches: list[EventBatch] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-sink", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _run(self) -> None:
        import msgpack

        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(100)):
                continue
            topic, seq, payload = self._sock.recv_multipart()
            ts, events, *rest = msgpack.unpackb(payload, raw=False, strict_map_key=False)
            batch = EventBatch(
                topic=topic.decode(),
                seq=int.from_bytes(seq, "big"),
                ts=float(ts),
                events=list(events),
                dp_rank=rest[0] if rest else None,
            )
            with self._lock:
                self._batches.append(batch)

    def batches(self) -> list[EventBatch]:
        with self._lock:
            return list(self._batches)

    def take(self) -> list[EventBatch]:
        """Every batch received so far, forgetting them."""
        with self._lock:
            out, self._batches = self._batches, []
        return out

    def wait_for(
        self, predicate: Callable[[list[EventBatch]], bool], timeout_s: float = 10.0
    ) -> list[EventBatch]:
        """Batches so far once ``predicate`` holds for them; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            seen = self.batches()
            if predicate(seen):
                return seen
            if time.monotonic() > deadline:
                kinds = [e.get("type") for b in seen for e in b.events]
                raise TimeoutError(f"no matching KV event within {timeout_s} s; saw {kinds}")
            time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)
        self._ctx.term()


def stored(batches: Sequence[EventBatch], topic: str | None = None) -> list[dict[str, Any]]:
    """The BlockStored events of ``batches`` (of one replica's topic, if given)."""
    return [
        e
        for b in batches
        if topic is None or b.topic == topic
        for e in b.events
        if e.get("type") == "BlockStored"
    ]


def stored_hashes_for(
    batches: Sequence[EventBatch], tokens: Sequence[int], topic: str | None = None
) -> list[int]:
    """Hashes of the stored blocks whose tokens are the full blocks of ``tokens``, in order.

    One BlockStored event can carry several consecutive blocks (``token_ids`` is their
    concatenation); its first block must start the prompt (``parent_block_hash`` null).
    """
    for event in stored(batches, topic):
        if event.get("parent_block_hash") is not None:
            continue
        size = int(event["block_size"])
        full = len(tokens) // size * size
        if list(event["token_ids"])[:full] == list(tokens[:full]):
            return [int(h) for h in event["block_hashes"][: full // size]]
    return []


def _sha256_pickle(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()


def reference_block_hashes(
    tokens: Sequence[int],
    block_size: int,
    seed: str,
    lora: tuple[str, str] | None = None,
) -> list[int]:
    """REFERENCE.md section 3 for ``--prefix-caching-hash-algo sha256``, written from the spec
    (independently of ``proxy/``): chained sha256 over pickled ``(parent, block, extra)``,
    root ``H(seed)``, ``extra = (("lora", name, path),)`` on every block of an adapter request,
    reported as the low 64 bits big-endian."""
    parent = _sha256_pickle(seed)
    extra = (("lora", lora[0], lora[1]),) if lora else None
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = _sha256_pickle((parent, tuple(tokens[start : start + block_size]), extra))
        out.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
    return out
