"""Secrets out of everything the proxy says: response masking, log-line redaction, and the
cleaning of replica answers it echoes (``/server_info``, error messages)."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from typing import Any


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
    arguments and traceback alike)."""

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
    under a secret-named key is replaced (other scalars are kept: "hf_token": null is no leak),
    and every other string is cleaned by ``redact_text``."""
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
