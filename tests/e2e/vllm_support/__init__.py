"""Support for the end-to-end tests against real vLLM CPU servers (``tests/e2e/test_vllm_*.py``).

The servers run from ``.venv-vllm`` (``make setup-vllm``); the launcher is
``scripts/vllm_replicas.py`` and the tiny model/adapters come from ``trainer.tiny_model`` and
``scripts/tiny_lora.py``. Test modules load the fixtures with
``pytest_plugins = ["tests.e2e.vllm_support.fixtures"]``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
# Override with VLLM_VENV=/path/to/venv to test against another vLLM install.
VLLM_VENV = Path(os.environ.get("VLLM_VENV", REPO_ROOT / ".venv-vllm"))


def skip_reason() -> str | None:
    """Why the real-vLLM tests cannot run here, or None when they can."""
    python = VLLM_VENV / "bin" / "python"
    if not python.is_file():
        return f"no vLLM venv at {VLLM_VENV}: run `make setup-vllm` to create it (~1.5 min, 3.1 GB)"
    if not any(VLLM_VENV.glob("lib/python3*/site-packages/vllm/entrypoints/openai/api_server.py")):
        return f"{VLLM_VENV} has no vLLM installed: rerun `make setup-vllm`"
    missing = [
        name
        for name in ("torch", "transformers", "peft", "zmq", "msgpack")
        if importlib.util.find_spec(name) is None
    ]
    if missing:
        return (
            f"main venv lacks {', '.join(missing)}: "
            "pip install -e '.[trainer,dev]' (builds the tiny model and adapters)"
        )
    return None
