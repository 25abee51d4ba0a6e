"""``python -m trainer`` / ``rollout-train``: parse the configuration, run the recipe.

Exit codes: 0 done, 2 configuration / data / preflight problem (message on stderr, no traceback),
1 anything else (traceback: a bug or an infrastructure failure worth the full stack).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

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
    # Only after a whole run, when every rank is past its last collective: on a failure a peer
    # may still wait in one, and tearing NCCL down under it can block the exit.
    destroy_process_group()
    return 0


def destroy_process_group() -> None:
    """Tear the process group down while the interpreter is whole. A rank that exits with its
    group alive can abort in finalization (SIGABRT, "terminate called without an active
    exception": gloo's worker threads still hold tensors; pytorch/pytorch#190489, #179291).
    NCCL warns of the same leak at exit; exit_process covers what teardown leaves behind."""
    dist = sys.modules.get("torch.distributed")  # not imported: no group (and no torch import)
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End a trainer process with ``code``. Once torch.distributed was loaded, the interpreter's
    finalization is skipped (outputs are flushed first; the run's files are already written):
    gloo's worker threads can still abort it with SIGABRT ("terminate called without an active
    exception") after a clean destroy_process_group, and a finished run must not exit -6."""
    if "torch.distributed" in sys.modules:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


def cli() -> NoReturn:
    """The ``rollout-train`` console script."""
    exit_process(main())


if __name__ == "__main__":
    cli()
