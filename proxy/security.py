"""Inbound security: who may call what, which adapters may be loaded, how big a request may be,
and keeping the upstream token out of everything the proxy says.

The proxy holds a credential (the upstream token, sent to every replica) and can make GPU servers
load files (``lora_path``). Exposed on a port without these rules it would be an open relay for
that token and a way to load arbitrary files.

Planes and keys
    * open: ``/health``, ``/livez`` and ``/metrics``. Health and liveness probes (Docker,
      Kubernetes, TRL's own ``wait_for_server_ready``) and Prometheus scrapers cannot be given a
      key in practice, and none of these reveals the token, an adapter path or a prompt.
    * admin (``PROXY_ADMIN_KEYS``): everything that changes what the fleet serves -- adapter
      load/unload, pause/resume, prefix-cache reset, ``/admin/*`` (fleet state, membership), and
      TRL's NCCL weight-transfer endpoints.
    * data (``PROXY_API_KEYS``, and admin keys too): everything else -- completions, chat,
      ``/v1/models``, ``/server_info``, ``/is_paused``, any other ``/v1/*`` forward, the schema.

    With no key configured at all the proxy is open (the default, behind loopback: see
    settings.py, which refuses a non-loopback bind without keys unless explicitly allowed). As
    soon as any key is configured, a request to a non-open path without a valid key gets 401, and
    a data key on an admin path gets 403.

How a client presents a key
    ``Authorization: Bearer <key>`` (OpenAI clients, curl), or HTTP Basic with the key as the
    password (or as the user name when the password is empty). Basic is what makes TRL work:
    TRL 1.16's ``VLLMClient`` calls plain ``requests.get/post`` and its rollout worker a bare
    ``aiohttp.ClientSession``, neither with any header or auth hook, but both turn credentials in
    the URL into Basic auth. So ``vllm_server_base_url="http://trl:<admin key>@proxy:8000"``
    authenticates every call TRL makes (verified with requests 2.34 and aiohttp 3.14; the user
    name is ignored but needed: requests drops a URL's credentials without a password). TRL logs
    that URL ("Waiting for vLLM server at ..."), so the key lands in the trainer's log: use a key
    for the trainer alone, and rotate it with the run.

Keys are compared in constant time: the presented key is hashed (SHA-256) and the digest compared
with ``hmac.compare_digest`` against every configured key's digest, without stopping at the
first match, so neither the key's content nor its length nor which key matched shows in timing.

Paths are checked for canonical form before anything else: ``/v1/../pause`` would otherwise be
forwarded as a data-plane ``/v1/*`` request and arrive at the replica, after URL normalisation,
as ``POST /pause`` -- an admin action taken with a data key, behind the control plane's back.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import json
import logging
import posixpath
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from proxy.core.extract import RoutingKey
from proxy.errors import Forbidden, InvalidRequest, PayloadTooLarge, ProxyError, Unauthorized

if TYPE_CHECKING:
    from proxy.settings import Settings

log = logging.getLogger("rollout_proxy.security")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# -- which endpoint belongs to which plane ---------------------------------------------------

OPEN_PATHS = frozenset({"/health", "/livez", "/metrics"})
ADMIN_PATHS = frozenset(
    {
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/pause",
        "/resume",
        "/reset_prefix_cache",
        # TRL's merged-weight (NCCL) sync: world size probe and the transfer itself
        "/get_world_size",
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
    }
)
ADMIN_PREFIX = "/admin"


class Plane(Enum):
    OPEN = "open"
    DATA = "data"
    ADMIN = "admin"


def classify(path: str) -> Plane:
    """The plane of a (canonical) request path. Unknown paths are data plane: with keys
    configured an anonymous caller gets 401 for them, not a 404 that maps the routes."""
    if path in OPEN_PATHS:
        return Plane.OPEN
    if path in ADMIN_PATHS or path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/"):
        return Plane.ADMIN
    return Plane.DATA


# Segments of letters, digits, '_' and '-', optionally joined by single '.' or '~' inside a
# segment: no '.'/'..' segment, no empty segment, no trailing '/', nothing percent-encoded.
_PLAIN_PATH = re.compile(r"/|(?:/[A-Za-z0-9_-]+(?:[.~][A-Za-z0-9_-]+)*)+")


def path_problem(path: str, raw_path: bytes | None = None) -> str | None:
    """Why ``path`` is not in canonical form, or None. Non-canonical paths are refused rather
    than normalised: the proxy, Starlette's router and the replica (after httpx re-encodes the
    URL) must all see the same path, or the plane check means nothing."""
    if _PLAIN_PATH.fullmatch(path) and (raw_path is None or raw_path == path.encode()):
        return None  # the common case (every path TRL and OpenAI clients use), one regex
    if not path.startswith("/"):
        return "the request path must start with '/'"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        return "the request path contains control characters"
    if "\\" in path:
        return "the request path contains a backslash"
    if any(c in path for c in "?#%"):
        # Only reachable percent-encoded (or double-encoded): httpx would re-read them as a
        # query, a fragment or an escape when it builds the upstream URL.
        return "the request path contains an encoded '?', '#' or '%'"
    segments = path.split("/")[1:]
    if any(s in (".", "..") for s in segments):
        return "the request path contains '.' or '..' segments"
    if any(not s for s in segments[:-1]):
        return "the request path contains an empty segment ('//')"
    if len(path) > 1 and path.endswith("/"):
        return "the request path ends with '/'"
    if raw_path is not None:
        lowered = raw_path.lower()
        if b"%2f" in lowered or b"%5c" in lowered:
            return "the request path contains an encoded '/' or '\\'"
    return None


# -- keys ----------------------------------------------------------------------------------

MIN_KEY_CHARS = 16


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class KeyRing:
    """Digests of the configured keys; ``role`` answers in time independent of the key."""

    def __init__(self, data_keys: Iterable[str] = (), admin_keys: Iterable[str] = ()) -> None:
        self._admin = tuple(_digest(k) for k in admin_keys)
        self._data = tuple(_digest(k) for k in data_keys)

    @classmethod
    def from_settings(cls, settings: Settings) -> KeyRing:
        return cls(
            (k.get_secret_value() for k in settings.api_keys),
            (k.get_secret_value() for k in settings.admin_keys),
        )

    @property
    def enabled(self) -> bool:
        return bool(self._admin or self._data)

    def role(self, credential: str | None) -> Plane | None:
        """Plane.ADMIN, Plane.DATA, or None for no/unknown key."""
        if credential is None:
            return None
        digest = _digest(credential)
        is_admin = False
        for k in self._admin:
            is_admin |= hmac.compare_digest(digest, k)
        is_data = False
        for k in self._data:
            is_data |= hmac.compare_digest(digest, k)
        if is_admin:
            return Plane.ADMIN
        return Plane.DATA if is_data else None


def credential_from(authorization: str | None) -> str | None:
    """The key in an ``Authorization`` header value: ``Bearer <key>``, or Basic with the key as
    the password (as the user name if the password is empty). None when absent or malformed."""
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    value = value.strip()
    if not value:
        return None
    scheme = scheme.lower()
    if scheme == "bearer":
        return value
    if scheme == "basic":
        try:
            decoded = base64.b64decode(value, validate=True).decode("utf-8")
        except (binascii.Error, ValueError):
            return None
        user, _, password = decoded.partition(":")
        return password or user or None
    return None


# -- adapter paths --------------------------------------------------------------------------


def normalize_root(root: str) -> str:
    """An allow-list root in canonical form; raises ValueError when it is not absolute."""
    root = root.strip()
    if not root.startswith("/"):
        raise ValueError(f"adapter root {root!r} must be an absolute path")
    if any(ord(c) < 0x20 for c in root):
        raise ValueError("adapter roots must not contain control characters")
    return _normpath(root)


def _normpath(path: str) -> str:
    # posixpath.normpath keeps a leading '//' (POSIX leaves its meaning to the implementation);
    # Linux treats it as '/', and so do we, so '//etc' cannot slip past a '/etc' comparison.
    normalized = posixpath.normpath(path)
    return "/" + normalized.lstrip("/")


class AdapterRoots:
    """``PROXY_ADAPTER_ROOTS``: the directories adapters may be loaded from.

    Checked on the string, before any replica sees the load (the proxy usually cannot see the
    replicas' file systems). The path must be absolute (a relative path is resolved against the
    replica's working directory, and vLLM treats a non-existent one as a Hugging Face repo id and
    downloads it), free of control characters, and free of '..' segments even when they would
    normalise to a path inside a root: on the replica '/roots/link/..' is the parent of wherever
    'link' points, not '/roots', so string normalisation of '..' is unsound in the presence of
    symlinks. TRL sends ``os.path.abspath`` paths, which never contain '..'. What remains ('.',
    '//', trailing '/') is normalised, and the result must equal a root or lie below one.
    A symlink *inside* a root that points outside it cannot be seen from here: keep the roots'
    contents writable by the trainer only.
    """

    def __init__(self, roots: Sequence[str]) -> None:
        self.roots = tuple(normalize_root(r) for r in roots)

    def allows(self, normalized: str) -> bool:
        return any(
            normalized == root or normalized.startswith(root.rstrip("/") + "/")
            for root in self.roots
        )

    def check(self, path: str) -> None:
        """Raise InvalidRequest (400, param lora_path) unless ``path`` is under a root."""
        problem: str | None = None
        if not path.startswith("/"):
            problem = "must be an absolute path"
        elif any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
            problem = "must not contain control characters"
        elif ".." in path.split("/"):
            problem = "must not contain '..' segments"
        elif not self.allows(_normpath(path)):
            problem = "is outside the allowed adapter roots"
        if problem is not None:
            raise InvalidRequest(
                f"'lora_path' {problem} (PROXY_ADAPTER_ROOTS: {', '.join(self.roots)})",
                param="lora_path",
            )


# -- request limits -------------------------------------------------------------------------

# Without PROXY_MAX_PROMPT_TOKENS and before any replica reported its max_model_len: 2**20
# tokens, above the longest context any served model offers today (1M), so the proxy never
# refuses what a replica would accept; the body-size limit bounds the work long before that.
FALLBACK_MAX_PROMPT_TOKENS = 1 << 20


class PromptLimits:
    """Prompt count and prompt length, checked after parsing and before routing.

    Length is checked on token ids: TRL's token prompts, and text or chat prompts when a
    tokenizer is configured. Text without a tokenizer is bounded only by the body size: no
    bytes-per-token ratio is safe for every vocabulary (a run of spaces can be one token), and a
    wrong guess would refuse prompts the replica accepts; the replica checks them exactly.
    The bound is the replicas' smallest max_model_len unless set: a longer prompt cannot be
    served (vLLM needs room for at least one generated token), so the proxy says so without
    hashing it or spending a replica round trip.
    """

    def __init__(
        self,
        max_prompt_tokens: int | None,
        max_batch_prompts: int,
        fleet_max_len: Callable[[], int | None],
    ) -> None:
        self.max_prompt_tokens = max_prompt_tokens
        self.max_batch_prompts = max_batch_prompts
        self.fleet_max_len = fleet_max_len

    def token_limit(self) -> tuple[int, str]:
        if self.max_prompt_tokens is not None:
            return self.max_prompt_tokens, "PROXY_MAX_PROMPT_TOKENS"
        known = self.fleet_max_len()
        if known:
            return known, "the replicas' max_model_len"
        return FALLBACK_MAX_PROMPT_TOKENS, "the proxy's default bound"

    def check(self, body: Any, key: RoutingKey) -> None:
        if key.num_prompts > self.max_batch_prompts:
            raise InvalidRequest(
                f"at most {self.max_batch_prompts} prompts per request "
                f"(PROXY_MAX_BATCH_PROMPTS), got {key.num_prompts}",
                param="prompt",
            )
        if key.tokens is None:
            return
        longest = len(key.tokens)
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            longest = max(len(p) for p in prompt)
        limit, source = self.token_limit()
        if longest > limit:
            raise InvalidRequest(
                f"the prompt has {longest} tokens; at most {limit} are accepted ({source})",
                param="prompt",
            )


def fleet_max_model_len(lengths: Iterable[int | None]) -> int | None:
    """The smallest max_model_len any replica reported (what every replica can serve)."""
    known = [n for n in lengths if n]
    return min(known) if known else None


class BodyTooLarge(PayloadTooLarge):
    """Raised from inside ``receive`` once the streamed body passes the limit."""


class HeadersTooLarge(PayloadTooLarge):
    status_code = 431


# -- the middleware -------------------------------------------------------------------------


@dataclass(frozen=True)
class Guard:
    """What the middleware enforces (built once per app from the settings)."""

    keys: KeyRing
    max_body_bytes: int
    max_header_bytes: int
    secrets: tuple[bytes, ...] = ()

    @classmethod
    def from_settings(cls, settings: Settings) -> Guard:
        token = settings.upstream_token
        return cls(
            KeyRing.from_settings(settings),
            settings.max_body_bytes,
            settings.max_header_bytes,
            (token.get_secret_value().encode(),) if token and token.get_secret_value() else (),
        )


def _header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return bytes(v)
    return None


def _error_response_parts(err: ProxyError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    body = json.dumps(err.to_body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if err.status_code == 401:
        headers.append((b"www-authenticate", b'Bearer realm="rollout-proxy"'))
    return err.status_code, headers, body


class SecurityMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware: that buffers and re-wraps streamed responses).

    Order, cheapest refusal first: header size (431), canonical path (400), key (401/403),
    declared Content-Length (413, before a byte of the body is read), then the body is counted
    as it streams in and the request fails with 413 as soon as it passes the limit, so an
    unbounded body is never buffered. Responses are checked for the upstream token as a last
    line of defence: nothing in the proxy writes it, and if something ever did, it is masked
    (same length, so Content-Length stays right) and a warning is logged.
    """

    def __init__(
        self,
        app: ASGIApp,
        guard: Guard,
        on_reject: Callable[[Scope, int], None] | None = None,
    ) -> None:
        self.app = app
        self.guard = guard
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        problem = self._check_head(scope)
        if problem is not None:
            await self._reject(scope, send, problem)
            return
        if self.guard.secrets:
            send = self._masking(send)
        limit = self.guard.max_body_bytes
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(_too_large(limit), param="body")
            return message

        started = False

        async def tracking(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited, tracking)
        except BodyTooLarge as exc:
            # Reached only when the app has no handler for ProxyError (the proxy's app has one).
            if started:
                raise
            await self._reject(scope, send, exc)

    def _check_head(self, scope: Scope) -> ProxyError | None:
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        for k, v in scope.get("headers", ()):
            size += len(k) + len(v) + 4  # ": " and CRLF, as on the wire
        if size > self.guard.max_header_bytes:
            return HeadersTooLarge(
                f"request line and headers are {size} bytes; at most "
                f"{self.guard.max_header_bytes} are accepted (PROXY_MAX_HEADER_BYTES)"
            )
        path: str = scope.get("path", "")
        bad = path_problem(path, scope.get("raw_path"))
        if bad is not None:
            return InvalidRequest(bad)
        plane = classify(path)
        if plane is not Plane.OPEN and self.guard.keys.enabled:
            raw = _header(scope, b"authorization")
            role = self.guard.keys.role(credential_from(raw.decode("latin-1") if raw else None))
            if role is None:
                return Unauthorized(
                    "a valid key is required: send 'Authorization: Bearer <key>' (or HTTP Basic "
                    "auth with the key as the password, e.g. http://user:<key>@host in a URL)"
                )
            if plane is Plane.ADMIN and role is not Plane.ADMIN:
                return Forbidden(
                    f"{path} is a control-plane endpoint: it needs a key from PROXY_ADMIN_KEYS"
                )
        declared = _header(scope, b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return InvalidRequest("Content-Length must be a non-negative integer")
            if int(declared) > self.guard.max_body_bytes:
                return PayloadTooLarge(_too_large(self.guard.max_body_bytes), param="body")
        return None

    async def _reject(self, scope: Scope, send: Send, err: ProxyError) -> None:
        if self.on_reject is not None:
            self.on_reject(scope, err.status_code)
        status, headers, body = _error_response_parts(err)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _masking(self, send: Send) -> Send:
        secrets = self.guard.secrets

        async def masked(message: Message) -> None:
            if message["type"] == "http.response.body":
                body = message.get("body", b"")
                if any(s in body for s in secrets):
                    log.warning("a response body contained the upstream token; masked it")
                    message = {**message, "body": mask(body, secrets)}
            elif message["type"] == "http.response.start":
                headers = message.get("headers", ())
                if any(s in v for _, v in headers for s in secrets):
                    log.warning("a response header contained the upstream token; masked it")
                    message = {
                        **message,
                        "headers": [(k, mask(bytes(v), secrets)) for k, v in headers],
                    }
            await send(message)

        return masked


def _too_large(limit: int) -> str:
    return f"request body is larger than {limit} bytes (PROXY_MAX_BODY_BYTES)"


# -- secrets out of logs and echoes ---------------------------------------------------------


def mask(data: bytes, secrets: Iterable[bytes]) -> bytes:
    """``data`` with every secret replaced by as many '*' (lengths kept)."""
    for s in secrets:
        if s:
            data = data.replace(s, b"*" * len(s))
    return data


def scrub(text: str, secrets: Iterable[str]) -> str:
    for s in secrets:
        if s:
            text = text.replace(s, "<redacted>")
    return text


class RedactingFormatter(logging.Formatter):
    """Wraps a handler's formatter and removes secrets from the finished line (message,
    arguments and traceback alike). Defence in depth: nothing logs headers or the token."""

    def __init__(self, inner: logging.Formatter, secrets: Sequence[str]) -> None:
        super().__init__()
        self.inner = inner
        self.secrets = tuple(s for s in secrets if s)

    def format(self, record: logging.LogRecord) -> str:
        return scrub(self.inner.format(record), self.secrets)


def install_log_redaction(secrets: Sequence[str], logger: logging.Logger | None = None) -> None:
    """Make every handler of ``logger`` (the root logger by default) redact ``secrets``."""
    target = logger or logging.getLogger()
    for handler in target.handlers:
        inner = handler.formatter or logging.Formatter()
        if not isinstance(inner, RedactingFormatter):
            handler.setFormatter(RedactingFormatter(inner, secrets))


# Words that make a key's value secret, matched on whole words of the key ("hf_token",
# "S3_SECRET_ACCESS_KEY", "apiKey"), not substrings: vLLM's config has "max_num_batched_tokens",
# "tokenizer" and "dbo_decode_token_threshold", which are not secrets.
SECRET_WORDS = frozenset(
    {
        "token",
        "secret",
        "password",
        "passwd",
        "credential",
        "credentials",
        "authorization",
        "auth",
        "cookie",
        "apikey",
        "key",
        "keys",
    }
)
_CAMEL = re.compile(r"([a-z0-9])([A-Z])")
_WORD_SPLIT = re.compile(r"[^a-z0-9]+")
# Inside strings: "NAME=value" / "name: value" / "name='value'" assignments whose NAME has a secret
# word (env dumps such as collect_env's env_vars, and the text form of vLLM's config), bearer
# credentials, and Hugging Face tokens by their published shape.
_ASSIGNMENT = re.compile(
    r"(?P<name>\b[A-Za-z0-9_]*(?:TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?|API_?KEY|ACCESS_KEY|"
    r"PRIVATE_KEY|AUTHORIZATION)\b)(?P<sep>\s*[=:]\s*)"
    r"(?P<value>'[^']*'|\"[^\"]*\"|[^\s,;)\]}]+)",
    re.IGNORECASE,
)
_BEARER = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,}")
_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{20,}\b")
_HARMLESS = frozenset({"none", "null", "true", "false", "''", '""'})
REDACTED = "<redacted>"


