"""KV-event routing end to end over real ZMQ sockets on 127.0.0.1: the proxy's subscribers, gaps
and replays against a publisher speaking vLLM's wire format, bad input, and the routing result."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from bench.harness.kv_events_publisher import KvEventPublisher
from proxy.core.hashing import Namespace, VllmHasher
from proxy.core.kv_view import PreciseMatcher, ReplicaView
from proxy.kv_events import Endpoints, ReplicaSubscriber
from tests.support.fake_vllm import FakeVllm

BLOCK = 16


def frames(seq: int, *events: dict[str, Any]) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), msgpack.packb([time.time(), list(events), 0])]


def stored(keys: list[int]) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": keys, "parent_block_hash": None,
            "token_ids": [], "block_size": BLOCK, "lora_id": None, "medium": "GPU"}  # fmt: skip


def removed(keys: list[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": keys, "medium": "GPU"}


# -- the subscriber against the simulator's publisher (vLLM's replay protocol) -----------------


async def _subscriber(replay: str | None, timeout_s: float = 2.0) -> ReplicaSubscriber:
    ctx = zmq.asyncio.Context.instance()
    return ReplicaSubscriber(
        0, Endpoints("tcp://127.0.0.1:1", replay), ReplicaView(1000), ctx, "", timeout_s
    )


async def test_a_gap_is_filled_from_the_replay_socket() -> None:
    pub = KvEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", BLOCK)
    pub.start()
    try:
        for keys in ([1, 2], [3], [4]):
            pub.stored(keys, None)
            pub.flush()  # one batch each: seq 0, 1, 2
        pub.removed([1])
        pub.flush()  # seq 3
        sub = await _subscriber(pub.replay_endpoint)
        # The SUB socket saw only seq 0 and seq 3; 1 and 2 come from the replay.
        await sub.handle(frames(0, stored([1, 2])))
        await sub.handle(frames(3, removed([1])))
        assert sub.view.live and set(sub.view.blocks) == {2, 3, 4}
        assert (sub.view.gaps, sub.replays, sub.replay_failures) == (1, 1, 0)
    finally:
        await pub.close()


async def test_a_late_subscriber_recovers_the_whole_history() -> None:
    pub = KvEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", BLOCK)
    pub.start()
    try:
        for key in range(5):
            pub.stored([key], None)
            pub.flush()
        sub = await _subscriber(pub.replay_endpoint)
        await sub.handle(frames(5, stored([5])))  # first batch it ever sees
        assert sub.view.live and set(sub.view.blocks) == set(range(6))
    finally:
        await pub.close()


async def test_a_silent_replay_socket_drops_the_view_after_the_timeout() -> None:
    ctx = zmq.asyncio.Context.instance()
    mute = ctx.socket(zmq.ROUTER)  # accepts the request, never answers
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    try:
        sub = await _subscriber(f"tcp://127.0.0.1:{port}", timeout_s=0.2)
        await sub.handle(frames(0, stored([1])))
        await sub.handle(frames(4, stored([9])))
        assert not sub.view.live and sub.replay_failures == 1
        assert sub.view.next_seq == 5  # numbering carries on; the view waits for a resync
        await sub.handle(frames(5, {"type": "AllBlocksCleared"}, stored([7])))
        assert sub.view.live and set(sub.view.blocks) == {7}
    finally:
        mute.close(linger=0)


@pytest.mark.parametrize(
    "bad",
    [
        [b"only-one-frame"],
        [b"", b"short", b""],
        [b"", (1).to_bytes(8, "big"), b"\xc1"],  # 0xc1 is never valid msgpack
        [b"", (1).to_bytes(8, "big"), msgpack.packb({"events": [{"type": 3}]})],
        [b"", (1).to_bytes(8, "big"), msgpack.packb([0, [{"type": "BlockStored"}]])],
    ],
)
async def test_malformed_frames_are_counted_and_never_raise(bad: list[bytes]) -> None:
    sub = await _subscriber(None)
    await sub.handle(frames(0, stored([1])))
    await sub.handle(bad)
    assert sub.bad_frames + sub.view.malformed == 1
    await sub.handle(frames(2, {"type": "AllBlocksCleared"}))
    assert sub.view.live


# -- the proxy, routing on what a replica reports ----------------------------------------------


class Publisher:
    """A replica's event socket driven from the test thread."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.seq = 0

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def send(self, *events: dict[str, Any], seq: int | None = None) -> None:
        if seq is not None:
            self.seq = seq
        self.sock.send_multipart(frames(self.seq, *events))
        self.seq += 1

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def publishers() -> Iterator[list[Publisher]]:
    pubs = [Publisher(), Publisher()]
    yield pubs
    for p in pubs:
        p.close()


def wait_for(predicate: Callable[[], bool], action: Callable[[], None] | None = None) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        if action is not None:
            action()
        time.sleep(0.05)


