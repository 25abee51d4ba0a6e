"""Fleet state: what each replica has and may do, and what the fleet should look like.

Pure bookkeeping, no I/O: the async edge reports what it observed; this module decides what
follows (eligible for traffic? needs reconciling? what to load/unload?).

Replica lifecycle::

    PENDING --probe ok--> RECONCILING --plan applied--> READY --probe/connect fails--> EJECTED
       ^                                                 |  ^                            |
       |                                                 |  +--------(reconciled)--------+
       |                                      drain -> DRAINING (in-flight finish; no new work)
    (added)                                   remove -> REMOVED (slot kept: indexes are stable)

Desired state (``desired_adapters``, ``desired_paused``) is what TRL last asked for; observed
state is what each replica is believed to hold, known (observed, or a successful apply) or
unknown (``paused is None``). Unknown is never read as a value: the plan re-applies what it
cannot confirm, once, then trusts the successful apply, so reconciliation terminates. Which
replica serves what: docs/reliability-publish.md; the control and fleet rules:
docs/reliability.md.
"""

from __future__ import annotations

import enum
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from proxy.core.weights import ReplicaWeights, WeightBook

# At most 18 digits: the name is a replica's or a client's word, and int() of a 5,000-digit
# version raises; no run publishes a quintillion versions, so a longer one is not TRL's name.
POLICY_ADAPTER = re.compile(r"trl-policy-v(\d{1,18})\Z")


class Status(enum.Enum):
    PENDING = "pending"  # never probed successfully
    RECONCILING = "reconciling"
    READY = "ready"
    EJECTED = "ejected"
    DRAINING = "draining"
    REMOVED = "removed"


# Replicas whose answers stand for the fleet in TRL's probes (/v1/models, /server_info): the ones
# serving (a draining replica still finishes requests). Control calls reach every member instead
# (Fleet.broadcast_targets), whatever its status.
SERVING = frozenset({Status.READY, Status.DRAINING})


@dataclass
class Replica:
    index: int
    url: str
    status: Status = Status.PENDING
    in_flight: int = 0
    adapters: dict[str, str] = field(default_factory=dict)  # confirmed loaded: name -> path
    # Believed pause state: None is unknown (never observed, /is_paused missing, or the replica
    # may have restarted since the last apply). ``paused_observed`` says whether the last
    # observation could read it at all (shown in /admin/fleet).
    paused: bool | None = None
    paused_observed: bool = False
    base_model: str | None = None
    max_model_len: int | None = None
    # Requests at the replica that this proxy did not send (other clients'), from the last
    # scrape: :func:`unaccounted_requests`. The router's load is ``in_flight + queue_depth``,
    # so each request at the replica counts once.
    queue_depth: float = 0.0
    block_size: int | None = None  # from vllm:cache_config_info / server_info
    hash_algo: str | None = None  # --prefix-caching-hash-algo, same sources
    failures: int = 0  # consecutive failed probes/connects
    last_error: str | None = None
    # Bumped before and after every call that changes the replica (control call or
    # reconciliation step): an observation that overlapped one is stale and discarded.
    generation: int = 0
    # Why the last reconciliation left it short of the desired state (None when it is not).
    not_reconciled: str | None = None
    # vLLM's prefix-cache counters (tokens queried, hit) at the last scrape, and the share hit
    # between the last two scrapes (None: unknown, e.g. no traffic or counters reset).
    cache_counters: tuple[float, float] | None = None
    hit_rate: float | None = None
    # Merged-weight sync: its seat in the weight-transfer group and the weights it holds
    # (proxy/core/weights.py). Only READY replicas whose ``weights.ok`` take traffic.
    weights: ReplicaWeights = field(default_factory=ReplicaWeights)

    @property
    def weight_version(self) -> str | None:
        """Label of the last merged-weight sync it completed (None: launch weights)."""
        return self.weights.version


