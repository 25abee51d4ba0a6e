"""One simulated training run: the real proxy, simulated replicas, a TRL-shaped trainer, a seeded
fault schedule, and the invariants checked after every step.

Invariants (README, "Reliability"):

* I1 no completion reaches a replica that lacks its adapter (checked by the replica itself);
* I2 every TRL control call is answered 200 whenever at least one replica applied it;
* I3 a replica that stays healthy reaches the desired state (and READY) within 3 probe rounds;
* I4 the proxy's own code never answers 500, and its 502/503/504 name a replica and a reason;
* I5 no task, connection or file descriptor is left at the end;
* I6 publish means served: after a 200 on a load of X, every rollout of X sent before the next
  unload of X is served, or fails only because no replica holding X stayed alive through it
  (a replica counts once it has been alive for ``I6_GRACE_S``: the proxy has seen it by then).

Merged mode (``mode="merged"``): the trainer syncs merged weights through the weight-transfer
routes instead of loading adapters (TRL 1.16's sequence: /get_world_size and
/init_weight_transfer_engine once, then per sync pause, start, update, finish, resume), with
faults of its own (an update that fails or hangs, a replica added at run time) on top of the
restarts. Its invariants:

* I7 no stale weights after a successful finish: a completion sent and answered while the
  fleet's last successfully finished version is k (no finish between) is answered by a replica
  that holds k, and its X-Proxy-Weight-Version names k's label;
* I8 no weight-transfer call, pause or resume takes longer than PROXY_CONTROL_TIMEOUT_S;
* I9 no weight-transfer route answers 404.

Everything random is drawn from one ``random.Random(seed)``, and time is virtual
(``sim.loop``), so a seed replays exactly.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from proxy.core.fleet import Status
from proxy.settings import Settings
from sim.proxy_adapter import Answer, ProxyUnderTest
from sim.replica import BASE_MODEL, SimReplica, SimTransport

# Simulated settings: the shipped defaults where they matter for the rules under test, a few
# shortened so a run covers many syncs (each virtual second costs the same as a real one would
# not, but fewer events make more seeds per second).
HEALTH_INTERVAL_S = 2.0
PROBE_TIMEOUT_S = 2.0
SETTINGS: dict[str, Any] = {
    "health_interval_s": HEALTH_INTERVAL_S,
    "probe_timeout_s": PROBE_TIMEOUT_S,
    "connect_timeout_s": 3.0,
    "control_timeout_s": 10.0,
    "upstream_timeout_s": 15.0,  # a wedged replica holds a rollout this long, not a minute
    "lora_retry_s": 1.0,
    "lora_load_timeout_s": 30.0,
    "eject_after": 2,
    "scrape_vllm_metrics": True,
    # No TLS between in-process peers; building a verifying SSL context (certifi's bundle) for
    # every simulated proxy start cost more than the rest of a seed.
    "upstream_insecure": True,
}
RUN_S = 45.0  # virtual seconds of training per seed (6-8 weight syncs)
MAX_STALENESS = 4  # TRL's default: adapter v(N-5) is unloaded after vN is published
FAULT_KINDS = (
    "crash",
    "restart_empty",
    "wedge",
    "slow",
    "5xx",
    "mount_lag",
    "missing_endpoints",
    "probe_timeout",
    "partition",
    "proxy_restart",
    "restart_all",  # every replica at once, their mount lagging on reload (the reported run)
)
# Merged mode: no adapters (so no mount lag), and the weight transfer's own faults.
MERGED_FAULT_KINDS = (
    *(kind for kind in FAULT_KINDS if kind != "mount_lag"),
    "update_fail",  # /update_weights answers 500 (the transfer broke on that replica)
    "update_hang",  # /update_weights never answers (the transfer stalled)
    "add_replica",  # POST /admin/replicas after the group was formed
)
# World sizes a replica may have (TP x PP x DP workers), drawn per replica in merged mode.
WORLD_SIZES = (1, 1, 2, 4)
FINISH_SERVING = re.compile(r"\(replicas \[([\d, ]*)\] serve weight version ([^)]*)\)")
# A replica counts as healthy for I3 once this long has passed since its last fault and since
# the desired state last changed: 3 probe rounds, plus one probe budget for the round in flight.
I3_WINDOW_S = 3 * HEALTH_INTERVAL_S + PROBE_TIMEOUT_S
TIMED_OUT = re.compile(r"replica (\d+) timed out")
# A replica alive this long has been probed and observed since its fault ended: two probe
# rounds plus one probe budget.
I6_GRACE_S = 2 * HEALTH_INTERVAL_S + PROBE_TIMEOUT_S


@dataclass
class Fault:
    at: float
    kind: str
    replica: int
    duration: float
    detail: str = ""

    def describe(self) -> str:
        who = {
            "proxy_restart": "proxy",
            "restart_all": "every replica",
            "add_replica": "a new replica",
        }.get(self.kind, f"replica {self.replica}")
        extra = f" ({self.detail})" if self.detail else ""
        return f"t={self.at:6.2f}s {self.kind:<17} {who} for {self.duration:.2f}s{extra}"


def draw_schedule(
    rng: random.Random, replicas: int, kinds: tuple[str, ...] = FAULT_KINDS
) -> list[Fault]:
    faults: list[Fault] = []
    for _ in range(rng.randint(2, 5)):
        kind = rng.choice(kinds)
        at = round(rng.uniform(3.0, RUN_S - 18.0), 2)
        replica = rng.randrange(replicas)
        # A restart takes vLLM tens of seconds; at least three probe rounds here, so that the
        # proxy has seen it down (eject_after=2) before it comes back empty.
        duration = round(rng.uniform(3 * HEALTH_INTERVAL_S + 0.5, 14.0), 2)
        detail = ""
        if kind == "slow":
            detail = f"{rng.choice((0.05, 0.3, 1.0)):g}s per answer"
        elif kind == "mount_lag":
            detail = f"adapters readable {rng.choice((2.5, 6.0, 40.0)):g}s late"
        elif kind == "missing_endpoints":
            detail = ",".join(
                sorted(rng.sample(["/is_paused", "/metrics", "/server_info"], rng.randint(1, 3)))
            )
            duration = RUN_S
        elif kind == "proxy_restart":
            duration = 0.5
        elif kind == "add_replica":
            duration = 0.0
        elif kind == "restart_all":
            detail = f"{rng.choice((3, 6, 10))} load attempts 404 per adapter"
        faults.append(Fault(at, kind, replica, duration, detail))
    return sorted(faults, key=lambda f: f.at)


@dataclass
class Violation:
    at: float
    invariant: str
    message: str


@dataclass
class Result:
    seed: int
    schedule: list[Fault]
    violations: list[Violation] = field(default_factory=list)
    control_calls: int = 0
    control_refused: int = 0
    completions: int = 0
    completions_failed: int = 0
    syncs: int = 0
    weight_calls: int = 0  # merged mode: weight-transfer calls the trainer made
    weight_refused: int = 0  # ... and how many were answered with an error
    weights_checked: int = 0  # completions whose serving replica's weights I7 checked
    # Completions a replica with other weights served while no check applied: after a proxy
    # restart (it keeps no weight state) and before the next group's first finish.
    stale_unchecked: int = 0
    persist: bool = False  # merged mode: the trainer carries on to finish after a failed step


class World:
    def __init__(
        self,
        seed: int,
        replicas: int = 3,
        mutate: Callable[[World], None] | None = None,
        mode: str = "adapter",
    ) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.loop = asyncio.get_running_loop()
        self.replicas = [SimReplica(i, self) for i in range(replicas)]
        self.transport = SimTransport(self.replicas)
        settings = Settings(
            replicas=[f"http://replica{r.index}.sim:{r.port}" for r in self.replicas], **SETTINGS
        )
        self.proxy = ProxyUnderTest(settings, self.transport)
        self.mode = mode
        kinds = MERGED_FAULT_KINDS if mode == "merged" else FAULT_KINDS
        self.schedule = draw_schedule(self.rng, replicas, kinds)
        self.result = Result(seed, self.schedule)
        self.mutate = mutate
        self.healthy_since = [0.0] * replicas  # when each replica's last fault ended
        # The same, for faults that stop a replica serving (a lagging mount does not): I6.
        self.alive_since = [0.0] * replicas
        self.published: dict[str, float] = {}  # adapter -> when its load was answered 200
        self.unloading: dict[str, float] = {}  # adapter -> when its last unload call began
        self.pauses = self.resumes = 0  # trainer pauses begun, and how many a resume lifted
        self.desired_changed_at = 0.0
        self.control_busy = False
        self.proxy_down = False
        self.version = 0  # the last adapter version the trainer published
        self.serving_version = 0  # the one rollouts use: published and loaded
        self._forever: list[asyncio.Future[None]] = []
        self._restarts: list[asyncio.Future[None]] = []
        self._one_proxy = asyncio.Lock()  # restarts scheduled close together run one by one
        self._stopping = False
        # Merged mode (drawn only there, so the adapter mode's seeds replay as before).
        self.group_formed = False
        self.epoch = 0  # groups formed so far
        # Finish calls begun so far, and whether one is in flight: a completion whose sending or
        # answer falls within one is not checked (replicas switch weights before the proxy hears
        # of it, and the simulated pause holds only requests that arrive while paused).
        self.finish_calls = 0
        self.finishing = False
        self.reference: int | None = None  # the version of the last successful finish ...
        self.reference_label: str | None = None  # ... and its label; None: nothing to check
        self.last_finished = 0  # the trainer's last successfully finished version, kept
        self.persist = False  # carry on to finish after a failed step (TRL stops at the first)
        if mode == "merged":
            for r in self.replicas:
                r.world_size = self.rng.choice(WORLD_SIZES)
            self.persist = self.result.persist = self.rng.random() < 0.5

    # -- helpers used by the replicas ---------------------------------------------------------

    def now(self) -> float:
        return self.loop.time()

    def violation(self, invariant: str, message: str) -> None:
        self.result.violations.append(Violation(self.now(), invariant, message))

    def rng_completion_s(self) -> float:
        return self.rng.uniform(0.5, 3.0)

    def rng_transfer_s(self) -> float:
        return self.rng.uniform(0.2, 2.0)

    async def forever(self) -> None:
        """Hang until cancelled (a wedged replica; callers always have a timeout)."""
        future: asyncio.Future[None] = self.loop.create_future()
        self._forever.append(future)
        try:
            await future
        finally:
            self._forever.remove(future)

    # -- faults ---------------------------------------------------------------------------------

    async def _inject(self, fault: Fault) -> None:
        await asyncio.sleep(max(0.0, fault.at - self.now()))
        if self._stopping:
            return
        if fault.kind == "proxy_restart":
            # Shielded: the end of the run waits for a restart under way rather than cutting it
            # in half (a half-started proxy would leak its tasks and be reported as I5).
            restart = asyncio.ensure_future(self._restart_proxy(fault.duration))
            self._restarts.append(restart)
            await asyncio.shield(restart)
            return
        if fault.kind == "restart_all":
            await self._restart_all(fault)
            return
        if fault.kind == "add_replica":
            await self._add_replica()
            return
        replica = self.replicas[fault.replica]
        f = replica.faults
        undo: Callable[[], None]
        if fault.kind in ("crash", "restart_empty"):
            replica.crash()
            undo = replica.restart
        elif fault.kind == "wedge":
            f.wedged = True
            undo = lambda: setattr(f, "wedged", False)  # noqa: E731
        elif fault.kind == "slow":
            f.slow_s = float(fault.detail.split("s")[0])
            undo = lambda: setattr(f, "slow_s", 0.0)  # noqa: E731
        elif fault.kind == "5xx":
            f.errors_5xx = True
            undo = lambda: setattr(f, "errors_5xx", False)  # noqa: E731
        elif fault.kind == "mount_lag":
            f.mount_lag_s = float(fault.detail.split()[2].rstrip("s"))
            undo = lambda: setattr(f, "mount_lag_s", 0.0)  # noqa: E731
        elif fault.kind == "missing_endpoints":
            f.missing |= set(fault.detail.split(","))
            undo = lambda: None  # noqa: E731
        elif fault.kind == "probe_timeout":
            f.probe_hang = True
            undo = lambda: setattr(f, "probe_hang", False)  # noqa: E731
        elif fault.kind == "update_fail":
            f.update_fails = True
            undo = lambda: setattr(f, "update_fails", False)  # noqa: E731
        elif fault.kind == "update_hang":
            f.update_hangs = True
            undo = lambda: setattr(f, "update_hangs", False)  # noqa: E731
        else:  # partition
            f.partitioned = True
            undo = lambda: setattr(f, "partitioned", False)  # noqa: E731
        if fault.kind in ("update_fail", "update_hang"):  # probes and serving are unaffected
            await asyncio.sleep(fault.duration)
            undo()
            return
        if fault.kind in ("wedge", "slow", "5xx", "partition"):
            replica.disruptions += 1
        if fault.kind != "missing_endpoints":  # a permanent trait, not a fault: I3 must hold
            self.healthy_since[fault.replica] = float("inf")
        if fault.kind not in ("missing_endpoints", "mount_lag"):
            self.alive_since[fault.replica] = float("inf")
        await asyncio.sleep(fault.duration)
        undo()
        self.healthy_since[fault.replica] = self.now()
        if fault.kind != "mount_lag":
            self.alive_since[fault.replica] = self.now()

    async def _restart_all(self, fault: Fault) -> None:
        """Every replica crashes at once and comes back with a mount that answers "No adapter
        found" to the first N loads of each adapter. The reconciler tries each missing adapter
        once per probe round, so the mount is treated as caught up (I3) after N rounds."""
        attempts = int(fault.detail.split()[0])
        for r in self.replicas:
            r.lag_after_restart(attempts)
            self.healthy_since[r.index] = self.alive_since[r.index] = float("inf")
        await asyncio.sleep(fault.duration)
        now = self.now()
        for r in self.replicas:
            r.restart()
            r.lag_until = now + attempts * HEALTH_INTERVAL_S + PROBE_TIMEOUT_S
            self.healthy_since[r.index] = self.alive_since[r.index] = now

    async def _add_replica(self) -> None:
        """POST /admin/replicas with a fresh replica (launch weights, no seat). The operator also
        lists it in PROXY_REPLICAS, so a proxy restart keeps it at the same index."""
        while self.proxy_down or self.control_busy:  # noqa: ASYNC110 - virtual clock
            await asyncio.sleep(0.1)
        replica = SimReplica(len(self.replicas), self)
        replica.world_size = self.rng.choice(WORLD_SIZES)
        self.replicas.append(replica)
        self.transport.by_port[replica.port] = replica
        self.healthy_since.append(self.now())
        self.alive_since.append(self.now())
        url = f"http://replica{replica.index}.sim:{replica.port}"
        settings = self.proxy.settings
        self.proxy.settings = settings.model_copy(update={"replicas": [*settings.replicas, url]})
        self.control_busy = True
        try:
            answer = await self.proxy.add_replica(url)
        finally:
            self.control_busy = False
        self._check_answer("add replica", answer)
        if answer.status != 201:
            self.violation("I2", f"adding replica {replica.index} answered {answer.status}")

    def _unhealthy(self, replica: SimReplica) -> bool:
        f = replica.faults
        return (
            f.down
            or f.wedged
            or f.partitioned
            or f.errors_5xx
            or f.probe_hang
            or f.slow_s >= PROBE_TIMEOUT_S / 2
            or replica.mount_lags(self.now())
        )

    async def _restart_proxy(self, down_s: float) -> None:
        async with self._one_proxy:
            await self._restart_proxy_once(down_s)

    async def _restart_proxy_once(self, down_s: float) -> None:
        while self.control_busy:  # noqa: ASYNC110 - polled on the virtual clock, costs nothing
            await asyncio.sleep(0.1)  # (TRL's own process survives; restarts fall between calls)
        self.proxy_down = True
        await self.proxy.stop()
        if self.mode == "merged":
            # The proxy keeps no weight state across a restart: it routes to every replica until
            # the trainer forms a new group (its next step answers 409) and finishes a sync in it.
            self.reference = self.reference_label = None
        await asyncio.sleep(down_s)
        await self.proxy.start()
        if self.mutate is not None:
            self.mutate(self)
        self.proxy_down = False
        self.desired_changed_at = self.now()

    # -- the trainer ------------------------------------------------------------------------------

    def _able(self, replica: SimReplica, endpoint: str, path: str) -> bool:
        """Can this replica apply a control call right now (reachable, answering, its mount
        showing the adapter well before the load deadline)?"""
        f = replica.faults
        if f.down or f.wedged or f.partitioned or f.errors_5xx or f.slow_s >= PROBE_TIMEOUT_S / 2:
            return False
        if endpoint == "load":
            budget = float(SETTINGS["lora_load_timeout_s"]) - 2 * float(SETTINGS["lora_retry_s"])
            return replica.readable_at.get(path, float("inf")) <= self.now() + budget
        return True

    def _holds(self, replica: SimReplica, endpoint: str, body: dict[str, Any]) -> bool:
        name = str(body.get("lora_name", ""))
        if endpoint == "load":
            return replica.adapters.get(name) == body.get("lora_path")
        if endpoint == "unload":
            return name not in replica.adapters
        if endpoint == "pause":
            return replica.paused
        return not replica.paused

    async def _control(self, endpoint: str, raw: bytes = b"", query: str = "") -> Answer:
        while self.proxy_down:  # noqa: ASYNC110 - a restarting proxy refuses connections and
            await asyncio.sleep(0.1)  # TRL would crash, so restarts fall between calls (above)
        self.control_busy = True
        body = json.loads(raw) if raw else {}
        name = body.get("lora_name", "")
        started = self.now()
        path = body.get("lora_path", "")
        able_before = {
            r.index: (r.incarnation, r.disruptions)
            for r in self.replicas
            if self._able(r, endpoint, path)
        }
        answer = await self.proxy.control(endpoint, raw, query)
        self.control_busy = False
        self.desired_changed_at = self.now()
        self.result.control_calls += 1
        # Able throughout the call: at its start and its end, with no restart and no disabling
        # fault in between (seed 2840: a replica wedged mid-load and recovered just before the
        # load's answer; the proxy rightly ejected it and answered 200).
        able = [
            r
            for r in self.replicas
            if able_before.get(r.index) == (r.incarnation, r.disruptions)
            and self._able(r, endpoint, path)
        ]
        what = f"{endpoint} {name} at {started:.2f}s"
        self._check_answer(what, answer)
        if self.mode == "merged":
            self._check_bounded(what, started)
        if answer.status != 200 and not (endpoint == "unload" and answer.status == 404):
            self.result.control_refused += 1
            if able:
                self.violation(
                    "I2",
                    f"{what} answered {answer.status} although replicas "
                    f"{[r.index for r in able]} could apply it: {answer.message[:300]}",
                )
        elif answer.status == 200:
            missed = [r.index for r in able if not self._holds(r, endpoint, body)]
            if missed:
                self.violation(
                    "I2",
                    f"{what} answered 200 but never reached replicas {missed} (able to apply it)",
                )
        return answer

    def _check_answer(self, what: str, answer: Answer) -> None:
        if answer.relayed or answer.status == 0:
            return  # a replica's own answer, or a connection a proxy restart dropped
        if answer.status == 500:
            self.violation("I4", f"{what}: the proxy answered 500: {answer.message[:300]}")
        elif answer.status in (502, 503, 504) and (
            "replica" not in answer.message or len(answer.message) < 20
        ):
            self.violation(
                "I4", f"{what}: {answer.status} names no replica/reason: {answer.message!r}"
            )

    async def _sync_loop(self) -> None:
        while self.now() < RUN_S - 12.0:
            await asyncio.sleep(self.rng.uniform(3.0, 7.0))
            self.version += 1
            v = self.version
            path = f"/adapters/trl-policy-v{v}"
            self.pauses += 1  # the trainer holds rollouts itself until it resumes (I6)
            await self._control("pause", query="mode=keep")
            for r in self.replicas:  # the trainer saves and renames the adapter meanwhile
                r.publish(path, self.now())
            await asyncio.sleep(self.rng.uniform(0.2, 3.0))
            body = {"lora_name": f"trl-policy-v{v}", "lora_path": path, "load_inplace": False}
            loaded = await self._control("load", json.dumps(body).encode())
            if loaded.status == 200:
                self.serving_version = v
                self.published[f"trl-policy-v{v}"] = self.now()
            resumed = await self._control("resume")
            if resumed.status == 200:
                self.resumes = self.pauses
            old = v - MAX_STALENESS - 1
            if old >= 1:
                self.unloading[f"trl-policy-v{old}"] = self.now()
                await self._control(
                    "unload", json.dumps({"lora_name": f"trl-policy-v{old}"}).encode()
                )
            self.result.syncs += 1

    # -- the trainer, merged mode -------------------------------------------------------------

    async def _weight_call(self, endpoint: str, body: dict[str, Any] | None = None) -> Answer:
        while self.proxy_down:  # noqa: ASYNC110 - restarts fall between calls (as _control)
            await asyncio.sleep(0.1)
        self.control_busy = True
        raw = json.dumps(body).encode() if body is not None else b""
        started = self.now()
        try:
            answer = await self.proxy.weights(endpoint, raw)
        finally:
            self.control_busy = False
        self.desired_changed_at = self.now()
        self.result.weight_calls += 1
        what = f"{endpoint} at {started:.2f}s"
        self._check_bounded(what, started)
        if answer.status == 404:
            self.violation("I9", f"{what} answered 404: {answer.message[:300]}")
        self._check_answer(what, answer)
        if answer.status != 200:
            self.result.weight_refused += 1
        return answer

    def _check_bounded(self, what: str, started: float) -> None:
        took, limit = self.now() - started, float(SETTINGS["control_timeout_s"])
        if took > limit + 1e-6:
            self.violation("I8", f"{what} took {took:.2f}s, past PROXY_CONTROL_TIMEOUT_S={limit:g}")

    async def _form_group(self) -> bool:
        """TRL's init_communicator: ask the world size, then init with rank_offset 1."""
        sized = await self._weight_call("get_world_size")
        if sized.status != 200:
            return False
        info = {
            "master_address": "10.0.0.1",
            "master_port": 51216,
            "rank_offset": 1,
            "world_size": int(sized.body["world_size"]) + 1,
        }
        formed = await self._weight_call("init", {"init_info": info})
        if formed.status != 200:
            return False
        self.group_formed = True
        self.epoch += 1
        self.reference = self.reference_label = None  # nothing finished in this group yet
        return True

    async def _merged_sync_loop(self) -> None:
        while self.now() < RUN_S - 12.0:
            await asyncio.sleep(self.rng.uniform(3.0, 7.0))
            # A trainer whose group broke (a step answered 409 or "not initialized") stops; the
            # run that replaces it forms a new group first.
            if not self.group_formed and not await self._form_group():
                continue
            self.version += 1
            v = self.version
            self.pauses += 1
            await self._control("pause", query="mode=keep")
            update_info = {
                "names": ["model.embed_tokens.weight"],
                "dtype_names": ["bfloat16"],
                "shapes": [[32, 8]],
                "packed": False,
                "sim_version": v,
            }
            answers = [await self._weight_call("start", {})]
            if answers[-1].status == 200 or self.persist:
                answers.append(await self._weight_call("update", {"update_info": update_info}))
            if answers[-1].status == 200 or self.persist:
                self.finish_calls += 1
                self.finishing = True
                try:
                    finished = await self._weight_call("finish", {})
                finally:
                    self.finishing = False
                answers.append(finished)
                self._finished(v, finished)
            resumed = await self._control("resume")
            if resumed.status == 200:
                self.resumes = self.pauses
            if any(a.status == 409 or "not initialized" in a.message for a in answers):
                self.group_formed = False
            self.result.syncs += 1

    def _finished(self, version: int, answer: Answer) -> None:
        """The fleet moves to ``version`` on a finish answered 200, or refused with the replicas
        that completed the sync whole named (they serve it; the others are stale)."""
        label: str | None = None
        if answer.status == 200 and isinstance(answer.body, dict):
            label = answer.body.get("weight_version")
        else:
            serving = FINISH_SERVING.search(answer.message)
            if serving is not None and serving.group(1).strip():
                label = serving.group(2)
        if label is None:
            return
        self.reference, self.reference_label = version, label
        self.last_finished = version

    def _weights_moment(self) -> tuple[int, int] | None:
        """What a completion's I7 check compares between its sending and its answer (None: a
        finish is in flight)."""
        return None if self.finishing else (self.epoch, self.finish_calls)

    def _check_weights(self, answer: Answer, sent: tuple[int, int] | None) -> None:
        """I7 on a completion answered 200 (merged mode)."""
        index = int(answer.headers.get("x-proxy-replica", "-1"))
        if not 0 <= index < len(self.replicas):
            self.violation("I7", f"completion answered without a known replica ({index})")
            return
        replica = self.replicas[index]
        if sent is None or sent != self._weights_moment():
            return  # a finish was under way while it ran: replicas may hold either weights
        if self.reference is None:
            if self.last_finished and replica.weights != self.last_finished:
                self.result.stale_unchecked += 1
            return
        self.result.weights_checked += 1
        header = answer.headers.get("x-proxy-weight-version")
        if replica.weights != self.reference:
            self.violation(
                "I7",
                f"completion served by replica {index} holding weights v{replica.weights} after "
                f"the fleet finished v{self.reference} (header {header!r})",
            )
        elif header != self.reference_label or replica.weights_label != header:
            self.violation(
                "I7",
                f"completion from replica {index}: X-Proxy-Weight-Version {header!r}, the "
                f"replica's label {replica.weights_label!r}, the fleet's {self.reference_label!r}",
            )

    async def _rollouts(self, worker: int) -> None:
        rng = random.Random(self.rng.random())
        while self.now() < RUN_S - 5.0:
            # Asynchronous GRPO: a rollout worker may still be on a policy a version or two
            # behind (never past max_staleness, whose adapters are still loaded everywhere).
            v = self.serving_version - rng.choice((0, 0, 1, 2))
            v = v if v > max(0, self.serving_version - MAX_STALENESS) else self.serving_version
            model = f"trl-policy-v{v}" if v else BASE_MODEL
            prompt = [rng.randrange(50_000) for _ in range(rng.randint(20, 80))]
            for _turn in range(rng.choice((1, 1, 2, 3))):  # multi-turn: prompt grows each turn
                group = [self._complete(model, prompt, rng.getrandbits(62)) for _ in range(2)]
                answers = await asyncio.gather(*group)
                tokens = next((a for a in answers if a), None)
                if tokens is None:
                    break
                prompt = prompt + tokens + [rng.randrange(50_000) for _ in range(8)]

    async def _complete(self, model: str, prompt: list[int], seed: int) -> list[int] | None:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": 8,
            "return_token_ids": True,
            "logprobs": 0,
            "seed": seed,
        }
        for _attempt in range(6):  # TRL retries failed rollouts (about 90 times over minutes)
            if self.proxy_down:
                await asyncio.sleep(0.5)
                continue
            sent_at = self.now()
            alive = self._living_holders(model, sent_at)
            faults_before = list(self.alive_since)
            pauses = self.pauses if self.pauses == self.resumes else -1
            weights_sent = self._weights_moment()
            answer = await self.proxy.complete(body, f"sim-{seed}")
            if self.mode == "merged" and answer.status == 200:
                self._check_weights(answer, weights_sent)
            self.result.completions += 1
            self._check_answer(f"completion {model}", answer)
            if pauses == self.pauses:  # not held by a pause of the trainer's own at any point
                self._check_published_served(model, sent_at, alive, answer, faults_before)
            if answer.status == 200:
                choices = answer.body.get("choices") if isinstance(answer.body, dict) else None
                if isinstance(choices, list) and choices:
                    return list(choices[0].get("token_ids") or [])
                return []
            self.result.completions_failed += 1
            await asyncio.sleep(1.0)
            if answer.status == 404:
                return None  # an adapter past staleness: TRL drops the sample
        return None

    async def _probes(self) -> None:
        while self.now() < RUN_S - 5.0:
            await asyncio.sleep(self.rng.uniform(2.0, 6.0))
            if self.proxy_down:
                continue
            endpoint = self.rng.choice(
                ("health", "server_info", "server_info_text", "models", "is_paused")
            )
            answer = await self.proxy.probe(endpoint)
            self._check_answer(f"probe {endpoint}", answer)

    # -- invariants -------------------------------------------------------------------------

    def _living_holders(self, model: str, at: float) -> dict[int, int]:
        """Replicas holding ``model`` now, alive for I6_GRACE_S: index -> incarnation."""
        return {
            r.index: r.incarnation
            for r in self.replicas
            if model in r.adapters and self.alive_since[r.index] <= at - I6_GRACE_S
        }

    def _check_published_served(
        self,
        model: str,
        sent_at: float,
        alive: dict[int, int],
        answer: Answer,
        faults_before: list[float],
    ) -> None:
        """I6: a rollout of a published adapter fails only if no replica holding it stayed
        alive (same process, no fault begun) from its sending to its answer. One exception,
        the data plane's documented rule: a completion that timed out on a replica that had a
        fault meanwhile is not re-sent (that would double an already long wait)."""
        published = self.published.get(model)
        if answer.status in (0, 200) or published is None or published > sent_at:
            return
        if self.unloading.get(model, -1.0) >= published:
            return  # an unload of it began since its publication (before or during the rollout)
        timed_out = TIMED_OUT.match(answer.message) if answer.status == 504 else None
        if timed_out is not None:
            index = int(timed_out.group(1))
            if index < len(self.replicas) and self.alive_since[index] != faults_before[index]:
                return
        survivors = [
            r.index
            for r in self.replicas
            if alive.get(r.index) == r.incarnation
            and model in r.adapters
            and self.alive_since[r.index] <= sent_at - I6_GRACE_S
        ]
        if survivors:
            self.violation(
                "I6",
                f"rollout of {model} sent at {sent_at:.2f}s (published {published:.2f}s) answered "
                f"{answer.status} while replicas {survivors} held it and stayed alive: "
                f"{answer.message[:300]}",
            )

    async def _watch(self) -> None:
        """I3, checked every half probe round."""
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S / 2)
            self.check_converged()

    def check_converged(self) -> None:
        rt = self.proxy.rt
        if rt is None or self.control_busy:
            return
        now = self.now()
        fleet = rt.fleet
        for replica in self.replicas:
            if self._unhealthy(replica):
                continue
            since = max(
                self.healthy_since[replica.index],
                self.desired_changed_at,
                replica.mount_caught_up_at(now),
            )
            if now - since < I3_WINDOW_S:
                continue
            if replica.index >= len(fleet.replicas):
                continue  # being added right now
            proxy_view = fleet.replicas[replica.index]
            problems = []
            if replica.adapters != fleet.desired_adapters:
                have, want = sorted(replica.adapters), sorted(fleet.desired_adapters)
                problems.append(f"adapters {have} != desired {want}")
            if replica.paused != fleet.desired_paused:
                problems.append(f"paused={replica.paused}, desired {fleet.desired_paused}")
            if proxy_view.status is not Status.READY:
                why = proxy_view.not_reconciled or proxy_view.last_error
                problems.append(f"status {proxy_view.status.value} ({why})")
            if problems:
                self.violation(
                    "I3",
                    f"replica {replica.index} healthy for {now - since:.1f}s but not converged: "
                    + "; ".join(problems),
                )
                self.healthy_since[replica.index] = now  # report once per window

    # -- one run ------------------------------------------------------------------------------

    async def run(self) -> Result:
        await self.proxy.start()
        if self.mutate is not None:
            self.mutate(self)
        background = [asyncio.create_task(self._watch())]
        background += [asyncio.create_task(self._inject(f)) for f in self.schedule]
        syncs = self._merged_sync_loop() if self.mode == "merged" else self._sync_loop()
        work = [asyncio.create_task(syncs), asyncio.create_task(self._probes())]
        work += [asyncio.create_task(self._rollouts(w)) for w in range(3)]
        await asyncio.gather(*work)
        self._stopping = True
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await asyncio.gather(*self._restarts)
        await self.proxy.stop()
        for future in list(self._forever):
            future.cancel()
        await asyncio.sleep(0)
        self._check_leftovers()
        return self.result

    def _check_leftovers(self) -> None:
        current = asyncio.current_task()
        left = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
        if left:
            names = ", ".join(sorted(t.get_name() for t in left))
            self.violation("I5", f"{len(left)} tasks left running: {names}")
        if self.transport.open:
            self.violation("I5", f"{self.transport.open} upstream requests left open")


def run_seed(
    seed: int,
    replicas: int = 3,
    mutate: Callable[[World], None] | None = None,
    mode: str = "adapter",
) -> Result:
    from sim.loop import run

    # Thousands of seeds of injected faults would log every ejection; the level is restored
    # afterwards so that a process running seeds (the test suite) keeps its own logging.
    proxy_log = logging.getLogger("rollout_proxy")
    level = proxy_log.level
    proxy_log.setLevel(logging.CRITICAL)
    fds_before = _open_fds()

    async def main() -> Result:
        world = World(seed, replicas, mutate, mode)
        return await world.run()

    try:
        result: Result = run(main())
    finally:
        proxy_log.setLevel(level)
    leaked = _open_fds() - fds_before
    if leaked > 0:
        result.violations.append(Violation(RUN_S, "I5", f"{leaked} file descriptors left open"))
    return result


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: the check is skipped
        return 0
