"""The in-process request harness (bench/harness/request_micro.py), the mypyc build's bookkeeping
(scripts/compile_core.py) and run_overhead's proxy-mypyc target, without compiling anything."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from bench.harness.request_micro import request_timings
from bench.runners import run_overhead

REPO = Path(__file__).resolve().parents[2]


def _compile_core() -> Any:
    spec = importlib.util.spec_from_file_location("compile_core", REPO / "scripts/compile_core.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["compile_core"] = module
    spec.loader.exec_module(module)
    return module


def test_every_stage_of_a_routed_request_runs_once() -> None:
    called: list[str] = []

    def once(name: str, fn: Any) -> str:
        fn()  # the whole request raises unless the data path answered 200
        called.append(name)
        return name

    timings, core = request_timings(once)
    assert timings == called
    assert called[0].startswith("DataPath.respond")
    assert any("hash" in name for name in called) and any("learn" in name for name in called)
    assert core.endswith(("router.py", ".so"))


def test_compile_core_lists_the_core_and_cleans_only_built_files(tmp_path: Path) -> None:
    cc = _compile_core()
    modules = [p.name for p in cc.core_modules(REPO)]
    assert "router.py" in modules and "prefix_index.py" in modules
    assert "__init__.py" not in modules
    core = tmp_path / "proxy" / "core"
    core.mkdir(parents=True)
    (core / "router.py").write_text("")
    built = [core / "router.cpython-311-x86_64-linux-gnu.so", tmp_path / "ab12__mypyc.x.so"]
    for path in built:
        path.write_bytes(b"")
    assert sorted(cc.clean(tmp_path)) == sorted(built)
    assert (core / "router.py").exists() and not any(p.exists() for p in built)


def test_proxy_mypyc_target_is_skipped_until_built(tmp_path: Path) -> None:
    target = run_overhead.Target("proxy-mypyc", "", "proxy", package_root=tmp_path)
    reason = target.unavailable()
    assert reason is not None and "not found" in reason and "compile_core.py" in reason
    core = tmp_path / "proxy" / "core"
    core.mkdir(parents=True)
    (core / "router.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    assert target.unavailable() is None
