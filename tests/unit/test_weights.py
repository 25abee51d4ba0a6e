"""proxy/core/weights.py: seats, answer validation and each replica's weight state."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.core.fleet import Fleet, Status
from proxy.core.weights import (
    NOT_IN_GROUP,
    ReplicaWeights,
    Seat,
    WeightBook,
    check_version,
    parse_world_size,
    seats,
)


@pytest.mark.parametrize(
    ("sizes", "base", "offsets", "total"),
    [
        ([(0, 1)], 1, [1], 2),  # one replica: what TRL does against vLLM alone
        ([(0, 1), (1, 1)], 1, [1, 2], 3),
        ([(0, 1), (1, 2)], 1, [1, 2], 4),
        ([(0, 2), (1, 1), (2, 1)], 1, [1, 3, 4], 5),
        ([(0, 4), (2, 2)], 1, [1, 5], 7),  # replica 1 left out (no valid answer)
        ([(3, 2)], 0, [0], 2),
    ],
)
def test_seats(sizes: list[tuple[int, int]], base: int, offsets: list[int], total: int) -> None:
    group, world = seats(sizes, base)
    assert [s.rank_offset for s in group] == offsets
    assert [s.replica for s in group] == [i for i, _ in sizes]
    assert world == total
    ranks = [r for s in group for r in s.ranks]
    assert ranks == list(range(base, total))  # every rank once, none shared


def test_seats_refuse_an_empty_replica() -> None:
    with pytest.raises(ValueError, match="world size 0"):
        seats([(0, 0)])


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        ({"world_size": 1}, 1),
        ({"world_size": 8}, 8),
        ({"world_size": 0}, "outside"),
        ({"world_size": -2}, "outside"),
        ({"world_size": 1 << 20}, "outside"),
        ({"world_size": True}, "not an integer"),
        ({"world_size": 2.0}, "not an integer"),
        ({"world_size": "2"}, "not an integer"),
        ({}, "not an integer"),
        ([2], "not a JSON object"),
        (None, "not a JSON object"),
    ],
)
def test_parse_world_size(payload: Any, expected: int | str) -> None:
    if isinstance(expected, int):
        assert parse_world_size(payload) == expected
    else:
        with pytest.raises(ValueError, match=expected):
            parse_world_size(payload)


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        (None, True),
        ("v12", True),
        ("step 3", True),
        ("", False),
        ("x" * 129, False),
        ("a\nb", False),
        ("é", False),
        (3, False),
    ],
)
def test_check_version(value: Any, ok: bool) -> None:
    if ok:
        assert check_version(value) == value
    else:
        with pytest.raises(ValueError):
            check_version(value)


def _formed(n: int) -> tuple[WeightBook, dict[int, ReplicaWeights]]:
    book = WeightBook()
    members = {i: ReplicaWeights() for i in range(n)}
    group, total = seats([(i, 1) for i in range(n)])
    book.form(members, group, total, "10.0.0.1:29500")
    return book, members


def _sync(book: WeightBook, members: dict[int, ReplicaWeights], fail: dict[int, str]) -> list[int]:
    """One sync; ``fail`` maps a replica to the step that fails on it."""
    for step in ("start", "update", "finish"):
        for i, w in members.items():
            if w.seat is None:
                continue
            book.record(w, step, "boom" if fail.get(i) == step else None)
    return book.finish(members, book.next_label(None))


@pytest.mark.parametrize(
    ("fail", "serving", "stale_reason"),
    [
        ({}, [0, 1, 2], {}),
        ({1: "update"}, [0, 2], {1: "update_weights failed"}),
        ({1: "start"}, [0, 2], {1: "start_weight_update failed"}),
        ({2: "finish"}, [0, 1], {2: "finish_weight_update failed"}),
        ({0: "update", 1: "update", 2: "update"}, [], {0: "update_weights", 1: "update_w"}),
    ],
)
def test_a_sync_serves_only_replicas_that_completed_it(
    fail: dict[int, str], serving: list[int], stale_reason: dict[int, str]
) -> None:
    book, members = _formed(3)
    assert _sync(book, members, fail) == serving
    assert book.seq == (1 if serving else 0)
    for i, w in members.items():
        assert w.ok == (i in serving)
        if i in stale_reason:
            assert w.stale is not None and stale_reason[i] in w.stale
        if i in serving:
            assert (w.seq, w.version) == (1, "1")


def test_a_stale_replica_comes_back_with_a_whole_sync() -> None:
    book, members = _formed(2)
    _sync(book, members, {1: "update"})
    assert not members[1].ok
    _sync(book, members, {})
    assert members[1].ok and members[1].seq == 2 and book.header == "2"


def test_a_replica_that_missed_a_sync_is_stale_even_without_a_failure() -> None:
    book, members = _formed(2)
    members[1].seat = None  # e.g. not targeted: no seat
    _sync(book, members, {})
    assert members[0].ok and "fleet is at 1" in (members[1].stale or "")


def test_a_replica_lost_during_a_sync_does_not_count_as_completing_it() -> None:
    book, members = _formed(3)
    for step in ("start", "update", "finish"):
        for i in (1, 2):
            book.record(members[i], step)
    # The finish still waits on replica 0 when 1 is ejected (it may have restarted with its
    # launch weights): the finish that follows leaves it stale.
    book.lost(members[1], "ejected (connection refused)")
    book.record(members[0], "finish", "timeout")
    assert book.finish(members, book.next_label(None)) == [2]
    assert not members[1].ok and "may have restarted" in (members[1].stale or "")
    assert members[2].ok and book.seq == 1


def test_trainer_given_label_is_kept() -> None:
    book, members = _formed(1)
    for step in ("start", "update", "finish"):
        book.record(members[0], step)
    assert book.finish(members, book.next_label("policy-7")) == [0]
    assert book.header == "policy-7" and members[0].version == "policy-7"


def test_fleet_routes_only_current_weights_and_learns_restarts() -> None:
    fleet = Fleet(["http://a", "http://b"], eject_after=1)
    for r in fleet.replicas:
        r.status = Status.READY
    assert [r.index for r in fleet.eligible("")] == [0, 1]  # no group: nothing changes
    fleet.record_failure(1, "refused")  # before any group: weights are not a concern
    assert fleet.replicas[1].weights.ok
    fleet.replicas[1].status = Status.READY
    group, total = seats([(0, 1), (1, 1)])
    fleet.weights.form(fleet.weight_states(), group, total, None)
    assert [r.index for r in fleet.eligible("")] == [0, 1]
    fleet.record_failure(1, "connection refused")  # ejected: it may have restarted
    assert "may have restarted" in (fleet.replicas[1].weights.stale or "")
    fleet.replicas[1].status = Status.READY  # back and reconciled...
    assert [r.index for r in fleet.eligible("")] == [0]  # ...but not routed
    added = fleet.add("http://c")
    added.status = Status.READY
    assert added.weights.stale == NOT_IN_GROUP and added.weight_version is None
    assert [r.index for r in fleet.eligible("")] == [0]


def test_describe_and_seat_ranks() -> None:
    book, members = _formed(2)
    view = book.describe(members)
    assert view["group_formed"] is True and view["world_size"] == 3
    assert view["replicas"] == {
        "0": {"in_group": True, "ranks": [1, 1], "seq": 0, "version": None, "stale": None},
        "1": {"in_group": True, "ranks": [2, 2], "seq": 0, "version": None, "stale": None},
    }
    assert Seat(0, 3, 2).ranks == range(3, 5)


def test_one_failed_probe_in_a_group_distrusts_the_weights_before_any_ejection() -> None:
    # A replica can restart between two probes (launch weights, no seat) and answer the next
    # one: waiting for the ejection (eject_after failures) would route to it meanwhile.
    fleet = Fleet(["http://a", "http://b"], eject_after=2)
    for r in fleet.replicas:
        r.status = Status.READY
    group, total = seats([(0, 1), (1, 1)])
    fleet.weights.form(fleet.weight_states(), group, total, None)
    assert fleet.record_failure(1, "read timeout") is False  # not ejected yet
    assert fleet.replicas[1].status is Status.READY
    assert "may have restarted" in (fleet.replicas[1].weights.stale or "")
    assert [r.index for r in fleet.eligible("")] == [0]


def test_a_start_forgets_the_steps_of_an_abandoned_sync() -> None:
    # TRL stops a sync at its first failed step: what an abandoned sync applied must not count
    # toward the next sync's finish.
    book, members = _formed(1)
    for step in ("start", "update"):
        book.record(members[0], step)
    book.record(members[0], "start")
    book.record(members[0], "finish")
    assert book.finish(members, book.next_label(None)) == []
    assert "without a complete update" in (members[0].stale or "")
