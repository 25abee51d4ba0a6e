"""Merged-weight sync bookkeeping: the weight-transfer group the replicas form with the trainer,
and which weights each replica holds. Pure: no I/O; the async edge is proxy/weight_sync.py.

vLLM ranks each worker ``rank_offset + dp_rank * world_size + rank`` in the trainer's group, so
N replicas form ONE group when the proxy reports the sum of their world sizes and gives replica
i the offset ``base + (sizes before it)`` (:func:`seats`). A replica serves only while it holds
the fleet's weights (``stale is None``); what makes it stale and what brings it back: the fault
table of docs/merged-weights.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# No vLLM deployment runs anywhere near this many workers per server; a larger answer is a
# broken or hostile replica, not a configuration (and would make ranks overflow NCCL's int).
MAX_WORLD_SIZE = 1 << 16
# A weight version is echoed in a response header on every completion: short printable ASCII.
MAX_VERSION_LEN = 128

# A sync's steps, in order, and the replica endpoint of each.
ENDPOINTS = {
    "start": "start_weight_update",
    "update": "update_weights",
    "finish": "finish_weight_update",
}


def parse_world_size(payload: object) -> int:
    """``n`` of a replica's ``{"world_size": n}``; ValueError (the reason) for anything else."""
    if not isinstance(payload, dict):
        raise ValueError("answer is not a JSON object")
    value = payload.get("world_size")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"'world_size' is not an integer ({value!r:.40})")
    if not 1 <= value <= MAX_WORLD_SIZE:
        raise ValueError(f"'world_size' {value} is outside 1..{MAX_WORLD_SIZE}")
    return value


def check_version(value: object) -> str | None:
    """A trainer-given ``weight_version``: None, or a short printable-ASCII string (it goes
    into a header). ValueError with the reason otherwise."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError("'weight_version' must be a string or null")
    if not value or len(value) > MAX_VERSION_LEN:
        raise ValueError(f"'weight_version' must have 1..{MAX_VERSION_LEN} characters")
    if not all(" " <= ch <= "~" for ch in value):
        raise ValueError("'weight_version' must be printable ASCII")
    return value


@dataclass(frozen=True)
class Seat:
    """A replica's place in the group: ranks ``rank_offset .. rank_offset + world_size - 1``."""

    replica: int
    rank_offset: int
    world_size: int

    @property
    def ranks(self) -> range:
        return range(self.rank_offset, self.rank_offset + self.world_size)


def seats(sizes: Iterable[tuple[int, int]], base_offset: int = 1) -> tuple[list[Seat], int]:
    """Seats for ``(replica, world_size)`` in the given order, and the group's total world size
    (``base_offset`` ranks before the replicas: TRL's trainer is rank 0, so 1)."""
    out: list[Seat] = []
    offset = base_offset
    for replica, size in sizes:
        if size < 1:
            raise ValueError(f"replica {replica}: world size {size} < 1")
        out.append(Seat(replica, offset, size))
        offset += size
    return out, offset


@dataclass
class ReplicaWeights:
    """One replica's weights as the proxy knows them (kept on ``fleet.Replica.weights``)."""

    seat: Seat | None = None
    seq: int = 0  # syncs completed whole under the current group (0: launch weights)
    version: str | None = None  # label of the last finish it applied (None: launch weights)
    stale: str | None = None  # why it must not serve (None: it holds the fleet's weights)
    steps: set[str] = field(default_factory=set)  # steps applied in the sync under way

    @property
    def ok(self) -> bool:
        return self.stale is None

    @property
    def header(self) -> str:
        """What its completions carry as X-Proxy-Weight-Version: the label of the weights it
        holds (printable ASCII), else the number of its syncs."""
        return label(self.version, self.seq)

    def as_dict(self) -> dict[str, object]:
        seat = self.seat
        return {
            "in_group": seat is not None,
            "ranks": [seat.ranks.start, seat.ranks.stop - 1] if seat else None,
            "seq": self.seq,
            "version": self.version,
            "stale": self.stale,
        }


def label(version: str | None, seq: int) -> str:
    """A weight version as headers and /health show it: the trainer's label, else the number of
    completed syncs."""
    return version if version is not None else str(seq)


