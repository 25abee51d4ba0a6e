"""Trainer glue: the checkpoint a run resumes from, the completion parser, the metrics file."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from trainer.config import ConfigError
from trainer.recipe import Recipe
from trainer.run import (
    CHATML_RESPONSE_TEMPLATE,
    _metrics_callback,
    check_world,
    ensure_response_template,
    launched_processes,
    resolve_checkpoint,
)


def _checkpoint(out: Path, step: int, *, complete: bool = True, version: int | None = None) -> Path:
    path = out / f"checkpoint-{step}"
    path.mkdir(parents=True)
    if complete:
        (path / "trainer_state.json").write_text("{}")
    state: dict[str, Any] = {"prompt_index": step * 2}
    if version is not None:
        state["model_version"] = version
    (path / "rollout_state.json").write_text(json.dumps(state))
    return path


def test_fresh_run(tmp_path: Path) -> None:
    point = resolve_checkpoint(Recipe(output_dir=str(tmp_path / "missing")))
    assert (point.checkpoint, point.first_version) == (None, 1)


def test_resumes_from_the_newest_complete_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _checkpoint(tmp_path, 50, version=13)
    newest_complete = _checkpoint(tmp_path, 100, version=26)
    _checkpoint(tmp_path, 150, complete=False, version=38)  # preempted mid-save
    (tmp_path / "checkpoint-x").mkdir()
    with caplog.at_level("INFO", logger="trainer"):
        point = resolve_checkpoint(Recipe(output_dir=str(tmp_path)))
    assert point.checkpoint == str(newest_complete)
    assert point.first_version == 27  # versions continue, not restart at v1
    assert "skipping incomplete checkpoint" in caplog.text
    assert "adapters continue at trl-policy-v27" in caplog.text


def test_checkpoint_without_a_version_restarts_numbering(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 10)
    point = resolve_checkpoint(Recipe(output_dir=str(tmp_path)))
    assert point.first_version == 1 and point.checkpoint is not None


def test_explicit_and_disabled_resume(tmp_path: Path) -> None:
    old = _checkpoint(tmp_path, 10, version=3)
    _checkpoint(tmp_path, 20, version=6)
    assert resolve_checkpoint(Recipe(output_dir=str(tmp_path), resume=str(old))).first_version == 4
    assert resolve_checkpoint(Recipe(output_dir=str(tmp_path), resume="never")).checkpoint is None
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        resolve_checkpoint(Recipe(output_dir=str(tmp_path), resume=str(tmp_path / "checkpoint-99")))


class _Tokenizer(SimpleNamespace):
    def apply_chat_template(
        self, messages: Any, tokenize: bool = False, add_generation_prompt: bool = False
    ) -> str:
        return self.rendered  # type: ignore[no-any-return]


def test_response_template_kept_when_the_tokenizer_has_one() -> None:
    tok = _Tokenizer(chat_template="x", response_template={"mine": True}, rendered="")
    assert ensure_response_template(tok) == "tokenizer"
    assert tok.response_template == {"mine": True}


def test_chatml_fallback_for_templates_trl_does_not_know() -> None:
    tok = _Tokenizer(
        chat_template="custom", rendered="<|im_start|>user\n1+1<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ensure_response_template(tok) == "chatml"
    assert tok.response_template == CHATML_RESPONSE_TEMPLATE


def test_unknown_non_chatml_template_is_an_error() -> None:
    tok = _Tokenizer(chat_template="custom", rendered="[INST] 1+1 [/INST]")
    with pytest.raises(ConfigError, match="neither one TRL recognizes nor ChatML"):
        ensure_response_template(tok)


def test_metrics_file_appends_one_json_line_per_log(tmp_path: Path) -> None:
    path = tmp_path / "out" / "metrics.jsonl"
    callback = _metrics_callback(path)
    state = SimpleNamespace(is_world_process_zero=True, global_step=3)
    callback.on_log(None, state, None, logs={"ratio": 1.0, "kl": math.nan, "loss": 0.5})
    callback.on_log(
        None, SimpleNamespace(is_world_process_zero=False, global_step=4), None, logs={"ratio": 2.0}
    )
    callback.on_log(None, state, None, logs={})
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"step": 3, "ratio": 1.0, "kl": None, "loss": 0.5}]


def test_cli_stops_with_the_preflight_reason_when_the_proxy_is_down(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    from trainer.__main__ import main

    with socket.socket() as sock:  # a port nothing listens on once the socket is closed
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    argv = [
        "--vllm-server-base-url",
        url,
        "--vllm-server-timeout",
        "0.5",
        "--output-dir",
        str(tmp_path),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rollout-train: cannot reach the rollout proxy at {url}")
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("num_processes", "launched", "refused"),
    [
        (1, 1, False),  # python -m trainer
        (2, 2, False),  # accelerate launch --num_processes 2, joined into one run
        (1, 2, True),  # each of 2 launched processes alone (accelerate's CPU fallback)
        (4, 2, True),
    ],
)
def test_a_launch_whose_processes_did_not_join_one_run_is_refused(
    num_processes: int, launched: int, refused: bool
) -> None:
    if refused:
        with pytest.raises(ConfigError, match=f"launched as {launched} processes"):
            check_world(num_processes, launched)
    else:
        check_world(num_processes, launched)


@pytest.mark.parametrize(("value", "expected"), [(None, 1), ("2", 2), ("0", 1), ("x", 1)])
def test_launched_processes_reads_world_size(
    monkeypatch: pytest.MonkeyPatch, value: str | None, expected: int
) -> None:
    if value is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", value)
    assert launched_processes() == expected
