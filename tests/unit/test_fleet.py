"""Fleet bookkeeping: eligibility, reconciliation plans, restart adoption."""

from __future__ import annotations

import pytest

from proxy.core.fleet import Fleet, Status, adapter_version, unaccounted_requests


def published(fleet: Fleet, name: str, path: str, loaded_on: list[int]) -> None:
    """What a load answered 200 leaves behind: desired, and held where it applied."""
    fleet.desired_adapters[name] = path
    for i in loaded_on:
        fleet.replicas[i].adapters[name] = path


def ready_fleet(n: int = 2) -> Fleet:
    fleet = Fleet([f"http://r{i}" for i in range(n)])
    for r in fleet.replicas:
        fleet.record_models(r.index, "base", 4096, {})
        fleet.mark_reconciled(r.index)
    return fleet


def test_only_replicas_with_the_adapter_are_eligible() -> None:
    fleet = ready_fleet(3)
    published(fleet, "trl-policy-v1", "/a/1", [0, 2])
    assert [r.index for r in fleet.eligible("trl-policy-v1")] == [0, 2]
    assert [r.index for r in fleet.eligible("base")] == [0, 1, 2]
    assert [r.index for r in fleet.eligible("")] == [0, 1, 2]
    assert fleet.eligible("trl-policy-v9") == []
    assert fleet.known_anywhere("trl-policy-v1") and not fleet.known_anywhere("x")


def test_max_len_bound_follows_reports_and_removals() -> None:
    """The prompt limit's bound (read per request) is the members' smallest max_model_len as of
    the last change: a smaller report or a removal applies to the very next request."""
    fleet = Fleet([f"http://r{i}" for i in range(3)])
    assert fleet.max_len_bound is None
    fleet.record_models(0, "base", 4096, {})
    fleet.record_models(1, "base", None, {})
    assert fleet.max_len_bound == 4096
    fleet.record_models(2, "base", 1024, {})
    assert fleet.max_len_bound == 1024
    fleet.remove(2)
    assert fleet.replicas[2].status is Status.REMOVED
    assert fleet.max_len_bound == 4096
    fleet.record_models(0, "base", 2048, {})  # restarted with a shorter context
    assert fleet.max_len_bound == 2048
    fleet.add("http://r3")
    fleet.record_models(3, "base", 512, {})
    assert fleet.max_len_bound == 512


def test_ejected_and_draining_take_no_traffic() -> None:
    fleet = ready_fleet(3)
    assert fleet.record_failure(0, "refused") is True
    fleet.replicas[1].status = Status.DRAINING
    assert [r.index for r in fleet.eligible("base")] == [2]
    # Control calls still reach both: the ejected one may answer again, the draining one
    # finishes requests that may name any published adapter.
    assert [r.index for r in fleet.broadcast_targets()] == [0, 1, 2]
    assert [r.index for r in fleet.serving()] == [1, 2]
    fleet.replicas[2].status = Status.REMOVED
    assert [r.index for r in fleet.broadcast_targets()] == [0, 1]


def test_restarted_replica_is_reconciled_before_ready() -> None:
    fleet = ready_fleet(2)
    published(fleet, "trl-policy-v1", "/a/1", [0, 1])
    fleet.desired_paused = True
    fleet.pause_query = "mode=keep"
    fleet.record_models(1, "base", 4096, {"stale": "/x"})  # came back empty but for junk
    r = fleet.replicas[1]
    assert r.status is Status.RECONCILING
    assert fleet.eligible("trl-policy-v1") == [fleet.replicas[0]]
    plan = fleet.plan(r)
    assert plan.load == {"trl-policy-v1": "/a/1"}
    assert plan.unload == ["stale"]
    assert plan.pause is True and plan.pause_query == "mode=keep"


def test_same_name_other_path_is_reloaded() -> None:
    fleet = ready_fleet(1)
    fleet.desired_adapters["a"] = "/new"
    fleet.replicas[0].adapters["a"] = "/old"
    plan = fleet.plan(fleet.replicas[0])
    assert plan.load == {"a": "/new"} and plan.unload == ["a"]


