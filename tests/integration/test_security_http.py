"""Issue 8 over real HTTP: keys per plane, canonical paths, the adapter allow-list, request
limits, header hygiene (hop-by-hop, Host, the client's own key), each against fake vLLM replicas
behind the proxy, asserting also what the replicas did *not* receive."""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response

from tests.support.fake_vllm import FakeVllm

DATA_KEY = "data-key-0123456789abcdef"
ADMIN_KEY = "admin-key-0123456789abcdef"
UPSTREAM = "upstream-token-0123456789abcdef"
KEYS = {"api_keys": DATA_KEY, "admin_keys": ADMIN_KEY}


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def completion(prompt: Any = None, model: str = "tiny/base", **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt or [1, 2, 3], "max_tokens": 4, **extra}


def raw_request(url: str, method: str, path: str, headers: dict[str, str] | None = None) -> int:
    """Send ``path`` exactly as written (httpx and requests resolve '..' before sending)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request(
            method, path, body=b"{}", headers={"content-type": "application/json"} | (headers or {})
        )
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def metric(h, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(h.client.get("/metrics").text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


# -- keys -------------------------------------------------------------------------------------

OPEN = [("GET", "/health", None), ("GET", "/livez", None), ("GET", "/metrics", None)]
DATA = [
    ("POST", "/v1/completions", completion()),
    ("POST", "/v1/chat/completions", {"model": "tiny/base", "messages": [{"role": "user"}]}),
    ("GET", "/v1/models", None),
    ("GET", "/server_info", None),
    ("GET", "/is_paused", None),
    ("POST", "/v1/tokenize", {"prompt": "hi"}),
    ("GET", "/openapi.json", None),
]
ADMIN = [
    ("POST", "/pause?mode=keep", None),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "trl-policy-v1", "lora_path": "/b/v1"}),
    ("POST", "/resume", None),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "trl-policy-v1"}),
    ("POST", "/reset_prefix_cache", None),
    ("GET", "/admin/fleet", None),
    ("POST", "/admin/replicas/0/undrain", None),
    ("GET", "/get_world_size", None),
    ("POST", "/init_weight_transfer_engine", {}),
    ("POST", "/update_weights", {}),
]


def call(h, method: str, path: str, body: Any, headers: dict[str, str]) -> httpx.Response:
    return h.client.request(method, path, json=body, headers=headers)


def test_every_endpoint_is_gated_by_its_plane(make_fleet) -> None:
    h = make_fleet(2, upstream_token=UPSTREAM, **KEYS)
    for method, path, body in OPEN:
        assert call(h, method, path, body, {}).status_code == 200, path
    for method, path, body in DATA + ADMIN:
        r = call(h, method, path, body, {})
        assert r.status_code == 401, (path, r.status_code)
        assert r.json()["error"]["type"] == "AuthenticationError"
        assert call(h, method, path, body, auth("x" * 30)).status_code == 401, path
    for method, path, body in ADMIN:
        r = call(h, method, path, body, auth(DATA_KEY))
        assert r.status_code == 403, (path, r.status_code)
        assert r.json()["error"]["type"] == "PermissionDeniedError"
    # Nothing refused reached a replica.
    assert all(not f.control_calls() and not f.served for f in h.fakes)
    for method, path, body in DATA:
        r = call(h, method, path, body, auth(DATA_KEY))
        assert r.status_code not in (401, 403), (path, r.status_code, r.text)
        assert call(h, method, path, body, auth(ADMIN_KEY)).status_code not in (401, 403)
    for method, path, body in ADMIN:
        r = call(h, method, path, body, auth(ADMIN_KEY))
        assert r.status_code not in (401, 403), (path, r.status_code, r.text)
    assert [p for p, _ in h.fakes[0].control_calls()] == [
        "/pause?mode=keep",
        "/v1/load_lora_adapter",
        "/resume",
        "/v1/unload_lora_adapter",
        "/reset_prefix_cache",
    ]
    assert metric(h, "rollout_proxy_requests_total", status="401") == 2 * len(DATA + ADMIN)
    assert metric(h, "rollout_proxy_requests_total", status="403") == len(ADMIN)


def test_no_keys_configured_means_open(make_fleet) -> None:
    h = make_fleet(1)
    assert h.client.post("/pause").status_code == 200
    assert h.client.post("/resume").status_code == 200
    assert h.client.post("/v1/completions", json=completion()).status_code == 200


def test_clients_key_never_reaches_a_replica(make_fleet) -> None:
    h = make_fleet(1, upstream_token=UPSTREAM, **KEYS)
    r = h.client.post("/v1/completions", json=completion(), headers=auth(DATA_KEY))
    assert r.status_code == 200
    seen = h.fakes[0].seen_headers[-1]
    assert seen["authorization"] == f"Bearer {UPSTREAM}"
    assert DATA_KEY not in json.dumps(seen)


def test_basic_auth_from_url_credentials(make_fleet) -> None:
    """What TRL does when the key is put in vllm_server_base_url: requests (trainer) and
    aiohttp (rollout worker) both send it as HTTP Basic auth."""
    requests = pytest.importorskip("requests")
    aiohttp = pytest.importorskip("aiohttp")
    h = make_fleet(1, **KEYS)
    port = urlsplit(h.proxy.url).port
    admin_url = f"http://trl:{ADMIN_KEY}@127.0.0.1:{port}"
    data_url = f"http://eval:{DATA_KEY}@127.0.0.1:{port}"
    assert requests.post(f"{admin_url}/pause", params={"mode": "keep"}, timeout=10).ok
    assert requests.post(f"{admin_url}/resume", timeout=10).ok
    assert requests.post(f"{data_url}/pause", timeout=10).status_code == 403
    keyless = f"http://trl:wrong-key-0000000000000@127.0.0.1:{port}"
    assert requests.get(f"{keyless}/v1/models", timeout=10).status_code == 401
    assert requests.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200

    async def rollout() -> int:
        async with (
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4)) as session,
            session.post(f"{data_url}/v1/completions", json=completion()) as response,
        ):
            await response.read()
            return response.status

    assert asyncio.run(rollout()) == 200


def test_trl_vllm_client_with_the_key_in_its_url(make_fleet, tmp_path) -> None:
    pytest.importorskip("trl")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.async_grpo.vllm_client import VLLMClient
    from accelerate import PartialState

    PartialState()
    h = make_fleet(2, **KEYS)
    port = urlsplit(h.proxy.url).port
    client = VLLMClient(f"http://trl:{ADMIN_KEY}@127.0.0.1:{port}", server_timeout=10)
    client.wait_for_server_ready(poll_interval_s=0.1)
    assert client.get_max_model_len() == 4096
    assert client.get_server_info()["lora_config"]["max_loras"] == 6
    (tmp_path / "trl-policy-v1").mkdir()
    client.pause()
    client.load_lora_adapter("trl-policy-v1", str(tmp_path / "trl-policy-v1"))
    client.resume()
    assert all(f.adapters == {"trl-policy-v1": str(tmp_path / "trl-policy-v1")} for f in h.fakes)
    data_client = VLLMClient(f"http://trl:{DATA_KEY}@127.0.0.1:{port}", server_timeout=10)
    with pytest.raises(Exception, match="403"):
        data_client.pause()


# -- canonical paths ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/v1/../pause",
        "/v1/%2e%2e/pause",
        "/v1/%2E%2E/pause?mode=abort",
        "/v1/./../pause",
        "/v1//pause",
        "/v1/load_lora_adapter/",
        "/v1/x%2F..%2F..%2Fpause",
        "/v1/%252e%252e/pause",
        "/v1/completions%23",
    ],
)
@pytest.mark.parametrize("keyed", [True, False])
def test_path_tricks_never_reach_a_replica(make_fleet, path: str, keyed: bool) -> None:
    h = make_fleet(1, **(KEYS if keyed else {}))
    headers = auth(DATA_KEY) if keyed else {}
    assert raw_request(h.proxy.url, "POST", path, headers) == 400
    assert not h.fakes[0].control_calls() and not h.fakes[0].paused
    assert not [c for c in h.fakes[0].calls if "pause" in c[1]]


# -- adapter roots ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/etc/passwd",
        "/bucket/../etc/passwd",
        "/bucket/x/../../etc",
        "/bucketX/trl-policy-v1",
        "bucket/trl-policy-v1",
        "Qwen/some-public-lora",
        "/bucket/trl\x00-policy",
    ],
)
def test_adapter_outside_the_roots_is_400_before_any_replica(make_fleet, path: str) -> None:
    h = make_fleet(2, adapter_roots="/bucket")
    r = h.client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "lora_path" and err["type"] == "BadRequestError"
    assert "PROXY_ADAPTER_ROOTS" in err["message"]
    assert all(not f.control_calls() for f in h.fakes)


def test_adapter_inside_the_roots_loads(make_fleet) -> None:
    h = make_fleet(2, adapter_roots="/bucket/,/data/run")
    for name, path in (("a", "/bucket/trl-policy-v1"), ("b", "/data/run//x/./y/")):
        r = h.client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        assert r.status_code == 200, r.text
    # The replicas get the path as sent: normalising is for the check, not a rewrite.
    assert h.fakes[0].adapters == {"a": "/bucket/trl-policy-v1", "b": "/data/run//x/./y/"}


# -- limits -------------------------------------------------------------------------------------


def test_body_size_limit_declared_and_streamed(make_fleet) -> None:
    h = make_fleet(1, max_body_bytes=64 * 1024)
    big = completion(prompt=list(range(20_000)))  # ~130 KB of JSON
    r = h.client.post("/v1/completions", json=big)
    assert r.status_code == 413
    assert "PROXY_MAX_BODY_BYTES" in r.json()["error"]["message"]
    payload = json.dumps(big).encode()

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(payload), 8192):
            yield payload[i : i + 8192]

    r = h.client.post(
        "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413
    assert r.json()["error"]["type"] == "RequestTooLargeError"
    assert not h.fakes[0].served
    small = completion(prompt=list(range(1000)))
    assert h.client.post("/v1/completions", json=small).status_code == 200
    assert metric(h, "rollout_proxy_requests_total", status="413") == 2


def test_load_body_is_limited_too(make_fleet) -> None:
    h = make_fleet(1, max_body_bytes=4096)
    body = {"lora_name": "x", "lora_path": "/b/" + "a" * 5000}
    assert h.client.post("/v1/load_lora_adapter", json=body).status_code == 413
    assert not h.fakes[0].control_calls()


def test_prompt_length_defaults_to_the_fleets_max_model_len(make_fleet) -> None:
    fakes = [FakeVllm(name="a", max_model_len=4096), FakeVllm(name="b", max_model_len=2048)]
    h = make_fleet(fakes=fakes)
    r = h.client.post("/v1/completions", json=completion(prompt=[7] * 2049))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "prompt" and "2049 tokens; at most 2048" in err["message"]
    assert "max_model_len" in err["message"]
    assert h.client.post("/v1/completions", json=completion(prompt=[7] * 2048)).status_code == 200
    r = h.client.post("/v1/completions", json=completion(prompt=[[1], [7] * 3000]))
    assert r.status_code == 400 and "3000 tokens" in r.json()["error"]["message"]
    assert len(fakes[0].served) + len(fakes[1].served) == 1


def test_prompt_length_and_batch_settings(make_fleet) -> None:
    h = make_fleet(1, max_prompt_tokens=100, max_batch_prompts=4)
    assert h.client.post("/v1/completions", json=completion(prompt=[1] * 100)).status_code == 200
    r = h.client.post("/v1/completions", json=completion(prompt=[1] * 101))
    assert r.status_code == 400 and "PROXY_MAX_PROMPT_TOKENS" in r.json()["error"]["message"]
    r = h.client.post("/v1/completions", json=completion(prompt=["a"] * 5))
    assert r.status_code == 400 and "PROXY_MAX_BATCH_PROMPTS" in r.json()["error"]["message"]
    assert h.client.post("/v1/completions", json=completion(prompt=[[1]] * 4)).status_code == 200
    assert len(h.fakes[0].served) == 2


def test_header_size_limit(make_fleet) -> None:
    h = make_fleet(1, max_header_bytes=4096)
    r = h.client.get("/v1/models", headers={"x-padding": "p" * 8000})
    assert r.status_code == 431
    assert "PROXY_MAX_HEADER_BYTES" in r.json()["error"]["message"]
    assert h.client.get("/v1/models", headers={"x-padding": "p" * 1000}).status_code == 200


# -- header hygiene -----------------------------------------------------------------------------

HOP_BY_HOP_IN = {
    "connection": "keep-alive, x-hop-secret",
    "x-hop-secret": "listed-in-connection",
    "keep-alive": "timeout=99",
    "proxy-authorization": "Basic cHJveHk6c2VjcmV0",
    "te": "trailers",
    "x-forwarded-for": "6.6.6.6",
    "cookie": "session=client-cookie",
    "host": "evil.example",
}
HOP_BY_HOP_OUT = {
    "keep-alive": "timeout=99",
    "proxy-authenticate": "Basic realm=upstream",
    "set-cookie": "replica-session=abc",
    "trailer": "x-checksum",
    "x-internal-route": "gpu-7",
    "server": "vllm-internal/0.33",
}


@dataclass
class LeakyVllm(FakeVllm):
    """Answers with hop-by-hop and internal headers, and records what it was sent."""

    async def completions(self, request: Request) -> Response:
        response = await super().completions(request)
        response.headers.update(HOP_BY_HOP_OUT)
        return response

    async def tokenize(self, request: Request) -> Response:
        self.seen_headers.append(dict(request.headers))
        response = await super().tokenize(request)
        response.headers.update(HOP_BY_HOP_OUT)
        return response


def _assert_clean(seen: dict[str, str], replica_url: str) -> None:
    for name in HOP_BY_HOP_IN:
        if name in ("host", "connection"):
            continue
        assert name not in seen, name
    assert seen["host"] == urlsplit(replica_url).netloc  # httpx sets Host from the URL
    assert "x-hop-secret" not in seen.get("connection", "")


def _assert_relayed_clean(response: httpx.Response) -> None:
    for name, value in HOP_BY_HOP_OUT.items():
        assert response.headers.get(name) != value, name
    assert "set-cookie" not in response.headers and "x-internal-route" not in response.headers


def test_hop_by_hop_and_host_are_not_forwarded(make_fleet) -> None:
    fake = LeakyVllm(name="r0")
    h = make_fleet(fakes=[fake])
    r = h.client.post("/v1/completions", json=completion(), headers=HOP_BY_HOP_IN)
    assert r.status_code == 200
    _assert_clean(fake.seen_headers[-1], h.replicas[0].url)
    _assert_relayed_clean(r)
    with h.client.stream(
        "POST", "/v1/completions", json=completion(stream=True), headers=HOP_BY_HOP_IN
    ) as r:
        assert r.status_code == 200
        r.read()
        _assert_relayed_clean(r)
    _assert_clean(fake.seen_headers[-1], h.replicas[0].url)
    r = h.client.post("/v1/tokenize", json={"prompt": "hi"}, headers=HOP_BY_HOP_IN)
    assert r.status_code == 200
    _assert_clean(fake.seen_headers[-1], h.replicas[0].url)
    _assert_relayed_clean(r)


def test_cookies_a_replica_sets_are_never_replayed() -> None:
    """The upstream client is shared by every caller: a replica's Set-Cookie must not ride
    along on later requests. A host name, not an IP: aiohttp's default jar ignores IPs."""
    from proxy.app import create_app
    from proxy.settings import Settings
    from tests.support.servers import ServerThread

    fake = LeakyVllm(name="r0")
    replica = ServerThread(fake.app()).start()
    app = create_app(Settings(replicas=[f"http://localhost:{replica.port}"]))
    proxy = ServerThread(app).start()
    try:
        with httpx.Client(base_url=proxy.url, timeout=30) as client:
            for _ in range(3):
                assert client.post("/v1/completions", json=completion()).status_code == 200
                assert client.post("/v1/tokenize", json={"prompt": "x"}).status_code == 200
        assert len(fake.seen_headers) == 6
        assert all("cookie" not in seen for seen in fake.seen_headers)
    finally:
        proxy.stop()
        replica.stop()