@dataclass(frozen=True)
class ReconcilePlan:
    """What to send a replica so it matches the desired state."""

    load: dict[str, str]  # name -> path
    unload: list[str]
    pause: bool | None  # True: pause it, False: resume it, None: leave as is
    pause_query: str = ""
    pause_known: bool = True  # False: re-applied because the replica's pause state is unknown

    @property
    def empty(self) -> bool:
        return not self.load and not self.unload and self.pause is None

    def describe(self) -> str:
        """What is still to do, in words (every "not reconciled" line and fleet entry says it)."""
        parts = [f"load {name}" for name in sorted(self.load)]
        parts += [f"unload {name}" for name in self.unload]
        if self.pause is not None:
            why = "state unknown" if not self.pause_known else "differs"
            parts.append(f"{'pause' if self.pause else 'resume'} ({why})")
        return ", ".join(parts) or "nothing"


def unaccounted_requests(running: float, waiting: float, in_flight: int) -> float:
    """Requests a replica runs or queues (its scraped ``vllm:num_requests_running`` +
    ``vllm:num_requests_waiting``) beyond this proxy's own ``in_flight`` to it: other clients'.

    ``in_flight`` already counts the proxy's requests the replica queued, so adding the whole
    scrape would count them twice. Floored at 0: what the proxy sent but the scheduler has not
    seen yet (or still streams back) is in ``in_flight`` only. A request with ``n`` > 1 is ``n``
    requests to vLLM V1, so it reads as others'; TRL sends ``n: 1``."""
    extra = running + waiting - in_flight
    return extra if extra > 0.0 else 0.0


def adapter_version(name: str) -> int | None:
    """N of ``trl-policy-vN`` (the name TRL gives each published adapter), else None."""
    m = POLICY_ADAPTER.match(name)
    return int(m.group(1)) if m else None


