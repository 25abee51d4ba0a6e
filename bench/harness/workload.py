"""An AsyncGRPO-shaped rollout workload: a deterministic plan, and a driver replaying it over HTTP.

The shape follows what TRL's AsyncGRPOTrainer sends (see /work/shared/REFERENCE.md, section 1):

- G rollouts per prompt, each its own ``POST /v1/completions`` with the *same* token prefix;
- every prompt starts with the same chat-template tokens (system prompt + role markers);
- prompt lengths drawn like MATH problems rendered by the Qwen2.5 chat template;
- a fraction of prompts are tool tasks: each of their rollouts continues for a few turns, the next
  prompt being the previous prompt + the completion's token ids + the tool's output tokens;
- adapter versions ``trl-policy-vN`` advance every ``rollouts_per_version`` rollouts with TRL's
  sync sequence: ``/pause?mode=keep``, ``/v1/load_lora_adapter``, ``/resume``,
  ``/v1/unload_lora_adapter`` of version ``N - max_staleness - 1``;
- at most ``max_inflight`` rollouts in flight (TRL's ``max_inflight_tasks``).

:func:`build_plan` is pure and deterministic given the seed: prompts, tool outputs, per-request
seeds (the simulator derives completion lengths and ids from them) and each rollout's adapter
version. Only timing differs between runs, so every router serves the same requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import orjson

from bench.harness.simulator import SimConfig, completion_length

PromptFormat = Literal["ids", "text"]


@dataclass(frozen=True)
class WorkloadConfig:
    """Shape of the workload; each default says what it was sized from."""

    seed: int = 0
    # Distinct prompts. 128 prompts x 8 = 1,024 rollouts: two adapter versions' worth at the
    # recipe's 512 completions per sync, in ~5 s of real time per router at time_scale 0.05.
    groups: int = 128
    # The recipe's 8 samples per prompt (G).
    group_size: int = 8
    # Qwen2.5's chat template around a MATH problem: the default system prompt
    # ("Please reason step by step, and put your final answer within \\boxed{}.") plus
    # <|im_start|>/<|im_end|> role markers come to ~40 tokens.
    template_tokens: int = 40
    # MATH problems tokenize to ~110 tokens at the median with a long tail (lognormal, sigma 0.5
    # gives p90 ~210); with the template that is ~150 tokens per prompt.
    problem_median_tokens: float = 110.0
    problem_sigma: float = 0.5
    problem_min_tokens: int = 16
    problem_max_tokens: int = 1024
    # Share of prompts that are tool tasks (multi-turn). A quarter keeps single-turn GRPO the
    # common case while giving continuations enough weight to show in the hit rate.
    multi_turn_fraction: float = 0.25
    # A multi-turn rollout makes min_extra_turns..max_extra_turns tool calls before its final
    # answer.
    min_extra_turns: int = 1
    max_extra_turns: int = 2
    # Tool outputs (a Python result, a search snippet): median ~60 tokens, clipped to
    # [tool_min_tokens, tool_max_tokens] (the upper bound: a quarter of the recipe's context).
    tool_median_tokens: float = 60.0
    tool_sigma: float = 0.6
    tool_min_tokens: int = 1
    tool_max_tokens: int = 1024
    # Completion budget of a tool-calling turn, and of a final answer (the recipe's 3,000).
    turn_max_tokens: int = 512
    max_tokens: int = 3000
    # The recipe's --max-model-len.
    max_model_len: int = 4096
    # Rollouts per adapter version: the recipe syncs every 4 steps of 128 completions = 512; 256
    # gives several versions in a short run. Named trl-policy-v0, -v1, ...
    rollouts_per_version: int = 256
    # The recipe's max_staleness: the driver unloads version N-5 after publishing N.
    max_staleness: int = 4
    # TRL's max_inflight_tasks: concurrent rollouts.
    max_inflight: int = 64
    vocab_size: int = 151_936
    adapter_prefix: str = "trl-policy-v"
    adapter_dir: str = "/tmp/rollout-bench/.vllm_lora"

    def __post_init__(self) -> None:
        for name in (
            "groups",
            "group_size",
            "rollouts_per_version",
            "max_inflight",
            "max_model_len",
            "max_tokens",
            "turn_max_tokens",
            "vocab_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"WorkloadConfig.{name} must be >= 1")
        if not 0.0 <= self.multi_turn_fraction <= 1.0:
            raise ValueError("multi_turn_fraction must be within [0, 1]")
        if self.template_tokens < 0 or self.max_extra_turns < 0 or self.max_staleness < 0:
            raise ValueError("template_tokens, max_extra_turns and max_staleness must be >= 0")
        if not 1 <= self.min_extra_turns <= max(self.max_extra_turns, 1):
            raise ValueError("need 1 <= min_extra_turns <= max_extra_turns")
        if not 1 <= self.tool_min_tokens <= self.tool_max_tokens:
            raise ValueError("need 1 <= tool_min_tokens <= tool_max_tokens")
        if not 1 <= self.problem_min_tokens <= self.problem_max_tokens:
            raise ValueError("need 1 <= problem_min_tokens <= problem_max_tokens")
        if self.template_tokens + self.problem_max_tokens >= self.max_model_len:
            raise ValueError("template + longest problem must leave room to generate")

    def adapter_name(self, version: int) -> str:
        return f"{self.adapter_prefix}{version}"

    def adapter_path(self, version: int) -> str:
        return f"{self.adapter_dir}/{self.adapter_name(version)}"


@dataclass(frozen=True)
class TurnSpec:
    """One request of a rollout. ``tool_tokens`` follow this turn's completion if a turn follows."""

    seed: int
    max_tokens: int
    tool_tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class RolloutSpec:
    index: int
    group: int
    member: int
    version: int
    prompt: tuple[int, ...]
    turns: tuple[TurnSpec, ...]


