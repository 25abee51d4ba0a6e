"""Inbound security: who may call what (open, data and admin planes), which adapters may be
loaded, how big a request may be, and keeping the upstream token out of everything the proxy
says. One concept per module; callers import from the module that holds the name. The rules
and their reasons: docs/security.md."""

from __future__ import annotations

from proxy.security.redaction import redact

__all__ = ["redact"]
