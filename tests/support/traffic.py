"""GRPO-shaped traffic against the proxy, with a TRL-like trainer advancing adapter versions.

Groups of ``group_size`` identical-prefix rollouts run concurrently (``groups_in_flight`` groups at
a time, like TRL's max_inflight_tasks); every ``sync_every_s`` the trainer does what TRL's weight
sync does: pause(mode=keep) -> load trl-policy-v(N+1) -> resume -> unload v(N-max_staleness-1).
Every request's fate is recorded so a test can count what was lost and where.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

TEMPLATE = list(range(1000, 1048))


def wait_until(
    predicate: Callable[[], object], timeout: float = 5.0, what: str = "the condition"
) -> None:
    """Poll ``predicate`` (from a test's thread) until true, or fail after ``timeout`` s saying
    ``what`` was awaited. Polls every 20 ms: cheap next to what the predicates check (a dict
    read, a file's existence, a localhost request), and short next to the waits they replace."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


async def settled(
    predicate: Callable[[], object], timeout: float = 5.0, what: str = "the condition"
) -> None:
    """``wait_until`` for a test running on the event loop: yields to it between polls, so the
    requests the test started make progress. Replaces a fixed sleep that assumed how fast a
    loaded CI machine gets a request to a replica (a 0.2 s sleep once saw none there)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


@dataclass
class Result:
    model: str
    status: int  # 0: transport failure after retries
    replica: str | None
    error: str = ""


@dataclass
class Traffic:
    proxy_url: str
    group_size: int = 8
    groups_in_flight: int = 4
    sync_every_s: float = 0.4
    max_staleness: int = 4
    adapter_root: str = "/bucket"
    seed: int = 0
    version: int = 0
    results: list[Result] = field(default_factory=list)
    syncs: list[tuple[int, str]] = field(default_factory=list)  # (version, "ok" | error)
    proxy_retries: int = 0  # requests re-sent because the proxy itself was unreachable

    async def _call(
        self, client: httpx.AsyncClient, method: str, path: str, **kwargs: object
    ) -> httpx.Response:
        """Retry only what a dying proxy process produces (it is restarting): refused or
        dropped connections, and the bare "Internal Server Error" uvicorn answers for requests
        it abandons at the end of its graceful shutdown. TRL retries both. Anything the proxy
        itself answered (OpenAI-shaped JSON) is returned as is."""
        deadline = time.monotonic() + 30  # a restart under load takes seconds, not minutes
        while True:
            try:
                r = await client.request(method, path, **kwargs)  # type: ignore[arg-type]
                if not (r.status_code == 500 and r.text == "Internal Server Error"):
                    return r
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                if time.monotonic() > deadline:
                    raise
            self.proxy_retries += 1
            await asyncio.sleep(0.05)

    async def sync(self, client: httpx.AsyncClient) -> None:
        """One TRL weight sync."""
        version = self.version + 1
        name = f"trl-policy-v{version}"
        await self._call(client, "POST", "/pause", params={"mode": "keep"})
        r = await self._call(
            client,
            "POST",
            "/v1/load_lora_adapter",
            json={
                "lora_name": name,
                "lora_path": f"{self.adapter_root}/{name}",
                "load_inplace": False,
            },
        )
        await self._call(client, "POST", "/resume")
        if r.status_code != 200:
            self.syncs.append((version, f"{r.status_code}: {r.text[:200]}"))
            return
        self.syncs.append((version, "ok"))
        self.version = version
        old = version - self.max_staleness - 1
        if old >= 1:
            await self._call(
                client, "POST", "/v1/unload_lora_adapter", json={"lora_name": f"trl-policy-v{old}"}
            )

    async def _trainer(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(self.sync_every_s)
            await self.sync(client)

    async def _rollout(
        self, client: httpx.AsyncClient, model: str, prompt: list[int], seed: int
    ) -> None:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 1.0,
            "n": 1,
            "return_token_ids": True,
            "logprobs": 0,
            "seed": seed,
        }
        try:
            r = await self._call(client, "POST", "/v1/completions", json=body)
        except httpx.HTTPError as exc:
            self.results.append(Result(model, 0, None, type(exc).__name__))
            return
        self.results.append(
            Result(
                model,
                r.status_code,
                r.headers.get("x-proxy-replica"),
                "" if r.status_code == 200 else r.text[:200],
            )
        )

    async def _worker(
        self, client: httpx.AsyncClient, stop: asyncio.Event, rng: random.Random
    ) -> None:
        while not stop.is_set():
            model = f"trl-policy-v{self.version}"
            prompt = TEMPLATE + [rng.randrange(50_000) for _ in range(rng.randint(60, 200))]
            if rng.random() < 0.25:  # a multi-turn continuation of an earlier prompt
                prompt = prompt + [rng.randrange(50_000) for _ in range(40)]
            await asyncio.gather(
                *(
                    self._rollout(client, model, prompt, rng.getrandbits(63))
                    for _ in range(self.group_size)
                )
            )

    async def run(
        self,
        duration_s: float,
        events: list[tuple[float, object]] = (),
        min_requests: int = 0,
        patience_s: float = 30.0,
    ) -> None:
        """Drive traffic for ``duration_s``; ``events`` are (at_seconds, callable) run in a
        thread at those times (fault injection). If fewer than ``min_requests`` rollouts have
        finished by then (a loaded machine serves fewer in the same window), keep going until
        they have, for at most ``patience_s`` more: a test then waits on the amount of traffic
        it needs instead of betting on how much fits in a fixed window."""
        rng = random.Random(self.seed)
        limits = httpx.Limits(max_connections=self.group_size * self.groups_in_flight + 8)
        async with httpx.AsyncClient(base_url=self.proxy_url, timeout=30, limits=limits) as c:
            if self.version == 0:
                await self.sync(c)
            stop = asyncio.Event()
            tasks = [asyncio.create_task(self._trainer(c, stop))]
            tasks += [
                asyncio.create_task(self._worker(c, stop, random.Random(rng.random())))
                for _ in range(self.groups_in_flight)
            ]
            started = time.monotonic()
            for at, action in sorted(events, key=lambda e: e[0]):
                await asyncio.sleep(max(0.0, started + at - time.monotonic()))
                await asyncio.to_thread(action)  # type: ignore[arg-type]
            await asyncio.sleep(max(0.0, started + duration_s - time.monotonic()))
            give_up = time.monotonic() + patience_s
            while len(self.results) < min_requests and time.monotonic() < give_up:  # noqa: ASYNC110 - the rollout tasks append
                await asyncio.sleep(0.05)
            stop.set()
            await asyncio.gather(*tasks)

    @property
    def lost(self) -> list[Result]:
        return [r for r in self.results if r.status != 200]