def _lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma))))


def build_plan(cfg: WorkloadConfig) -> list[RolloutSpec]:
    """The rollouts in issue order: group by group, G members each. Deterministic in ``cfg``."""
    rng = random.Random(cfg.seed)
    template = tuple(rng.randrange(cfg.vocab_size) for _ in range(cfg.template_tokens))
    plan: list[RolloutSpec] = []
    for g in range(cfg.groups):
        n_problem = _lognormal_int(
            rng,
            cfg.problem_median_tokens,
            cfg.problem_sigma,
            cfg.problem_min_tokens,
            cfg.problem_max_tokens,
        )
        prompt = template + tuple(rng.randrange(cfg.vocab_size) for _ in range(n_problem))
        multi_turn = rng.random() < cfg.multi_turn_fraction
        for m in range(cfg.group_size):
            index = g * cfg.group_size + m
            extra = 0
            if multi_turn and cfg.max_extra_turns:
                extra = rng.randint(cfg.min_extra_turns, cfg.max_extra_turns)
            turns = []
            for t in range(extra + 1):
                final = t == extra
                tool: tuple[int, ...] = ()
                if not final:
                    n_tool = _lognormal_int(
                        rng,
                        cfg.tool_median_tokens,
                        cfg.tool_sigma,
                        cfg.tool_min_tokens,
                        cfg.tool_max_tokens,
                    )
                    tool = tuple(rng.randrange(cfg.vocab_size) for _ in range(n_tool))
                turns.append(
                    TurnSpec(
                        seed=rng.getrandbits(63),
                        max_tokens=cfg.max_tokens if final else cfg.turn_max_tokens,
                        tool_tokens=tool,
                    )
                )
            plan.append(
                RolloutSpec(
                    index=index,
                    group=g,
                    member=m,
                    version=index // cfg.rollouts_per_version,
                    prompt=prompt,
                    turns=tuple(turns),
                )
            )
    return plan


