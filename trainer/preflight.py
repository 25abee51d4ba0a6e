"""Check the proxy and its replicas before loading a 1.5B model, with one clear message per problem.

Without it, a misconfigured replica surfaces as a stack trace from deep inside TRL (a ``KeyError``
on ``parallel_config``, a silent fall back to merged-weight sync over NCCL that cannot work through
a proxy, a 400 on the first adapter load minutes into the run). The checks mirror what TRL 1.16's
``select_adapter_sync`` and ``VLLMClient`` read, plus what TRL does not check at all:

1. reachable: ``GET /health`` answers 200 (the proxy answers 200 only when every replica does);
2. ``GET /server_info?config_format=json`` answers (404 = replicas lack ``VLLM_SERVER_DEV_MODE=1``;
   an error body = e.g. the proxy found replicas serving different base models);
3. LoRA enabled (``lora_config`` present), ``data_parallel_size == 1`` (a runtime adapter load
   reaches one data-parallel engine only), ``max_lora_rank >= r``,
   ``max_loras >= max_staleness + 2``;
4. ``GET /v1/models``: the base model comes first with a ``max_model_len`` leaving room for a
   prompt after ``max_completion_length`` tokens, and is the model the trainer trains;
5. optionally, a sweep: ``trl-policy-*`` adapters left loaded by an earlier run are unloaded
   (vLLM answers 400 to a load under a name it already holds, which TRL treats as fatal), then
   the prefix caches are reset (a resumed run may republish a name with other weights).

The decision logic (``evaluate``) is a pure function of the two JSON documents, so it is tested
with tables; the HTTP part takes an ``httpx`` transport for tests.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import PurePosixPath
from typing import Any

import httpx

from trainer.recipe import VLLM_LORA_RANKS

logger = logging.getLogger(__name__)

ADAPTER_PREFIX = "trl-policy-"
# N of a published adapter's name, at most 18 digits, as the proxy's own copy
# (proxy/core/fleet.py): the name is a replica's word, and int() of a 5,000-digit version raises
# ValueError; no run publishes a quintillion versions, so a longer one is not a name TRL publishes.
_ADAPTER_VERSION = re.compile(re.escape(ADAPTER_PREFIX) + r"v(\d{1,18})\Z")
# One /health probe; TRL's own readiness poll uses the same 5 s per request and 2 s between tries.
PROBE_TIMEOUT_S = 5.0
POLL_INTERVAL_S = 2.0
# Control calls (server_info, models, unload) are cheap on vLLM; a proxy broadcasting an unload to
# N replicas answers within a few seconds, so this only bounds a hung connection.
CALL_TIMEOUT_S = 30.0


class PreflightError(RuntimeError):
    """The proxy or a replica cannot serve this run; the message lists every problem found."""


@dataclass(frozen=True)
class Requirements:
    """What this run needs from the servers."""

    base_model: str
    lora_rank: int
    min_adapter_slots: int
    max_completion_length: int
    allow_base_model_mismatch: bool = False
    # The first adapter version this run publishes (1 fresh, model_version + 1 on resume): a loaded
    # trl-policy-vK with K >= it would collide with one of this run's loads.
    first_version: int = 1


@dataclass(frozen=True)
class ServerFacts:
    """What the servers reported, as the rest of the trainer needs it."""

    served_model: str
    model_path: str
    max_model_len: int
    max_lora_rank: int
    max_loras: int
    data_parallel_size: int
    adapters: tuple[str, ...]

    @property
    def stale_adapters(self) -> tuple[str, ...]:
        return tuple(a for a in self.adapters if a.startswith(ADAPTER_PREFIX))


def adapter_version(name: str) -> int | None:
    """N of ``trl-policy-vN`` (N of at most 18 digits); None for any other name."""
    match = _ADAPTER_VERSION.match(name)
    return int(match.group(1)) if match else None


@dataclass
class Verdict:
    facts: ServerFacts | None
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


# What a message shows of one name a replica reported, and how many names of a list: the names are
# untrusted (a replica or an operator's script chose them) and a message quoting a 1 MB name, or
# 500 of them, buries the sentence that says what to do. 120 characters hold any real model path
# or adapter name seen (HF ids, /mnt/bucket/... paths are well under); 8 names are a screenful.
SHOWN_NAME_CHARS = 120
SHOWN_NAMES = 8


def _shown(name: str) -> str:
    """``name`` quoted for a message, cut to :data:`SHOWN_NAME_CHARS` with its full length said."""
    if len(name) <= SHOWN_NAME_CHARS:
        return repr(name)
    return f"{name[:SHOWN_NAME_CHARS]!r}... ({len(name):,} characters)"


def _shown_list(names: list[str] | tuple[str, ...]) -> str:
    """Up to :data:`SHOWN_NAMES` of ``names``, each :func:`_shown`, then how many more."""
    shown = ", ".join(_shown(n) for n in names[:SHOWN_NAMES])
    more = len(names) - SHOWN_NAMES
    return shown + (f" and {more} more" if more > 0 else "")


def _round_rank(rank: int) -> int:
    return next((r for r in VLLM_LORA_RANKS if r >= rank), VLLM_LORA_RANKS[-1])


def _same_model(a: str, b: str) -> bool:
    """Same model by id or by last path component: ``/models/Qwen2.5-Math-1.5B`` is
    ``Qwen/Qwen2.5-Math-1.5B`` served from a local copy."""

    def norm(name: str) -> str:
        return name.rstrip("/").lower()

    return norm(a) == norm(b) or PurePosixPath(norm(a)).name == PurePosixPath(norm(b)).name


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def evaluate(
    server_info: Mapping[str, Any], models: Mapping[str, Any], req: Requirements
) -> Verdict:
    """Decide whether the servers can run ``req``; pure, never raises on odd input."""
    verdict = Verdict(facts=None)
    problems, warnings = verdict.problems, verdict.warnings
    config = server_info.get("vllm_config")
    if not isinstance(config, Mapping):
        problems.append(
            "/server_info has no 'vllm_config' object; is the proxy (or server) a vLLM >= 0.11 "
            "started with VLLM_SERVER_DEV_MODE=1?"
        )
        config = {}

    lora = config.get("lora_config")
    max_lora_rank = max_loras = 0
    if config and lora is None:
        problems.append(
            "LoRA is not enabled on the replicas (lora_config is null): start every vLLM with "
            f"--enable-lora --max-lora-rank {_round_rank(req.lora_rank)} "
            f"--max-loras {req.min_adapter_slots} and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 "
            "(without it TRL falls back to full merged-weight sync over NCCL, which cannot work "
            "through a proxy)"
        )
    elif isinstance(lora, Mapping):
        max_lora_rank = _int(lora.get("max_lora_rank")) or 0
        max_loras = _int(lora.get("max_loras")) or 0
        if max_lora_rank < req.lora_rank:
            problems.append(
                f"the replicas serve LoRA ranks up to {max_lora_rank} but the adapter has rank "
                f"{req.lora_rank}: restart them with --max-lora-rank {_round_rank(req.lora_rank)}"
            )
        if max_loras < req.min_adapter_slots:
            problems.append(
                f"the replicas hold {max_loras} adapters at once (--max-loras) but max_staleness "
                f"needs {req.min_adapter_slots} (max_staleness + 2: in-flight samples may name "
                "max_staleness + 1 versions and each sync loads one more before unloading the "
                f"oldest); restart with --max-loras {req.min_adapter_slots} or lower max_staleness"
            )

    parallel = config.get("parallel_config")
    dp = 0
    if config and not isinstance(parallel, Mapping):
        problems.append(
            "/server_info has no parallel_config (TRL reads data_parallel_size from it)"
        )
    elif isinstance(parallel, Mapping):
        dp = _int(parallel.get("data_parallel_size")) or 1
        if dp != 1:
            problems.append(
                f"data_parallel_size is {dp}: a runtime adapter load reaches only one "
                "data-parallel engine. Run one replica per vLLM server (data_parallel_size 1) and "
                "let the proxy spread the load"
            )

    data = models.get("data")
    if not isinstance(data, list) or not data or not isinstance(data[0], Mapping):
        problems.append("/v1/models lists no model")
        return verdict
    base = data[0]
    served = str(base.get("id", ""))
    model_config = config.get("model_config")
    model_path = str(model_config.get("model", "")) if isinstance(model_config, Mapping) else ""
    max_model_len = _int(base.get("max_model_len"))
    if max_model_len is None:
        problems.append(
            f"/v1/models lists {_shown(served)} first without a max_model_len: the base model "
            "must come first (TRL reads data[0].max_model_len)"
        )
        max_model_len = 0
    elif max_model_len <= req.max_completion_length:
        problems.append(
            f"the replicas' max_model_len ({max_model_len}) leaves no room for a prompt before "
            f"max_completion_length={req.max_completion_length} generated tokens; raise "
            "--max-model-len (the recipe uses 4096) or lower max_completion_length"
        )
    if not any(_same_model(req.base_model, name) for name in (served, model_path) if name):
        message = (
            f"the replicas serve {_shown(served)} (path {_shown(model_path)}) but the trainer "
            f"trains {req.base_model!r}: adapters trained on one base model are garbage on another"
        )
        if req.allow_base_model_mismatch:
            warnings.append(message + " (allowed by allow_base_model_mismatch)")
        else:
            problems.append(message + "; set allow_base_model_mismatch if it is the same weights")
    adapters = tuple(str(m.get("id")) for m in data[1:] if isinstance(m, Mapping) and m.get("id"))
    verdict.facts = ServerFacts(
        served_model=served,
        model_path=model_path,
        max_model_len=max_model_len,
        max_lora_rank=max_lora_rank,
        max_loras=max_loras,
        data_parallel_size=dp,
        adapters=adapters,
    )
    if verdict.facts.stale_adapters:
        warnings.append(
            f"{len(verdict.facts.stale_adapters)} adapter(s) from an earlier run are loaded: "
            f"{_shown_list(verdict.facts.stale_adapters)}"
        )
    return verdict


def _describe(response: httpx.Response) -> str:
    """Status plus the server's own words: the message of an OpenAI-shaped error body (vLLM's and
    the proxy's), else the start of the body."""
    body = response.text.strip()
    try:
        data = response.json()
    except ValueError:
        data = None
    if isinstance(data, Mapping):
        error = data.get("error")
        if isinstance(error, Mapping) and error.get("message"):
            body = str(error["message"])
        elif isinstance(data.get("detail"), str):
            body = data["detail"]
    body = body.replace("\n", " ")
    return f"HTTP {response.status_code}: {body[:300]}" if body else f"HTTP {response.status_code}"


