"""Preflight decisions: a table over /server_info + /v1/models, then the HTTP flow (mock proxy)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from trainer.preflight import PreflightError, Requirements, adapter_version, evaluate, run_preflight

REQ = Requirements(
    base_model="Qwen/Qwen2.5-Math-1.5B",
    lora_rank=1,
    min_adapter_slots=6,
    max_completion_length=3000,
)
GOOD_INFO: dict[str, Any] = {
    "vllm_config": {
        "model_config": {
            "model": "Qwen/Qwen2.5-Math-1.5B",
            "max_model_len": 4096,
            "dtype": "torch.bfloat16",
        },
        "lora_config": {"max_lora_rank": 1, "max_loras": 6},
        "parallel_config": {"data_parallel_size": 1, "tensor_parallel_size": 1},
    }
}
GOOD_MODELS: dict[str, Any] = {
    "object": "list",
    "data": [
        {"id": "Qwen/Qwen2.5-Math-1.5B", "root": "Qwen/Qwen2.5-Math-1.5B", "max_model_len": 4096}
    ],
}


def _edit(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node = doc
    for key in parents:
        node = node[key]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return doc


_DELETE = object()


def test_recipe_fleet_passes() -> None:
    verdict = evaluate(GOOD_INFO, GOOD_MODELS, REQ)
    assert verdict.problems == [] and verdict.warnings == []
    assert verdict.facts is not None
    assert (verdict.facts.max_model_len, verdict.facts.max_loras, verdict.facts.max_lora_rank) == (
        4096,
        6,
        1,
    )


@pytest.mark.parametrize(
    ("info_edit", "models", "message"),
    [
        (
            ("vllm_config.lora_config", None),
            GOOD_MODELS,
            "LoRA is not enabled.*--enable-lora --max-lora-rank 1 --max-loras 6",
        ),
        (("vllm_config.parallel_config", _DELETE), GOOD_MODELS, "no parallel_config"),
        (
            ("vllm_config.parallel_config.data_parallel_size", 2),
            GOOD_MODELS,
            "data_parallel_size is 2",
        ),
        (
            ("vllm_config.lora_config.max_lora_rank", 1),
            None,
            "ranks up to 1 but the adapter has rank 4.*--max-lora-rank 8",
        ),
        (("vllm_config.lora_config.max_loras", 5), GOOD_MODELS, "hold 5 adapters at once.*needs 6"),
        (("vllm_config", _DELETE), GOOD_MODELS, "no 'vllm_config' object"),
        (
            ("vllm_config.model_config.model", "Qwen/Qwen2.5-7B"),
            {"data": [{"id": "Qwen/Qwen2.5-7B", "max_model_len": 4096}]},
            "serve 'Qwen/Qwen2.5-7B'.*trains 'Qwen/Qwen2.5-Math-1.5B'",
        ),
        (None, {"data": []}, "lists no model"),
        (
            None,
            {"data": [{"id": "trl-policy-v1", "max_model_len": None}]},
            "without a max_model_len: the base model must come first",
        ),
        (
            None,
            {"data": [{"id": "Qwen/Qwen2.5-Math-1.5B", "max_model_len": 2048}]},
            "max_model_len \\(2048\\) leaves no room",
        ),
    ],
)
def test_each_misconfiguration_has_its_own_message(
    info_edit: tuple[str, Any] | None, models: dict[str, Any] | None, message: str
) -> None:
    info = _edit(GOOD_INFO, *info_edit) if info_edit else GOOD_INFO
    req = REQ if models is not None else Requirements(**{**REQ.__dict__, "lora_rank": 4})
    verdict = evaluate(info, models if models is not None else GOOD_MODELS, req)
    assert len(verdict.problems) == 1, verdict.problems
    assert pytest.approx(0) == 0
    import re

    assert re.search(message, verdict.problems[0]), verdict.problems[0]


def test_all_problems_are_reported_at_once() -> None:
    info = _edit(
        _edit(GOOD_INFO, "vllm_config.lora_config.max_loras", 2),
        "vllm_config.parallel_config.data_parallel_size",
        4,
    )
    assert len(evaluate(info, GOOD_MODELS, REQ).problems) == 2


@pytest.mark.parametrize(
    "served",
    ["/models/Qwen2.5-Math-1.5B", "qwen/qwen2.5-math-1.5b", "Qwen/Qwen2.5-Math-1.5B/"],
)
def test_same_model_under_a_local_path_or_other_case(served: str) -> None:
    info = _edit(GOOD_INFO, "vllm_config.model_config.model", served)
    models = {"data": [{"id": served, "max_model_len": 4096}]}
    assert evaluate(info, models, REQ).problems == []


def test_model_mismatch_can_be_allowed() -> None:
    models = {"data": [{"id": "other", "max_model_len": 4096}]}
    info = _edit(GOOD_INFO, "vllm_config.model_config.model", "/weights/other")
    verdict = evaluate(
        info, models, Requirements(**{**REQ.__dict__, "allow_base_model_mismatch": True})
    )
    assert verdict.problems == []
    assert "allowed by allow_base_model_mismatch" in verdict.warnings[0]


def test_stale_adapters_are_reported() -> None:
    models = {
        "data": [
            *GOOD_MODELS["data"],
            {"id": "trl-policy-v7", "max_model_len": None},
            {"id": "mine"},
        ]
    }
    verdict = evaluate(GOOD_INFO, models, REQ)
    assert verdict.facts is not None and verdict.facts.stale_adapters == ("trl-policy-v7",)
    assert "trl-policy-v7" in verdict.warnings[0]


class MockProxy:
    """A proxy as a function of the request; records the calls it saw."""

    def __init__(self, health: list[int] | None = None, adapters: list[str] | None = None) -> None:
        self.health = list(health or [200])
        self.adapters = list(adapters or [])
        self.info: tuple[int, Any] = (200, GOOD_INFO)
        self.unload_status = 200
        self.unload_keeps = False
        self.reset_status = 200
        self.calls: list[str] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(f"{request.method} {request.url.path}")
        path = request.url.path
        if path == "/health":
            status = self.health.pop(0) if len(self.health) > 1 else self.health[0]
            return httpx.Response(status, text="" if status == 200 else "replica 1 unhealthy")
        if path == "/server_info":
            assert request.url.params["config_format"] == "json"
            status, body = self.info
            return (
                httpx.Response(status, json=body)
                if isinstance(body, dict)
                else httpx.Response(status, text=body)
            )
        if path == "/v1/models":
            data = GOOD_MODELS["data"] + [{"id": a, "max_model_len": None} for a in self.adapters]
            return httpx.Response(200, json={"object": "list", "data": data})
        if path == "/reset_prefix_cache":
            return httpx.Response(self.reset_status)
        if path == "/v1/unload_lora_adapter":
            name = json.loads(request.content)["lora_name"]
            if self.unload_status == 200 and not self.unload_keeps:
                self.adapters.remove(name)
            return httpx.Response(self.unload_status, text="done")
        return httpx.Response(404, json={"detail": "Not Found"})


def _run(
    proxy: MockProxy | Callable[[httpx.Request], httpx.Response],
    *,
    sweep: bool = True,
    timeout: float = 10,
    first_version: int = 1,
) -> Any:
    clock = [0.0]
    handler = proxy.handler if isinstance(proxy, MockProxy) else proxy
    return run_preflight(
        "http://proxy.test",
        Requirements(**{**REQ.__dict__, "first_version": first_version}),
        health_timeout_s=timeout,
        sweep_stale=sweep,
        transport=httpx.MockTransport(handler),
        sleep=lambda s: clock.__setitem__(0, clock[0] + s),
        monotonic=lambda: clock[0],
    )


def test_waits_for_health_then_checks() -> None:
    proxy = MockProxy(health=[503, 503, 200])
    facts = _run(proxy)
    assert facts.max_loras == 6
    assert proxy.calls == ["GET /health"] * 3 + ["GET /server_info", "GET /v1/models"]


def test_unreachable_proxy() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(
        PreflightError, match=r"cannot reach the rollout proxy at http://proxy\.test after 10s"
    ):
        _run(refuse)


def test_unhealthy_fleet_times_out_with_the_proxy_answer() -> None:
    with pytest.raises(
        PreflightError, match="up but not healthy after 10s \\(HTTP 503: replica 1 unhealthy\\)"
    ):
        _run(MockProxy(health=[503]))


@pytest.mark.parametrize(
    ("info", "message"),
    [
        ((404, {"detail": "Not Found"}), "VLLM_SERVER_DEV_MODE=1"),
        (
            (502, "replicas serve different base models: r0=A, r1=B"),
            "HTTP 502: replicas serve different base models",
        ),
        (  # the proxy's OpenAI-shaped error: its message is quoted, not the JSON
            (
                502,
                {
                    "error": {
                        "message": "replicas serve different base models "
                        "(replica 0: A, replica 1: B)",
                        "type": "InconsistentFleetError",
                        "code": 502,
                    }
                },
            ),
            r"HTTP 502: replicas serve different base models \(replica 0: A, replica 1: B\)$",
        ),
        ((200, "not json"), "did not return JSON"),
    ],
)
def test_server_info_failures(info: tuple[int, Any], message: str) -> None:
    proxy = MockProxy()
    proxy.info = info
    with pytest.raises(PreflightError, match=message):
        _run(proxy)


def test_bad_config_lists_problems() -> None:
    proxy = MockProxy()
    proxy.info = (200, _edit(GOOD_INFO, "vllm_config.lora_config", None))
    with pytest.raises(PreflightError, match="cannot serve this run:\n  - LoRA is not enabled"):
        _run(proxy)


def test_sweep_unloads_stale_adapters_only() -> None:
    proxy = MockProxy(adapters=["trl-policy-v3", "keep-me", "trl-policy-v4"])
    facts = _run(proxy)
    posts = [c for c in proxy.calls if c.startswith("POST")]
    assert posts == ["POST /v1/unload_lora_adapter"] * 2 + ["POST /reset_prefix_cache"]
    assert proxy.adapters == ["keep-me"]
    assert facts.adapters == ("keep-me",)


def test_sweep_disabled_refuses_names_this_run_will_publish() -> None:
    with pytest.raises(
        PreflightError,
        match=r"names this run will publish \(from trl-policy-v1 on\).*Enable sweep",
    ):
        _run(MockProxy(adapters=["trl-policy-v3"]), sweep=False)
    # A resumed run publishing from v8 on does not collide with v3..v7: they stay, with a warning.
    proxy = MockProxy(adapters=["trl-policy-v3", "trl-policy-v7"])
    facts = _run(proxy, sweep=False, first_version=8)
    assert facts.stale_adapters == ("trl-policy-v3", "trl-policy-v7")
    assert not [c for c in proxy.calls if c.startswith("POST")]
    with pytest.raises(PreflightError, match="\\('trl-policy-v8'\\)"):
        _run(MockProxy(adapters=["trl-policy-v7", "trl-policy-v8"]), sweep=False, first_version=8)


@pytest.mark.parametrize(
    ("name", "version"),
    [
        ("trl-policy-v12", 12),
        ("trl-policy-v0", 0),
        ("trl-policy-vx", None),
        ("my-adapter", None),
        ("trl-policy-v3-b", None),
        ("trl-policy-v" + "9" * 18, 10**18 - 1),
        # Longer is no name TRL publishes; int() of 5,000 digits would raise ValueError.
        ("trl-policy-v" + "1" * 19, None),
        ("trl-policy-v" + "9" * 5000, None),
        ("trl-policy-v12\n", None),
    ],
)
def test_adapter_version(name: str, version: int | None) -> None:
    assert adapter_version(name) == version


def test_over_long_adapter_version_from_the_replicas_is_not_a_crash() -> None:
    """A replica listing trl-policy-v<5,000 digits> is an adapter this run cannot publish: with
    the sweep disabled it is left loaded (warned), not a ValueError out of the preflight."""
    huge = "trl-policy-v" + "9" * 5000
    proxy = MockProxy(adapters=[huge])
    facts = _run(proxy, sweep=False)
    assert facts.stale_adapters == (huge,)
    assert not [c for c in proxy.calls if c.startswith("POST")]
    # Beside a name this run will publish, only that one is reported as colliding.
    with pytest.raises(PreflightError, match=r"still loaded \('trl-policy-v2'\) under names"):
        _run(MockProxy(adapters=[huge, "trl-policy-v2"]), sweep=False)
    # The sweep unloads it like any other trl-policy-* adapter.
    proxy = MockProxy(adapters=[huge])
    assert _run(proxy).adapters == ()
    assert proxy.adapters == []


def test_messages_cut_untrusted_names(caplog: pytest.LogCaptureFixture) -> None:
    """A replica's names are quoted, cut to SHOWN_NAME_CHARS with their length said, and a long
    list is cut to SHOWN_NAMES: the message stays a sentence that says what to do."""
    huge = "trl-policy-v1" + "x" * 100_000
    many = [huge] + [f"trl-policy-v{v}" for v in range(2, 40)]
    proxy = MockProxy(adapters=many)
    with pytest.raises(PreflightError) as refused:
        _run(proxy, sweep=False)
    message = str(refused.value)  # the 38 this run would publish, not the over-long one
    assert len(message) < 1_000 and "'trl-policy-v2'" in message and "and 30 more" in message
    warned = " ".join(r.getMessage() for r in caplog.records)  # all 39, the over-long one cut
    assert len(warned) < 1_000 and "39 adapter(s) from an earlier run" in warned
    assert "'trl-policy-v1xxx" in warned and "... (100,013 characters)" in warned


def test_sweep_that_does_not_take_is_an_error() -> None:
    proxy = MockProxy(adapters=["trl-policy-v3"])
    proxy.unload_keeps = True
    with pytest.raises(PreflightError, match="still loaded after the sweep: 'trl-policy-v3'"):
        _run(proxy)
    proxy = MockProxy(adapters=["trl-policy-v3"])
    proxy.unload_status = 500
    with pytest.raises(PreflightError, match="unloading stale adapter 'trl-policy-v3': HTTP 500"):
        _run(proxy)


def test_a_sweep_clears_the_prefix_caches_or_fails() -> None:
    proxy = MockProxy(adapters=["trl-policy-v3"])
    proxy.reset_status = 404
    with pytest.raises(
        PreflightError, match="resetting the prefix caches after the sweep: HTTP 404"
    ):
        _run(proxy)


def test_no_sweep_no_reset() -> None:
    proxy = MockProxy()
    _run(proxy)
    assert not [c for c in proxy.calls if c.startswith("POST")]
