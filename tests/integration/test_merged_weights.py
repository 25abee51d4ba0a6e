"""TRL's merged-weight sync through the proxy to every replica, for real on CPU: fake replicas
(tests/support/fake_weight_replica.py, one process each) join a gloo process group at the ranks
vLLM would give them, and tensors move from the trainer (this process, rank 0) to each of them.

The trainer follows TRL 1.16's call sequence with TRL's own ``VLLMClient`` for every HTTP call:

* ``WeightTransferClient.init_weight_transfer`` (trl/experimental/async_grpo/weight_transfer.py,
  lines 90-120): ``get_world_size()`` + 1 as the world size, ``rank_offset`` 1, the trainer's
  rendezvous opened on a thread while ``init_weight_transfer_engine`` runs;
* ``AsyncGRPOTrainer._sync_weight_merged`` (async_grpo_trainer.py, lines 1766-1796): ``pause``,
  ``send_weights``, ``resume``;
* ``WeightTransferClient.send_weights`` (weight_transfer.py, lines 135-170):
  ``start_weight_update``, then the broadcast on a thread while ``update_weights`` runs, then
  ``finish_weight_update`` (also called, best effort, after a failed update).

In place of vLLM's NCCL ``trainer_init`` / ``packed_nccl_broadcast_producer`` (GPU only), a gloo
``ProcessGroupGloo`` over a ``TCPStore`` at rank 0 broadcasts the same tensors, one broadcast per
tensor in ``update_info`` order. ``AsyncGRPOTrainer.__init__`` (lines 1348-1360) builds
``update_info`` as ``names`` / ``dtype_names`` / ``shapes``, as here.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fakes.net import free_port
from proxy.app import create_app
from proxy.settings import Settings
from tests.conftest import FAST
from tests.support.servers import ServerThread

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from trl.experimental.async_grpo.async_grpo_trainer import select_adapter_sync
    from trl.experimental.async_grpo.vllm_client import VLLMClient


ROOT = Path(__file__).resolve().parents[2]
GROUP_TIMEOUT = datetime.timedelta(seconds=60)
HTTP_TIMEOUT = 60  # TRL's own default is 1800 s; a hang fails the test long before that


def _wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"fake replica exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"fake replica at {url} did not start")


class Replicas:
    """Fake weight-transfer replicas, one process each, stopped by PID at the end."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, world_size: int, port: int | None = None) -> str:
        port = port or free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.support.fake_weight_replica",
                "--port",
                str(port),
                "--world-size",
                str(world_size),
            ],
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            start_new_session=True,
        )
        self.procs[url] = proc
        _wait_healthy(url, proc)
        return url

    def kill(self, url: str) -> None:
        proc = self.procs.pop(url)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def close(self) -> None:
        for url in list(self.procs):
            self.kill(url)


class GlooTrainer:
    """TRL 1.16's merged-weight sync (see the module docstring), gloo in place of NCCL."""

    def __init__(self, url: str) -> None:
        self.client = VLLMClient(url, server_timeout=30)
        self.group: Any = None

    def init(self) -> int:
        world_size = self.client.get_world_size() + 1
        port = free_port()
        init_info = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": world_size,
            "packed": True,
        }
        errors: list[BaseException] = []

        def trainer_init() -> None:
            try:
                store = torch.distributed.TCPStore(
                    "127.0.0.1", port, world_size, True, GROUP_TIMEOUT, wait_for_workers=False
                )
                self.group = torch.distributed.ProcessGroupGloo(store, 0, world_size, GROUP_TIMEOUT)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=trainer_init, daemon=True)
        thread.start()
        self.client.init_weight_transfer_engine(init_info, timeout=HTTP_TIMEOUT)
        thread.join(timeout=HTTP_TIMEOUT)
        assert not errors and self.group is not None, errors
        return world_size

    def send_weights(self, params: dict[str, Any]) -> None:
        self.client.start_weight_update(timeout=HTTP_TIMEOUT)
        errors: list[BaseException] = []

        def broadcast() -> None:
            try:
                for tensor in params.values():
                    self.group.broadcast(tensor, 0).wait()
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=broadcast, daemon=True)
        thread.start()
        info = {
            "names": list(params),
            "dtype_names": [str(t.dtype).split(".")[-1] for t in params.values()],
            "shapes": [list(t.shape) for t in params.values()],
        }
        try:
            self.client.update_weights(info, timeout=HTTP_TIMEOUT)
            thread.join(timeout=HTTP_TIMEOUT)
            assert not errors, errors
        except Exception:
            with contextlib.suppress(Exception):
                self.client.finish_weight_update(timeout=HTTP_TIMEOUT)
            raise
        self.client.finish_weight_update(timeout=HTTP_TIMEOUT)

    def sync(self, params: dict[str, Any]) -> None:
        self.client.pause(timeout=HTTP_TIMEOUT)
        self.send_weights(params)
        self.client.resume(timeout=HTTP_TIMEOUT)


