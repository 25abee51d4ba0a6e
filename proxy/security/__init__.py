"""Inbound security: who may call what (open, data and admin planes), which adapters may be
loaded, how big a request may be, and keeping the upstream token out of everything the proxy
says. The rules and their reasons: docs/security.md."""

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
