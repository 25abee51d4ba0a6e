from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy.app import create_app
from proxy.settings import Settings
from tests.support.fake_vllm import FakeVllm
from tests.support.servers import ServerThread

# Tests never read the developer's real token.
os.environ.pop("HF_TOKEN", None)
for _k in [k for k in os.environ if k.startswith("PROXY_")]:
    os.environ.pop(_k)

# vLLM 0.33.0's own block hashes for 60 inputs (computed by its get_request_block_hasher; the
# project's shared/vectors/ holds the original). A copy lives in the repo so a clone tests alone.
VLLM_VECTORS = Path(__file__).resolve().parent / "fixtures" / "vllm_block_hashes.json"


@dataclass
class Harness:
    fakes: list[FakeVllm]
    replicas: list[ServerThread]
    proxy: ServerThread
    app: Any
    client: httpx.Client
    extra: list[ServerThread] = field(default_factory=list)

    @property
    def rt(self) -> Any:
        return self.app.state.rt

    def close(self) -> None:
        self.client.close()
        self.proxy.stop()
        for s in self.replicas + self.extra:
            if s.thread.is_alive():
                s.kill()  # do not wait for requests a test left hanging


# Probing every 0.1 s makes ejection and recovery observable within a test's patience. The probe
# budget and the ejection threshold are the product's defaults (2 s, 2 consecutive misses): fakes,
# proxy and test client share one process (and its GIL) on 2 busy cores, where one probe can stall
# past 1 s (a CI run ejected a healthy fake after one 1 s timeout on GET /v1/models, then failed a
# routing assertion). Tests about timeouts and ejection set their own budget.
FAST = {"health_interval_s": 0.1, "probe_timeout_s": 2.0, "lora_retry_s": 0.05, "eject_after": 2}


@pytest.fixture
def make_fleet() -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def make(
        n: int = 2, fakes: list[FakeVllm] | None = None, front: bool = True, **settings: Any
    ) -> Harness:
        fakes = fakes or [FakeVllm(name=f"r{i}") for i in range(n)]
        servers = [ServerThread(f.app()).start() for f in fakes]
        opts = {**FAST, **settings}
        app = create_app(Settings(replicas=[s.url for s in servers], **opts))
        proxy = ServerThread(app, front=front).start()
        h = Harness(fakes, servers, proxy, app, httpx.Client(base_url=proxy.url, timeout=30))
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


# Test modules that train with torch. Each starts a trainer (one process, or two for FSDP), two
# torch-backed fake replicas and a proxy, with thread counts sized for having the 2-core machine
# to itself. Under pytest-xdist (`make test`) they form one scheduling unit, so one worker runs
# them one after the other (building the session's tiny model once) while the other worker takes
# everything else. Side by side they oversubscribed the cores: the trainer fixture took 315 s
# instead of ~60 s, and FSDP's 4-step run published an adapter that had not moved.
TORCH_TRAINER_MODULES = frozenset(
    {"tests/e2e/test_trainer_e2e.py", "tests/e2e/test_trainer_fsdp.py"}
)


@pytest.hookimpl(optionalhook=True)  # only called when pytest-xdist is installed and active
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile`, except that the torch trainer modules share one unit (see above).

    Whole files per worker (rather than loadgroup marks, which pytest-xdist 3.8 cannot apply
    under pytest 9.2: it sets a node-id attribute pytest no longer reads) also keeps every
    module-scoped fixture built once and module-level state (test_faults.py's report rows) whole.
    """
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class TorchTrainersTogether(LoadFileScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = str(super()._split_scope(nodeid))
            return "torch trainer modules" if path in TORCH_TRAINER_MODULES else path

    return TorchTrainersTogether(config, log)