# --------------------------------------------------------------------------------------------
# The driver.


@dataclass
class RequestRecord:
    """One /v1/completions call as the client saw it (monotonic seconds)."""

    rollout: int
    turn: int
    model: str
    adapter_path: str
    t_send: float
    t_recv: float
    prompt: list[int]
    completion: list[int]
    status: int
    error: str | None = None
    replica_header: str | None = None
    response_id: str = ""
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when reported


@dataclass
class ControlEvent:
    t: float
    endpoint: str
    target: str
    status: int
    detail: str = ""


@dataclass
class RunTrace:
    records: list[RequestRecord] = field(default_factory=list)
    control: list[ControlEvent] = field(default_factory=list)
    # Send times of calls that cleared the replicas' prefix caches (for the oracle).
    cache_clears: list[float] = field(default_factory=list)
    # Each weight sync as TRL sees it: (first call sent, last answer received), monotonic
    # seconds, from /pause to /resume's answer.
    syncs: list[tuple[float, float]] = field(default_factory=list)
    t_start: float = 0.0
    t_end: float = 0.0

    @property
    def ok_records(self) -> list[RequestRecord]:
        return [r for r in self.records if r.error is None]

    @property
    def errors(self) -> list[RequestRecord]:
        return [r for r in self.records if r.error is not None]


class ControlError(RuntimeError):
    """A control call TRL would treat as fatal (load, pause, resume failed)."""


class ControlPlane:
    """Sends TRL's weight-sync sequence to one base URL (a router) or to every replica directly.

    TRL talks to one URL; ``targets`` has that URL when the router broadcasts control calls, and
    every replica's URL when it does not (the Rust routers), so adapters exist everywhere in both
    cases and the comparison measures routing only.
    """

    def __init__(self, targets: Sequence[str], trace: RunTrace) -> None:
        if not targets:
            raise ValueError("ControlPlane needs at least one target URL")
        self.targets = list(targets)
        self.trace = trace

    async def _post(
        self,
        session: aiohttp.ClientSession,
        target: str,
        path: str,
        body: dict[str, Any] | None,
        *,
        fatal: bool,
    ) -> int:
        async with session.post(target + path, json=body) as resp:
            text = await resp.text()
            self.trace.control.append(
                ControlEvent(time.monotonic(), path, target, resp.status, text[:200])
            )
            if fatal and resp.status != 200:
                raise ControlError(f"POST {target}{path} -> {resp.status}: {text[:300]}")
            return resp.status

    async def _all(
        self,
        session: aiohttp.ClientSession,
        path: str,
        body: dict[str, Any] | None,
        *,
        fatal: bool,
    ) -> None:
        await asyncio.gather(
            *(self._post(session, t, path, body, fatal=fatal) for t in self.targets)
        )

    async def publish(
        self, session: aiohttp.ClientSession, name: str, path: str, *, first: bool
    ) -> None:
        """TRL's sync: pause(keep), load, resume. The very first load skips the pause."""
        started = time.monotonic()
        if not first:
            # vLLM resets the prefix cache on pause unless clear_cache=false; TRL does not pass it.
            self.trace.cache_clears.append(started)
            await self._all(session, "/pause?mode=keep", None, fatal=True)
        try:
            body = {"lora_name": name, "lora_path": path, "load_inplace": False}
            await self._all(session, "/v1/load_lora_adapter", body, fatal=True)
        finally:
            if not first:
                await self._all(session, "/resume", None, fatal=True)
                self.trace.syncs.append((started, time.monotonic()))

    async def unload(self, session: aiohttp.ClientSession, name: str) -> None:
        # TRL ignores the answer (a missing adapter is fine), so does the driver.
        await self._all(session, "/v1/unload_lora_adapter", {"lora_name": name}, fatal=False)


