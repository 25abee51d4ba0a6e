"""Opt-in: compile the pure routing core (``proxy/core/*.py``) to C extensions with mypyc.

    python scripts/compile_core.py                 # .so files beside the sources (git-ignored)
    python scripts/compile_core.py --clean         # remove them: the pure-Python core again
    python scripts/compile_core.py --out DIR       # a copy of the package in DIR/proxy, compiled
                                                   # there (bench.runners.run_overhead's
                                                   # proxy-mypyc)

Why opt-in. The Python modules stay the reference and the default: mypyc ships with mypy (the dev
venv has it) and needs a C compiler, which neither ``pip install rollout-proxy`` nor the image
guarantees, and a compiled module silently shadows its source (Python imports the extension
first), so an edit to ``proxy/core/*.py`` does nothing until this is re-run or cleaned. What the
build buys is measured, not assumed: ``python -m bench.runners.run_micro --request`` times a routed
request in process with either core, and ``bench.runners.run_overhead``'s ``proxy-mypyc`` target
runs the
compiled copy side by side with the default. Measured on the 2-core machine (2026-12-02): ~14%
less CPU per routed request in process, 7-9% *more* under wrk load in the quiet final run (no
difference in a loaded one): bench/results/overhead_profile.md, "mypyc".

The core is compiled whole, because mypyc calls between compiled modules natively (a call into a
pure-Python module goes through the interpreter). Nothing in it may be monkeypatched or
subclassed from outside at run time once compiled; the unit tests of the core run against the
build to check it: ``PYTHONPATH=DIR python -P -m pytest tests/unit/test_router.py ...``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CORE = Path("proxy") / "core"


def core_modules(root: Path) -> list[Path]:
    """Every module of the core but the package ``__init__`` (a docstring; compiling it gains
    nothing and would make the package itself an extension)."""
    return sorted(p.relative_to(root) for p in (root / CORE).glob("*.py") if p.stem != "__init__")


def built_files(root: Path) -> list[Path]:
    """What a build leaves at ``root``: one extension per module plus mypyc's shared runtime
    library (named after a hash of the module group) at the top level."""
    return sorted([*(root / CORE).glob("*.so"), *root.glob("*__mypyc.*.so")])


def clean(root: Path) -> list[Path]:
    removed = built_files(root)
    for path in removed:
        path.unlink()
    return removed


def compile_core(root: Path) -> float:
    """Build the extensions in place under ``root``; returns the wall-clock seconds it took."""
    clean(root)
    modules = [str(m) for m in core_modules(root)]
    started = time.monotonic()
    # mypyc writes its C sources and objects to ./build (git-ignored); the .so files land beside
    # the modules. Strict settings come from pyproject.toml when root is the repository.
    subprocess.run([sys.executable, "-m", "mypyc", *modules], cwd=root, check=True)
    return time.monotonic() - started


def copy_package(out: Path) -> None:
    """``proxy/`` (sources only) into ``out/proxy``, replacing an earlier copy."""
    target = out / "proxy"
    shutil.rmtree(target, ignore_errors=True)
    for old in out.glob("*__mypyc.*.so"):
        old.unlink()
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(
        REPO / "proxy", target, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    )
    pyproject = REPO / "pyproject.toml"
    shutil.copy2(pyproject, out / "pyproject.toml")  # mypy's settings for the build


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/compile_core.py", description=__doc__)
    p.add_argument("--out", type=Path, help="build a compiled copy of the package here instead")
    p.add_argument("--clean", action="store_true", help="remove the compiled modules and exit")
    args = p.parse_args(argv)
    root = REPO
    if args.out is not None:
        root = args.out.resolve()
        if args.clean:
            shutil.rmtree(root / "proxy", ignore_errors=True)
        else:
            copy_package(root)
    if args.clean:
        removed = clean(root)
        print(f"removed {len(removed)} compiled file(s) under {root}")
        return 0
    seconds = compile_core(root)
    built = built_files(root)
    print(f"compiled {len(core_modules(root))} core modules in {seconds:.0f} s under {root}:")
    for path in built:
        print(f"  {path.relative_to(root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
