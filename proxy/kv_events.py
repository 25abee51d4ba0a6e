"""Subscribers to vLLM's KV-cache events: the thin async edge around ``proxy.core.kv_view``
(docs/kv-events.md).

One ZMQ SUB socket per replica on the server's own event loop (no thread); each message is
``[topic, seq (8 bytes big-endian), msgpack payload]``. A gap in ``seq`` is filled from vLLM's
replay socket, else that replica's view is dropped until it resynchronises. Metrics are read at
scrape time, so an event costs no Prometheus update; the only call on the request path is
``observe``. Needs the ``[kv-events]`` extra; imported only when ``PROXY_KV_EVENTS`` is on.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any
from urllib.parse import urlsplit

import msgpack
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.core.fleet import Fleet, Status
from proxy.core.hashing import BlockHasher, Namespace, VllmHasher
from proxy.core.kv_view import (
    CLEARED,
    REMOVED,
    ROUTED_MEDIA,
    STORED,
    BlockEvent,
    PreciseMatcher,
    ReplicaView,
    batch_fields,
    root_block,
)
from proxy.settings import Settings
from proxy.shutdown import cancel_and_wait

log = logging.getLogger("rollout_proxy.kv_events")

END_OF_REPLAY = -1
# A batch is one scheduler step: at most max_num_seqs (256) requests' new blocks with their token
# ids, a few MB at the recipe's 4,096-token context. 64 MiB refuses only garbage.
MAX_MESSAGE_BYTES = 64 * 2**20
# How often the supervisor looks for replicas added, ejected or removed (a fleet change is rare;
# one second is short next to a replica's ~30 s start-up).
SUPERVISE_INTERVAL_S = 1.0
# A replica's usage figures are untrusted input read on the request path: at most 12 digits (a
# trillion tokens, past any context length), so int() never meets a number long enough to raise
# (Python refuses to parse over 4,300 digits) and a longer one reads as no report at all.
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d{1,12})(?!\d)')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d{1,12})(?!\d)')


def first_match(pattern: re.Pattern[bytes], literal: bytes, body: bytes) -> re.Match[bytes] | None:
    """``pattern.search(body)`` for a pattern whose every match starts with ``literal``:
    ``bytes.find`` skips to each candidate faster than the regex engine scans, and an answer that
    carries its prompt's ids is tens of KiB."""
    at = body.find(literal)
    while at >= 0:
        match = pattern.match(body, at)
        if match is not None:
            return match
        at = body.find(literal, at + 1)
    return None


@dataclass(frozen=True)
class Endpoints:
    events: str
    replay: str | None


def endpoints_for(settings: Settings, index: int, url: str) -> Endpoints | None:
    """Where replica ``index`` publishes: the explicit list entry, else its URL's host with the
    configured ports. None when the explicit list has no entry for it (then it falls back)."""
    if settings.kv_events_endpoints:
        if index >= len(settings.kv_events_endpoints):
            return None
        events, _, replay = settings.kv_events_endpoints[index].partition("|")
        return Endpoints(events, replay or None)
    host = urlsplit(url).hostname or "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    replay_port = settings.kv_events_replay_port
    return Endpoints(
        f"tcp://{host}:{settings.kv_events_port}",
        f"tcp://{host}:{replay_port}" if replay_port else None,
    )


def decode(payload: bytes) -> Any:
    """The payload as plain Python values; None (which ``apply`` counts as malformed) for
    anything msgpack refuses. Untrusted input: no exception may escape."""
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except Exception:  # any decoding failure is just a malformed batch
        return None


def _typed_batch_decoder() -> Callable[[bytes], Any] | None:
    """msgspec's typed decoder for vLLM's ``KVEventBatch`` (``[ts, events, rank]``, events
    tagged by ``"type"``), or None without msgspec (optional: loaded by name). Its structs
    declare only the block hashes and the medium, so msgspec skips every other field (a
    BlockStored's token ids above all) and the view reads them as they are (``kind``, ``keys``):
    bench/runners/run_kv_events_micro.py measures it against msgpack plus ``parse_batch``."""
    try:
        msgspec = importlib.import_module("msgspec")
    except ImportError:
        return None
    # A uint64: msgpack has no larger integer, so only negatives need refusing.
    key = Annotated[int, msgspec.Meta(ge=0)]
    tagged = {"tag_field": "type", "gc": False, "rename": {"keys": "block_hashes"}}
    fields = [("keys", list[key]), ("medium", str | None, None)]
    stored = msgspec.defstruct("Stored", fields, tag=STORED, namespace={"kind": STORED}, **tagged)
    removed = msgspec.defstruct(
        "Removed", fields, tag=REMOVED, namespace={"kind": REMOVED}, **tagged
    )
    cleared = msgspec.defstruct(
        "Cleared", [], tag=CLEARED, tag_field="type", gc=False,
        namespace={"kind": CLEARED, "keys": (), "medium": None},
    )  # fmt: skip
    batch = msgspec.defstruct(
        "Batch",
        # list[...] of variables, spelled so that mypy does not read it as a type annotation
        [("ts", float), ("events", list.__class_getitem__(stored | removed | cleared))],
        array_like=True,
        gc=False,
    )
    decoder: Callable[[bytes], Any] = msgspec.msgpack.Decoder(batch).decode
    return decoder