def completion_body(
    model: str, prompt: Sequence[int], max_tokens: int, seed: int, prompt_format: PromptFormat
) -> dict[str, Any]:
    """The body TRL's rollout worker posts (REFERENCE.md section 1)."""
    return {
        "model": model,
        "prompt": list(prompt) if prompt_format == "ids" else " ".join(map(str, prompt)),
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "repetition_penalty": 1.0,
        "n": 1,
        "return_token_ids": True,
        "logprobs": 0,
        "seed": seed,
    }


def _cached_tokens(data: Any) -> int | None:
    try:
        value = data["usage"]["prompt_tokens_details"]["cached_tokens"]
    except (KeyError, TypeError):
        return None
    return value if type(value) is int else None


def _parse_completion(data: Any) -> tuple[list[int], str]:
    """What TRL reads from the answer (and the answer's id); raises ValueError when a router
    mangled it."""
    try:
        choice = data["choices"][0]
        ids = choice["token_ids"]
        lps = choice["logprobs"]["token_logprobs"]
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"answer lacks choices[0].token_ids / logprobs: {exc!r}") from None
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise ValueError("choices[0].token_ids is not a list of ints")
    if not isinstance(lps, list) or len(lps) != len(ids):
        raise ValueError("logprobs.token_logprobs does not match token_ids")
    return ids, str(data.get("id", ""))


# The client's request bodies are serialized with orjson for the reason its answers are parsed
# with it (Driver._request): the harness's CPU per request is kept off the router's cores.
_JSON = {"Content-Type": "application/json"}


@dataclass
class Driver:
    """Replays a plan against ``base_url`` with TRL's concurrency and sync sequence."""

    cfg: WorkloadConfig
    base_url: str
    control: ControlPlane
    prompt_format: PromptFormat = "ids"
    request_timeout_s: float = 600.0
    trace: RunTrace = field(init=False)
    _inflight: Counter[int] = field(init=False, default_factory=Counter)
    _changed: asyncio.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.trace = self.control.trace
        self._changed = asyncio.Condition()

    async def run(self, plan: Sequence[RolloutSpec]) -> RunTrace:
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        # One session, as TRL's rollout worker has; the connector is sized to the concurrency.
        connector = aiohttp.TCPConnector(limit=self.cfg.max_inflight + 8)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            self.trace.t_start = time.monotonic()
            await self.control.publish(
                session, self.cfg.adapter_name(0), self.cfg.adapter_path(0), first=True
            )
            published = 0
            slots = asyncio.Semaphore(self.cfg.max_inflight)
            tasks: list[asyncio.Task[None]] = []
            try:
                for spec in plan:
                    await slots.acquire()
                    while spec.version > published:
                        published += 1
                        await self._publish(session, published)
                    self._inflight[spec.version] += 1
                    tasks.append(asyncio.create_task(self._rollout(session, spec, slots)))
                await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            self.trace.t_end = time.monotonic()
        return self.trace

    async def _publish(self, session: aiohttp.ClientSession, version: int) -> None:
        cfg = self.cfg
        await self.control.publish(
            session, cfg.adapter_name(version), cfg.adapter_path(version), first=False
        )
        old = version - cfg.max_staleness - 1
        if old >= 0:
            # Never unload under a rollout still using it (TRL bounds staleness the same way).
            async with self._changed:
                await self._changed.wait_for(
                    lambda: all(n == 0 for v, n in self._inflight.items() if v <= old)
                )
            await self.control.unload(session, cfg.adapter_name(old))

    async def _rollout(
        self, session: aiohttp.ClientSession, spec: RolloutSpec, slots: asyncio.Semaphore
    ) -> None:
        try:
            model = self.cfg.adapter_name(spec.version)
            path = self.cfg.adapter_path(spec.version)
            prompt = list(spec.prompt)
            for t, turn in enumerate(spec.turns):
                max_tokens = min(turn.max_tokens, self.cfg.max_model_len - len(prompt))
                if max_tokens < 1:
                    break
                record = await self._request(session, spec, t, model, path, prompt, max_tokens)
                if record.error is not None:
                    break
                prompt = prompt + record.completion + list(turn.tool_tokens)
        finally:
            self._inflight[spec.version] -= 1
            slots.release()
            async with self._changed:
                self._changed.notify_all()

    async def _request(
        self,
        session: aiohttp.ClientSession,
        spec: RolloutSpec,
        turn: int,
        model: str,
        path: str,
        prompt: list[int],
        max_tokens: int,
    ) -> RequestRecord:
        body = completion_body(model, prompt, max_tokens, spec.turns[turn].seed, self.prompt_format)
        t_send = time.monotonic()
        status, error, header, rid = 0, None, None, ""
        completion: list[int] = []
        cached: int | None = None
        try:
            async with session.post(
                self.base_url + "/v1/completions", data=orjson.dumps(body), headers=_JSON
            ) as resp:
                status = resp.status
                header = resp.headers.get("X-Proxy-Replica")
                if status == 200:
                    # orjson: the client's CPU per answer (a few hundred token ids and their
                    # logprobs) competes with the router under test; the same for every router.
                    data = orjson.loads(await resp.read())
                    completion, rid = _parse_completion(data)
                    cached = _cached_tokens(data)
                else:
                    error = f"HTTP {status}: {(await resp.text())[:200]}"
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:  # JSONDecodeError too
            error = f"{type(exc).__name__}: {exc}"
        record = RequestRecord(
            rollout=spec.index,
            turn=turn,
            model=model,
            adapter_path=path,
            t_send=t_send,
            t_recv=time.monotonic(),
            prompt=prompt,
            completion=completion,
            status=status,
            error=error,
            replica_header=header,
            response_id=rid,
            cached_tokens=cached,
        )
        self.trace.records.append(record)
        return record


