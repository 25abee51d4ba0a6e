"""rollout-train configuration: recipe defaults, flag > env > file > default, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.__main__ import main
from trainer.config import ConfigError, describe, load_config, read_config_file, read_env
from trainer.recipe import Recipe

# The published recipe (REFERENCE.md section 4); a changed default must be a deliberate edit here.
RECIPE = {
    "model": "Qwen/Qwen2.5-Math-1.5B",
    "dataset": "sail/Sanity-Test-R1D-1.5B",
    "answer_column": "reward_model.ground_truth",
    "lora_r": 1,
    "lora_alpha": 2,
    "lora_target_modules": "all-linear",
    "learning_rate": 4e-5,
    "lr_scheduler_type": "constant",
    "num_generations": 8,
    "completions_per_step": 128,
    "max_completion_length": 3000,
    "max_staleness": 4,
    "weight_sync_steps": 4,
    "max_steps": 500,
    "per_device_train_batch_size": 1,
    "token_budget": 0,
    "temperature": 1.0,
    "top_p": 1.0,
}


def test_defaults_are_the_published_recipe() -> None:
    recipe = load_config([], {}).recipe
    assert {k: getattr(recipe, k) for k in RECIPE} == RECIPE
    assert recipe.min_adapter_slots == 6  # the recipe's --max-loras 6
    assert recipe.effective_gradient_accumulation(num_processes=2) == 64  # 128 = 2 x 1 x 64
    assert recipe.effective_queue_maxsize() == 4 * 128


@pytest.mark.parametrize(
    ("file", "env", "flags", "expected", "source"),
    [
        ({}, {}, [], 4e-5, "default"),
        ({"learning_rate": 1e-4}, {}, [], 1e-4, "file"),
        (
            {"learning_rate": 1e-4},
            {"TRAIN_LEARNING_RATE": "2e-4"},
            [],
            2e-4,
            "env TRAIN_LEARNING_RATE",
        ),
        (
            {"learning_rate": 1e-4},
            {"TRAIN_LEARNING_RATE": "2e-4"},
            ["--learning-rate", "3e-4"],
            3e-4,
            "flag",
        ),
        ({}, {"TRAIN_LEARNING_RATE": "2e-4"}, ["--learning-rate", "3e-4"], 3e-4, "flag"),
        ({"learning_rate": 1e-4}, {}, ["--learning-rate", "3e-4"], 3e-4, "flag"),
    ],
)
def test_precedence_flag_over_env_over_file_over_default(
    tmp_path: Path,
    file: dict[str, object],
    env: dict[str, str],
    flags: list[str],
    expected: float,
    source: str,
) -> None:
    argv = list(flags)
    if file:
        path = tmp_path / "run.yaml"
        path.write_text("".join(f"{k}: {v}\n" for k, v in file.items()))
        argv += ["--config", str(path)]
    loaded = load_config(argv, env)
    assert loaded.recipe.learning_rate == pytest.approx(expected)
    assert loaded.sources["learning_rate"].split(" ")[0] == source.split(" ")[0]
    if source.startswith("env"):
        assert loaded.sources["learning_rate"] == source


def test_every_field_is_reachable_by_all_three_channels(tmp_path: Path) -> None:
    # A bool, an int, a str and an optional, each set by file, then env, then flag.
    path = tmp_path / "run.json"
    path.write_text(
        json.dumps(
            {"preflight": False, "max_steps": 7, "output_dir": "/from/file", "queue_maxsize": 9}
        )
    )
    from_file = load_config(["--config", str(path)], {}).recipe
    assert (
        from_file.preflight,
        from_file.max_steps,
        from_file.output_dir,
        from_file.queue_maxsize,
    ) == (
        False,
        7,
        "/from/file",
        9,
    )
    env = {
        "TRAIN_PREFLIGHT": "true",
        "TRAIN_MAX_STEPS": "8",
        "TRAIN_OUTPUT_DIR": "/from/env",
        "TRAIN_QUEUE_MAXSIZE": "none",
    }
    from_env = load_config(["--config", str(path)], env).recipe
    assert (
        from_env.preflight,
        from_env.max_steps,
        from_env.output_dir,
        from_env.queue_maxsize,
    ) == (
        True,
        8,
        "/from/env",
        None,
    )
    flags = [
        "--config",
        str(path),
        "--no-preflight",
        "--max-steps",
        "9",
        "--output-dir",
        "/f",
        "--queue-maxsize",
        "3",
    ]
    from_flags = load_config(flags, env).recipe
    assert (
        from_flags.preflight,
        from_flags.max_steps,
        from_flags.output_dir,
        from_flags.queue_maxsize,
    ) == (
        False,
        9,
        "/f",
        3,
    )


def test_config_file_from_env_and_kebab_keys(tmp_path: Path) -> None:
    path = tmp_path / "run.yml"
    path.write_text("weight-sync-steps: 1\nbf16: false\n")
    recipe = load_config([], {"TRAIN_CONFIG": str(path)}).recipe
    assert recipe.weight_sync_steps == 1
    assert recipe.bf16 is False


@pytest.mark.parametrize(
    ("value", "cuda", "expected"),
    [("auto", True, True), ("auto", False, False), ("true", False, True), ("false", True, False)],
)
def test_bf16_auto_follows_cuda(value: str, cuda: bool, expected: bool) -> None:
    assert load_config(["--bf16", value], {}).recipe.use_bf16(cuda) is expected


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--learning-rate", "fast"], {}, "learning_rate (from flag)"),
        ([], {"TRAIN_MAX_STEPS": "0"}, "max_steps (from env TRAIN_MAX_STEPS)"),
        ([], {"TRAIN_LEARNING_RAT": "1"}, "did you mean TRAIN_LEARNING_RATE"),
        (["--token-budget", "16384"], {}, "set gradient_accumulation_steps"),
        (["--lora-target-modules", "q_proj,lm_head"], {}, "must not include lm_head"),
        (["--lora-target-modules", " , "], {}, "lora_target_modules is empty"),
        (["--top-p", "0"], {}, "top_p (from flag)"),
        (["--bf16", "maybe"], {}, "bf16 (from flag)"),
        (["--lora-r", "1024"], {}, "exceeds vLLM's largest LoRA rank"),
    ],
)
def test_bad_values_name_the_field_and_its_source(
    argv: list[str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(argv, env)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        (
            "a.yaml",
            "learning_rat: 1\n",
            "unknown option 'learning_rat'; did you mean 'learning_rate'",
        ),
        ("a.yaml", "- 1\n- 2\n", "must hold a mapping"),
        ("a.yaml", "a: [1,\n", "could not be parsed"),
        ("a.json", "{not json", "is not valid JSON"),
        ("a.toml", "x = 1", "use .yaml, .yml or .json"),
    ],
)
def test_bad_config_files(tmp_path: Path, name: str, content: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        read_config_file(path)


def test_missing_config_file_and_empty_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(["--config", str(tmp_path / "nope.yaml")], {})
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert read_config_file(empty) == {}


def test_env_ignores_other_prefixes_the_config_variable_and_foreign_train_variables() -> None:
    env = {
        "PROXY_PORT": "1",
        "TRAIN_CONFIG": "x.yaml",
        "TRAIN_SEED": "3",
        "HOME": "/",
        "TRAIN_CMD": "accelerate launch -m trainer",  # deploy/train_with_proxy.sh's, not ours
    }
    assert read_env(env) == {"seed": "3"}


def test_gradient_accumulation_is_derived_or_refused() -> None:
    recipe = Recipe(completions_per_step=128, per_device_train_batch_size=4)
    assert recipe.effective_gradient_accumulation(2) == 16
    with pytest.raises(ValueError, match="not a multiple"):
        Recipe(
            completions_per_step=100, per_device_train_batch_size=3
        ).effective_gradient_accumulation(2)
    assert (
        Recipe(gradient_accumulation_steps=6, token_budget=16384).effective_gradient_accumulation(2)
        == 6
    )


def test_target_modules_shorthand_and_list() -> None:
    assert Recipe().target_modules == "all-linear"
    assert Recipe(lora_target_modules="q_proj, v_proj").target_modules == ["q_proj", "v_proj"]


def test_print_config_lists_each_value_with_its_source(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--print-config", "--max-steps", "3"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("max_steps "))
    assert line.split() == ["max_steps", "3", "flag"]
    assert len(out.splitlines()) == len(Recipe.model_fields)


def test_main_reports_config_errors_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--max-steps", "zero"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rollout-train: invalid configuration")
    assert "Traceback" not in err


def test_describe_marks_defaults() -> None:
    text = describe(load_config([], {}))
    assert "learning_rate" in text and "default" in text


def test_readme_documents_every_knob() -> None:
    readme = (Path(__file__).resolve().parents[2] / "trainer" / "README.md").read_text()
    for name in Recipe.model_fields:
        row = f"| `--{name.replace('_', '-')}` / `TRAIN_{name.upper()}` |"
        assert row in readme, f"trainer/README.md has no row for {name}"


def test_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name, field in Recipe.model_fields.items():
        flag = "--" + name.replace("_", "-")
        assert flag in out, flag
        if field.annotation is bool:
            assert "--no-" + name.replace("_", "-") in out
