"""Upstream TLS over real HTTPS replicas with a private CA (trustme), for both clients (the lean
pool for completions, httpx for control calls and probes): verification is on by default (an
unknown CA is refused, and says so), PROXY_UPSTREAM_CA_BUNDLE trusts exactly that CA,
PROXY_UPSTREAM_INSECURE is the explicit opt-out."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from proxy.app import create_app
from proxy.settings import Settings
from tests.support.fake_vllm import FakeVllm
from tests.support.servers import ServerThread

trustme = pytest.importorskip("trustme")


def tls_server(app: object, cert: Path, key: Path) -> ServerThread:
    """ServerThread's socket and lifecycle, serving HTTPS."""
    server = ServerThread(app)
    config = uvicorn.Config(
        app, log_level="warning", lifespan="auto", ssl_certfile=str(cert), ssl_keyfile=str(key)
    )
    server.server = uvicorn.Server(config)
    server.thread = threading.Thread(
        target=server.server.run, kwargs={"sockets": [server.sock]}, daemon=True
    )
    server.url = f"https://127.0.0.1:{server.port}"
    return server.start()


@pytest.fixture
def https_replicas(tmp_path: Path) -> Iterator[tuple[list[str], Path, list[FakeVllm]]]:
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    cert, key, bundle = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(bundle))
    fakes = [FakeVllm(name=f"r{i}") for i in range(2)]
    servers = [tls_server(f.app(), cert, key) for f in fakes]
    yield [s.url for s in servers], bundle, fakes
    for s in servers:
        s.stop()


def run_proxy(urls: list[str], **settings: object) -> tuple[ServerThread, httpx.Client]:
    app = create_app(Settings(replicas=urls, probe_timeout_s=2.0, **settings))
    proxy = ServerThread(app).start()
    return proxy, httpx.Client(base_url=proxy.url, timeout=30)


BODY = {"model": "tiny/base", "prompt": [1, 2, 3], "max_tokens": 4}


def test_unknown_ca_is_refused_and_named(https_replicas) -> None:
    urls, _, fakes = https_replicas
    proxy, client = run_proxy(urls, upstream_token="tls-token-x" * 3)
    try:
        r = client.get("/health")
        assert r.status_code == 503  # no replica can serve
        for replica in r.json()["replicas"].values():
            assert "TLS handshake failed" in replica["error"]
            assert "PROXY_UPSTREAM_CA_BUNDLE" in replica["error"]
        assert client.post("/v1/completions", json=BODY).status_code in (502, 503)
    finally:
        client.close()
        proxy.stop()
    # Not a single HTTP request (so not the token either) reached a replica.
    assert all(not f.calls and not f.seen_headers for f in fakes)


@pytest.mark.parametrize("mode", ["ca_bundle", "insecure"])
def test_ca_bundle_or_explicit_insecure_connects(https_replicas, mode: str) -> None:
    urls, bundle, fakes = https_replicas
    extra = (
        {"upstream_ca_bundle": str(bundle)} if mode == "ca_bundle" else {"upstream_insecure": True}
    )
    proxy, client = run_proxy(urls, **extra)
    try:
        assert client.get("/health").status_code == 200
        r = client.post("/v1/completions", json=BODY)
        assert r.status_code == 200 and r.json()["served_by"] in ("r0", "r1")
        load = {"lora_name": "trl-policy-v1", "lora_path": "/bucket/trl-policy-v1"}
        assert client.post("/v1/load_lora_adapter", json=load).status_code == 200
    finally:
        client.close()
        proxy.stop()
    assert all(f.adapters == {"trl-policy-v1": "/bucket/trl-policy-v1"} for f in fakes)


def test_a_bundle_trusts_only_its_own_ca(https_replicas, tmp_path: Path) -> None:
    urls, _, _ = https_replicas
    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    proxy, client = run_proxy(urls, upstream_ca_bundle=str(other))
    try:
        assert client.get("/health").status_code == 503
    finally:
        client.close()
        proxy.stop()
