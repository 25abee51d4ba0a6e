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

from proxy.checks import MIN_KEY_CHARS, is_loopback, normalize_root
from proxy.security.adapter_roots import AdapterRoots
from proxy.security.guard import Guard, SecurityMiddleware
from proxy.security.keys import KeyRing, credential_from
from proxy.security.limits import (
    FALLBACK_MAX_PROMPT_TOKENS,
    BodyTooLarge,
    HeadersTooLarge,
    PromptLimits,
)
from proxy.security.planes import ADMIN_PATHS, OPEN_PATHS, Plane, classify, path_problem
from proxy.security.posture import posture
from proxy.security.redaction import (
    REDACTED,
    RedactingFormatter,
    install_log_redaction,
    mask,
    redact,
    redact_text,
    scrub,
    secret_key,
)
from proxy.security.schemas import CHAT_BODY, COMPLETION_BODY, LOAD_BODY, UNLOAD_BODY

__all__ = [
    "ADMIN_PATHS",
    "CHAT_BODY",
    "COMPLETION_BODY",
    "FALLBACK_MAX_PROMPT_TOKENS",
    "LOAD_BODY",
    "MIN_KEY_CHARS",
    "OPEN_PATHS",
    "REDACTED",
    "UNLOAD_BODY",
    "AdapterRoots",
    "BodyTooLarge",
    "Guard",
    "HeadersTooLarge",
    "KeyRing",
    "Plane",
    "PromptLimits",
    "RedactingFormatter",
    "SecurityMiddleware",
    "classify",
    "credential_from",
    "install_log_redaction",
    "is_loopback",
    "mask",
    "normalize_root",
    "path_problem",
    "posture",
    "redact",
    "redact_text",
    "scrub",
    "secret_key",
]