def test_adopt_on_proxy_restart() -> None:
    fleet = Fleet(["http://a", "http://b", "http://c"])
    conflicts = fleet.adopt(
        {0: {"v1": "/p1", "v2": "/p2"}, 1: {"v1": "/p1"}, 2: {"v1": "/other", "v2": "/p2"}},
        {0: False, 1: True, 2: False},
    )
    assert fleet.desired_adapters == {"v1": "/p1", "v2": "/p2"}
    assert conflicts == ["v1"]


@pytest.mark.parametrize(
    ("answers", "desired"),
    [
        ({0: True, 1: True, 2: True}, True),  # TRL paused the fleet: every replica says so
        # A resume that reached only some replicas (one wedged through it): resume the rest too,
        # rather than hold every rollout until a sync that needs rollouts to come.
        ({0: False, 1: True, 2: False}, False),
        ({0: True, 1: True, 2: False}, False),
        ({0: False, 1: False, 2: False}, False),
        ({0: True, 1: None, 2: True}, True),  # unknown answers say nothing either way
        ({0: False, 1: None, 2: None}, False),
        ({0: None, 1: None, 2: None}, False),  # nothing known: not paused
        ({}, False),
    ],
)
def test_adopt_pauses_only_a_unanimously_paused_fleet(
    answers: dict[int, bool | None], desired: bool
) -> None:
    fleet = Fleet(["http://a", "http://b", "http://c"])
    fleet.desired_paused = not desired  # adopt decides it, whatever it was
    fleet.adopt({}, answers)
    assert fleet.desired_paused is desired


def test_membership_and_versions() -> None:
    fleet = ready_fleet(1)
    new = fleet.add("http://new")
    assert new.index == 1 and new.status is Status.PENDING
    assert adapter_version("trl-policy-v12") == 12 and adapter_version("other") is None
    # A name is a client's or a replica's word: int() of 5,000 digits would raise, and a name
    # with a trailing newline is not TRL's.
    assert adapter_version("trl-policy-v" + "9" * 5000) is None
    assert adapter_version("trl-policy-v12\n") is None
    published(fleet, "trl-policy-v3", "/3", [0])
    published(fleet, "trl-policy-v12", "/12", [0])
    assert fleet.latest_version(fleet.replicas[0]) == 12


def test_unknown_pause_state_is_applied_once_then_trusted() -> None:
    fleet = ready_fleet(1)
    r = fleet.replicas[0]
    fleet.desired_paused = True
    fleet.record_models(0, "base", 4096, {}, paused=None)  # /is_paused missing
    assert r.paused is None and not r.paused_observed
    plan = fleet.plan(r)
    assert plan.pause is True and not plan.pause_known
    assert plan.describe() == "pause (state unknown)"
    r.paused = True  # what a successful apply records (proxy.reconciler)
    fleet.record_models(0, "base", 4096, {}, paused=None)  # still unobservable: not undone
    assert r.paused is True and fleet.plan(r).empty
    fleet.record_models(0, "base", 4096, {}, paused=False)  # observed: the observation wins
    assert fleet.plan(r).pause is True and fleet.plan(r).pause_known


def test_lost_adapter_makes_pause_unknown_but_lagging_desired_state_keeps_serving() -> None:
    fleet = ready_fleet(2)
    published(fleet, "trl-policy-v1", "/a/1", [0, 1])
    for r in fleet.replicas:
        r.paused = False
    fleet.desired_adapters["trl-policy-v2"] = "/a/2"  # a broadcast is under way
    fleet.record_models(0, "base", 4096, {"trl-policy-v1": "/a/1"}, paused=None)
    assert fleet.replicas[0].status is Status.READY  # behind, not broken
    assert fleet.plan(fleet.replicas[0]).describe() == "load trl-policy-v2"
    fleet.record_models(1, "base", 4096, {}, paused=None)  # restarted: v1 is gone
    assert fleet.replicas[1].status is Status.RECONCILING
    assert fleet.replicas[1].paused is None


