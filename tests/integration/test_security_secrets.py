"""The upstream token never leaves the proxy except towards a replica.

A full session through the proxy over real HTTP -- health, server_info, models, load (ok and
failing), pause, resume, completions (plain, streamed, invalid, unknown model, too long, a dead
replica, a hung replica), unload, admin, metrics -- with every log record of every logger at
DEBUG (the proxy's, httpx/httpcore, aiohttp, uvicorn's) and every response status, header and
body kept; then the token is searched for in all of it. The replicas themselves try to leak it:
their /server_info dumps it as HF_TOKEN, and a failing load quotes it back in the error.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Any

import httpx

from proxy.app import create_app
from proxy.settings import Settings
from tests.support.fake_vllm import FakeVllm
from tests.support.servers import ServerThread

ADMIN_KEY = "admin-key-" + secrets.token_hex(12)
DATA_KEY = "data-key-" + secrets.token_hex(12)
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


class Recorder:
    def __init__(self, client: httpx.Client) -> None:
        self.client = client
        self.seen: list[str] = []
        self.statuses: list[tuple[str, int]] = []

    def keep(self, label: str, response: httpx.Response, body: bytes) -> httpx.Response:
        head = "\n".join(f"{k}: {v}" for k, v in response.headers.multi_items())
        self.seen.append(f"{label} {response.status_code}\n{head}\n\n{body.decode('latin-1')}")
        self.statuses.append((label, response.status_code))
        return response

    def __call__(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        kwargs.setdefault("headers", {"authorization": f"Bearer {ADMIN_KEY}"})
        response = self.client.request(method, path, **kwargs)
        return self.keep(f"{method} {path}", response, response.content)

    def stream(self, path: str, body: dict[str, Any]) -> httpx.Response:
        headers = {"authorization": f"Bearer {DATA_KEY}"}
        with self.client.stream("POST", path, json=body, headers=headers) as response:
            data = b"".join(response.iter_raw())
        return self.keep(f"STREAM {path}", response, data)


def rollout(model: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 1.0,
        "n": 1,
        "return_token_ids": True,
        "logprobs": 0,
        "seed": 7,
    } | extra


def test_token_appears_in_no_log_and_no_response(caplog) -> None:
    token = "hf_" + secrets.token_hex(20)  # the shape of a real HF token
    fakes = [FakeVllm(name=f"r{i}", env_secret=token) for i in range(3)]
    replicas = [ServerThread(f.app()).start() for f in fakes]
    settings = Settings(
        replicas=[s.url for s in replicas],
        upstream_token=token,
        api_keys=DATA_KEY,
        admin_keys=ADMIN_KEY,
        adapter_roots="/bucket",
        health_interval_s=0.1,
        probe_timeout_s=2.0,  # the product's defaults: one slow probe on a busy machine is fine
        lora_retry_s=0.05,
        eject_after=2,
        upstream_timeout_s=0.5,
    )
    caplog.set_level(logging.DEBUG)  # the root logger: every logger that propagates
    app = create_app(settings)
    proxy = ServerThread(app).start()
    # uvicorn's own loggers do not propagate to the root: listen to them directly.
    for name in UVICORN_LOGGERS:
        logging.getLogger(name).addHandler(caplog.handler)
        logging.getLogger(name).setLevel(logging.DEBUG)
    client = httpx.Client(base_url=proxy.url, timeout=30)
    call = Recorder(client)
    try:
        call("GET", "/health")
        call("GET", "/livez")
        info = call("GET", "/server_info", params={"config_format": "json"}).json()
        assert info["vllm_env"]["HF_TOKEN"] == "<redacted>"  # the replicas did dump it
        call("GET", "/server_info")
        call("GET", "/v1/models")
        call("GET", "/is_paused")
        call("GET", "/admin/fleet")
        assert call("POST", "/pause", params={"mode": "keep"}).status_code == 200
        load = {"lora_name": "trl-policy-v1", "lora_path": "/bucket/trl-policy-v1"}
        assert call("POST", "/v1/load_lora_adapter", json=load).status_code == 200
        # Replicas (or a gateway in front of them) that quote the token back in an error. One
        # failing replica is ejected and the load still answers 200 (issue 11's rule), so
        # every replica fails here and the refusal quotes each of them.
        for f in fakes:
            f.load_failure = (500, f"invalid credentials: Bearer {token} (token={token})")
        load2 = {"lora_name": "trl-policy-v2", "lora_path": "/bucket/trl-policy-v2"}
        failed = call("POST", "/v1/load_lora_adapter", json=load2)
        assert failed.status_code >= 500 and "<redacted>" in failed.text, failed.text
        for f in fakes:
            f.load_failure = None
        call("POST", "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/etc/x"})
        assert call("POST", "/resume").status_code == 200
        data = {"authorization": f"Bearer {DATA_KEY}"}
        for seed in range(4):
            body = rollout("trl-policy-v1", [1, 2, 3], seed=seed)
            r = call("POST", "/v1/completions", json=body, headers=data)
            assert r.status_code == 200
        call.stream("/v1/completions", rollout("trl-policy-v1", list(range(40)), stream=True))
        call(
            "POST",
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
            headers=data,
        )
        call("POST", "/v1/completions", content=b"{not json", headers=data)
        call("POST", "/v1/completions", json=rollout("no-such-adapter", [1]), headers=data)
        call("POST", "/v1/completions", json=rollout("trl-policy-v1", [1] * 5000), headers=data)
        call("POST", "/v1/tokenize", json={"prompt": "hi"}, headers=data)
        call("POST", "/v1/completions", json=rollout("trl-policy-v1", [1]), headers={})
        call("POST", "/pause", headers=data)
        call("GET", "/get_world_size")
        call("POST", "/start_weight_update")
        # A hung replica (timeout, 504) and a dead one (ejected; requests go elsewhere).
        for f in fakes:
            f.hang_completions = True
        call("POST", "/v1/completions", json=rollout("trl-policy-v1", [9, 9]), headers=data)
        for f in fakes:
            f.hang_completions = False
        replicas[1].kill()
        for seed in range(6):
            call(
                "POST", "/v1/completions", json=rollout("trl-policy-v1", [seed, 5, 6]), headers=data
            )
        time.sleep(0.3)  # a few probe rounds fail on the dead replica
        call("GET", "/health")
        call("GET", "/admin/fleet")
        call("POST", "/v1/unload_lora_adapter", json={"lora_name": "trl-policy-v1"})
        call("POST", "/reset_prefix_cache")
        metrics = call("GET", "/metrics", headers={}).text
    finally:
        client.close()
        proxy.stop()
        for s in replicas:
            if s.thread.is_alive():
                s.stop()
        for name in UVICORN_LOGGERS:
            logging.getLogger(name).removeHandler(caplog.handler)

    # The token was in play: every live replica received it on every call.
    assert all(seen["authorization"] == f"Bearer {token}" for f in fakes for seen in f.seen_headers)
    assert sum(len(f.seen_headers) for f in fakes) >= 10
    codes = {code for _, code in call.statuses}
    assert {200, 400, 401, 403, 404, 409, 502}.issubset(codes), sorted(codes)
    assert codes & {502, 503, 504}, sorted(codes)
    assert "rollout_proxy_requests_total" in metrics

    responses = "\n\n".join(call.seen)
    assert token not in responses
    assert ADMIN_KEY not in responses and DATA_KEY not in responses

    records = caplog.records
    assert len(records) > 50  # DEBUG from httpx/httpcore/aiohttp/asyncio and the proxy itself
    assert {r.name.split(".")[0] for r in records} >= {"rollout_proxy"}
    logged = "\n".join(
        [caplog.text]
        + [r.getMessage() for r in records]
        + [json.dumps(getattr(r, "args", None), default=repr) for r in records]
    )
    for secret in (token, ADMIN_KEY, DATA_KEY):
        assert secret not in logged
    # Nothing had to be masked at the last line of defence: the token never got that far.
    assert "contained the upstream token" not in logged
    assert "unhandled error" not in logged
