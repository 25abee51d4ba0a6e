"""The README is a contract: its two commands exist and are what CI runs, its settings table
names real settings with their real flags, and every link in it and in docs/ leads somewhere.
(docs/configuration.md lists every setting: tests/unit/test_config_docs.py checks it.)"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from proxy.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()
CI = (ROOT / ".ci" / "run").read_text()
# Going away (bench-only); a user must not be told to set them.
REMOVED = {"UPSTREAM_TRANSPORT", "HOT_PATH"}


def section(title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, flags=re.M | re.S)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def two_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", section("Two commands"), flags=re.S)
    assert block, "the two commands are one bash block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_readme_is_short() -> None:
    assert len(README.splitlines()) <= 250


def test_the_two_commands_are_make_demo_and_make_test() -> None:
    assert two_commands() == ["make demo", "make test"]


@pytest.mark.parametrize("target", ["demo", "test"])
def test_each_command_is_a_make_target(target: str) -> None:
    assert re.search(rf"^{target}:", MAKEFILE, flags=re.M), target


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize(("target", "runs"), [("demo", "scripts/demo.py"), ("test", "-m pytest")])
def test_each_command_runs_what_the_readme_says(target: str, runs: str) -> None:
    # -n prints the recipe without running it; -B ignores the stamp files, so every step shows.
    out = subprocess.run(
        ["make", "-n", "-B", target], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert runs in out, f"make {target} no longer runs {runs}"
    assert "uv pip install" in out, f"make {target} no longer sets up the venv first"


def test_ci_runs_the_readmes_test_command() -> None:
    commands = [line.strip() for line in CI.splitlines() if not line.lstrip().startswith("#")]
    assert two_commands()[1] in commands, ".ci/run must run the README's test command as is"


def test_the_commands_section_gives_no_timings() -> None:
    text = section("Two commands")
    timing = re.search(r"\b\d[\d,.]*(-\d[\d,.]*)?\s*(s|sec|seconds|min|minutes|h)\b", text)
    assert timing is None, f"timings belong in docs/development.md: {timing.group(0)!r}"


def settings_rows() -> dict[str, str]:
    return {
        m.group(1): m.group(0)
        for m in re.finditer(r"^\| `PROXY_([A-Z_]+)` \|.*$", README, flags=re.M)
    }


def test_the_settings_table_has_at_most_ten_rows() -> None:
    assert 1 <= len(settings_rows()) <= 10


def test_every_setting_in_the_table_exists_with_its_flag() -> None:
    fields = {n.upper(): n for n in Settings.model_fields}
    for env, row in settings_rows().items():
        assert env in fields, f"PROXY_{env} in README's table is not a setting"
        assert env not in REMOVED, f"PROXY_{env} is going away"
        assert f"`--{fields[env].replace('_', '-')}`" in row, f"PROXY_{env}: wrong flag"


def test_the_table_points_to_the_full_configuration() -> None:
    assert "](docs/configuration.md)" in section("The settings people change")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("doc", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{doc.relative_to(ROOT)} links to missing {target}"