def secret_key(name: str) -> bool:
    words = _WORD_SPLIT.split(_CAMEL.sub(r"\1_\2", name).lower())
    return any(w in SECRET_WORDS for w in words)


def _redact_assignment(match: re.Match[str]) -> str:
    value = match.group("value")
    if value.lower() in _HARMLESS or value.lstrip("-").replace(".", "", 1).isdigit():
        return match.group(0)
    return f"{match.group('name')}{match.group('sep')}{REDACTED}"


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` without the known secrets, secret assignments, bearer credentials or HF tokens."""
    text = scrub(text, secrets)
    text = _BEARER.sub(lambda m: f"{m.group(1)} {REDACTED}", text)
    text = _ASSIGNMENT.sub(_redact_assignment, text)
    return _HF_TOKEN.sub(REDACTED, text)


def redact(value: Any, secrets: Sequence[str] = (), *, inside_secret: bool = False) -> Any:
    """Deep copy of a JSON value (a replica's /server_info) fit to echo: every non-empty string
    under a secret-named key is replaced (numbers, booleans and nulls are kept: "hf_token": null
    is not a leak, and "max_num_batched_tokens" is not a secret), and every other string is
    cleaned by ``redact_text`` (the upstream token, env-dump assignments, bearer credentials)."""
    if isinstance(value, dict):
        return {
            k: redact(
                v, secrets, inside_secret=inside_secret or (isinstance(k, str) and secret_key(k))
            )
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact(v, secrets, inside_secret=inside_secret) for v in value]
    if isinstance(value, str):
        if inside_secret and value:
            return REDACTED
        return redact_text(value, secrets)
    return value


def settings_secrets(settings: Settings) -> list[str]:
    """Every secret the settings hold: the upstream token and all inbound keys."""
    out = [k.get_secret_value() for k in (*settings.api_keys, *settings.admin_keys)]
    if settings.upstream_token is not None:
        out.append(settings.upstream_token.get_secret_value())
    return [s for s in out if s]


# -- start-up posture -----------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def posture(settings: Settings) -> list[tuple[int, str]]:
    """The start-up log lines (level, message) that say how exposed the proxy is."""
    lines: list[tuple[int, str]] = []
    keys = bool(settings.api_keys or settings.admin_keys)
    where = f"{settings.host}:{settings.port}"
    if not keys:
        if is_loopback(settings.host):
            lines.append(
                (
                    logging.INFO,
                    f"no PROXY_API_KEYS/PROXY_ADMIN_KEYS: listening on loopback only ({where}); "
                    "every endpoint is open to local processes",
                )
            )
        else:
            lines.append(
                (
                    logging.WARNING,
                    f"no PROXY_API_KEYS/PROXY_ADMIN_KEYS and listening on {where} "
                    "(PROXY_ALLOW_UNAUTHENTICATED=true): anyone who reaches this port can load "
                    "adapters, pause the fleet and spend the upstream token",
                )
            )
    else:
        lines.append(
            (
                logging.INFO,
                f"inbound auth on ({len(settings.api_keys)} data key(s), "
                f"{len(settings.admin_keys)} admin key(s)); /health and /metrics stay open",
            )
        )
        if not settings.admin_keys:
            lines.append(
                (
                    logging.WARNING,
                    "PROXY_API_KEYS without PROXY_ADMIN_KEYS: control-plane endpoints (adapter "
                    "load, pause, resume) refuse every caller with 403",
                )
            )
    if settings.adapter_roots:
        lines.append(
            (logging.INFO, f"adapters may be loaded from: {', '.join(settings.adapter_roots)}")
        )
    else:
        lines.append(
            (
                logging.INFO if is_loopback(settings.host) else logging.WARNING,
                "PROXY_ADAPTER_ROOTS is not set: any lora_path is passed to the replicas",
            )
        )
    if settings.upstream_insecure:
        lines.append(
            (
                logging.WARNING,
                "PROXY_UPSTREAM_INSECURE=true: replicas' TLS certificates are NOT verified",
            )
        )
    return lines


# -- OpenAPI request bodies (documentation and fuzzing; handlers read raw bodies) ------------


def _json_body(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": dict(schema)}},
        }
    }


_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
COMPLETION_BODY = _json_body(
    {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            "model": {"type": "string"},
            "prompt": {
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "string"}, "minItems": 1},
                    _TOKEN_IDS,
                    {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
                ]
            },
            "max_tokens": {"type": "integer", "minimum": 1},
            "temperature": {"type": "number"},
            "n": {"type": "integer", "minimum": 1},
            "seed": {"type": "integer"},
            "stream": {"type": "boolean"},
            "cache_salt": {"type": "string", "minLength": 1},
            "return_token_ids": {"type": "boolean"},
            "logprobs": {"type": "integer", "minimum": 0},
        },
    }
)
CHAT_BODY = _json_body(
    {
        "type": "object",
        "required": ["messages"],
        "properties": {
            "model": {"type": "string"},
            "messages": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["role"],
                    "properties": {
                        "role": {"type": "string"},
                        "content": {
                            "anyOf": [
                                {"type": "string"},
                                {"type": "null"},
                                {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "properties": {
                                            "type": {"type": "string"},
                                            "text": {"type": "string"},
                                        },
                                    },
                                },
                            ]
                        },
                    },
                },
            },
            "stream": {"type": "boolean"},
            "cache_salt": {"type": "string", "minLength": 1},
        },
    }
)
LOAD_BODY = _json_body(
    {
        "type": "object",
        "required": ["lora_name", "lora_path"],
        "properties": {
            "lora_name": {"type": "string", "minLength": 1},
            "lora_path": {"type": "string", "minLength": 1},
            "load_inplace": {"type": "boolean"},
        },
    }
)
UNLOAD_BODY = _json_body(
    {
        "type": "object",
        "required": ["lora_name"],
        "properties": {"lora_name": {"type": "string", "minLength": 1}},
    }
)
