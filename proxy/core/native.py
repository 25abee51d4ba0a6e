"""Which implementation runs the pure primitives: the C extension or the pure-Python reference.

``proxy.core._native`` (proxy/core/_native.c, built by ``pip install -e .`` / ``make setup``)
scans a token-id prompt from the request bytes and the generated ids from the answer's, and
computes the chained block keys (XXH3 and vLLM's exact digests); the pure-Python path (orjson +
``array('I')`` in hotpath/extract/dataplane, xxhash and hashlib in hashing) stays the
specification, tested against the extension on vectors and on random and adversarial bodies.
Routing decisions are Python only.
PROXY_NATIVE picks: ``auto`` (the extension when it is built), ``on`` (refuse to start without
it), ``off``.
"""

from __future__ import annotations

from types import ModuleType

NATIVE_MODES = ("auto", "on", "off")

try:
    from proxy.core import _native

    MODULE: ModuleType | None = _native
except ImportError:  # not built (no compiler at install time): the reference path runs
    MODULE = None


def available() -> bool:
    return MODULE is not None


def resolve(mode: str) -> bool:
    """Whether the extension runs under PROXY_NATIVE=``mode``; ``on`` without it is an error."""
    if mode not in NATIVE_MODES:
        raise ValueError(f"unknown native mode {mode!r}; one of {NATIVE_MODES}")
    if mode == "on" and MODULE is None:
        raise RuntimeError(
            "PROXY_NATIVE=on but the C extension proxy.core._native is not built "
            "(reinstall with a C compiler: make setup, or pip install -e .)"
        )
    return mode != "off" and MODULE is not None


def module_for(use_native: bool | None) -> ModuleType | None:
    """The extension when ``use_native`` asks for it (None: whenever it is built), else None.
    Asking for it when it is not built is an error, never a silent fallback."""
    if use_native is None:
        return MODULE
    if use_native and MODULE is None:
        raise RuntimeError("the C extension proxy.core._native was asked for but is not built")
    return MODULE if use_native else None