class Fleet:
    def __init__(self, urls: Iterable[str], eject_after: int = 1) -> None:
        self.replicas: list[Replica] = [Replica(i, u) for i, u in enumerate(urls)]
        if not self.replicas:
            raise ValueError("a fleet needs at least one replica")
        self.eject_after = eject_after
        self.desired_adapters: dict[str, str] = {}
        self.desired_paused = False
        self.pause_query = ""  # query string of the last pause, re-applied on reconcile
        self.base_model: str | None = None
        # The smallest max_model_len any member reported (None before any did): the data path's
        # prompt limit reads it per request, so the only two changes that move it
        # (``record_models`` and ``remove``) update it at once instead.
        self.max_len_bound: int | None = None
        self.weights = WeightBook()

    # -- membership -------------------------------------------------------------------------

    def add(self, url: str) -> Replica:
        replica = Replica(len(self.replicas), url)
        self.weights.admit(replica.weights)
        self.replicas.append(replica)
        return replica

    def remove(self, index: int) -> None:
        """Take replica ``index`` out of the fleet for good (its index is never reused)."""
        self.replicas[index].status = Status.REMOVED
        self._update_max_len_bound()

    def _update_max_len_bound(self) -> None:
        known = [r.max_model_len for r in self.members() if r.max_model_len]
        self.max_len_bound = min(known) if known else None

    def get(self, index: int) -> Replica:
        if not 0 <= index < len(self.replicas) or self.replicas[index].status is Status.REMOVED:
            raise KeyError(index)
        return self.replicas[index]

    def weight_states(self) -> dict[int, ReplicaWeights]:
        """Each member's merged-weight state, by index (what proxy/core/weights.py works on)."""
        return {r.index: r.weights for r in self.members()}

    def members(self) -> list[Replica]:
        return [r for r in self.replicas if r.status is not Status.REMOVED]

    # A control call reaches every member, whatever the proxy's bookkeeping says about it.
    broadcast_targets = members

    def serving(self) -> list[Replica]:
        return [r for r in self.replicas if r.status in SERVING]

    # -- data plane -------------------------------------------------------------------------

    def is_base_model(self, model: str) -> bool:
        return model == "" or self.base_model is None or model == self.base_model

    def can_serve(self, replica: Replica, model: str) -> bool:
        """May ``replica`` take a new request for ``model``? The table: docs/reliability-publish.md.
        A RECONCILING replica serves an adapter it holds at the desired path, only with its pause
        state known and as desired (else a request could be held by a pause nobody lifts, or run
        while TRL has the fleet paused); the base model waits for READY: every replica has it, so
        only the whole plan says whether it is fit. Without the fleet's merged weights: nothing."""
        status = replica.status
        if replica.weights.stale is not None:
            return False  # it does not hold the fleet's merged weights (proxy/core/weights.py)
        if status is Status.READY:
            return self.is_base_model(model) or model in replica.adapters
        if status is not Status.RECONCILING or self.is_base_model(model):
            return False
        path = replica.adapters.get(model)
        return (
            path is not None
            and path == self.desired_adapters.get(model)
            and replica.failures == 0
            and replica.paused == self.desired_paused  # None (unknown) never equals it
        )

    def eligible(self, model: str) -> list[Replica]:
        """The replicas that may take a new request for ``model`` (:meth:`can_serve`)."""
        if self.is_base_model(model):
            # can_serve for the base model, in one pass: this runs for every routed request,
            # and a rollout of a merged-weights run always asks for the base model.
            return [
                r for r in self.replicas if r.status is Status.READY and r.weights.stale is None
            ]
        return [r for r in self.replicas if self.can_serve(r, model)]

    def serves_anything(self, replica: Replica) -> bool:
        """It may take a new request for some model: READY, or RECONCILING and eligible for an
        adapter it holds. Plain /health is 200 while one replica that answers does."""
        if replica.status is Status.READY:
            return replica.weights.stale is None
        return any(self.can_serve(replica, name) for name in replica.adapters)

    def in_desired_state(self, replica: Replica) -> bool:
        """READY with nothing left to apply (what strict /health asks of every replica)."""
        return replica.status is Status.READY and self.plan(replica).empty

    def awaited(self, model: str) -> bool:
        """No replica may serve ``model`` now, but one may soon: it is a desired adapter (its
        load is under way or being reconciled) and some member is not removed or draining. A
        rollout for it waits for the fleet to change rather than being refused at once."""
        if self.is_base_model(model) or model not in self.desired_adapters:
            return False
        if any(self.can_serve(r, model) for r in self.replicas):
            return False
        return any(r.status not in (Status.REMOVED, Status.DRAINING) for r in self.replicas)

    def waiting_for(self, replica: Replica) -> str | None:
        """What keeps ``replica`` from READY and in the desired state, in words (None: nothing).
        /health's body and ``python -m proxy status`` show it."""
        status = replica.status
        if status is Status.REMOVED:
            return None
        if status is Status.PENDING:
            return "a first successful probe"
        if status is Status.EJECTED:
            return f"its probes to succeed again (last error: {replica.last_error or 'unknown'})"
        if status is Status.DRAINING:
            return "undrain or removal (draining: no new requests)"
        plan = self.plan(replica)
        if status is Status.READY and plan.empty:
            return None
        if replica.not_reconciled:
            return replica.not_reconciled
        return plan.describe() if not plan.empty else "its reconciliation to finish"

    def known_anywhere(self, model: str) -> bool:
        return any(model in r.adapters for r in self.replicas) or model in self.desired_adapters

    def lora_path(self, model: str) -> str | None:
        return None if self.is_base_model(model) else self.desired_adapters.get(model)

    # -- observations -----------------------------------------------------------------------

    def record_failure(self, index: int, error: str) -> bool:
        """A probe or connection failed. Returns True if this ejected the replica."""
        replica = self.replicas[index]
        replica.failures += 1
        replica.last_error = error
        # In a weight-transfer group one failure is enough to distrust its weights: a replica
        # can restart (launch weights, no seat) between two probes, before it is ever ejected.
        self.weights.lost(replica.weights, f"unreachable ({error})")
        if replica.status in (Status.READY, Status.RECONCILING, Status.PENDING) and (
            replica.failures >= self.eject_after
        ):
            was_serving = replica.status is Status.READY
            replica.status = Status.EJECTED
            # It may restart before it is seen again: what it had applied is no longer known.
            replica.paused = None
            return was_serving
        return False

    def record_models(
        self,
        index: int,
        base_model: str | None,
        max_model_len: int | None,
        adapters: Mapping[str, str],
        paused: bool | None = None,
    ) -> None:
        """What a replica's /v1/models (and /is_paused, ``None`` when it could not be read) said.

        A READY replica that lost a desired adapter it had (it restarted between probes) leaves
        service until reconciled, and its pause state becomes unknown unless observed. One that
        merely lags the desired state (a broadcast is still being applied) keeps serving what it
        has: eligibility is per adapter, so nothing it lacks is routed to it."""
        replica = self.replicas[index]
        lost = [n for n in replica.adapters if n not in adapters and n in self.desired_adapters]
        replica.failures = 0
        replica.last_error = None
        replica.base_model = base_model
        replica.max_model_len = max_model_len
        self._update_max_len_bound()
        replica.adapters = dict(adapters)
        replica.paused_observed = paused is not None
        if paused is not None:
            replica.paused = paused
        elif lost:
            replica.paused = None
        if self.base_model is None and base_model is not None:
            self.base_model = base_model
        returning = replica.status in (Status.PENDING, Status.EJECTED)
        if returning or (replica.status is Status.READY and lost):
            replica.status = Status.RECONCILING

    def record_cache(self, index: int, queries: float, hits: float) -> None:
        """A scrape's cumulative prefix-cache counters: the recent hit rate is the share of
        tokens hit since the previous scrape. Counters that went down (a restart) or a hit
        count above the queries are no rate (unknown) until the next scrape."""
        replica = self.replicas[index]
        previous, replica.cache_counters = replica.cache_counters, (queries, hits)
        replica.hit_rate = None
        if previous is None:
            return
        asked, hit = queries - previous[0], hits - previous[1]
        if asked > 0 and 0 <= hit <= asked:
            replica.hit_rate = hit / asked

    def plan(self, replica: Replica) -> ReconcilePlan:
        load = {
            name: path
            for name, path in self.desired_adapters.items()
            if replica.adapters.get(name) != path
        }
        unload = [
            name for name in replica.adapters if name not in self.desired_adapters or name in load
        ]
        # An unknown pause state (None) is re-applied too.
        pause = None if replica.paused == self.desired_paused else self.desired_paused
        return ReconcilePlan(load, unload, pause, self.pause_query, replica.paused is not None)

    def mark_reconciled(self, index: int) -> None:
        replica = self.replicas[index]
        replica.not_reconciled = None
        if replica.status is Status.RECONCILING:
            replica.status = Status.READY

    # -- desired state ----------------------------------------------------------------------

    def adopt(
        self, observed: Mapping[int, Mapping[str, str]], paused: Mapping[int, bool | None]
    ) -> list[str]:
        """Rebuild the desired state from what replicas hold (proxy restart). Every adapter
        found on any replica becomes desired (TRL published it; a replica without it lost it),
        unless two replicas hold the same name at different paths: then the path on most
        replicas wins, and the conflict is returned for reporting."""
        votes: dict[str, Counter[str]] = {}
        for adapters in observed.values():
            for name, path in adapters.items():
                votes.setdefault(name, Counter())[path] += 1
        for name, paths in votes.items():
            self.desired_adapters[name] = paths.most_common(1)[0][0]
        # Paused only when every replica that gave a known answer is paused (no known answer:
        # not paused). A mixed fleet is a resume that reached only some replicas, and staying
        # paused wrongly would hold every rollout: docs/reliability.md (Start-up) says why.
        known = [p for p in paused.values() if p is not None]
        self.desired_paused = bool(known) and all(known)
        return [name for name, paths in votes.items() if len(paths) > 1]

    def latest_version(self, replica: Replica) -> int:
        versions = [v for v in map(adapter_version, replica.adapters) if v is not None]
        return max(versions, default=0)