def test_ejection_forgets_the_pause_state() -> None:
    fleet = ready_fleet(1)
    fleet.replicas[0].paused = True
    assert fleet.record_failure(0, "refused")
    assert fleet.replicas[0].paused is None


def test_adopt_ignores_unknown_pause_states() -> None:
    fleet = Fleet(["http://a", "http://b"])
    fleet.adopt({0: {}, 1: {}}, {0: None, 1: False})
    assert fleet.desired_paused is False


def test_a_scraped_queue_adds_only_the_requests_this_proxy_did_not_send() -> None:
    # The router's load is in_flight + queue_depth: each request at the replica counts once.
    # Five of ours, two queued for memory: nothing to add (the old count said 5 + 2 = 7).
    assert unaccounted_requests(running=3.0, waiting=2.0, in_flight=5) == 0.0
    # Two of ours and five of another client's: the replica holds 7.
    assert unaccounted_requests(running=4.0, waiting=3.0, in_flight=2) == 5.0
    # Sent but not yet at the replica's scheduler: the proxy's count is the newer one.
    assert unaccounted_requests(running=0.0, waiting=0.0, in_flight=3) == 0.0


# -- who may serve an adapter (publish means served) -------------------------------------------


def reconciling_fleet() -> Fleet:
    """Two replicas back from a restart: observed (adapters, pause state known), reconciling."""
    fleet = Fleet(["http://r0", "http://r1"])
    fleet.desired_adapters = {"trl-policy-v1": "/a/1", "trl-policy-v2": "/a/2"}
    for r in fleet.replicas:
        fleet.record_models(r.index, "base", 4096, {}, paused=False)
    return fleet


def _set(fleet: Fleet, index: int, **fields: object) -> None:
    replica = fleet.replicas[index]
    for name, value in fields.items():
        setattr(replica, name, value)


# (what is changed on replica 0 after it holds v2 at the desired path, expected can_serve v2)
CAN_SERVE_V2 = [
    ({}, True),  # reconciling, still reloading v1: serves v2, which it holds
    ({"status": Status.READY}, True),
    ({"adapters": {}}, False),  # never route X to a replica that lacks X
    ({"adapters": {"trl-policy-v2": "/old/2"}}, False),  # held at another path: being replaced
    ({"paused": None}, False),  # pause state unknown
    ({"paused": True}, False),  # paused while TRL asked for resumed
    ({"failures": 1}, False),  # a probe failed since its last observation
    ({"status": Status.EJECTED}, False),
    ({"status": Status.PENDING}, False),
    ({"status": Status.DRAINING}, False),
    ({"status": Status.REMOVED}, False),
]


@pytest.mark.parametrize(("change", "expected"), CAN_SERVE_V2)
def test_can_serve_an_adapter(change: dict[str, object], expected: bool) -> None:
    fleet = reconciling_fleet()
    _set(fleet, 0, adapters={"trl-policy-v2": "/a/2"})
    _set(fleet, 0, **change)
    assert fleet.can_serve(fleet.replicas[0], "trl-policy-v2") is expected
    assert ([r.index for r in fleet.eligible("trl-policy-v2")] == [0]) is expected


def test_a_paused_fleet_serves_from_replicas_paused_as_desired() -> None:
    """TRL's pause (mode=keep) holds requests at the replica: a reconciling replica paused as
    desired takes them like a READY one; an unpaused one while TRL has paused does not."""
    fleet = reconciling_fleet()
    fleet.desired_paused = True
    _set(fleet, 0, adapters={"trl-policy-v2": "/a/2"}, paused=True)
    _set(fleet, 1, adapters={"trl-policy-v2": "/a/2"}, paused=False)
    assert [r.index for r in fleet.eligible("trl-policy-v2")] == [0]


def test_the_base_model_waits_for_ready() -> None:
    fleet = reconciling_fleet()
    assert fleet.eligible("base") == [] and not fleet.awaited("base")
    fleet.mark_reconciled(1)
    assert [r.index for r in fleet.eligible("base")] == [1]