def wait_until_healthy(
    client: httpx.Client,
    timeout_s: float,
    *,
    sleep: Callable[[float], None] = time.sleep,
    monotonic: Callable[[], float] = time.monotonic,
) -> None:
    """Poll ``/health`` until 200; on timeout, tell an unreachable proxy from an unhealthy one."""
    deadline = monotonic() + timeout_s
    last = "no answer yet"
    reached = False
    while True:
        try:
            response = client.get("/health", timeout=PROBE_TIMEOUT_S)
            reached = True
            if response.status_code == 200:
                return
            last = _describe(response)
        except httpx.TransportError as exc:
            last = f"{type(exc).__name__}: {exc}"
        if monotonic() >= deadline:
            break
        sleep(POLL_INTERVAL_S)
    if not reached:
        raise PreflightError(
            f"cannot reach the rollout proxy at {client.base_url} after {timeout_s:.0f}s ({last}); "
            "is rollout-proxy running, and is vllm_server_base_url its address?"
        )
    raise PreflightError(
        f"the rollout proxy at {client.base_url} is up but not healthy after {timeout_s:.0f}s "
        f"({last}); /health is 200 only when every replica is healthy - check the replicas"
    )


def _get_json(client: httpx.Client, path: str, params: Mapping[str, str] | None = None) -> Any:
    try:
        response = client.get(path, params=params, timeout=CALL_TIMEOUT_S)
    except httpx.TransportError as exc:
        raise PreflightError(f"GET {path} on {client.base_url} failed: {exc}") from exc
    if response.status_code == 404 and path == "/server_info":
        raise PreflightError(
            "GET /server_info answered 404: start every vLLM replica with VLLM_SERVER_DEV_MODE=1 "
            "(TRL needs /server_info, /pause and /resume)"
        )
    if response.status_code != 200:
        raise PreflightError(f"GET {path} on {client.base_url}: {_describe(response)}")
    try:
        return response.json()
    except ValueError as exc:
        raise PreflightError(
            f"GET {path} on {client.base_url} did not return JSON: {_describe(response)}"
        ) from exc


