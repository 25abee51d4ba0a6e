"""Print the `uv pip install` options that give uv the package sources pip is configured with.

`make setup` and scripts/setup_vllm_venv.sh install with uv (the project's venv: ~9 s instead of
pip's ~180 s on the 2-core CI machine, measured from empty caches), but uv does not read pip's
configuration, and on this kind of machine that configuration is what makes `torch==2.13.0`
resolve to the local CPU wheel (`find-links`) instead of PyPI's multi-GB CUDA build, and what
adds the local package indexes and the site's constraints. So the sources are read from
`pip config list` (pip's own answer, every file and PIP_* variable) and handed to uv unchanged.

Precedence follows pip: a PIP_* variable over a config file's [install] section over [global].
`--index-strategy unsafe-best-match` makes uv pick the best version across all indexes, as pip
does (uv's default takes a package from the first index that has it at all).

Usage: python scripts/uv_pip_args.py PYTHON   (PYTHON: the interpreter whose pip is asked)
"""

from __future__ import annotations

import ast
import shlex
import subprocess
import sys

# pip option -> uv option; the values of the list-valued ones are whitespace-separated in pip's
# configuration, and each becomes its own uv flag.
OPTIONS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}
SECTIONS = (":env:", "install", "global")  # highest precedence first


def pip_config(python: str) -> dict[str, str]:
    listing = subprocess.run(
        [python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    config = {}
    for line in listing.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            config[key.strip()] = ast.literal_eval(value.strip())
    return config


def uv_args(config: dict[str, str]) -> list[str]:
    args = ["--index-strategy", "unsafe-best-match"]
    for name, flag in OPTIONS.items():
        for section in SECTIONS:
            value = config.get(f"{section}.{name}")
            if value is not None:
                args += [part for item in value.split() for part in (flag, item)]
                break
    no_index = next(
        (config[f"{s}.no-index"] for s in SECTIONS if f"{s}.no-index" in config), "false"
    )
    if no_index.lower() in ("1", "true", "yes", "on"):
        args.append("--no-index")
    return args


if __name__ == "__main__":
    print(shlex.join(uv_args(pip_config(sys.argv[1] if len(sys.argv) > 1 else sys.executable))))
