"""``rollout-proxy`` / ``python -m proxy``: settings -> app -> server (proxy/server.py).

``python -m proxy status --url URL [--watch]`` prints the fleet instead (proxy/status.py)."""

from __future__ import annotations

import logging
import os
import sys

from pydantic import ValidationError
from pydantic_settings import CliApp

from proxy.errors import ConfigError
from proxy.logs import configure_logging
from proxy.security.posture import posture
from proxy.security.redaction import install_log_redaction
from proxy.settings import Settings, removed_settings

log = logging.getLogger("rollout_proxy")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["status"]:
        from proxy.status import main as status

        sys.exit(status(args[1:]))
    removed = removed_settings(args, os.environ)
    if removed:
        sys.exit(f"rollout-proxy: invalid configuration: {'; '.join(removed)}")
    try:
        settings = CliApp.run(Settings, cli_args=args)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
        sys.exit(f"rollout-proxy: invalid configuration: {problems}")
    configure_logging(settings.log_level, settings.log_json)
    # Nothing logs a key or the token; should anything ever try, the line is redacted.
    install_log_redaction(settings.secrets())
    for level, line in posture(
        settings.host,
        settings.port,
        data_keys=len(settings.api_keys),
        admin_keys=len(settings.admin_keys),
        adapter_roots=settings.adapter_roots,
        upstream_insecure=settings.upstream_insecure,
    ):
        log.log(level, line)

    from proxy.app import create_app
    from proxy.server import serve

    try:
        app = create_app(settings)
    except ConfigError as exc:
        sys.exit(f"rollout-proxy: invalid configuration: {exc.message}")
    serve(app, settings, app.state.rt.shutdown)


if __name__ == "__main__":
    main()