def fetch_state(client: httpx.Client) -> tuple[dict[str, Any], dict[str, Any]]:
    """The two documents ``evaluate`` reads: ``/server_info`` (JSON form) and ``/v1/models``."""
    info = _get_json(client, "/server_info", {"config_format": "json"})
    models = _get_json(client, "/v1/models")
    if not isinstance(info, dict) or not isinstance(models, dict):
        raise PreflightError("/server_info and /v1/models must return JSON objects")
    return info, models


def sweep(client: httpx.Client, names: tuple[str, ...]) -> None:
    """Unload each adapter in ``names`` (broadcast by the proxy); a name already gone is fine."""
    for name in names:
        try:
            response = client.post(
                "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=CALL_TIMEOUT_S
            )
        except httpx.TransportError as exc:
            raise PreflightError(f"unloading stale adapter {_shown(name)} failed: {exc}") from exc
        if response.status_code not in (200, 404):
            raise PreflightError(f"unloading stale adapter {_shown(name)}: {_describe(response)}")
        logger.info("preflight: unloaded stale adapter %s (%s)", _shown(name), response.status_code)
    # A resumed run republishes the versions its predecessor loaded after the last checkpoint,
    # under the same names and paths but with the checkpoint's weights. vLLM keys cached KV blocks
    # on (name, path), and an unload does not evict them: clear the caches so no request can reuse
    # blocks computed by the old weights. (TRL's first pause clears them too, unless told not to.)
    try:
        response = client.post("/reset_prefix_cache", timeout=CALL_TIMEOUT_S)
    except httpx.TransportError as exc:
        raise PreflightError(f"resetting the prefix caches after the sweep failed: {exc}") from exc
    if response.status_code != 200:
        raise PreflightError(f"resetting the prefix caches after the sweep: {_describe(response)}")


