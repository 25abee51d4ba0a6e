"""Routing policies: filter (the caller passes only eligible replicas) -> score -> pick.

Policies see plain numbers, never requests or HTTP objects, and are chosen by name from
``POLICIES``. Ties are broken round robin with a counter the policy owns, so a sequence of
decisions is deterministic and testable.

``cost`` (the default) estimates, for each eligible replica, the latency that sending the request
there adds to everyone's requests, and picks the cheapest: the prefill of the prompt tokens that
replica does not hold (which stalls its running batch too), the decode interference of sharing
its batch and, on a replica whose KV cache cannot hold all its requests at once, the time the
blocks it newly allocates keep the requests queued for memory waiting. Affinity therefore wins
exactly when the prefill and the memory it saves outweigh the queue it joins.
The shape follows Dynamo's KV router (cost = overlap weight * new prefill blocks + active decode
blocks, per worker, from the router's own bookkeeping) and llm-d's scheduler (filter -> score ->
pick, its default profile adding a queue-depth scorer at weight 2 to a prefix-cache scorer at
weight 3). Their weights are unitless knobs; here both terms are seconds, derived from the
hardware (:class:`CostModel`), so no weight is left to tune.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

Outcome = Literal["affinity", "spilled", "unmatched"]
OUTCOMES: tuple[Outcome, ...] = ("affinity", "spilled", "unmatched")


# Candidate and Decision are built on every routed request: plain slotted dataclasses, not
# frozen ones, whose __init__ pays an object.__setattr__ call per field. Nothing mutates them
# after the router and the policy build them, except the router setting a decision's block keys.
@dataclass(slots=True)
class Candidate:
    """One eligible replica as the policy sees it."""

    replica: int
    load: float  # in flight through this proxy (+ other clients' requests there, if scraped)
    matched: int  # blocks of this request's *specific* prefix the replica was already sent
    # Prompt tokens this replica would have to prefill: the prompt minus the leading blocks it
    # holds (with KV events its reported reach, common preamble included only where held; on
    # the index the common preamble counts as held everywhere). Set by the router for
    # prefix policies. ``matched`` counts only the specific part: a shared preamble is not
    # affinity, but a replica that lacks it still pays to prefill it.
    new_tokens: int = 0
    # The whole prompt, and the replica's KV cache in tokens (vLLM's num_gpu_blocks *
    # block_size, scraped once: it never changes). 0: unknown, and no memory term is priced.
    prompt_tokens: int = 0
    kv_capacity_tokens: int = 0


@dataclass(slots=True)
class Decision:
    replica: int
    outcome: Outcome
    matched_blocks: int
    blocks: Sequence[int] = ()  # the prompt's block keys, set by the router (for extension)


class Policy(Protocol):
    name: str
    uses_prefix: bool

    def choose(self, candidates: Sequence[Candidate]) -> Decision: ...


class RoundRobinTies:
    """Ties broken in turn: a policy's own counter, so a sequence of decisions is
    deterministic."""

    def __init__(self) -> None:
        self._turn = 0

    def _pick(self, tied: Sequence[Candidate]) -> Candidate:
        if len(tied) == 1:
            return tied[0]  # no choice made: the rotation only advances on real ties
        self._turn += 1
        return tied[self._turn % len(tied)]

    def _least_loaded(self, candidates: Sequence[Candidate]) -> Candidate:
        low = min(c.load for c in candidates)
        return self._pick([c for c in candidates if c.load == low])


class PrefixAffinity(RoundRobinTies):
    """Longest specific prefix wins, unless that replica is more than ``imbalance`` requests
    busier than the least-loaded one; then (and when nothing matches) least-loaded wins."""

    name = "prefix"
    uses_prefix = True

    def __init__(self, imbalance: float) -> None:
        super().__init__()
        if imbalance < 0:
            raise ValueError("imbalance must be >= 0")
        self.imbalance = imbalance

    def choose(self, candidates: Sequence[Candidate]) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        best_match = max(c.matched for c in candidates)
        if best_match > 0:
            matching = [c for c in candidates if c.matched == best_match]
            best = self._least_loaded(matching)
            floor = min(c.load for c in candidates)
            if best.load - floor <= self.imbalance:
                return Decision(best.replica, "affinity", best_match)
            spill = self._least_loaded(candidates)
            return Decision(spill.replica, "spilled", spill.matched)
        pick = self._least_loaded(candidates)
        return Decision(pick.replica, "unmatched", 0)


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds of serving time, for the recipe's model (Qwen2.5-Math-1.5B, bf16) on one H100.

    The constants are derived from published hardware and model figures, never fitted to a
    benchmark (bench/simulator.py models the replicas with the same derivation; what the routing
    benchmark tests is the decision rule given these costs):

    - ``prefill_s_per_token`` 10 us: a forward pass costs 2 * 1.54e9 parameters = 3.1 GFLOP per
      token; the H100 SXM datasheet gives 989 TFLOPS dense bf16, and vLLM reaches ~30-35% MFU on
      prompts of a few hundred tokens: 3.1e9 / (0.32 * 989e12) = 9.8 us.
    - ``decode_s_per_seq_step`` 0.05 ms: each sequence in the batch adds its KV reads to every
      decode step (~1k tokens * 28 KiB/token = 28 MB at the datasheet's 3.35 TB/s = 8.4 us) plus
      its share of sampling over the 151,936-token vocabulary; ~50 us in all. A rough check
      against the published recipe: 500 steps x 128 = 64,000 completions in 53 min on two
      H100s, at ~770 tokens each (mean of a lognormal with median 600, sigma 0.7, an assumption)
      is ~7.7k generated tokens/s per replica, what a 4 ms + 0.05 ms/sequence step gives at a
      batch of ~50.
    - ``expected_output_tokens`` 600: the median completion of Qwen2.5-Math-1.5B on MATH (the
      recipe's task); the proxy does not see how long a request will decode.
    - ``decode_step_base_s`` 4 ms: a decode step of a batch of one. Reading the 3.1 GB of
      weights at 3.35 TB/s takes 0.9 ms; scheduler, sampler and graph launch bring vLLM to
      ~250 tokens/s single-stream for a 1.5B model, ~4 ms a step (the same derivation as
      bench/simulator.py's ``decode_step_base_ms``). With the per-sequence cost it says how long
      a request holds its KV blocks: ``expected_output_tokens`` steps.
    """

    prefill_s_per_token: float = 10e-6
    decode_s_per_seq_step: float = 0.05e-3
    expected_output_tokens: float = 600.0
    decode_step_base_s: float = 4e-3

    def slots(self, candidate: Candidate) -> float:
        """How many contexts like this request's (prompt + expected output) the candidate's KV
        cache holds (its capacity must be known)."""
        context = max(candidate.prompt_tokens, 0) + self.expected_output_tokens
        return candidate.kv_capacity_tokens / context

    def hold_seconds(self, slots: float) -> float:
        """How long a request holds its KV blocks: its expected output's decode steps, at a
        batch of ``slots`` sequences (the batch runs at most that many while requests wait for
        blocks)."""
        return self.expected_output_tokens * (
            self.decode_step_base_s + self.decode_s_per_seq_step * slots
        )

    def cost(
        self, candidate: Candidate, duplicate_tokens: int = 0, projected_waiting: float = 0.0
    ) -> float:
        """Latency added to all requests by sending this one to ``candidate``'s replica.

        Prefill: the request waits for its own new tokens, and each of the ``load`` requests
        already there stalls for as long (a prefill step holds the batch). Decode: each step of
        this request reads the other ``load`` sequences' KV, and each of theirs reads this one's,
        for about ``expected_output_tokens`` steps.

        Memory, when the replica's KV capacity is known: a cache that holds :meth:`slots`
        requests like this one runs at most that many; the rest wait for blocks, ``load + 1 -
        slots`` of them once this one joins. The blocks this request allocates there (its prompt
        beyond what the replica holds, plus its output; a matched prefix is shared, not copied)
        are out of their reach for :meth:`hold_seconds`: each of them waits that long times the
        share of the cache taken. On a memory-bound replica this is what a spill really costs:
        the copy evicts prefixes that other rollouts then prefill again (the memory table of
        bench/results/routing.md). Nothing is charged while all fit.

        Projected memory (``duplicate_tokens``, ``projected_waiting``: :meth:`CostBased.choose`
        sets them): the queue above is what is in flight *now*, so on the empty replicas of a
        start-up burst it is zero and a group's prompt is copied onto a second replica for 19 ms
        of prefill against 60 ms of one more decode neighbour, though the group's rollouts will
        keep both copies alive until they end. ``projected_waiting`` is this replica's share
        (its share of the fleet's KV capacity) of the contexts the fleet will carry (its
        concurrency, learned) that its caches cannot hold at once; those requests wait for the
        blocks of a copy another replica already holds (``duplicate_tokens``: this replica's
        new prompt tokens beyond the fewest any candidate must prefill), for the same hold. It
        prices the same wait as the current queue, so the larger of the two is charged, never
        both. On a fleet whose caches hold every context in flight nothing changes.
        """
        load = candidate.load if candidate.load > 0.0 else 0.0
        new_tokens = candidate.new_tokens if candidate.new_tokens > 0 else 0
        output = self.expected_output_tokens
        cost = new_tokens * self.prefill_s_per_token * (1.0 + load)
        cost += 2.0 * load * output * self.decode_s_per_seq_step
        capacity = candidate.kv_capacity_tokens
        if capacity > 0:
            # slots() and hold_seconds() inlined, as this runs per candidate on every request
            # (tests/unit/test_policy.py pins this copy to them).
            slots = capacity / (max(candidate.prompt_tokens, 0) + output)
            # Blocks held x requests waiting for them, now and as projected for the fleet.
            blocked = max(
                (load + 1.0 - slots) * (new_tokens + output), projected_waiting * duplicate_tokens
            )
            if blocked > 0.0:
                hold_s = output * (self.decode_step_base_s + self.decode_s_per_seq_step * slots)
                cost += blocked / capacity * hold_s
        return cost


