"""Run ``python -m trainer`` with the CPU patches of ``cpu_patches`` applied (e2e test only)."""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import cpu_patches  # type: ignore[import-not-found]  # found via the sys.path line above

    cpu_patches.apply()
    from trainer.__main__ import main

    raise SystemExit(main(sys.argv[1:]))
