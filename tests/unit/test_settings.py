"""Settings as the leaf of the import graph, removed settings refused with their replacement,
the policy name checked at start-up against the core's registry, and the cross-field rules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pydantic import ValidationError

from proxy.__main__ import main
from proxy.app import create_app
from proxy.core.extract import MAX_BATCH_PROMPTS
from proxy.core.hashing import VLLM_HASH_ALGOS
from proxy.core.policy import POLICIES
from proxy.core.prefix_index import DEFAULT_MAX_REPLICAS
from proxy.errors import ConfigError
from proxy.settings import REMOVED_SETTINGS, Settings, removed_settings

REPLICA = "http://127.0.0.1:9"
SETTINGS = Path(__file__).resolve().parents[2] / "proxy" / "settings.py"


def test_settings_imports_nothing_from_core_or_security() -> None:
    for node in ast.walk(ast.parse(SETTINGS.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            assert not name.startswith(("proxy.core", "proxy.security")), name


def test_the_values_settings_mirror_are_the_cores() -> None:
    fields = Settings.model_fields
    assert fields["max_batch_prompts"].default == MAX_BATCH_PROMPTS
    assert fields["max_replicas"].default == DEFAULT_MAX_REPLICAS
    for algo in VLLM_HASH_ALGOS:
        Settings(replicas=[REPLICA], vllm_hash_algo=algo)
    with pytest.raises(ValidationError):
        Settings(replicas=[REPLICA], vllm_hash_algo="md5")


def test_the_benchmark_only_options_are_gone_and_listed() -> None:
    assert {"upstream_transport", "hot_path"} <= set(REMOVED_SETTINGS)
    assert not set(REMOVED_SETTINGS) & set(Settings.model_fields)


@pytest.mark.parametrize("name", sorted(REMOVED_SETTINGS))
def test_a_removed_setting_is_refused_from_the_environment(name: str, monkeypatch) -> None:
    monkeypatch.setenv(f"PROXY_{name.upper()}", "anything")
    with pytest.raises(ValidationError) as info:
        Settings(replicas=[REPLICA])
    message = str(info.value)
    assert f"PROXY_{name.upper()}" in message and REMOVED_SETTINGS[name] in message


@pytest.mark.parametrize("name", sorted(REMOVED_SETTINGS))
def test_a_removed_setting_is_refused_as_a_keyword(name: str) -> None:
    with pytest.raises(ValidationError, match=f"PROXY_{name.upper()}"):
        Settings(replicas=[REPLICA], **{name: "anything"})


@pytest.mark.parametrize("name", sorted(REMOVED_SETTINGS))
@pytest.mark.parametrize("form", ["separate", "joined", "env"])
def test_the_command_line_names_the_replacement(name: str, form: str, monkeypatch) -> None:
    flag = "--" + name.replace("_", "-")
    args = ["--replicas", REPLICA]
    if form == "separate":
        args += [flag, "x"]
    elif form == "joined":
        args += [f"{flag}=x"]
    else:
        monkeypatch.setenv(f"PROXY_{name.upper()}", "x")
    with pytest.raises(SystemExit) as info:
        main(args)
    message = str(info.value.code)
    assert message.startswith("rollout-proxy: invalid configuration: ")
    assert f"PROXY_{name.upper()} ({flag}) was removed" in message
    assert REMOVED_SETTINGS[name] in message


def test_other_arguments_are_not_mistaken_for_removed_ones() -> None:
    assert removed_settings(["--replicas", REPLICA, "--hot-paths", "--port", "1"], {}) == []
    assert removed_settings([], {"PROXY_PORT": "1", "HOT_PATH": "asgi"}) == []
    assert len(removed_settings(["--hot-path=asgi"], {"proxy_upstream_transport": "x"})) == 2


def test_an_unknown_policy_stops_start_up() -> None:
    with pytest.raises(ConfigError) as info:
        create_app(Settings(replicas=[REPLICA], policy="fastest"))
    assert "unknown policy 'fastest'" in info.value.message
    assert all(name in info.value.message for name in POLICIES)


def test_a_removed_policy_names_its_replacement(monkeypatch) -> None:
    name = "round_robin"
    monkeypatch.delitem(POLICIES, name, raising=False)
    with pytest.raises(ConfigError) as info:
        create_app(Settings(replicas=[REPLICA], policy=name))
    message = info.value.message
    assert message.startswith(f"PROXY_POLICY: policy {name!r} is a benchmark baseline")
    assert "use 'cost'" in message and "bench.harness.proxy_with_baselines" in message


def test_main_reports_a_bad_policy_without_a_traceback(monkeypatch) -> None:
    # main() configures the process's logging; the test's process keeps its own.
    monkeypatch.setattr("proxy.__main__.configure_logging", lambda *_: None)
    monkeypatch.setattr("proxy.__main__.install_log_redaction", lambda *_: None)
    with pytest.raises(SystemExit) as info:
        main(["--replicas", REPLICA, "--policy", "fastest"])
    assert str(info.value.code).startswith("rollout-proxy: invalid configuration: PROXY_POLICY")


def test_cross_field_rules_and_fallbacks(monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf-token-from-the-environment")
    assert Settings(replicas=[REPLICA]).secrets() == ["hf-token-from-the-environment"]
    given = Settings(replicas=[REPLICA], upstream_token="own-token-0123456789")
    assert given.secrets() == ["own-token-0123456789"]  # a given token wins over HF_TOKEN
    urls = [f"http://127.0.0.1:{port}" for port in (1, 2, 3)]
    assert len(Settings(replicas=urls, max_replicas=3).replicas) == 3
    with pytest.raises(ValidationError, match="3 replicas exceed max_replicas=2"):
        Settings(replicas=urls, max_replicas=2)
