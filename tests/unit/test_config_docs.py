"""docs/configuration.md is generated from Settings: a setting changed without regenerating the
file (`make docs`) fails here, and so does a generator that drops a field or its help text."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
from pydantic import SecretStr

from proxy.settings import Settings
from scripts import gen_config_docs

ROOT = Path(__file__).resolve().parents[2]


def test_committed_configuration_doc_is_what_the_script_generates() -> None:
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == gen_config_docs.render(), (
        "docs/configuration.md is stale: run `make docs` (python -m scripts.gen_config_docs)"
    )


def test_generation_is_deterministic() -> None:
    assert gen_config_docs.render() == gen_config_docs.render()


@pytest.mark.parametrize("name", list(Settings.model_fields))
def test_every_field_has_its_row_with_env_var_flag_and_help(name: str) -> None:
    field = Settings.model_fields[name]
    row = next(
        (
            line
            for line in gen_config_docs.render().splitlines()
            if line.startswith(f"| `PROXY_{name.upper()}` |")
        ),
        None,
    )
    assert row is not None, f"PROXY_{name.upper()} missing"
    assert f"`--{name.replace('_', '-')}`" in row
    assert field.description, f"{name} has no help text"
    assert gen_config_docs.cell(field.description) in row


def test_check_mode_fails_on_a_stale_file(tmp_path: Path) -> None:
    out = tmp_path / "configuration.md"
    assert gen_config_docs.main(["--out", str(out)]) == 0
    assert gen_config_docs.main(["--check", "--out", str(out)]) == 0
    out.write_text(out.read_text().replace("Bind address", "Bind adress"))
    assert gen_config_docs.main(["--check", "--out", str(out)]) == 1


@pytest.mark.parametrize(
    ("annotation", "expected"),
    [
        (int, "int"),
        (bool, "bool"),
        (str | None, "string, optional"),
        (SecretStr | None, "secret string, optional"),
        (list[str], "list of string"),
        (Literal["a", "b"], "one of `a`, `b`"),
        (Literal["a", "b"] | None, "one of `a`, `b`, optional"),
    ],
)
def test_type_names(annotation: object, expected: str) -> None:
    assert gen_config_docs.type_name(annotation) == expected


def test_defaults_and_bounds_are_rendered() -> None:
    assert gen_config_docs.default_text(Settings.model_fields["port"]) == "`8000`"
    assert gen_config_docs.default_text(Settings.model_fields["replicas"]) == "(required)"
    assert gen_config_docs.default_text(Settings.model_fields["api_keys"]) == "unset"
    assert gen_config_docs.default_text(Settings.model_fields["kv_events_topic"]) == "empty"
    assert gen_config_docs.default_text(Settings.model_fields["log_json"]) == "`false`"
    assert gen_config_docs.bounds(Settings.model_fields["port"]) == ">= 0, <= 65535"


def test_a_pipe_in_help_text_does_not_break_the_table() -> None:
    assert gen_config_docs.cell("a|b\n c") == "a\\|b c"
