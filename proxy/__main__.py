"""``rollout-proxy`` / ``python -m proxy``: settings -> uvicorn. No logic here."""

from __future__ import annotations

import sys

from pydantic import ValidationError
from pydantic_settings import CliApp

from proxy.logs import configure_logging
from proxy.settings import Settings


def main(argv: list[str] | None = None) -> None:
    try:
        settings = CliApp.run(Settings, cli_args=sys.argv[1:] if argv is None else argv)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
        sys.exit(f"rollout-proxy: invalid configuration: {problems}")
    configure_logging(settings.log_level, settings.log_json)

    import uvicorn

    from proxy.app import create_app

    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        lifespan="on",
    )


if __name__ == "__main__":
    main()