def new_params(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(8, 4, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4, generator=g),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(4, generator=g).to(torch.float64),
        "lm_head.weight": torch.randn(8, 4, generator=g).to(torch.bfloat16),
    }


def held(url: str) -> dict[str, Any]:
    return httpx.get(url + "/test/weights", timeout=10).json()


def assert_holds(url: str, params: dict[str, Any], version: str) -> None:
    state = held(url)
    assert state["version"] == version
    for worker in state["workers"]:
        assert set(worker) == set(params)
        for name, tensor in params.items():
            assert worker[name] == tensor.flatten().tolist(), (url, name)


def completion(client: httpx.Client) -> httpx.Response:
    body = {"model": "tiny/merged-base", "prompt": [1, 2, 3], "max_tokens": 1}
    return client.post("/v1/completions", json=body)


@pytest.fixture
def fleet() -> Iterator[Callable[..., tuple[Replicas, list[str], ServerThread, httpx.Client]]]:
    made: list[tuple[Replicas, ServerThread, httpx.Client]] = []

    def make(sizes: list[int], **settings: Any) -> tuple[Replicas, list[str], ServerThread, Any]:
        replicas = Replicas()
        proxy = None
        client = None
        try:
            urls = [replicas.start(size) for size in sizes]
            app = create_app(Settings(replicas=urls, **{**FAST, **settings}))
            proxy = ServerThread(app).start()
            client = httpx.Client(base_url=proxy.url, timeout=HTTP_TIMEOUT)
        finally:
            made.append((replicas, proxy, client))  # type: ignore[arg-type]
        return replicas, urls, proxy, client

    yield make
    for replicas, proxy, client in made:
        if client is not None:
            client.close()
        if proxy is not None:
            proxy.stop()
        replicas.close()


def _weights_view(client: httpx.Client) -> dict[str, Any]:
    result: dict[str, Any] = client.get("/health").json()["weights"]
    return result


