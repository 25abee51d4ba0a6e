"""The defects issue 11 found, reproduced over HTTP exactly as a user met them (each failed
before the control plane was restructured around the reconciler).

1. Replicas without ``/is_paused`` (404): the fleet kept paused across several probe rounds made
   the health loop re-send /pause forever, both replicas stuck in ``reconciling`` with an empty
   reason, and every later control call was refused with 502.
2. ``GET /server_info`` without ``?config_format=json`` (vLLM's default text form, where
   ``vllm_config`` is one string) answered 500.
"""

from __future__ import annotations

import time

from tests.support.fake_vllm import FakeVllm


def rollout(model: str, seed: int) -> dict[str, object]:
    return {
        "model": model,
        "prompt": list(range(40)),
        "max_tokens": 4,
        "return_token_ids": True,
        "logprobs": 0,
        "seed": seed,
    }


def test_sync_with_replicas_lacking_is_paused_keeps_every_call_200(make_fleet) -> None:
    fakes = [FakeVllm(name=f"r{i}", missing_paths={"/is_paused"}) for i in range(2)]
    h = make_fleet(fakes=fakes)
    statuses: list[tuple[str, int, str]] = []

    def call(path: str, **kwargs: object) -> None:
        r = h.client.post(path, **kwargs)  # type: ignore[arg-type]
        statuses.append((path, r.status_code, r.text[:300]))

    for version in (1, 2, 3):
        call("/pause", params={"mode": "keep"})
        # TRL saves the adapter meanwhile: many probe rounds (0.1 s each here) pass paused.
        time.sleep(0.8)
        call(
            "/v1/load_lora_adapter",
            json={"lora_name": f"trl-policy-v{version}", "lora_path": f"/a/v{version}"},
        )
        call("/resume")
        time.sleep(0.3)
        for seed in range(4):
            r = h.client.post("/v1/completions", json=rollout(f"trl-policy-v{version}", seed))
            statuses.append(("completion", r.status_code, r.text[:300]))
    refused = [s for s in statuses if s[1] != 200]
    assert not refused, refused
    fleet = h.client.get("/admin/fleet").json()
    assert [r["status"] for r in fleet["replicas"]] == ["ready", "ready"], fleet
    assert all(not f.paused for f in h.fakes)
    # Unknown, not guessed: the fleet view says the pause state is not observable.
    assert all(r["observed"]["paused"] == "unknown" for r in fleet["replicas"]), fleet


def test_pause_is_not_resent_every_round_when_it_cannot_be_observed(make_fleet) -> None:
    fakes = [FakeVllm(name=f"r{i}", missing_paths={"/is_paused"}) for i in range(2)]
    h = make_fleet(fakes=fakes)
    assert h.client.post("/pause", params={"mode": "keep"}).status_code == 200
    time.sleep(1.0)  # ~10 probe rounds
    pauses = [p for f in h.fakes for p, _ in f.control_calls() if p.startswith("/pause")]
    assert len(pauses) == 2, pauses  # one per replica: the successful apply is trusted


def test_server_info_text_format_is_served(make_fleet) -> None:
    h = make_fleet(2)
    r = h.client.get("/server_info")
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body["vllm_config"], str)
    assert body["rollout_proxy"]["replicas"] == 2