# How fast the learned fleet concurrency forgets a peak: by a factor (1 - 1/N) per decision, so
# a drop in concurrency is believed after ~0.7 N decisions. TRL keeps ``max_inflight_tasks``
# rollouts in flight for a whole run, refilling after every completion; 1,024 decisions are two
# of the recipe's 512-completion steps, long enough to span the dip of a sync and short
# enough to follow a changed setting within a few steps.
CONCURRENCY_MEMORY_DECISIONS = 1024

# The concurrency assumed before any is seen: TRL's reference run keeps 128 rollout requests in
# flight (trainer/recipe.py ``max_inflight_tasks``, "one step's completions"). Without a prior
# the start-up burst is priced blind: its first groups arrive while few requests are in flight,
# and are split over empty replicas before the policy has seen how many will follow. A lower
# concurrency replaces it as it decays (CONCURRENCY_MEMORY_DECISIONS); the prior keeps working
# beyond the burst, so it is not dropped when the burst ends (docs/decisions/cost-policy.md).
COLD_START_CONCURRENCY = 128.0


class CostBased(RoundRobinTies):
    """The replica where the request adds the least latency (:class:`CostModel`).

    It also learns the fleet's concurrency (the peak of requests in flight, decaying slowly:
    :data:`CONCURRENCY_MEMORY_DECISIONS`), which with the scraped KV capacities says whether the
    fleet's caches will hold every context in flight; where they will not, a placement that
    copies a prefix another replica holds is priced for the memory it takes
    (:meth:`CostModel.cost`)."""

    name = "cost"
    uses_prefix = True

    def __init__(
        self, model: CostModel | None = None, concurrency: float = COLD_START_CONCURRENCY
    ) -> None:
        super().__init__()
        self.model = model or CostModel()
        self.concurrency = concurrency

    def _projected_excess(self, candidates: Sequence[Candidate]) -> tuple[float, int]:
        """(contexts the fleet will carry beyond what its caches hold, fleet capacity in
        tokens); (0, 0) while any candidate's capacity is unknown."""
        loads = 0.0
        fleet_capacity = 0
        known = True
        for c in candidates:
            if c.load > 0.0:
                loads += c.load
            if c.kv_capacity_tokens > 0:
                fleet_capacity += c.kv_capacity_tokens
            else:
                known = False
        decayed = self.concurrency * (1.0 - 1.0 / CONCURRENCY_MEMORY_DECISIONS)
        self.concurrency = max(1.0 + loads, decayed)
        if not known:
            return 0.0, 0
        # Each context in flight is taken to be this one's size (prompt + expected output):
        # the proxy does not see the others' growth, and a group's members share this shape.
        context = max(candidates[0].prompt_tokens, 0) + self.model.expected_output_tokens
        return self.concurrency - fleet_capacity / context, fleet_capacity

    def _holder_has_room(self, candidates: Sequence[Candidate], fewest_new: int) -> bool:
        """Whether a replica holding most of the prompt (``fewest_new`` new tokens) can take the
        request without queuing it for memory. Only then is a copy elsewhere avoidable: where
        the holder's cache is already full, the request waits for blocks there too. On small
        caches (tight x16: 8,192 tokens, 3.2 contexts of 2,578) this lets a group spread once
        its holder is full instead of queuing 8 rollouts on one replica."""
        for c in candidates:
            if max(c.new_tokens, 0) == fewest_new and max(c.load, 0.0) + 1.0 <= self.model.slots(c):
                return True
        return False

    def _own_wait_beyond_fleet(self, candidates: Sequence[Candidate]) -> list[float] | None:
        """Per candidate, the seconds this request would itself wait for KV blocks there beyond
        the fleet's mean wait and one cache turnover; None when no candidate would make it
        wait for memory (the usual case).

        The simulator and vLLM admit FCFS and a request needs blocks for its whole context
        (bench/simulator.py ``_admit``; vLLM's scheduler stops admitting, or preempts by
        recompute, when the free block pool runs out). A replica whose cache holds ``slots``
        contexts like this one and has ``load`` in flight makes it wait behind
        ``load + 1 - slots`` requests, and a completion frees one context every
        ``hold_s / slots`` (``hold_s``: :meth:`CostModel.hold_seconds`),
        so the wait is their product. :meth:`CostModel.cost` prices only the wait this
        request's blocks impose on others; charging the whole own wait too priced the same
        queue twice and over-spread both routers (bench/results/kv_events.md).

        Two parts of the wait are not this placement's doing, so neither is charged:

        - the fleet's mean wait: on a fleet that is uniformly full, a request joining any queue
          displaces another that would have taken that place;
        - one ``hold_s`` more: a queue up to one cache's worth of contexts (``slots``) beyond
          the fleet's is the transient of a group landing together, which the memory term keeps
          together on purpose (its prompt is pinned by the members running). Past it, the
          replica reallocates its whole cache before this request is admitted: whatever is
          cached there now and not pinned by a request still ahead of it is evicted first
          (vLLM and the simulator evict freed blocks LRU), so the hit that drew it there is
          gone and the extra wait buys nothing. That is x8's tail: the slowest requests all
          behind one replica holding ~5x its cache in flight while the rest ran."""
        model = self.model
        waits: list[float] = []
        holds: list[float] = []
        for c in candidates:
            if c.kv_capacity_tokens <= 0:
                return None  # unknown capacity: no memory term is priced anywhere
            slots = model.slots(c)
            hold_s = model.hold_seconds(slots)
            queued = max(c.load, 0.0) + 1.0 - slots
            waits.append(queued * hold_s / slots if queued > 0.0 else 0.0)
            holds.append(hold_s)
        mean = sum(waits) / len(waits)
        if mean <= 0.0:
            return None
        beyond = [wait - mean - hold_s for wait, hold_s in zip(waits, holds, strict=True)]
        return [b if b > 0.0 else 0.0 for b in beyond]

    def choose(self, candidates: Sequence[Candidate]) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        excess, fleet_capacity = self._projected_excess(candidates)
        price = self.model.cost
        if excess > 0.0 and self._holder_has_room(
            candidates, fewest_new := min([max(c.new_tokens, 0) for c in candidates])
        ):
            costs = [
                price(
                    c,
                    max(c.new_tokens, 0) - fewest_new,
                    excess * c.kv_capacity_tokens / fleet_capacity,
                )
                for c in candidates
            ]
        else:
            costs = [price(c) for c in candidates]
        # Some capacity unknown (fleet_capacity 0): no memory term is priced anywhere.
        own_wait = self._own_wait_beyond_fleet(candidates) if fleet_capacity else None
        if own_wait is not None:
            costs = [cost + wait for cost, wait in zip(costs, own_wait, strict=True)]
        low = min(costs)
        # Costs are sums of products of small integers and constants: equal inputs give
        # bit-identical floats, so exact comparison finds the real ties.
        if costs.count(low) == 1:
            pick = candidates[costs.index(low)]  # no tie: the rotation does not advance
        else:
            pick = self._pick([c for c, cost in zip(candidates, costs, strict=True) if cost == low])
        best_match = max([c.matched for c in candidates])
        if best_match == 0:
            return Decision(pick.replica, "unmatched", 0)
        return Decision(
            pick.replica, "affinity" if pick.matched == best_match else "spilled", pick.matched
        )


POLICIES: dict[str, Callable[[float], Policy]] = {
    "cost": lambda _imbalance: CostBased(),
    "prefix": PrefixAffinity,
}

# Baselines that only benchmarks run (bench/harness/baseline_policies.py registers them in
# POLICIES for the bench's own launcher, ``python -m bench.harness.proxy_with_baselines``).
BENCH_ONLY_POLICIES = ("round_robin", "least_loaded")


def make_policy(name: str, imbalance: float) -> Policy:
    """The policy called ``name``; ValueError naming what to use instead for any other."""
    if name in POLICIES:
        return POLICIES[name](imbalance)
    if name in BENCH_ONLY_POLICIES:
        raise ValueError(
            f"policy {name!r} is a benchmark baseline, not part of the proxy: use 'cost' (the "
            "default) or 'prefix'; benchmarks run it with "
            "`python -m bench.harness.proxy_with_baselines`"
        )
    raise ValueError(f"unknown policy {name!r}; one of {sorted(POLICIES)} ('cost' is the default)")
