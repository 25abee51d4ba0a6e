"""The proxy over HTTP with PROXY_NATIVE=on and off: the same routing and the same answers.

The C extension's own equivalence with the pure-Python reference is property-tested in
tests/unit/test_native.py; this checks the wiring: the setting picks the implementation, the
metric says which runs, and a real proxy in front of fake replicas routes and refuses alike.
"""

from __future__ import annotations

import random

import pytest

from proxy.core import native
from tests.integration.test_proxy_http import load, make_prompt, metric, rollout

MODES = [
    pytest.param("off", id="python"),
    pytest.param(
        "on",
        id="native",
        marks=pytest.mark.skipif(not native.available(), reason="C extension not built"),
    ),
]

BAD_BODIES = [
    b'{"model":"trl-policy-v1","prompt":[1,2,-3]}',
    b'{"model":"trl-policy-v1","prompt":[1,true]}',
    b'{"model":"trl-policy-v1","prompt":[]}',
    b'{"model":"trl-policy-v1","prompt":[1,2],"stream":"yes"}',
    b'{"model":5,"prompt":[1,2]}',
    b'{"model":"trl-policy-v1","prompt":[1,2,]}',
    b'{"model":"trl-policy-v1","prompt":[4294967296]}',
]


def served(make_fleet, mode: str) -> tuple[list[str], list[tuple[int, str]]]:
    h = make_fleet(2, native=mode)
    assert metric(h, "rollout_proxy_native_info", implementation="c" if mode == "on" else "python")
    assert load(h, "trl-policy-v1").status_code == 200
    rng = random.Random(5)
    homes = []
    for group in range(6):
        p = make_prompt(rng)
        for s in range(4):
            r = h.client.post("/v1/completions", json=rollout("trl-policy-v1", p, group * 10 + s))
            assert r.status_code == 200
            homes.append(r.headers["x-proxy-replica"])
    errors = []
    for raw in BAD_BODIES:
        r = h.client.post(
            "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
        errors.append((r.status_code, r.json()["error"]["message"]))
    return homes, errors


@pytest.mark.parametrize("mode", MODES)
def test_a_group_routes_together_and_bad_prompts_are_refused(make_fleet, mode: str) -> None:
    homes, errors = served(make_fleet, mode)
    groups = [homes[i : i + 4] for i in range(0, len(homes), 4)]
    assert all(len(set(g)) == 1 for g in groups), groups
    assert all(status == 400 for status, _ in errors), errors


@pytest.mark.skipif(not native.available(), reason="C extension not built")
def test_both_implementations_route_and_refuse_identically(make_fleet) -> None:
    assert served(make_fleet, "on") == served(make_fleet, "off")