def plan_summary(plan: Sequence[RolloutSpec]) -> dict[str, Any]:
    """Counts for the report (requests per rollout depend on completions, so turns are planned)."""
    turns = [len(s.turns) for s in plan]
    return {
        "rollouts": len(plan),
        "groups": len({s.group for s in plan}),
        "planned_requests": sum(turns),
        "multi_turn_rollouts": sum(1 for n in turns if n > 1),
        "versions": len({s.version for s in plan}),
        "median_prompt_tokens": sorted(len(s.prompt) for s in plan)[len(plan) // 2],
    }


def config_dict(cfg: WorkloadConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


# --------------------------------------------------------------------------------------------
# Named workloads: a rollout shape and the replicas it runs on.


def final_context_tokens(spec: RolloutSpec, cfg: WorkloadConfig, sim: SimConfig) -> int:
    """The longest context a rollout's requests reach (its last request's prompt + completion),
    replaying the driver's loop with the simulator's completion lengths (which depend only on
    each request's seed)."""
    prompt, held = len(spec.prompt), 0
    for turn in spec.turns:
        budget = min(turn.max_tokens, cfg.max_model_len - prompt)
        if budget < 1:
            break
        held = prompt + completion_length(sim, turn.seed, budget)
        prompt = held + len(turn.tool_tokens)
    return held


@functools.lru_cache(maxsize=32)  # configs are frozen; the report asks again per fleet size
def working_set_blocks(cfg: WorkloadConfig, sim: SimConfig) -> int:
    """KV blocks the fleet needs to keep every in-flight rollout's whole context cached:
    ``max_inflight`` rollouts at the plan's mean final context."""
    plan = build_plan(cfg)
    mean = sum(final_context_tokens(s, cfg, sim) for s in plan) / len(plan)
    return math.ceil(cfg.max_inflight * mean / sim.block_size)


@dataclass(frozen=True)
class Workload:
    """A named benchmark workload: the rollouts, and the replicas serving them."""

    name: str
    description: str
    workload: WorkloadConfig
    sim: SimConfig
    # When set, each replica's KV cache holds this share of the working set divided by the
    # fleet size (at least one full context, which a replica must be able to hold).
    kv_share: float | None = None

    def sim_for(self, replicas: int) -> SimConfig:
        if self.kv_share is None:
            return self.sim
        want = working_set_blocks(self.workload, self.sim) * self.kv_share / replicas
        floor = -(-self.sim.max_model_len // self.sim.block_size)
        return dataclasses.replace(self.sim, kv_blocks=max(math.ceil(want), floor))

    def kv_fraction(self, replicas: int) -> float:
        """Fleet KV capacity / working set, as run."""
        blocks = self.sim_for(replicas).kv_blocks * replicas
        return blocks / working_set_blocks(self.workload, self.sim)


# Agentic tool use (the shape): a system prompt with tool schemas (~400 tokens) and a
# task make a 1-4k-token first prompt; 4-10 turns of 100-500 generated tokens, each followed by a
# 100-1,000-token tool output, so contexts grow to several thousand tokens.
AGENTIC_WORKLOAD = WorkloadConfig(
    template_tokens=400,
    # task: median 1,500 tokens within [600, 3,600] (first prompt 1,000-4,000 with the template)
    problem_median_tokens=1500.0,
    problem_sigma=0.5,
    problem_min_tokens=600,
    problem_max_tokens=3600,
    multi_turn_fraction=1.0,
    min_extra_turns=3,
    max_extra_turns=9,
    # tool outputs: median ~316 tokens (the geometric middle of 100 and 1,000), clipped to them
    tool_median_tokens=316.0,
    tool_sigma=0.6,
    tool_min_tokens=100,
    tool_max_tokens=1000,
    turn_max_tokens=500,
    max_tokens=500,
    # 8k context: room for a first prompt and several turns; a rollout that fills it stops early
    max_model_len=8192,
    # The recipe syncs every 512 completions; an agentic rollout makes ~7 requests: 64 rollouts.
    rollouts_per_version=64,
    # 12 prompts x 8 = 96 rollouts (~650 requests, one sync): ~16-18 s of real time per run at
    # time_scale 0.5 (measured quiet), so that the full matrix fits in ~30 minutes.
    groups=12,
)
# Turns of 100-500 tokens: lognormal median 250, sigma 0.4 (p5 ~130, p95 ~480), capped at 500 by
# max_tokens. time_scale 0.5: agentic requests are short and many, and at 0.1 the client,
# router and simulator saturate this 2-core machine (real delays would dominate simulated ones).
AGENTIC_SIM = SimConfig(gen_median_tokens=250.0, gen_sigma=0.4, max_model_len=8192, time_scale=0.5)

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "grpo",
            "single-turn math prompts (~150 tokens) with ~600-token answers, a quarter of "
            "them with 1-2 tool turns: decode-bound",
            # 64 prompts x 8 = 512 rollouts (~750 requests, one sync at 256 rollouts).
            WorkloadConfig(groups=64),
            # time_scale 0.5, as agentic: on the quiet 2-core machine (grpo x8)
            # a request through rollout-proxy spends 18 ms real outside the simulated engine
            # (vllm-router 12, sglang-router 10); 0.2 made that 90 ms simulated against a 2.4 s
            # p50 (3.7%), 0.5 makes it 36 ms (1.5%), and a grpo run takes ~25 s instead of ~12.
            SimConfig(time_scale=0.5),
        ),
        Workload(
            "agentic",
            "multi-turn tool use: 1-4k-token first prompts, 4-10 turns of 100-500 tokens, "
            "100-1,000-token tool outputs: prefill matters",
            AGENTIC_WORKLOAD,
            AGENTIC_SIM,
        ),
        Workload(
            "tight",
            "the agentic shape on replicas whose KV cache holds ~1/4 of the working set",
            AGENTIC_WORKLOAD,
            AGENTIC_SIM,
            kv_share=0.25,
        ),
    )
}