NOT_IN_GROUP = (
    "not in the weight-transfer group (added or unreachable when it was formed; it serves "
    "again once the trainer forms a new group)"
)


class WeightBook:
    """The group and the fleet's current weights. Replicas' own state lives on each replica."""

    def __init__(self) -> None:
        self.active = False  # a group was formed: routing requires current weights
        self.world_size = 0
        self.master: str | None = None  # trainer's address:port, for operators
        self.seq = 0
        self.version: str | None = None
        self.sizes: list[tuple[int, int]] | None = None  # last /get_world_size answers

    # -- labels ------------------------------------------------------------------------------

    @property
    def header(self) -> str:
        """What completions carry as X-Proxy-Weight-Version."""
        return label(self.version, self.seq)

    def next_label(self, given: str | None) -> str:
        """The version label a finish applies: the trainer's, else the sync's number."""
        return given if given is not None else str(self.seq + 1)

    # -- transitions -------------------------------------------------------------------------

    def form(
        self,
        members: Mapping[int, ReplicaWeights],
        group: Iterable[Seat],
        world_size: int,
        master: str | None,
    ) -> None:
        """Every replica in ``group`` initialised its side: a new group with launch weights.
        Members without a seat cannot serve until the next group."""
        seated = {s.replica: s for s in group}
        self.active = True
        self.world_size = world_size
        self.master = master
        self.seq = 0
        self.version = None
        for index, w in members.items():
            w.seat = seated.get(index)
            w.seq = 0
            w.version = None
            w.steps = set()
            w.stale = None if w.seat is not None else NOT_IN_GROUP

    def record(self, w: ReplicaWeights, step: str, failure: str | None = None) -> None:
        """A seated replica's outcome of ``step`` (``failure``: why it did not apply it). A
        start begins a new sync: the steps applied in an earlier one no longer count."""
        if step == "start":
            w.steps = set()
        if failure is None:
            w.steps.add(step)
        else:
            w.steps.discard(step)
            w.stale = f"{ENDPOINTS[step]} failed: {failure}"

    def finish(self, members: Mapping[int, ReplicaWeights], label: str) -> list[int]:
        """Apply a finish: replicas that applied start, update and finish of this sync hold
        the new weights (returned); the fleet moves to them when there is at least one. Every
        other replica is stale from then on (its reason kept if it already had one)."""
        whole = [i for i, w in members.items() if w.seat is not None and set(ENDPOINTS) <= w.steps]
        if not whole:
            for w in members.values():
                if w.seat is not None and "finish" in w.steps and w.stale is None:
                    w.stale = "finish_weight_update without a complete update: weights unknown"
            return []
        self.seq += 1
        self.version = label
        for i, w in members.items():
            if i in whole:
                w.seq, w.version, w.stale = self.seq, label, None
            elif w.stale is None:
                w.stale = (
                    f"holds weights {w.version or 'as launched'} (seq {w.seq}); the fleet is at "
                    f"{label} (seq {self.seq})"
                )
            w.steps = set()
        return whole

    def lost(self, w: ReplicaWeights, reason: str) -> None:
        """The replica failed a probe or a connection: it may have restarted with its launch
        weights and without its seat. Stale until it completes a sync whole: the steps it applied in
        the sync under way no longer count (a restart during a finish that waits on another
        replica undoes them, and that finish must not make it current again)."""
        if self.active and w.seat is not None:
            w.stale = f"{reason}; it may have restarted: weights unknown until it completes a sync"
            w.steps = set()

    def admit(self, w: ReplicaWeights) -> None:
        """A replica joins the fleet: without a seat in a formed group it cannot serve."""
        if self.active:
            w.seat = None
            w.stale = NOT_IN_GROUP

    def describe(self, members: Mapping[int, ReplicaWeights]) -> dict[str, object]:
        return {
            "group_formed": self.active,
            "world_size": self.world_size,
            "trainer": self.master,
            "seq": self.seq,
            "version": self.header if self.active else None,
            "replicas": {str(i): w.as_dict() for i, w in sorted(members.items())},
        }
