"""The proxy over real HTTP in front of fake vLLM replicas (tests/support/fake_vllm.py).

Each behaviour of issue 2 is exercised through the public interface only: status codes, bodies,
the X-Proxy-Replica header, what each fake replica received, and /metrics.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from proxy.core.extract import RoutingKey
from tests.support.fake_vllm import FakeVllm
from tests.support.traffic import wait_until

TEMPLATE = list(range(1000, 1048))


def rollout(model: str, prompt: list[int], seed: int) -> dict:
    """Exactly what TRL's rollout worker posts (REFERENCE.md §1)."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "repetition_penalty": 1.0,
        "n": 1,
        "return_token_ids": True,
        "logprobs": 0,
        "seed": seed,
    }


def make_prompt(rng: random.Random, n: int = 120) -> list[int]:
    return TEMPLATE + [rng.randrange(50_000) for _ in range(n)]


def load(h, name: str, path: str = "") -> httpx.Response:
    return h.client.post(
        "/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": path or f"/bucket/{name}", "load_inplace": False},
    )


def metric(h, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(h.client.get("/metrics").text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


# -- data plane -------------------------------------------------------------------------------


def test_group_of_eight_lands_on_one_replica_and_prompts_spread(make_fleet) -> None:
    h = make_fleet(2)
    assert load(h, "trl-policy-v1").status_code == 200
    rng = random.Random(0)
    homes = []
    for group in range(12):
        p = make_prompt(rng)
        served = {
            h.client.post("/v1/completions", json=rollout("trl-policy-v1", p, s)).headers[
                "x-proxy-replica"
            ]
            for s in range(8)
        }
        assert len(served) == 1, f"group {group} split over {served}"
        homes.append(served.pop())
    assert set(homes) == {"0", "1"}  # different prompts spread
    assert metric(h, "rollout_proxy_routing_decisions_total", outcome="affinity") >= 12 * 7


def test_body_reaches_the_replica_unchanged_with_token_and_no_client_auth(make_fleet) -> None:
    h = make_fleet(1, upstream_token="upstream-secret")
    body = rollout("tiny/base", list(range(40)), seed=2**62 + 12345)
    r = h.client.post(
        "/v1/completions",
        json=body,
        headers={"Authorization": "Bearer client-key", "X-Request-Id": "rid-1"},
    )
    assert r.status_code == 200
    assert r.json()["echo_seed"] == 2**62 + 12345
    assert r.headers["x-request-id"] == "rid-1"
    assert h.fakes[0].served[-1]["body"] == body
    seen = h.fakes[0].seen_headers[-1]
    assert seen["authorization"] == "Bearer upstream-secret"
    assert seen["x-request-id"] == "rid-1"


def test_continuation_follows_its_prefix(make_fleet) -> None:
    h = make_fleet(3)
    load(h, "trl-policy-v1")
    rng = random.Random(1)
    for _ in range(6):  # warm up so the template is common
        h.client.post("/v1/completions", json=rollout("trl-policy-v1", make_prompt(rng), 0))
    p = make_prompt(rng)
    home = h.client.post("/v1/completions", json=rollout("trl-policy-v1", p, 0)).headers[
        "x-proxy-replica"
    ]
    for turn in range(4):
        cont = p + [rng.randrange(50_000) for _ in range(30)] + [5, 5]
        r = h.client.post("/v1/completions", json=rollout("trl-policy-v1", cont, turn))
        assert r.headers["x-proxy-replica"] == home


def test_a_multi_turn_continuation_follows_the_replica_that_generated_its_turn(
    make_fleet,
) -> None:
    """The next turn is prompt + generated ids + tool output: the generated blocks are learned
    from the answer before it is relayed, so the index knows prompt + completion."""
    h = make_fleet(3)
    load(h, "trl-policy-v1")
    rng = random.Random(7)
    rt = h.app.state.rt
    p = make_prompt(rng)
    first = h.client.post("/v1/completions", json=rollout("trl-policy-v1", p, 0))
    generated = first.json()["choices"][0]["token_ids"]
    turn = p + generated
    key = RoutingKey("trl-policy-v1", turn, None, None, False, 1)
    blocks = rt.router.block_keys(key, rt.fleet.lora_path("trl-policy-v1"))
    assert len(blocks) > len(p) // 16  # the completion fills blocks of its own
    # Learned before the answer is relayed (waiting only guards against a slow test thread).
    wait_until(lambda: len(rt.router.index.lookup(blocks)) == len(blocks), 5)
    cont = turn + [rng.randrange(50_000) for _ in range(40)]
    r = h.client.post("/v1/completions", json=rollout("trl-policy-v1", cont, 1))
    assert r.headers["x-proxy-replica"] == first.headers["x-proxy-replica"]


def test_new_adapter_version_starts_unmatched(make_fleet) -> None:
    h = make_fleet(2)
    load(h, "trl-policy-v1")
    load(h, "trl-policy-v2")
    p = make_prompt(random.Random(2))
    h.client.post("/v1/completions", json=rollout("trl-policy-v1", p, 0))
    before = metric(h, "rollout_proxy_routing_decisions_total", outcome="unmatched")
    h.client.post("/v1/completions", json=rollout("trl-policy-v2", p, 0))
    assert metric(h, "rollout_proxy_routing_decisions_total", outcome="unmatched") == before + 1


async def test_affinity_yields_to_imbalance(make_fleet) -> None:
    fakes = [FakeVllm(name=f"r{i}", completion_delay_s=0.5) for i in range(2)]
    h = make_fleet(fakes=fakes, imbalance=4)
    p = make_prompt(random.Random(3))
    async with httpx.AsyncClient(base_url=h.proxy.url, timeout=30) as client:
        responses = await asyncio.gather(
            *(client.post("/v1/completions", json=rollout("tiny/base", p, s)) for s in range(16))
        )
    served = [r.headers["x-proxy-replica"] for r in responses]
    assert all(r.status_code == 200 for r in responses)
    assert served.count("0") >= 4 and served.count("1") >= 4, served
    assert metric(h, "rollout_proxy_routing_decisions_total", outcome="spilled") >= 1


def test_unknown_adapter_is_a_404_without_touching_replicas(make_fleet) -> None:
    h = make_fleet(2)
    r = h.client.post("/v1/completions", json=rollout("trl-policy-v9", [1, 2, 3], 0))
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "model"
    assert r.json()["error"]["type"] == "NotFoundError"
    assert all(not f.served for f in h.fakes)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"model": "m", "prompt": {"x": 1}}', "'prompt' must be"),
        (b'["a"]', "JSON object"),
        (b'{"model": "m", "prompt": [1, -1]}', "non-negative"),
    ],
)
def test_bad_input_is_an_openai_shaped_400(make_fleet, content, fragment) -> None:
    h = make_fleet(1)
    r = h.client.post(
        "/v1/completions", content=content, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"] == "BadRequestError" and err["code"] == 400


def test_a_field_only_the_replica_checks_comes_back_as_its_400(make_fleet) -> None:
    """The proxy reads prompt and model only; vLLM validates the sampling fields, and its 400
    reaches the client as it is, with the replica named."""
    h = make_fleet(1)
    body = {"model": "tiny/base", "prompt": [1, 2, 3], "seed": {"x": 1}}
    r = h.client.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.headers["x-proxy-replica"] == "0"
    assert "seed must be an integer" in r.json()["error"]["message"]
    too_long = h.client.post("/v1/completions", json=body | {"seed": 7, "max_tokens": 10**9})
    assert too_long.status_code == 400 and "max_tokens" in too_long.json()["error"]["message"]
    assert h.client.post("/v1/completions", json=body | {"seed": 7}).status_code == 200


def test_batched_prompts_and_n_route_on_the_first_prompt(make_fleet) -> None:
    h = make_fleet(2)
    p = make_prompt(random.Random(4))
    first = h.client.post("/v1/completions", json={"model": "tiny/base", "prompt": p, "n": 4})
    batch = h.client.post(
        "/v1/completions", json={"model": "tiny/base", "prompt": [p, [1, 2, 3]], "n": 2}
    )
    assert first.status_code == batch.status_code == 200
    assert first.headers["x-proxy-replica"] == batch.headers["x-proxy-replica"]


def test_chat_completions_route_by_conversation_prefix(make_fleet) -> None:
    h = make_fleet(2)
    system = {"role": "system", "content": "You are a careful mathematician. " * 10}
    convo = [system, {"role": "user", "content": "What is 17 * 23? Show the steps. " * 5}]
    homes = {
        h.client.post(
            "/v1/chat/completions", json={"model": "tiny/base", "messages": convo}
        ).headers["x-proxy-replica"]
        for _ in range(6)
    }
    assert len(homes) == 1


def test_streaming_passes_through_chunk_by_chunk(make_fleet) -> None:
    fakes = [FakeVllm(name="r0", stream_chunks=5, stream_delay_s=0.2)]
    h = make_fleet(fakes=fakes)
    arrivals = []
    with h.client.stream(
        "POST",
        "/v1/completions",
        json={"model": "tiny/base", "prompt": [1, 2, 3], "max_tokens": 10, "stream": True},
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-proxy-replica"] == "0"
        for line in r.iter_lines():
            if line.startswith("data:"):
                arrivals.append((time.monotonic(), line))
    assert arrivals[-1][1] == "data: [DONE]"
    assert len(arrivals) == 6
    # Not buffered: the first chunk arrived long before the last was produced (~1 s later).
    assert arrivals[-1][0] - arrivals[0][0] > 0.5


async def test_client_going_away_closes_the_upstream_stream(make_fleet) -> None:
    fakes = [FakeVllm(name="r0", stream_chunks=50, stream_delay_s=0.1)]
    h = make_fleet(fakes=fakes)
    async with (
        httpx.AsyncClient(base_url=h.proxy.url, timeout=30) as client,
        client.stream(
            "POST",
            "/v1/completions",
            json={"model": "tiny/base", "prompt": [1], "max_tokens": 50, "stream": True},
        ) as r,
    ):
        async for _ in r.aiter_lines():
            break
    wait_until(lambda: h.rt.fleet.replicas[0].in_flight == 0)
    wait_until(lambda: fakes[0].streams_closed >= 1)
    assert fakes[0].streams_completed == 0


def test_dead_replica_is_a_502_not_a_hang(make_fleet) -> None:
    h = make_fleet(1)
    h.replicas[0].kill()
    started = time.monotonic()
    r = h.client.post("/v1/completions", json=rollout("tiny/base", [1, 2, 3], 0))
    assert r.status_code in (502, 503)
    assert time.monotonic() - started < 5
    assert r.json()["error"]["message"]


def test_a_dead_replica_is_routed_around(make_fleet) -> None:
    h = make_fleet(2)
    h.replicas[1].kill()
    codes = {
        h.client.post(
            "/v1/completions", json=rollout("tiny/base", make_prompt(random.Random(s)), s)
        ).status_code
        for s in range(6)
    }
    assert codes == {200}


def test_hung_replica_times_out_as_504(make_fleet) -> None:
    fakes = [FakeVllm(name="r0")]
    h = make_fleet(fakes=fakes, upstream_timeout_s=0.5)
    fakes[0].hang_completions = True
    r = h.client.post("/v1/completions", json=rollout("tiny/base", [1, 2, 3], 0))
    assert r.status_code == 504
    assert r.json()["error"]["type"] == "GatewayTimeoutError"


def test_other_v1_paths_are_forwarded_to_one_replica(make_fleet) -> None:
    h = make_fleet(2)
    r = h.client.post("/v1/tokenize", json={"prompt": "hi"})
    assert r.status_code == 200 and r.json()["tokens"] == [1, 2, 3]
    assert "x-proxy-replica" in r.headers


# -- probes -----------------------------------------------------------------------------------

# TRL's client gives GET /health 5 s: an answer within it is never a hang to TRL. A tighter bound
# would test the shared machine's load, not the proxy.
TRL_HEALTH_TIMEOUT_S = 5.0


def test_health_fan_in(make_fleet) -> None:
    """Plain /health is 200 while a replica that answers can serve; ?strict=true names the
    replicas short of ready (docs/reliability-publish.md)."""
    h = make_fleet(2)
    assert h.client.get("/health").status_code == 200
    h.fakes[1].health_status = 500
    r = h.client.get("/health", params={"strict": "true"})
    assert r.status_code == 503 and "[1]" in r.json()["message"]
    assert h.client.get("/health").status_code == 200
    h.fakes[1].health_status = 200
    h.replicas[0].kill()
    started = time.monotonic()
    r = h.client.get("/health", params={"strict": "true"})
    assert r.status_code == 503 and "[0]" in r.json()["message"]
    assert "error" in r.json()["replicas"]["0"]
    assert time.monotonic() - started < TRL_HEALTH_TIMEOUT_S


def test_health_never_hangs_on_a_wedged_replica(make_fleet) -> None:
    h = make_fleet(2, probe_timeout_s=0.5)
    h.fakes[0].hang = True
    started = time.monotonic()
    r = h.client.get("/health")
    assert r.status_code == 200 and r.json()["replicas"]["0"]["healthy"] is False
    # Bounded by the probe budget (0.5 s here); the contract is TRL's own /health timeout.
    assert time.monotonic() - started < TRL_HEALTH_TIMEOUT_S


def test_server_info_is_one_coherent_server(make_fleet) -> None:
    fakes = [
        FakeVllm(name="a", max_loras=6, max_lora_rank=8, data_parallel_size=2),
        FakeVllm(name="b", max_loras=4, max_lora_rank=2),
    ]
    h = make_fleet(fakes=fakes)
    info = h.client.get("/server_info", params={"config_format": "json"}).json()
    cfg = info["vllm_config"]
    # One replica runs data parallel: TRL must take the merged path, as against it alone.
    assert cfg["parallel_config"]["data_parallel_size"] == 2
    assert cfg["lora_config"]["max_loras"] == 4
    assert cfg["lora_config"]["max_lora_rank"] == 2


def test_server_info_lora_disabled_anywhere_is_null(make_fleet) -> None:
    h = make_fleet(fakes=[FakeVllm(name="a"), FakeVllm(name="b", lora_enabled=False)])
    info = h.client.get("/server_info", params={"config_format": "json"}).json()
    assert info["vllm_config"]["lora_config"] is None


def test_different_base_models_are_an_error(make_fleet) -> None:
    h = make_fleet(fakes=[FakeVllm(name="a"), FakeVllm(name="b", base_model="other/model")])
    for path in ("/server_info", "/v1/models"):
        r = h.client.get(path)
        assert r.status_code == 502
        assert "different base models" in r.json()["error"]["message"]


def test_models_lists_base_first_then_adapters_on_every_replica(make_fleet) -> None:
    fakes = [FakeVllm(name="a", max_model_len=4096), FakeVllm(name="b", max_model_len=2048)]
    h = make_fleet(fakes=fakes)
    load(h, "trl-policy-v1")
    fakes[0].adapters["only-here"] = "/x"  # loaded behind the proxy's back, on one replica
    data = h.client.get("/v1/models").json()["data"]
    assert data[0]["id"] == "tiny/base" and data[0]["max_model_len"] == 2048
    assert [d["id"] for d in data[1:]] == ["trl-policy-v1"]


def test_weight_transfer_endpoints_answer_for_several_replicas(make_fleet) -> None:
    """FakeVllm has no weight-transfer endpoints (like vLLM without VLLM_SERVER_DEV_MODE): the
    world size probe names each replica and why, never a 404 (test_merged_weights.py covers
    replicas that have them)."""
    h = make_fleet(2)
    r = h.client.get("/get_world_size")
    assert r.status_code == 502
    error = r.json()["error"]
    assert "VLLM_SERVER_DEV_MODE" in error["message"]
    assert [d["replica"] for d in error["details"]] == [0, 1]
    assert h.client.post("/start_weight_update").status_code == 409


def test_unknown_route_is_openai_shaped(make_fleet) -> None:
    h = make_fleet(1)
    r = h.client.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


# -- control plane ------------------------------------------------------------------------------


def test_load_broadcasts_and_makes_the_adapter_routable(make_fleet) -> None:
    h = make_fleet(2)
    r = load(h, "trl-policy-v1", "/bucket/trl-policy-v1")
    assert r.status_code == 200 and "added successfully" in r.text
    for f in h.fakes:
        assert f.adapters == {"trl-policy-v1": "/bucket/trl-policy-v1"}
    assert metric(h, "rollout_proxy_adapter_latest_version", replica="0") == 1
    r = h.client.post("/v1/completions", json=rollout("trl-policy-v1", [1, 2, 3], 0))
    assert r.status_code == 200


def test_lagging_mount_is_retried_until_visible(make_fleet) -> None:
    h = make_fleet(2)
    h.fakes[1].invisible_paths["/bucket/trl-policy-v1"] = 3  # three 404s, then visible
    r = load(h, "trl-policy-v1", "/bucket/trl-policy-v1")
    assert r.status_code == 200
    assert h.fakes[1].adapters == {"trl-policy-v1": "/bucket/trl-policy-v1"}
    assert metric(h, "rollout_proxy_adapter_mount_lag_retries_total", replica="1") == 3


def test_mount_that_never_catches_up_is_504_and_rolled_back(make_fleet) -> None:
    h = make_fleet(2, lora_load_timeout_s=0.4)
    for f in h.fakes:
        f.invisible_paths["/bucket/trl-policy-v1"] = -1
    r = load(h, "trl-policy-v1", "/bucket/trl-policy-v1")
    assert r.status_code == 504  # never 404: TRL would blame VLLM_ALLOW_RUNTIME_LORA_UPDATING
    err = r.json()["error"]
    assert "replica 0: mount_lag_timeout" in err["message"]
    assert "replica 1: mount_lag_timeout" in err["message"]
    assert h.fakes[0].adapters == {} and h.fakes[1].adapters == {}
    assert h.client.get("/admin/fleet").json()["desired"]["adapters"] == {}
    assert (
        h.client.post("/v1/completions", json=rollout("trl-policy-v1", [1], 0)).status_code == 404
    )


def test_mount_lagging_on_one_replica_ejects_it_and_the_load_succeeds(make_fleet) -> None:
    h = make_fleet(2, lora_load_timeout_s=0.4)
    h.fakes[1].invisible_paths["/bucket/trl-policy-v1"] = -1
    r = load(h, "trl-policy-v1", "/bucket/trl-policy-v1")
    assert r.status_code == 200, r.text
    replica = h.client.get("/admin/fleet").json()["replicas"][1]
    assert replica["status"] in ("ejected", "reconciling")
    assert "mount_lag_timeout" in replica["last_error"]
    # It serves nothing until it has the adapter; the other one serves.
    for seed in range(4):
        done = h.client.post("/v1/completions", json=rollout("trl-policy-v1", [1, 2], seed))
        assert done.status_code == 200 and done.headers["x-proxy-replica"] == "0"
    h.fakes[1].invisible_paths.clear()  # the mount catches up: reconciled, back in service
    deadline = time.monotonic() + 10
    while h.client.get("/admin/fleet").json()["replicas"][1]["status"] != "ready":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert h.fakes[1].adapters == {"trl-policy-v1": "/bucket/trl-policy-v1"}


def test_load_failing_on_every_replica_passes_vllms_reason_on(make_fleet) -> None:
    h = make_fleet(2)
    for f in h.fakes:
        f.load_failure = (500, "rank 8 is greater than max_lora_rank 1")
    r = load(h, "trl-policy-v1")
    assert r.status_code == 502
    message = r.json()["error"]["message"]
    assert "replica 1: failed (HTTP 500): rank 8 is greater" in message
    assert all(f.adapters == {} for f in h.fakes)
    assert h.client.get("/admin/fleet").json()["desired"]["adapters"] == {}


def test_load_failing_on_one_replica_ejects_it_and_names_it(make_fleet) -> None:
    h = make_fleet(3)
    h.fakes[2].load_failure = (500, "rank 8 is greater than max_lora_rank 1")
    r = load(h, "trl-policy-v1")
    assert r.status_code == 200, r.text
    fleet = h.client.get("/admin/fleet").json()
    assert fleet["replicas"][2]["status"] in ("ejected", "reconciling")
    assert "rank 8 is greater" in fleet["replicas"][2]["last_error"]
    assert h.fakes[0].adapters == h.fakes[1].adapters == {"trl-policy-v1": "/bucket/trl-policy-v1"}


def test_load_refused_by_one_replica_rolls_back_everywhere(make_fleet) -> None:
    h = make_fleet(3)
    h.fakes[2].load_failure = (400, "invalid adapter config")
    r = load(h, "trl-policy-v1")
    assert r.status_code == 400
    assert "replica 2: refused (HTTP 400): invalid adapter config" in r.json()["error"]["message"]
    details = {d["replica"]: d["result"] for d in r.json()["error"]["details"]}
    assert details[0] == details[1] == "ok, rolled back"
    assert all(f.adapters == {} for f in h.fakes)


def test_load_of_a_name_already_loaded_elsewhere_is_vllms_400(make_fleet) -> None:
    h = make_fleet(2)
    for f in h.fakes:
        f.adapters["taken"] = "/other/path"
    r = load(h, "taken", "/new/path")
    assert r.status_code == 400
    assert all(f.adapters == {"taken": "/other/path"} for f in h.fakes)


def test_repeated_publish_of_the_same_adapter_is_idempotent(make_fleet) -> None:
    h = make_fleet(2)
    assert load(h, "trl-policy-v1", "/p/1").status_code == 200
    assert load(h, "trl-policy-v1", "/p/1").status_code == 200


def test_load_requires_name_and_path(make_fleet) -> None:
    h = make_fleet(1)
    r = h.client.post("/v1/load_lora_adapter", json={"lora_name": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert not h.fakes[0].control_calls()


def test_trl_weight_sync_sequence_reaches_every_replica_in_order(make_fleet) -> None:
    h = make_fleet(2)
    for v in range(1, 8):
        assert h.client.post("/pause", params={"mode": "keep"}).status_code == 200
        assert load(h, f"trl-policy-v{v}").status_code == 200
        assert h.client.post("/resume").json() == {"status": "resumed"}
        old = v - 4 - 1
        if old >= 1:
            assert (
                h.client.post(
                    "/v1/unload_lora_adapter", json={"lora_name": f"trl-policy-v{old}"}
                ).status_code
                == 200
            )
    sequences = [f.control_calls() for f in h.fakes]
    assert sequences[0] == sequences[1]
    assert sequences[0][:3] == [
        ("/pause?mode=keep", None),
        (
            "/v1/load_lora_adapter",
            {
                "lora_name": "trl-policy-v1",
                "lora_path": "/bucket/trl-policy-v1",
                "load_inplace": False,
            },
        ),
        ("/resume", None),
    ]
    assert sorted(h.fakes[0].adapters) == [f"trl-policy-v{v}" for v in (3, 4, 5, 6, 7)]
    models = [d["id"] for d in h.client.get("/v1/models").json()["data"]]
    assert models[1:] == [f"trl-policy-v{v}" for v in (3, 4, 5, 6, 7)]


def test_unload_purges_and_unknown_unload_is_404_like_vllm(make_fleet) -> None:
    h = make_fleet(2)
    load(h, "trl-policy-v1")
    assert (
        h.client.post("/v1/unload_lora_adapter", json={"lora_name": "trl-policy-v1"}).status_code
        == 200
    )
    assert all(f.adapters == {} for f in h.fakes)
    r = h.client.post("/v1/unload_lora_adapter", json={"lora_name": "trl-policy-v1"})
    assert r.status_code == 404
    assert (
        h.client.post("/v1/completions", json=rollout("trl-policy-v1", [1], 0)).status_code == 404
    )


def test_pause_with_cache_clear_purges_the_index(make_fleet) -> None:
    h = make_fleet(2)
    h.client.post("/v1/completions", json=rollout("tiny/base", list(range(64)), 0))
    assert h.client.get("/admin/fleet").json()["routing"]["index_blocks"] == 4
    h.client.post("/pause", params={"mode": "keep", "clear_cache": "false"})
    assert h.client.get("/admin/fleet").json()["routing"]["index_blocks"] == 4
    h.client.post("/resume")
    h.client.post("/pause", params={"mode": "keep"})
    assert h.client.get("/admin/fleet").json()["routing"]["index_blocks"] == 0
    assert all(f.paused for f in h.fakes)
    assert h.client.get("/is_paused").json() == {"is_paused": True}
    h.client.post("/resume")
    assert not any(f.paused for f in h.fakes)


def test_pause_failing_on_one_replica_ejects_it(make_fleet) -> None:
    h = make_fleet(2)
    h.fakes[1].pause_status = 500
    r = h.client.post("/pause", params={"mode": "keep"})
    assert r.status_code == 200, r.text
    assert h.fakes[0].paused
    replica = h.client.get("/admin/fleet").json()["replicas"][1]
    assert replica["status"] in ("ejected", "reconciling") and "pause" in replica["last_error"]


def test_pause_failing_everywhere_is_refused_and_rolled_back(make_fleet) -> None:
    h = make_fleet(2)
    for f in h.fakes:
        f.pause_status = 500
    r = h.client.post("/pause", params={"mode": "keep"})
    assert r.status_code == 502
    assert "replica 0: failed (HTTP 500)" in r.json()["error"]["message"]
    assert h.client.get("/admin/fleet").json()["desired"]["paused"] is False


def test_pause_with_a_bad_mode_is_vllms_400(make_fleet) -> None:
    h = make_fleet(2)
    h.fakes[0].pause_status = 400
    r = h.client.post("/pause", params={"mode": "bogus"})
    assert r.status_code == 400
    assert not h.fakes[1].paused  # rolled back
    assert h.client.get("/admin/fleet").json()["desired"]["paused"] is False


def test_reset_prefix_cache_broadcasts_and_purges(make_fleet) -> None:
    h = make_fleet(2)
    h.client.post("/v1/completions", json=rollout("tiny/base", list(range(64)), 0))
    assert h.client.post("/reset_prefix_cache").status_code == 200
    assert all(("/reset_prefix_cache", None) in f.control_calls() for f in h.fakes)
    assert h.client.get("/admin/fleet").json()["routing"]["index_blocks"] == 0


def test_block_size_is_learned_from_the_replicas(make_fleet) -> None:
    h = make_fleet(fakes=[FakeVllm(name="a", block_size=32), FakeVllm(name="b", block_size=32)])
    routing = h.client.get("/admin/fleet").json()["routing"]
    assert routing["block_size"] == 32 and routing["error"] is None
    h.client.post("/v1/completions", json=rollout("tiny/base", list(range(100)), 0))
    assert h.client.get("/admin/fleet").json()["routing"]["index_blocks"] == 3  # 100 // 32


def test_replicas_disagreeing_on_block_size_refuse_routing_clearly(make_fleet) -> None:
    h = make_fleet(fakes=[FakeVllm(name="a", block_size=16), FakeVllm(name="b", block_size=32)])
    r = h.client.post("/v1/completions", json=rollout("tiny/base", [1, 2, 3], 0))
    assert r.status_code == 502
    message = r.json()["error"]["message"]
    assert "disagree on block size" in message and "replica 1: 32" in message
    assert all(not f.served for f in h.fakes)


def test_explicit_block_size_wins(make_fleet) -> None:
    h = make_fleet(fakes=[FakeVllm(name="a", block_size=32)], block_size=16)
    assert h.client.get("/admin/fleet").json()["routing"]["block_size"] == 16


def test_next_turn_matches_the_generated_tokens(make_fleet) -> None:
    h = make_fleet(3)
    rng = random.Random(11)
    for _ in range(6):
        h.client.post("/v1/completions", json=rollout("tiny/base", make_prompt(rng), 0))
    p = make_prompt(rng)
    body = rollout("tiny/base", p, 1) | {"max_tokens": 64}
    first = h.client.post("/v1/completions", json=body)
    generated = first.json()["choices"][0]["token_ids"]
    before = h.rt.router.index.lookup(
        h.rt.router.block_keys(
            __import__("proxy.core.extract", fromlist=["x"]).extract_completion(
                {"model": "tiny/base", "prompt": p + generated}
            )
        )
    )
    # every full block of prompt + completion is indexed on the serving replica
    assert len(before) == (len(p) + len(generated)) // 16
    turn2 = h.client.post(
        "/v1/completions", json=rollout("tiny/base", p + generated + [9, 9, 9], 2)
    )
    assert turn2.headers["x-proxy-replica"] == first.headers["x-proxy-replica"]
