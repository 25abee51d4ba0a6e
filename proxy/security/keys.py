"""Inbound keys: configured keys as digests, compared in constant time, and the key a client
presents (Bearer, or HTTP Basic for TRL; docs/security.md)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Iterable

from proxy.security.planes import Plane


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class KeyRing:
    """Digests of the configured keys; ``role`` answers in time independent of the key."""

    def __init__(self, data_keys: Iterable[str] = (), admin_keys: Iterable[str] = ()) -> None:
        self._admin = tuple(_digest(k) for k in admin_keys)
        self._data = tuple(_digest(k) for k in data_keys)

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