def rollout(prompt: list[int]) -> dict[str, Any]:
    return {"model": "base", "prompt": prompt, "max_tokens": 4, "return_token_ids": True}


def test_the_proxy_routes_to_the_replica_that_reports_the_blocks(
    make_fleet: Any, publishers: list[Publisher]
) -> None:
    fakes = [FakeVllm(name=f"r{i}", base_model="base") for i in range(2)]
    h = make_fleet(
        fakes=fakes, kv_events=True, kv_events_endpoints=[p.endpoint for p in publishers]
    )
    state = lambda: h.client.get("/admin/kv_events").json()["replicas"]  # noqa: E731
    # ZMQ subscribers miss what was sent before they connected: announce seq 0 until heard.
    for i, pub in enumerate(publishers):
        wait_for(lambda i=i: state()[str(i)]["live"], lambda pub=pub: pub.send(seq=0))
    assert h.client.get("/admin/fleet").json()["routing"]["hash_mode"] == "exact"

    prompt = list(range(100, 200))
    first = h.client.post("/v1/completions", json=rollout(prompt))
    sent_to = int(first.headers["x-proxy-replica"])
    other = 1 - sent_to
    # The replica it went to evicted the prompt; the other one holds it (say, a second client).
    keys = VllmHasher(BLOCK).hash_tokens(prompt, Namespace("base"))
    publishers[sent_to].send(stored(keys), removed(keys))
    publishers[other].send(stored(keys))
    wait_for(lambda: state()[str(other)]["blocks"] == len(keys))
    wait_for(lambda: state()[str(sent_to)]["events"] >= 2)
    again = h.client.post("/v1/completions", json=rollout(prompt))
    assert int(again.headers["x-proxy-replica"]) == other

    # A gap with no replay socket: that replica falls back to the index, the other stays live.
    publishers[other].send(stored([1]), seq=publishers[other].seq + 3)
    wait_for(lambda: not state()[str(other)]["live"])
    s = state()
    assert s[str(other)]["gaps"] == 1 and s[str(sent_to)]["live"]
    metrics = h.client.get("/metrics").text
    assert f'rollout_proxy_kv_events_gaps_total{{replica="{other}"}} 1.0' in metrics
    assert f'rollout_proxy_kv_events_view_live{{replica="{other}"}} 0.0' in metrics
    assert f'rollout_proxy_kv_events_view_live{{replica="{sent_to}"}} 1.0' in metrics
    # Garbage on the wire is counted; a cache reset brings the view back.
    publishers[other].sock.send_multipart([b"", publishers[other].seq.to_bytes(8, "big"), b"\xc1"])
    publishers[other].seq += 1
    wait_for(lambda: state()[str(other)]["malformed"] == 1)
    publishers[other].send({"type": "AllBlocksCleared"})
    wait_for(lambda: state()[str(other)]["live"])


def test_kv_events_need_exact_hashing() -> None:
    from proxy.settings import Settings

    assert Settings(replicas=["http://a:1"], kv_events=True).hash_mode == "exact"
    with pytest.raises(ValueError, match="PROXY_HASH_MODE=exact"):
        Settings(replicas=["http://a:1"], kv_events=True, hash_mode="fast")
    with pytest.raises(ValueError, match="tcp://host:port"):
        Settings(replicas=["http://a:1"], kv_events_endpoints=["http://a:5557"])


def test_admin_kv_events_says_when_the_feature_is_off(make_fleet: Any) -> None:
    h = make_fleet()
    resp = h.client.get("/admin/kv_events")
    assert resp.status_code == 501
    assert "PROXY_KV_EVENTS" in resp.json()["error"]["message"]


def _started_on_a_local_publisher(
    view_capacity: int,
) -> tuple[zmq.asyncio.Socket, ReplicaSubscriber]:
    """A PUB socket on a free local port and a started subscriber to it (no replay socket)."""
    ctx = zmq.asyncio.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = ReplicaSubscriber(
        0, Endpoints(f"tcp://127.0.0.1:{port}", None), ReplicaView(view_capacity), ctx, "", 1.0
    )
    sub.start()
    return pub, sub


async def test_subscriber_task_survives_and_stops_cleanly() -> None:
    pub, sub = _started_on_a_local_publisher(10)
    try:
        deadline = time.monotonic() + 10
        while not sub.view.live:
            assert time.monotonic() < deadline
            await pub.send_multipart(frames(0))
            await pub.send_multipart([b"garbage"])
            await asyncio.sleep(0.05)
        assert sub.bad_frames >= 1
    finally:
        await sub.stop()
        pub.close(linger=0)


