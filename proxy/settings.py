"""All configuration in one pydantic-settings class: env prefix ``PROXY_``, every field also a
CLI flag of ``rollout-proxy`` (``--upstream-token`` for ``PROXY_UPSTREAM_TOKEN``; CLI beats env).
Tests construct ``Settings(replicas=[...])`` directly. Each default says how it was sized.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from proxy.checks import MIN_KEY_CHARS, is_loopback, normalize_root

# The leaf of the import graph: nothing here comes from proxy.core or proxy.security. The three
# values below mirror the core's own (tests/unit/test_settings.py holds them equal).
# The request parser's bound on prompts per request (proxy/core/extract.py).
MAX_BATCH_PROMPTS = 4096
# The prefix index's replica bitmask width (proxy/core/prefix_index.py).
DEFAULT_MAX_REPLICAS = 32
# vLLM's --prefix-caching-hash-algo values the exact hasher implements (proxy/core/hashing.py).
VllmHashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]

# Settings the proxy no longer has, and what to do instead. Given as an environment variable, a
# CLI flag or an init keyword, each stops start-up with its message (``removed_settings``).
REMOVED_SETTINGS: dict[str, str] = {
    "upstream_transport": "completions always go through the proxy's own keep-alive pool "
    "(proxy/pool.py) and control calls through httpx; remove the setting "
    "(bench/ compares other clients)",
    "hot_path": "completions are always answered from the server's protocol (proxy/front.py); "
    "remove the setting",
}


def removed_settings(
    cli_args: Iterable[str] = (), environ: Mapping[str, str] = os.environ, given: Iterable[str] = ()
) -> list[str]:
    """One message per removed setting found among ``cli_args`` (``--hot-path`` or
    ``--hot-path=...``), ``environ`` (``PROXY_HOT_PATH``, any case) and ``given`` (field names
    passed as keywords), each naming what replaces it."""
    args, env, keywords = list(cli_args), {k.upper() for k in environ}, set(given)
    problems = []
    for name, instead in REMOVED_SETTINGS.items():
        variable, flag = f"PROXY_{name.upper()}", "--" + name.replace("_", "-")
        flags = (flag, "--" + name)
        flagged = any(a in flags or a.startswith(tuple(f + "=" for f in flags)) for a in args)
        if variable in env or name in keywords or flagged:
            problems.append(f"{variable} ({flag}) was removed: {instead}")
    return problems


def normalize_replica_url(url: str) -> str:
    """A replica base URL, checked: http(s), a host, a valid port, no query or fragment.
    Raises ValueError naming the problem (used at start-up and by the membership endpoint)."""
    parts = urlsplit(url)
    if "@" in parts.netloc:
        # Checked first, and the URL is not echoed: it would put the password in the message.
        raise ValueError(
            "a replica URL must not carry credentials (user:password@); "
            "use PROXY_UPSTREAM_TOKEN for the replicas' bearer token"
        )
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"replica URL {url!r} is malformed: expected http(s)://host[:port]")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise ValueError(f"replica URL {url!r} has a bad port") from exc
    if parts.query or parts.fragment:
        raise ValueError(f"replica URL {url!r} must not have a query or fragment")
    return url.rstrip("/")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="PROXY_",
        cli_kebab_case=True,
        cli_prog_name="rollout-proxy",
        cli_implicit_flags=True,
        extra="ignore",
        # Validation errors must not echo inputs: they include keys, tokens and credentials.
        hide_input_in_errors=True,
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
        description="prefix policy: in-flight gap at which affinity yields to load. 8 = one "
        "GRPO group (8 samples per prompt), the published proxy's value: a replica may take a "
        "whole extra group for the cache before load wins. The cost policy prices the gap "
        "instead.",
    )
    policy: str = Field(
        "cost",
        description="Routing policy, by name from proxy/core/policy.py's POLICIES (an unknown "
        "name stops start-up). cost: the replica where the request adds the least time "
        "(prefill, decode and KV-memory waits; docs/routing.md). prefix: the published proxy's "
        "rule, affinity first until the in-flight gap reaches PROXY_IMBALANCE. cost is the "
        "default: it matches or beats prefix on throughput and balance across the routing "
        "benchmark, and wins where KV memory is short (docs/decisions/cost-policy.md).",
    )
    hash_mode: Literal["fast", "exact"] = Field(
        "fast",
        description="fast: xxh3 chains (routing only). exact: vLLM's own block hashes, to "
        "compare with its KV-cache events; several times slower per prompt (sha256 and "
        "sha256_cbor digests; bench/results/micro.md).",
    )
    vllm_hash_algo: VllmHashAlgo | None = Field(
        None,
        description="Exact mode: the replicas' --prefix-caching-hash-algo. Default: learned "
        f"from the replicas, else sha256. One of {', '.join(get_args(VllmHashAlgo))}.",
    )
    vllm_hash_seed: str | None = Field(
        None, description="Exact mode: the replicas' PYTHONHASHSEED (unset: vLLM's default)."
    )
    index_capacity: int = Field(
        524_288,
        ge=2,
        description="Prefix blocks tracked (LRU). 2**19 ~ the KV cache of four H100 replicas "
        "serving a 1.5B model (~134k blocks each); ~45 MB at 84 bytes per block "
        "(bench/results/micro.md).",
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
    adapter_wait_s: float = Field(
        30,
        ge=0,
        description="How long a rollout for a published adapter no replica can serve yet (its "
        "load under way, or the replicas holding it restarted and reloading it) waits for one "
        "before a 503 with Retry-After; 0 answers at once. 30 s: a lagging mount answering 10 "
        "'No adapter found' at PROXY_LORA_RETRY_S=2 clears in about 20 s, plus one probe "
        "round; TRL gives a rollout 120 s in all (request_timeout) and retries after 1, 2, 4, "
        "8, 16 s, so 30 s leaves 90 s for the generation.",
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
    native: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Where a token-id completion's prompt scan and pack, the scan of its "
        "answer's generated ids and block-chain hashing run: the C extension "
        "proxy.core._native or its pure-Python reference, with the same "
        "routing decisions, keys and routes (docs/decisions/compiled-primitives.md). auto: the "
        "extension when built (pip install / make setup compile it given a C compiler); on: "
        "refuse to start without it; off: the reference. auto by default: the extension costs "
        "less CPU per request (bench/results/micro_request.md: a whole request in process).",
    )
    shutdown_grace_s: float = Field(
        20,
        ge=0,
        description="On SIGTERM, how long requests in flight may take to finish before they "
        "are closed with a 503. 20 s: under Kubernetes' default 30 s grace period, leaving "
        "10 s for the pod's preStop and the process's own exit.",
    )
    scrape_vllm_metrics: bool = Field(
        True,
        description="Scrape replicas' /metrics for queue depth, hit rates, block size and KV "
        "capacity (num_gpu_blocks: the cost policy prices KV memory with it).",
    )
    log_json: bool = Field(False, description="JSON log lines (one object per line).")
    log_level: str = Field("info", description="Python log level.")

    # -- precise routing from vLLM's KV-cache events (proxy/kv_events.py) ----------------------
    kv_events: bool = Field(
        False,
        description="Route on the blocks each replica reports cached (vLLM --kv-events-config, "
        "ZMQ) instead of the proxy's memory of what it sent; a replica that publishes nothing "
        "falls back to the index. Implies PROXY_HASH_MODE=exact. Needs the [kv-events] extra. "
        "Off by default: it has not yet won over the index on real fleets (docs/kv-events.md).",
    )
    kv_events_port: int = Field(
        5557,
        ge=1,
        le=65535,
        description="Port of each replica's event publisher, on the replica URL's host: "
        "vLLM's default endpoint tcp://*:5557.",
    )
    kv_events_replay_port: int | None = Field(
        5558,
        ge=1,
        le=65535,
        description="Port of each replica's replay socket (vLLM's replay_endpoint; the port "
        "deploy/ configures). Unset: a gap drops that replica's view until it resyncs.",
    )
    kv_events_endpoints: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Explicit per-replica endpoints instead of host+ports, comma-separated in "
        "PROXY_REPLICAS order: 'tcp://h:5557' or 'tcp://h:5557|tcp://h:5558' (events|replay); "
        "ipc:// works too. A replica without an entry falls back to the index.",
    )
    kv_events_topic: str = Field(
        "", description="Topic prefix subscribed to (vLLM's kv-events 'topic'; default '')."
    )
    kv_events_replay_timeout_s: float = Field(
        1.0,
        gt=0,
        description="Wait for a replay answer. A replay is a local buffer read on the replica "
        "(milliseconds); events keep queueing in the socket meanwhile, so 1 s bounds the stall.",
    )
    kv_events_view_capacity: int = Field(
        262_144,
        ge=1,
        description="Most blocks remembered per replica. 2**18: twice the ~140k blocks of an "
        "H100-80GB serving the recipe's 1.5B model; 88 bytes per block "
        "(bench/results/kv_events.md), ~23 MB.",
    )

    # -- security (enforced by proxy/security/) ---------------------------------------------
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated keys for the data plane (completions, chat, models, "
        "server_info, other /v1/ forwards). Sent as 'Authorization: Bearer <key>' or as the "
        "password of HTTP Basic auth (TRL: http://trl:<key>@host:port; any user name). Prefer the "
        "environment over the CLI flag (flags show in ps).",
    )
    admin_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated keys for the control plane (adapter load/unload, "
        "pause/resume, reset_prefix_cache, /admin/*, NCCL endpoints); they work on the data "
        "plane too. With any key set, /health and /metrics stay open and the rest needs one.",
    )
    allow_unauthenticated: bool = Field(
        False,
        description="Allow binding to a non-loopback address without any key. Without it the "
        "proxy refuses to start there: it would relay its upstream token for anyone.",
    )
    adapter_roots: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated absolute directories lora_path must lie under (checked "
        "as strings, '..' refused). Unset: any path is passed on.",
    )
    max_body_bytes: int = Field(
        16 * 1024 * 1024,
        ge=1024,
        description="Largest request body. 16 MiB: a 4,096-token prompt is at most ~32 KiB of "
        "JSON (token ids up to 6 digits plus ', '), so this fits a batch of 512 full-context "
        "prompts, or a chat turn with a few base64 images, and bounds what one request can "
        "make the proxy buffer and parse.",
    )
    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        description="Longest prompt in tokens (token-id prompts, or text with PROXY_TOKENIZER). "
        "Default: the replicas' smallest max_model_len (a longer prompt cannot be served), "
        "else 2**20.",
    )
    max_batch_prompts: int = Field(
        MAX_BATCH_PROMPTS,
        ge=1,
        le=MAX_BATCH_PROMPTS,
        description=f"Most prompts in one completions request. {MAX_BATCH_PROMPTS}: the "
        "parser's own bound (TRL sends one prompt per request; offline evaluation batches "
        "stay far below it).",
    )
    max_header_bytes: int = Field(
        16 * 1024,
        ge=1024,
        le=1024 * 1024,
        description="Largest request line + headers. 16 KiB: h11's and Node's default; TRL "
        "sends ~200 bytes and a JWT bearer token is a few KiB. Also uvicorn's "
        "h11_max_incomplete_event_size.",
    )
    upstream_ca_bundle: str | None = Field(
        None,
        description="PEM file of the CAs that https replicas' certificates must chain to "
        "(default: certifi's bundle, SSL_CERT_FILE honoured). TLS verification is always on "
        "unless PROXY_UPSTREAM_INSECURE.",
    )
    upstream_insecure: bool = Field(
        False,
        description="Do not verify replicas' TLS certificates (explicit opt-out; the upstream "
        "token then goes to whoever answers).",
    )

    @model_validator(mode="before")
    @classmethod
    def _refuse_removed(cls, data: Any) -> Any:
        given = data.keys() if isinstance(data, dict) else ()
        problems = removed_settings(environ=os.environ, given=given)
        if problems:
            raise ValueError("; ".join(problems))
        return data

    @field_validator(
        "replicas", "kv_events_endpoints", "api_keys", "admin_keys", "adapter_roots", mode="before"
    )
    @classmethod
    def _parse_lists(cls, value: Any) -> Any:
        """A comma-separated string (environment, CLI) as a list; a list as given."""
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @field_validator("api_keys", "admin_keys")
    @classmethod
    def _check_keys(cls, value: list[SecretStr]) -> list[SecretStr]:
        # Messages never quote the key (MIN_KEY_CHARS says how its length was chosen).
        for key in value:
            text = key.get_secret_value()
            if len(text) < MIN_KEY_CHARS:
                raise ValueError(
                    f"keys must be at least {MIN_KEY_CHARS} characters (generate one with: "
                    "python -c 'import secrets; print(secrets.token_urlsafe(32))')"
                )
            if not all(33 <= ord(c) < 127 for c in text):
                raise ValueError("keys must be printable ASCII without spaces or commas")
        return value

    @field_validator("adapter_roots")
    @classmethod
    def _check_roots(cls, value: list[str]) -> list[str]:
        return [normalize_root(r) for r in value]

    @field_validator("upstream_ca_bundle")
    @classmethod
    def _check_ca_bundle(cls, value: str | None) -> str | None:
        if value is not None and not os.path.isfile(value):
            raise ValueError(f"CA bundle {value!r} is not a readable file")
        return value

    @model_validator(mode="after")
    def _check_together(self) -> Settings:
        """Rules across fields, and the fallbacks that fill fields from others."""
        if self.upstream_ca_bundle and self.upstream_insecure:
            raise ValueError("PROXY_UPSTREAM_CA_BUNDLE and PROXY_UPSTREAM_INSECURE contradict")
        if not (self.api_keys or self.admin_keys or self.allow_unauthenticated) and not (
            is_loopback(self.host)
        ):
            raise ValueError(
                f"refusing to listen on {self.host!r} without keys: set PROXY_API_KEYS and "
                "PROXY_ADMIN_KEYS, or PROXY_ALLOW_UNAUTHENTICATED=true if a private network "
                "or another gateway already restricts who can reach this port"
            )
        if self.kv_events and self.hash_mode != "exact":
            if "hash_mode" in self.model_fields_set:
                raise ValueError(
                    "PROXY_KV_EVENTS needs PROXY_HASH_MODE=exact: events carry vLLM's own "
                    "block hashes, which only the exact mode computes"
                )
            self.hash_mode = "exact"
        if self.upstream_token is None and os.environ.get("HF_TOKEN"):
            self.upstream_token = SecretStr(os.environ["HF_TOKEN"])
        if len(self.replicas) > self.max_replicas:
            raise ValueError(
                f"{len(self.replicas)} replicas exceed max_replicas={self.max_replicas}"
            )
        return self

    @field_validator("replicas")
    @classmethod
    def _check_replicas(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("at least one replica URL is required (PROXY_REPLICAS)")
        cleaned = [normalize_replica_url(url) for url in value]
        if len(set(cleaned)) != len(cleaned):
            raise ValueError("replica URLs must be distinct")
        return cleaned

    @field_validator("kv_events_endpoints")
    @classmethod
    def _check_kv_endpoints(cls, value: list[str]) -> list[str]:
        for entry in value:
            for endpoint in entry.split("|"):
                if not endpoint.startswith(("tcp://", "ipc://")) or len(endpoint) < 7:
                    raise ValueError(
                        f"KV events endpoint {endpoint!r} must be tcp://host:port or ipc://path"
                    )
        return value

    def secrets(self) -> list[str]:
        """Every secret the settings hold: the upstream token and all inbound keys."""
        out = [k.get_secret_value() for k in (*self.api_keys, *self.admin_keys)]
        if self.upstream_token is not None:
            out.append(self.upstream_token.get_secret_value())
        return [s for s in out if s]
