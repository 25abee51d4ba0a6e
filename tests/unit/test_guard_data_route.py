"""``Guard.check_data_route_head`` (the completions front's shortcut) refuses exactly what
``Guard.check_head`` refuses, with the same error, for the proxy's own data routes."""

from __future__ import annotations

import random

import pytest

from proxy.hotpath import HOT_ROUTES
from proxy.security.guard import Guard
from proxy.security.keys import KeyRing


def _outcome(problem: object) -> tuple[str, str] | None:
    return None if problem is None else (type(problem).__name__, str(problem))


@pytest.mark.parametrize("seed", range(200))
def test_shortcut_agrees_with_the_full_check(seed: int) -> None:
    rng = random.Random(seed)
    keys = rng.choice([KeyRing(), KeyRing(["data-key"], ["admin-key"])])
    guard = Guard(
        keys, max_body_bytes=rng.choice([100, 10_000]), max_header_bytes=rng.choice([200, 8192])
    )
    path = rng.choice(list(HOT_ROUTES))
    headers = [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json")]
    auth = rng.choice(
        [None, b"Bearer data-key", b"Bearer admin-key", b"Bearer wrong", b"Basic eDpkYXRhLWtleQ=="]
    )
    if auth is not None:
        headers.append((b"authorization", auth))
    length = rng.choice([None, b"50", b"5000", b"50000", b"-1", b"1e3", b""])
    if length is not None:
        headers.append((b"content-length", length))
    if rng.random() < 0.3:
        headers.append((b"x-padding", b"p" * rng.randrange(300)))
    rng.shuffle(headers)
    scope = {"path": path, "raw_path": path.encode(), "query_string": b"", "headers": headers}
    assert _outcome(guard.check_data_route_head(scope)) == _outcome(guard.check_head(scope))
