"""``python -m trainer`` / ``rollout-train``: parse the configuration, run the recipe.

Exit codes: 0 done, 2 configuration / data / preflight problem (message on stderr, no traceback),
1 anything else (traceback: a bug or an infrastructure failure worth the full stack).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from trainer.config import ConfigError, describe, load_config


def main(argv: Sequence[str] | None = None) -> int:
    try:
        loaded = load_config(argv)
    except ConfigError as exc:
        print(f"rollout-train: {exc}", file=sys.stderr)
        return 2
    if loaded.print_config:
        print(describe(loaded))
        return 0

    from trainer.data import DataError
    from trainer.preflight import PreflightError
    from trainer.run import run

    try:
        run(loaded)
    except (ConfigError, DataError, PreflightError) as exc:
        print(f"rollout-train: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
