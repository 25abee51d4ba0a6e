"""``rollout-proxy`` / ``python -m proxy``: settings -> app -> server (proxy/server.py).

``python -m proxy status --url URL [--watch]`` prints the fleet instead (proxy/status.py)."""

from __future__ import annotations

import logging
import sys

from pydantic import ValidationError
from pydantic_settings import CliApp

from proxy.logs import configure_logging
from proxy.security.posture import posture
from proxy.security.redaction import install_log_redaction, settings_secrets
from proxy.settings import Settings

log = logging.getLogger("rollout_proxy")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["status"]:
        from proxy.status import main as status

        sys.exit(status(args[1:]))
    try:
        settings = CliApp.run(Settings, cli_args=args)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
        sys.exit(f"rollout-proxy: invalid configuration: {problems}")
    configure_logging(settings.log_level, settings.log_json)
    # Nothing logs a key or the token; should anything ever try, the line is redacted.
    install_log_redaction(settings_secrets(settings))
    for level, line in posture(settings):
        log.log(level, line)

    from proxy.app import create_app
    from proxy.server import serve

    app = create_app(settings)
    serve(app, settings, app.state.rt.shutdown)


if __name__ == "__main__":
    main()
