"""All configuration in one pydantic-settings class: env prefix ``PROXY_``, every field also a
CLI flag of ``rollout-proxy`` (``--upstream-token`` for ``PROXY_UPSTREAM_TOKEN``; CLI beats env).
Tests construct ``Settings(replicas=[...])`` directly instead of patching the environment.

Each default says how it was sized.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from proxy.core.hashing import VLLM_HASH_ALGOS
from proxy.core.policy import POLICIES
from proxy.core.prefix_index import DEFAULT_MAX_REPLICAS


def normalize_replica_url(url: str) -> str:
    """A replica base URL, checked: http(s), a host, a valid port, no query or fragment.
    Raises ValueError naming the problem (used at start-up and by the membership endpoint)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"replica URL {url!r} is malformed: expected http(s)://host[:port]")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise ValueError(f"replica URL {url!r} has a bad port") from exc
    if parts.query or parts.fragment:
        raise ValueError(f"replica URL {url!r} must not have a query or fragment")
    return url.rstrip("/")


def _split_urls(value: Any) -> Any:
    if isinstance(value, str):
        return [u.strip() for u in value.split(",") if u.strip()]
    return value


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="PROXY_",
        cli_kebab_case=True,
        cli_prog_name="rollout-proxy",
        cli_implicit_flags=True,
        extra="ignore",
    )

    replicas: Annotated[list[str], NoDecode] = Field(
        description="Comma-separated vLLM base URLs. Replica i in this list is replica i "
        "everywhere (X-Proxy-Replica, metrics labels)."
    )
    upstream_token: SecretStr | None = Field(
        None,
        description="Bearer token added to every upstream request (falls back to HF_TOKEN). "
        "A client's own Authorization header is never forwarded.",
    )
    host: str = Field(
        "127.0.0.1", description="Bind address. Loopback by default: the proxy holds a token."
    )
    port: int = Field(8000, ge=0, le=65535, description="Bind port (vLLM's usual 8000).")
    block_size: int | None = Field(
        None,
        ge=1,
        description="Tokens per hashed block. Default: learned from the replicas "
        "(vllm:cache_config_info / server_info), else 16, vLLM's GPU default.",
    )
    imbalance: float = Field(
        8,
        ge=0,
        description="In-flight gap at which affinity yields to load. 8 = one GRPO group "
        "(8 samples per prompt), the published proxy's value: a replica may take a whole "
        "extra group for the cache before load wins.",
    )
    policy: str = Field("prefix", description=f"Routing policy: {', '.join(sorted(POLICIES))}.")
    hash_mode: Literal["fast", "exact"] = Field(
        "fast",
        description="fast: xxh3 chains (routing only). exact: vLLM's own block hashes, to "
        "compare with its KV-cache events (measured 4x (sha256) to 11x (sha256_cbor) "
        "slower per prompt).",
    )
    vllm_hash_algo: Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"] | None = Field(
        None,
        description="Exact mode: the replicas' --prefix-caching-hash-algo. Default: learned "
        f"from the replicas, else sha256. One of {', '.join(VLLM_HASH_ALGOS)}.",
    )
    vllm_hash_seed: str | None = Field(
        None, description="Exact mode: the replicas' PYTHONHASHSEED (unset: vLLM's default)."
    )
    index_capacity: int = Field(
        524_288,
        ge=2,
        description="Prefix blocks tracked (LRU). 2**19 ~ the KV cache of four H100 replicas "
        "serving a 1.5B model (~134k blocks each); ~45 MB at the measured 84 bytes per block.",
    )
    max_replicas: int = Field(
        DEFAULT_MAX_REPLICAS,
        ge=1,
        le=1024,
        description="Most replicas ever in the fleet (the index's bitmask width; 32 keeps "
        "an entry within 36 bytes).",
    )
    tokenizer: str | None = Field(
        None,
        description="Local tokenizer path: text and chat prompts are tokenized (chat through "
        "its template) so they hash like token prompts. Needs the [tokenizer] extra.",
    )
    lora_load_timeout_s: float = Field(
        300,
        gt=0,
        description="Deadline for an adapter to appear on every replica's storage mount "
        "(a FUSE bucket mount can lag minutes behind the trainer's rename).",
    )
    lora_retry_s: float = Field(
        2, gt=0, description="Retry period while a replica answers 404 'No adapter found'."
    )
    health_interval_s: float = Field(
        2, gt=0, description="Probe period; TRL itself polls /health every 2 s."
    )
    probe_timeout_s: float = Field(
        2,
        gt=0,
        description="Per-replica probe timeout; keeps /health well inside TRL's 5 s timeout.",
    )
    connect_timeout_s: float = Field(
        5, gt=0, description="TCP connect timeout upstream; a live replica accepts in ms."
    )
    upstream_timeout_s: float = Field(
        900,
        gt=0,
        description="Longest silence from a replica mid-request: 3,000 generated tokens on a "
        "saturated replica took minutes; 15 min is generous without hanging forever.",
    )
    control_timeout_s: float = Field(
        120,
        gt=0,
        description="Per-replica timeout of a control call (load, unload, pause, resume, "
        "reset). vLLM applies each in about a second; a replica silent for 2 minutes is "
        "ejected and reconciled later instead of blocking TRL's weight sync.",
    )
    eject_after: int = Field(
        2,
        ge=1,
        description="Consecutive failed probes before ejection (one slow probe is not death; "
        "a refused connection on the data plane ejects at once).",
    )
    upstream_transport: Literal["aiohttp", "httpx"] = Field(
        "aiohttp",
        description="httpx transport: aiohttp (httpx-aiohttp, measured faster) or httpx's own.",
    )
    scrape_vllm_metrics: bool = Field(
        True, description="Scrape replicas' /metrics for queue depth, hit rates, block size."
    )
    log_json: bool = Field(False, description="JSON log lines (one object per line).")
    log_level: str = Field("info", description="Python log level.")

    @field_validator("replicas", mode="before")
    @classmethod
    def _parse_replicas(cls, value: Any) -> Any:
        return _split_urls(value)

    @field_validator("replicas")
    @classmethod
    def _check_replicas(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("at least one replica URL is required (PROXY_REPLICAS)")
        cleaned = [normalize_replica_url(url) for url in value]
        if len(set(cleaned)) != len(cleaned):
            raise ValueError("replica URLs must be distinct")
        return cleaned

    @field_validator("policy")
    @classmethod
    def _check_policy(cls, value: str) -> str:
        if value not in POLICIES:
            raise ValueError(f"unknown policy {value!r}; one of {sorted(POLICIES)}")
        return value

    @model_validator(mode="after")
    def _fallbacks(self) -> Settings:
        if self.upstream_token is None and os.environ.get("HF_TOKEN"):
            self.upstream_token = SecretStr(os.environ["HF_TOKEN"])
        if len(self.replicas) > self.max_replicas:
            raise ValueError(
                f"{len(self.replicas)} replicas exceed max_replicas={self.max_replicas}"
            )
        return self
