"""Structured logs: a completion's log line carries its X-Request-Id and routing outcome."""

from __future__ import annotations

import json
import logging

from proxy.logs import JsonFormatter


def test_completion_is_logged_with_its_request_id(make_fleet, caplog) -> None:
    h = make_fleet(1)
    with caplog.at_level(logging.DEBUG, logger="rollout_proxy.dataplane"):
        r = h.client.post(
            "/v1/completions",
            json={"model": "tiny/base", "prompt": [1] * 40},
            headers={"X-Request-Id": "trace-me-42"},
        )
    assert r.headers["x-request-id"] == "trace-me-42"
    records = [rec for rec in caplog.records if getattr(rec, "request_id", None) == "trace-me-42"]
    assert len(records) == 1
    line = json.loads(JsonFormatter().format(records[0]))
    assert line["request_id"] == "trace-me-42" and line["replica"] == 0 and line["status"] == 200
    assert line["route"] == "completions" and line["outcome"] in ("affinity", "unmatched")
    assert line["level"] == "debug" and "trace-me-42" in line["message"]