_TYPED_DECODE = _typed_batch_decoder()


def decode_typed(payload: bytes) -> tuple[float, list[BlockEvent]] | None:
    """(batch time, the events routing uses) through msgspec's typed decoder; None when msgspec
    is absent or the schema refuses the batch (then the generic path, which decides the same,
    takes it)."""
    if _TYPED_DECODE is None:
        return None
    try:
        batch = _TYPED_DECODE(payload)
    except Exception:  # anything the schema refuses goes the generic way
        return None
    return batch.ts, [e for e in batch.events if e.medium in ROUTED_MEDIA]


def batch_time(payload: Any) -> float | None:
    ts = (batch_fields(payload) or (None,))[0]
    return float(ts) if isinstance(ts, int | float) and not isinstance(ts, bool) else None


@dataclass
class _Tally:
    """Predicted-vs-reported prefix hits for one source ("events" or "index")."""

    results: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("exact", "over", "under"), 0)
    )
    predicted_tokens: int = 0
    reported_tokens: int = 0


class ReplicaSubscriber:
    """One replica's SUB socket feeding its view."""

    def __init__(
        self,
        index: int,
        endpoints: Endpoints,
        view: ReplicaView,
        context: zmq.asyncio.Context,
        topic: str,
        replay_timeout_s: float,
        hasher: Callable[[], BlockHasher] | None = None,
    ) -> None:
        self.index = index
        self._hasher = hasher
        self.endpoints = endpoints
        self.view = view
        self._ctx = context
        self._topic = topic.encode()
        self._replay_timeout_s = replay_timeout_s
        self.lag_s = 0.0
        self.replays = 0
        self.replay_failures = 0
        self.bad_frames = 0
        self._mismatch_logged = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.index}")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _run(self) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, self._topic)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoints.events)
        log.info("replica %d: subscribed to KV events at %s", self.index, self.endpoints.events)
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    await self.handle(frames)
                except asyncio.CancelledError:
                    raise
                except Exception:  # a bug here must not end the subscription
                    log.exception("replica %d: KV event batch failed", self.index)
                    self.view.drop()
        finally:
            sock.close(linger=0)

    async def handle(self, frames: Sequence[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            # Without a sequence number the frame cannot be placed; if it was a batch, the
            # next one shows the gap.
            self.bad_frames += 1
            return
        seq = int.from_bytes(frames[1], "big")
        view = self.view
        # Until the hashes are confirmed, root blocks are checked on the generic decoding (it
        # keeps the token ids); after that, the typed decoder when the batch fits it.
        typed = decode_typed(frames[2]) if view.hashes_match is True else None
        payload = decode(frames[2]) if typed is None else None
        start = view.gap_before(seq)
        if start is not None:
            if self.endpoints.replay is not None:
                await self._replay(start, seq)
            if not view.close_gap(seq):
                log.warning(
                    "replica %d: KV events %d..%d missing; view dropped until it resyncs",
                    self.index,
                    start,
                    seq - 1,
                )
        if typed is None:
            view.apply(seq, payload)
        else:
            view.apply_events(seq, typed[1])
        if view.hashes_match is not True and self._hasher is not None:
            # One sha256 per batch until the hashes are confirmed: the proxy's exact hash of a
            # base-model root block's tokens against the key the replica reported for it.
            root = root_block(payload)
            if root is not None:
                tokens, reported = root
                hasher = self._hasher()
                if hasher.mode == "exact" and len(tokens) == hasher.block_size:
                    view.hashes_match = hasher.hash_tokens(tokens, Namespace("")) == [reported]
        if view.hashes_match is False and not self._mismatch_logged:
            # Set by a root block here or by unconfirmed predictions while routing (kv_view.py).
            self._mismatch_logged = True
            log.error(
                "replica %d: its KV-event block hashes differ from the proxy's exact hashes; "
                "check PROXY_VLLM_HASH_SEED (the replicas' PYTHONHASHSEED) and "
                "PROXY_VLLM_HASH_ALGO. Routing uses the index for this replica.",
                self.index,
            )
        ts = batch_time(payload) if typed is None else typed[0]
        if ts is not None:
            self.lag_s = max(0.0, time.time() - ts)

    async def _replay(self, start: int, until: int) -> None:
        """Ask the replica's replay socket for batches ``start..until-1`` and apply them (vLLM
        answers one request with every buffered batch from ``start``, then seq END_OF_REPLAY)."""
        assert self.endpoints.replay is not None
        self.replays += 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        deadline = time.monotonic() + self._replay_timeout_s
        try:
            dealer.connect(self.endpoints.replay)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                frames = await asyncio.wait_for(dealer.recv_multipart(), remaining)
                # [b"", topic, seq, payload] (vLLM 0.32-0.33) or [b"", seq, payload] (later).
                if len(frames) not in (3, 4) or len(frames[-2]) != 8:
                    self.bad_frames += 1
                    continue
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == END_OF_REPLAY:
                    return
                if start <= seq < until:
                    self.view.apply(seq, decode(frames[-1]))
        except TimeoutError:
            self.replay_failures += 1
            log.warning("replica %d: no KV event replay from %s", self.index, self.endpoints.replay)
        finally:
            dealer.close(linger=0)


class KvEvents:
    """Every replica's view, their subscribers, and the hit predictions to check."""

    def __init__(
        self,
        settings: Settings,
        fleet: Fleet,
        block_size: Callable[[], int],
        hasher: Callable[[], BlockHasher] | None = None,
    ) -> None:
        self.settings = settings
        self.fleet = fleet
        self._block_size = block_size
        self.hasher = hasher  # the router's, read at call time (it may be rebuilt)
        self.views: dict[int, ReplicaView] = {}
        self.matcher = PreciseMatcher(self.views, block_size=block_size)
        self.subscribers: dict[int, ReplicaSubscriber] = {}
        self.tallies = {"events": _Tally(), "index": _Tally()}
        self.unreported = 0  # answers without usage.prompt_tokens_details.cached_tokens
        self._ctx: zmq.asyncio.Context | None = None
        self._supervisor: asyncio.Task[None] | None = None

    def register(self, registry: CollectorRegistry) -> None:
        registry.register(KvEventsCollector(self))

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self.supervise()
        self._supervisor = asyncio.create_task(self._supervise_loop(), name="kv-events")

    async def stop(self) -> None:
        await cancel_and_wait(self._supervisor)
        for sub in list(self.subscribers.values()):
            await sub.stop()
        self.subscribers.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def _supervise_loop(self) -> None:
        while True:
            await asyncio.sleep(SUPERVISE_INTERVAL_S)
            self.supervise()

    def supervise(self) -> None:
        """Subscribe to replicas not yet followed; forget the view of an ejected or removed one
        (it may be restarting: its next batches start a new numbering)."""
        assert self._ctx is not None
        s = self.settings
        for replica in self.fleet.replicas:
            i = replica.index
            if replica.status in (Status.EJECTED, Status.REMOVED):
                view = self.views.get(i)
                if view is not None and view.next_seq is not None:
                    view.forget()
                continue
            if i in self.subscribers:
                continue
            ends = endpoints_for(s, i, replica.url)
            if ends is None:
                continue
            view = self.views.setdefault(i, ReplicaView(s.kv_events_view_capacity))
            sub = ReplicaSubscriber(
                i,
                ends,
                view,
                self._ctx,
                s.kv_events_topic,
                s.kv_events_replay_timeout_s,
                self.hasher,
            )
            self.subscribers[i] = sub
            sub.start()

    def observe(self, decision: object, body: bytes) -> None:
        """Compare the cached tokens predicted for ``decision`` with the replica's report, and
        count its completion's length in what requests reserve (``observe_output``)."""
        pending = self.matcher.outcome(decision)
        if pending is None:
            return
        generated = first_match(_COMPLETION_TOKENS, b'"completion_tokens"', body)
        if generated is not None:
            self.matcher.observe_output(int(generated.group(1)))
        match = first_match(_CACHED_TOKENS, b'"cached_tokens"', body)
        if match is None:
            self.unreported += 1
            return
        blocks, live = pending
        expected = blocks * self._block_size()
        reported = int(match.group(1))
        tally = self.tallies["events" if live else "index"]
        result = "exact" if expected == reported else ("over" if expected > reported else "under")
        tally.results[result] += 1
        tally.predicted_tokens += expected
        tally.reported_tokens += reported

    def snapshot(self, with_blocks: bool = False) -> dict[str, Any]:
        """Per-replica state for /admin/kv_events (``with_blocks``: the keys too, sorted)."""
        out: dict[str, Any] = {}
        for i, view in sorted(self.views.items()):
            sub = self.subscribers.get(i)
            row = out[str(i)] = {
                "endpoint": sub.endpoints.events if sub else None,
                "replay_endpoint": sub.endpoints.replay if sub else None,
                "live": view.live,
                "hashes_match": view.hashes_match,
                "predictions_confirmed": view.predictions_confirmed,
                "predictions_expired": view.predictions_expired,
                "blocks": len(view),
                "next_seq": view.next_seq,
                "batches": view.batches,
                "events": view.events,
                "gaps": view.gaps,
                "malformed": view.malformed + (sub.bad_frames if sub else 0),
                "dropped": view.dropped,
                "resyncs": view.resyncs,
                "overflow": view.overflow,
                "replays": sub.replays if sub else 0,
                "replay_failures": sub.replay_failures if sub else 0,
                "lag_s": round(sub.lag_s, 6) if sub else None,
            }
            if with_blocks:
                row["block_keys"] = sorted(view.blocks)
        return out


# Per-replica families by name: help text; the counters' values are /admin/kv_events fields.
_COUNTERS = {
    "batches": "Event batches received (one per replica scheduler step).",
    "events": "KV-cache events applied (BlockStored, BlockRemoved, AllBlocksCleared).",
    "gaps": "Sequence gaps seen (missed batches).",
    "malformed": "Batches or frames skipped as malformed.",
    "dropped": "Times a replica's view stopped being trusted (routing fell back).",
    "replay_failures": "Replays that got no answer in time.",
}
_GAUGES = {
    "view_live": "1 when routing uses the replica's events, 0 when it falls back.",
    "view_blocks": "Blocks the replica reports cached.",
    "lag_seconds": "Receive time minus the batch's own timestamp (last batch).",
}


class KvEventsCollector(Collector):
    """Reads the views at scrape time (zero cost per event)."""

    def __init__(self, kv: KvEvents) -> None:
        self.kv = kv

    def collect(self) -> Iterator[Metric]:
        p = "rollout_proxy_kv_events_"
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
            n: CounterMetricFamily(p + n, doc, labels=["replica"]) for n, doc in _COUNTERS.items()
        }
        families |= {n: GaugeMetricFamily(p + n, d, labels=["replica"]) for n, d in _GAUGES.items()}
        for i, row in self.kv.snapshot().items():
            sub = self.kv.subscribers.get(int(i))
            row["view_live"] = 1.0 if self.kv.views[int(i)].usable else 0.0
            row["view_blocks"] = row["blocks"]
            row["lag_seconds"] = sub.lag_s if sub else 0.0
            for name, family in families.items():
                family.add_metric([i], row[name])
        yield from families.values()
        hasher = self.kv.hasher() if self.kv.hasher is not None else None
        if isinstance(hasher, VllmHasher):
            for name, value, doc in (
                ("hits", hasher.memo.hits, "Prompt blocks whose vLLM hash was remembered."),
                ("misses", hasher.memo.misses, "Prompt blocks hashed with vLLM's function."),
            ):
                yield CounterMetricFamily(p + "exact_memo_" + name, doc, value)
        p = "rollout_proxy_kv_prediction_"
        results = CounterMetricFamily(
            p + "requests",
            "Routed requests by whether the expected cached tokens equal the replica's reported "
            "usage.prompt_tokens_details.cached_tokens (exact), exceed it (over) or fall short "
            "(under); source: the chosen replica's live events view or the index.",
            labels=["source", "result"],
        )
        predicted = CounterMetricFamily(
            p + "predicted_tokens", "Cached prompt tokens the proxy expected.", labels=["source"]
        )
        reported = CounterMetricFamily(
            p + "reported_tokens", "Cached prompt tokens the replicas reported.", labels=["source"]
        )
        for source, tally in self.kv.tallies.items():
            for result, n in tally.results.items():
                results.add_metric([source, result], n)
            predicted.add_metric([source], tally.predicted_tokens)
            reported.add_metric([source], tally.reported_tokens)
        yield from (results, predicted, reported)
        yield CounterMetricFamily(
            p + "unreported",
            "Answers without cached_tokens (start vLLM with --enable-prompt-tokens-details).",
            self.kv.unreported,
        )
