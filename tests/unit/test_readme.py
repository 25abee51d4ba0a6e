"""The README is a contract: its configuration table and its two commands must stay true."""

from __future__ import annotations

import re
from pathlib import Path

from proxy.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_every_setting_is_documented_with_env_var_and_flag() -> None:
    for name in Settings.model_fields:
        env, flag = f"`PROXY_{name.upper()}`", f"`--{name.replace('_', '-')}`"
        row = next((line for line in README.splitlines() if line.startswith(f"| {env}")), None)
        assert row is not None, f"{env} missing from README's configuration table"
        assert flag in row, f"{flag} missing from the {env} row"


def test_documented_settings_exist() -> None:
    documented = set(re.findall(r"^\| `PROXY_([A-Z_]+)`", README, flags=re.M))
    assert documented == {n.upper() for n in Settings.model_fields}


def test_the_two_commands_are_make_targets() -> None:
    makefile = (ROOT / "Makefile").read_text()
    for target in ("demo", "test"):
        assert f"make {target}" in README
        assert re.search(rf"^{target}:", makefile, flags=re.M), target
