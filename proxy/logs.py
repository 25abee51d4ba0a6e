"""Logging setup: plain or JSON lines. Nothing logs headers, so the upstream token never can."""

from __future__ import annotations

import json
import logging
import time

# Structured fields a log call may attach with ``extra=``; JSON lines carry them as keys, so a
# request can be followed by its X-Request-Id across the proxy's logs.
FIELDS = ("request_id", "route", "replica", "status", "outcome", "matched_blocks", "upstream_ms")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for field in FIELDS:
            value = record.__dict__.get(field)
            if value is not None:
                entry[field] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(level: str, as_json: bool) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter()
        if as_json
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # httpx logs every request at INFO: a probe round every 2 s per replica would drown the log.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))