# (adapter, change to the fleet, awaited)
AWAITED = [
    ("trl-policy-v2", {}, True),  # desired, nobody holds it yet: a load is under way
    ("trl-policy-v9", {}, False),  # nobody asked for it: 404 at once
    ("base", {}, False),
    ("trl-policy-v2", {"held": True}, False),  # someone may serve it now
    ("trl-policy-v2", {"all": Status.EJECTED}, True),  # they may come back within the wait
    ("trl-policy-v2", {"all": Status.DRAINING}, False),  # nobody will take new work
    ("trl-policy-v2", {"all": Status.REMOVED}, False),
]


@pytest.mark.parametrize(("model", "change", "expected"), AWAITED)
def test_awaited(model: str, change: dict[str, object], expected: bool) -> None:
    fleet = reconciling_fleet()
    if change.get("held"):
        _set(fleet, 1, adapters={"trl-policy-v2": "/a/2"})
    if "all" in change:
        for r in fleet.replicas:
            r.status = change["all"]  # type: ignore[assignment]
    assert fleet.awaited(model) is expected


def test_waiting_for_names_what_is_left() -> None:
    fleet = reconciling_fleet()
    _set(fleet, 0, adapters={"trl-policy-v2": "/a/2"})
    assert fleet.waiting_for(fleet.replicas[0]) == "load trl-policy-v1"
    fleet.replicas[0].not_reconciled = "still to do: load trl-policy-v1 (mount lag)"
    assert fleet.waiting_for(fleet.replicas[0]) == "still to do: load trl-policy-v1 (mount lag)"
    assert fleet.serves_anything(fleet.replicas[0]) and not fleet.serves_anything(fleet.replicas[1])
    assert not fleet.in_desired_state(fleet.replicas[0])
    ready = ready_fleet(1)
    assert ready.waiting_for(ready.replicas[0]) == "resume (state unknown)"
    ready.record_models(0, "base", 4096, {}, paused=False)
    assert ready.waiting_for(ready.replicas[0]) is None
    assert ready.in_desired_state(ready.replicas[0])
    fleet.record_failure(1, "connection refused")
    assert "connection refused" in (fleet.waiting_for(fleet.replicas[1]) or "")


@pytest.mark.parametrize(
    ("scrapes", "rate"),
    [
        ([(100.0, 40.0)], None),  # one scrape: no interval yet
        ([(100.0, 40.0), (300.0, 190.0)], 0.75),
        ([(100.0, 40.0), (100.0, 40.0)], None),  # no traffic in between
        ([(300.0, 190.0), (50.0, 10.0)], None),  # counters reset (a restart)
        ([(100.0, 40.0), (200.0, 400.0)], None),  # more hits than queries: nonsense
    ],
)
def test_recent_hit_rate(scrapes: list[tuple[float, float]], rate: float | None) -> None:
    fleet = ready_fleet(1)
    for queries, hits in scrapes:
        fleet.record_cache(0, queries, hits)
    assert fleet.replicas[0].hit_rate == (pytest.approx(rate) if rate is not None else None)


@pytest.mark.parametrize("seed", range(40))
def test_eligible_is_can_serve_of_each_replica(seed: int) -> None:
    """``eligible`` (with its one-pass form for the base model) picks exactly the replicas
    ``can_serve`` accepts, over mixed statuses, stale weights, adapters and pause states."""
    import random

    rng = random.Random(seed)
    fleet = ready_fleet(6)
    published(fleet, "a", "/a/1", [0, 1, 2, 3])
    fleet.desired_paused = rng.choice([True, False])
    for r in fleet.replicas:
        r.status = rng.choice(list(Status))
        r.weights.stale = rng.choice([None, None, "behind the fleet's sync"])
        r.failures = rng.choice([0, 0, 1])
        r.paused = rng.choice([None, True, False])
        if rng.random() < 0.3:
            r.adapters["a"] = "/a/0"
    for model in ("base", "", "a", "missing"):
        expected = [r for r in fleet.replicas if fleet.can_serve(r, model)]
        assert fleet.eligible(model) == expected
