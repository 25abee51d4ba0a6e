"""Parsing what replicas report: /v1/models and vLLM's Prometheus text, on real vLLM output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proxy.health import parse_models, parse_vllm_metrics
from tests.support.fake_vllm import FakeVllm

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_cpu_0.32.0"


def test_vllm_cpu_metrics_fixture() -> None:
    path = FIXTURES / "metrics.prom"
    if not path.exists():
        pytest.skip("no recorded vLLM metrics fixture")
    values = parse_vllm_metrics(path.read_text())
    assert values["block_size"] == 32  # vLLM CPU needs a multiple of 32
    assert values["hash_algo"] == "sha256"
    assert values["num_gpu_blocks"] == 8192  # the KV cache the cost policy prices memory by
    assert values["prefix_queries"] >= values["prefix_hits"] > 0
    assert {"waiting", "running", "kv_usage"} <= set(values)


def test_fake_metrics_parse_like_real_ones() -> None:
    from starlette.testclient import TestClient

    fake = FakeVllm(prefix_cache_queries=10, prefix_cache_hits=3)
    values = parse_vllm_metrics(TestClient(fake.app()).get("/metrics").text)
    assert values["prefix_queries"] == 10 and values["prefix_hits"] == 3
    assert values["block_size"] == 16


def test_parse_models_on_real_answers() -> None:
    for name in ("models_base.json", "models_after_load.json"):
        path = FIXTURES / name
        if not path.exists():
            pytest.skip("no recorded vLLM /v1/models fixture")
        recorded = json.loads(path.read_text())
        payload = recorded.get("body", recorded)
        base, max_len, adapters = parse_models(payload)
        assert base and isinstance(max_len, int)
        if name == "models_after_load.json":
            assert adapters and all(p.startswith("/") for p in adapters.values())


@pytest.mark.parametrize("payload", [None, {}, {"data": "x"}, [], {"data": [1, {"id": 3}]}])
def test_parse_models_rejects_or_skips_garbage(payload) -> None:
    try:
        base, _, adapters = parse_models(payload)
    except ValueError:
        return
    assert base is None and adapters == {}


@pytest.mark.parametrize("bad", [True, False, 0, -4096, 4096.0, "4096", None, [4096]])
def test_an_insane_max_model_len_reads_as_unknown(bad: object) -> None:
    """Unknown, not a limit: it sets the proxy's prompt-length bound (PROXY_MAX_PROMPT_TOKENS)."""
    payload = {"data": [{"id": "base", "max_model_len": bad}]}
    assert parse_models(payload) == ("base", None, {})
    assert parse_models({"data": [{"id": "base", "max_model_len": 4096}]})[1] == 4096


def _cache_info(**labels: str) -> str:
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{{body}}} 1.0\n"


@pytest.mark.parametrize(
    "bad",
    ["inf", "nan", "-16", "0", "1e400", "16.5", "9" * 5000, "abc", "²"],
)
def test_untrusted_cache_labels_read_as_unknown(bad: str) -> None:
    """Each label is a replica's word: a block size or block count that is not a sane positive
    whole number is omitted (unknown), never an exception in the health round or a hasher
    built on a block size of -16; an unknown hash algorithm is omitted as well."""
    text = _cache_info(block_size=bad, num_gpu_blocks=bad, prefix_caching_hash_algo="md5")
    assert parse_vllm_metrics(text) == {}
    assert parse_vllm_metrics(_cache_info(block_size=str(2**17))) == {}  # past any block size


def test_cache_labels_in_either_number_form() -> None:
    text = _cache_info(block_size="16.0", num_gpu_blocks="8192", prefix_caching_hash_algo="xxhash")
    assert parse_vllm_metrics(text) == {
        "block_size": 16,
        "num_gpu_blocks": 8192,
        "hash_algo": "xxhash",
    }


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf", "-3"])
def test_untrusted_queue_figures_read_as_unknown(value: str) -> None:
    """A NaN or infinite queue would price a replica at infinity (or NaN, which compares false
    with everything); a negative count is no count."""
    text = (
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{engine="0"}} {value}\n'
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0"} 3.0\n'
    )
    assert parse_vllm_metrics(text) == {"running": 3.0}