async def test_batches_queued_together_are_all_applied_in_order() -> None:
    """A burst of batches sent while the subscriber is not running: every one is applied once
    and in order (a lost or reordered batch would show as a gap), with bad frames among them
    counted and skipped."""
    pub, sub = _started_on_a_local_publisher(1000)
    try:
        deadline = time.monotonic() + 10
        while not sub.view.live:  # the connection is up once a batch 0 gets through
            assert time.monotonic() < deadline
            await pub.send_multipart(frames(0))
            await asyncio.sleep(0.05)
        start = sub.view.next_seq
        assert start is not None
        burst = 101
        for i in range(burst):  # no await in between that lets the subscriber run
            pub.send_multipart(frames(start + i, stored([100 + i])))
            if i % 7 == 0:
                pub.send_multipart([b"garbage"])
        while sub.view.next_seq != start + burst:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert sub.view.live and sub.view.gaps == 0
        assert sorted(sub.view.blocks) == [100 + i for i in range(burst)]
        assert sub.bad_frames == len(range(0, burst, 7))
    finally:
        await sub.stop()
        pub.close(linger=0)


# -- the simulator publishes what its cache holds ---------------------------------------------


async def test_simulator_events_describe_its_cache_exactly() -> None:
    from bench.harness.kv_events_publisher import publish_events
    from bench.harness.simulator import Replica, SimClock, SimConfig

    # 40 blocks of 16 tokens: a few prompts with their completions overflow it, so it evicts.
    config = SimConfig(kv_events=True, time_scale=0.001, kv_blocks=40, max_model_len=256,
                       gen_median_tokens=40, gen_sigma=0.0)  # fmt: skip
    replica = Replica(config, SimClock(config.time_scale))
    publisher = publish_events(replica.engine, config.block_size, "127.0.0.1")
    replica.engine.start()
    ctx = zmq.asyncio.Context.instance()
    sub = ReplicaSubscriber(
        0,
        Endpoints(publisher.endpoint, publisher.replay_endpoint),
        ReplicaView(1000),
        ctx,
        "",
        2.0,
    )
    sub.start()  # joins late: what it missed comes from the replay socket
    try:
        rng = random.Random(5)

        async def serve(n: int) -> None:
            prompts = [
                [rng.randrange(1000) for _ in range(rng.randrange(20, 120))] for _ in range(n)
            ]
            await asyncio.gather(*(
                replica.complete({"model": config.model, "prompt": p, "max_tokens": 60, "seed": i})
                for i, p in enumerate(prompts)
            ))  # fmt: skip

        async def settled() -> None:
            deadline = time.monotonic() + 10
            nudge_at = time.monotonic() + 1
            while sub.view.next_seq != publisher.batches:
                now = time.monotonic()
                assert now < deadline, (sub.view.next_seq, publisher.batches)
                if sub.view.next_seq is None and now > nudge_at:
                    # PUB/SUB's slow joiner: on a loaded machine every batch so far may have gone
                    # out before the SUB connected, and a subscriber that heard nothing cannot
                    # know it missed anything. One more batch makes it ask for the replay.
                    await serve(1)
                    nudge_at = now + 1
                await asyncio.sleep(0.02)

        await serve(12)
        replica.engine.reset_cache()  # what /pause does
        await serve(12)
        await settled()
        cache = replica.engine.cache
        assert cache.evictions > 0
        assert sub.view.live
        assert set(sub.view.blocks) == set(cache._index)  # every findable block, no other
        # The keys are vLLM's: the proxy's exact hasher finds a cached prompt's blocks.
        prompt = [rng.randrange(1000) for _ in range(100)]
        await replica.complete({"model": config.model, "prompt": prompt, "max_tokens": 1})
        await settled()
        keys = VllmHasher(config.block_size).hash_tokens(prompt, Namespace("base"))
        assert sub.view.held_prefix(keys) == len(keys)
    finally:
        await sub.stop()
        await replica.engine.stop()
        await publisher.close()


@pytest.mark.parametrize(("seed", "matches"), [("0", True), (None, False)])
async def test_a_replica_whose_hashes_differ_is_routed_on_the_index(
    seed: str | None, matches: bool
) -> None:
    """The replicas hash with PYTHONHASHSEED=0 here; a proxy configured without it computes
    other keys, which would never match: the view must not be used."""
    tokens = list(range(3, 3 + BLOCK))
    vllm = VllmHasher(BLOCK, "sha256", "0")
    root = {**stored(vllm.hash_tokens(tokens, Namespace(""))), "token_ids": tokens,
            "extra_keys": [None]}  # fmt: skip
    ctx = zmq.asyncio.Context.instance()
    proxy_hasher = VllmHasher(BLOCK, "sha256", seed)
    sub = ReplicaSubscriber(
        0, Endpoints("tcp://127.0.0.1:1", None), ReplicaView(10), ctx, "", 1.0,
        lambda: proxy_hasher,
    )  # fmt: skip
    await sub.handle(frames(0, root))
    assert sub.view.live and sub.view.hashes_match is matches
    assert PreciseMatcher({0: sub.view}).live_mask([0]) == (1 if matches else 0)