def run_preflight(
    base_url: str,
    req: Requirements,
    *,
    health_timeout_s: float,
    sweep_stale: bool,
    transport: httpx.BaseTransport | None = None,
    sleep: Callable[[float], None] = time.sleep,
    monotonic: Callable[[], float] = time.monotonic,
) -> ServerFacts:
    """Run every check against the proxy at ``base_url``; raise ``PreflightError`` listing
    the problems."""
    with httpx.Client(base_url=base_url, transport=transport) as client:
        wait_until_healthy(client, health_timeout_s, sleep=sleep, monotonic=monotonic)
        verdict = evaluate(*fetch_state(client), req)
        for warning in verdict.warnings:
            logger.warning("preflight: %s", warning)
        if verdict.problems:
            raise PreflightError(
                f"the replicas behind {base_url} cannot serve this run:\n  - "
                + "\n  - ".join(verdict.problems)
            )
        assert verdict.facts is not None  # no problem implies the facts were read
        facts = verdict.facts
        if facts.stale_adapters and not sweep_stale:
            # Only a name this run can publish collides: trl-policy-vN with N >= first_version.
            # (An over-long version or another trl-policy-* name is left loaded, with the warning.)
            colliding = [
                a
                for a in facts.stale_adapters
                if (version := adapter_version(a)) is not None and version >= req.first_version
            ]
            if colliding:
                raise PreflightError(
                    "adapters from an earlier run are still loaded "
                    f"({_shown_list(colliding)}) under names this run will publish "
                    f"(from {ADAPTER_PREFIX}v{req.first_version} on), "
                    "and vLLM refuses a name it already holds. Enable sweep_stale_adapters or "
                    "unload them"
                )
            logger.warning(
                "preflight: leaving %d stale adapter(s) loaded (sweep disabled); they take adapter "
                "slots until unloaded",
                len(facts.stale_adapters),
            )
        elif facts.stale_adapters:
            sweep(client, facts.stale_adapters)
            _, models = fetch_state(client)
            left = [
                str(m.get("id"))
                for m in models.get("data", [])[1:]
                if isinstance(m, Mapping) and str(m.get("id", "")).startswith(ADAPTER_PREFIX)
            ]
            if left:
                raise PreflightError(
                    f"stale adapters still loaded after the sweep: {_shown_list(left)}"
                )
            kept = tuple(a for a in facts.adapters if not a.startswith(ADAPTER_PREFIX))
            facts = replace(facts, adapters=kept)
        logger.info(
            "preflight ok: %s serves %s (max_model_len %d, max_lora_rank %d, max_loras %d)",
            base_url,
            _shown(facts.served_model),
            facts.max_model_len,
            facts.max_lora_rank,
            facts.max_loras,
        )
        return facts