def _wait_for(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.parametrize("sizes", [[1, 2], [2, 1, 1]], ids=["2-replicas", "3-replicas"])
def test_trl_merged_sync_reaches_every_replica(fleet, sizes: list[int]) -> None:
    from accelerate import PartialState

    PartialState()  # TRL logs through accelerate
    _, urls, proxy, client = fleet(sizes)
    trainer = GlooTrainer(proxy.url)
    trainer.client.wait_for_server_ready(poll_interval_s=0.1)
    # The proxy answers /server_info so that TRL takes the merged path, as against one replica
    # started without --enable-lora.
    info = trainer.client.get_server_info()
    assert info["lora_config"] is None
    assert select_adapter_sync(info, None, None) is False  # type: ignore[arg-type]

    assert trainer.init() == 1 + sum(sizes)
    offset = 1
    for url, size in zip(urls, sizes, strict=True):
        assert held(url)["ranks"] == list(range(offset, offset + size))
        offset += size

    for n in (1, 2, 3):
        params = new_params(seed=n)
        trainer.sync(params)
        for url in urls:
            assert_holds(url, params, str(n))
        served = {completion(client).headers["x-proxy-replica"] for _ in range(12)}
        for _ in range(6):
            r = completion(client)
            assert r.status_code == 200
            assert r.headers["x-proxy-weight-version"] == str(n)
            assert r.json()["served_weight_version"] == str(n)
        assert served  # answered; every replica is eligible
    view = _weights_view(client)
    assert view["version"] == "3" and view["world_size"] == 1 + sum(sizes)
    assert all(r["stale"] is None and r["seq"] == 3 for r in view["replicas"].values())
    metrics = client.get("/metrics").text
    for i in range(len(sizes)):
        assert f'rollout_proxy_replica_weight_version{{replica="{i}"}} 3.0' in metrics
        assert f'rollout_proxy_replica_weights_stale{{replica="{i}"}} 0.0' in metrics


def _fault(url: str, step: str, mode: str | None) -> None:
    httpx.post(url + "/test/fault", json={"step": step, "mode": mode}, timeout=10)


def test_faults_never_serve_stale_weights(fleet) -> None:
    from accelerate import PartialState

    PartialState()
    replicas, urls, proxy, client = fleet([1, 1], control_timeout_s=3.0)
    trainer = GlooTrainer(proxy.url)
    trainer.init()
    trainer.sync(new_params(1))

    # 1. An update that fails on replica 1: TRL's update_weights raises (the proxy answers
    # 502 naming it); replica 0 completed the sync and serves it, replica 1 takes no traffic.
    _fault(urls[1], "update", "fail")
    with pytest.raises(Exception, match="502"):
        trainer.sync(new_params(2))
    trainer.client.resume()
    view = _weights_view(client)
    assert view["version"] == "2"
    assert view["replicas"]["0"]["stale"] is None
    assert "update_weights failed" in view["replicas"]["1"]["stale"]
    for _ in range(8):
        r = completion(client)
        assert r.headers["x-proxy-replica"] == "0"
        assert r.headers["x-proxy-weight-version"] == "2"
    assert 'rollout_proxy_replica_weights_stale{replica="1"} 1.0' in client.get("/metrics").text

    # 2. A replica that hangs in update_weights: 504 within PROXY_CONTROL_TIMEOUT_S, not a hang.
    _fault(urls[1], "update", "hang")
    with pytest.raises(Exception, match="504"):
        trainer.sync(new_params(3))
    trainer.client.resume()
    assert _weights_view(client)["version"] == "3"
    assert {completion(client).headers["x-proxy-replica"] for _ in range(8)} == {"0"}

    # 3. A later sync that replica 1 completes whole brings it back (every sync sends every
    # parameter, and it kept its seat in the group).
    _fault(urls[1], "update", None)
    params = new_params(4)
    trainer.sync(params)
    for url in urls:
        assert_holds(url, params, "4")
    served = {completion(client).headers["x-proxy-replica"] for _ in range(20)}
    assert served == {"0", "1"}

    # 4. Replica 1 restarts (killed, started again on its port): launch weights, no seat.
    port = int(urls[1].rsplit(":", 1)[1])
    replicas.kill(urls[1])
    _wait_for(
        lambda: _weights_view(client)["replicas"]["1"]["stale"] is not None, "the restart seen"
    )
    replicas.start(1, port=port)
    _wait_for(
        lambda: client.get("/admin/fleet").json()["replicas"][1]["status"] == "ready", "ready"
    )
    for _ in range(8):  # back and READY, but its weights are not the fleet's: no traffic
        r = completion(client)
        assert (r.headers["x-proxy-replica"], r.headers["x-proxy-weight-version"]) == ("0", "4")
    # The next sync cannot broadcast to a group that lost ranks: refused at once, naming it.
    r = client.post("/start_weight_update", json={"is_checkpoint_format": True})
    assert r.status_code == 502
    error = r.json()["error"]
    assert "replica 1" in error["message"] and "not initialized" in error["message"]
    assert [d["result"] for d in error["details"]] == ["ok", "failed"]

    # 5. A replica added at run time has no seat: it never serves until a new group is formed.
    added = replicas.start(1)
    assert client.post("/admin/replicas", json={"url": added}).status_code == 201
    _wait_for(
        lambda: client.get("/admin/fleet").json()["replicas"][2]["status"] == "ready", "added"
    )
    assert "not in the weight-transfer group" in _weights_view(client)["replicas"]["2"]["stale"]
    assert {completion(client).headers["x-proxy-replica"] for _ in range(8)} == {"0"}


def test_weight_calls_without_a_group_are_refused_not_404(fleet) -> None:
    _, _, _, client = fleet([1])
    for path in ("/start_weight_update", "/finish_weight_update"):
        r = client.post(path)
        assert r.status_code == 409, r.text
        assert "init_weight_transfer_engine" in r.json()["error"]["message"]
    r = client.post("/update_weights", json={"update_info": {"names": []}})
    assert r.status_code == 409
    bad = client.post(
        "/init_weight_transfer_engine",
        json={
            "init_info": {
                "master_address": "127.0.0.1",
                "master_port": 1,
                "rank_offset": 1,
                "world_size": 7,
            }
        },
    )
    assert bad.status_code == 400 and "does not match" in bad.json()["error"]["message"]
    assert client.get("/get_world_size").json()["world_size"] == 1
