"""The ``hpar-agent`` command line: version, refusals before anything starts, export of packaged files.

CLI tests run ``python -m hpar_agent`` in a fresh interpreter; none of them starts torchrun."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import hpar_agent
import hpar_trainer
from hpar_agent.tools import export
from hpar_agent.tools.launch import first_error_line

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpar_agent", *args], capture_output=True, text=True, timeout=60, cwd=cwd
    )


def test_version_has_one_source():
    res = _cli("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"hpar-agent {hpar_agent.__version__}"
    assert metadata.version("hpar-agent") == hpar_agent.__version__ == hpar_trainer.__version__
    pyproject = (REPO / "pyproject.toml").read_text()  # (tomllib is 3.11+; the project supports 3.10)
    assert 'dynamic = ["version"]' in pyproject and '\nversion = "' not in pyproject
    assert 'license = "Apache-2.0"' in pyproject
    assert (REPO / "LICENSE").read_text().lstrip().startswith("Apache License")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["demo", "--inject", "bogus"],
            "hpar-agent demo: error: --inject 'bogus' is not one of recompile-storm",
        ),
        (["demo", "--bogus"], "unrecognized arguments: --bogus"),
        (
            ["demo", "--", "--compile", "nope"],
            "hpar-agent demo: error: argument --compile: invalid choice: 'nope'",
        ),
        (
            ["demo", "--inject", "graph-break", "--", "--compile", "none"],
            "--inject graph-break needs --compile",
        ),
        (["report", "no-such-run"], "hpar-agent report: error: no-such-run: not found"),
        (["report", "."], "has no summary/events/traces/trainer files"),
        (["export", "grafana", "--out", "x"], "invalid choice: 'grafana'"),
    ],
)
def test_bad_input_is_refused_in_one_line_before_anything_starts(tmp_path, args, says):
    res = _cli(*args, cwd=tmp_path)  # a demo that started would create tmp_path/hpar-runs/
    assert res.returncode == 2, res.stderr
    assert res.stdout == "" and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert says in res.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize(("tool", "args"), [("demo", []), ("diagnose", ["--inject", "hang"])])
def test_a_linked_hpar_runs_is_refused_in_one_line(tmp_path, tool, args):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "hpar-runs").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    res = _cli(tool, *args, cwd=tmp_path)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert f"hpar-agent {tool}: error: run directory: hpar-runs is a symbolic link" in res.stderr
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_first_error_line_is_the_exception_of_the_first_traceback():
    log = (
        "W1201 warning from torch\n"
        'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n    import numpy\n'
        "    ^^^^^^^^^^^^\nRuntimeError: Numpy is not available\n"
        'Traceback (most recent call last):\n  File "y.py", line 2\nValueError: later\n'
    )
    assert first_error_line(log) == "RuntimeError: Numpy is not available"
    assert (
        first_error_line("hpar-train: error: --dp must be >= 1\n") == "hpar-train: error: --dp must be >= 1"
    )
    assert first_error_line("all fine\n") is None


@pytest.mark.parametrize(
    ("kind", "sources"),
    [
        ("dashboards", {p.name: p for p in (REPO / "dashboards").glob("*.json")}),
        ("rules", {p.name: p for p in (REPO / "deploy/prometheus/rules").glob("*.yml")}),
    ],
)
def test_export_writes_the_repository_files(tmp_path, kind, sources):
    res = _cli("export", kind, "--out", str(tmp_path / kind))
    assert res.returncode == 0, res.stderr
    written = {p.name: p for p in (tmp_path / kind).iterdir()}
    assert set(written) == set(sources) and len(sources) >= 2
    assert all(filecmp.cmp(written[n], sources[n], shallow=False) for n in sources)


def test_export_compose_keeps_the_layout_its_mounts_expect(tmp_path):
    assert export.main("compose", str(tmp_path)) == 0
    compose = tmp_path / "deploy/compose/compose.yaml"
    assert filecmp.cmp(compose, REPO / "deploy/compose/compose.yaml", shallow=False)
    for mount in (
        "../prometheus/prometheus.yml",
        "../prometheus/rules",
        "../alertmanager/alertmanager.yml",
        "./grafana/provisioning",
        "../../dashboards",
        "./alert_webhook.py",
    ):
        assert mount in compose.read_text() and (compose.parent / mount).exists(), mount
    assert (tmp_path / "dashboards/overview.json").exists()


def test_wheel_ships_assets_and_license(tmp_path):
    """What a pip user gets: build the wheel and look inside (the source tree holds links, not copies)."""
    import zipfile

    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    (wheel,) = tmp_path.glob("hpar_agent-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {f"hpar_agent/assets/dashboards/{p.name}" for p in (REPO / "dashboards").glob("*.json")}
    want |= {
        f"hpar_agent/assets/deploy/prometheus/rules/{p.name}"
        for p in (REPO / "deploy/prometheus/rules").glob("*.yml")
    }
    want |= {
        "hpar_agent/assets/deploy/compose/compose.yaml",
        "hpar_agent/assets/deploy/alertmanager/alertmanager.yml",
        "hpar_agent/assets/deploy/compose/alert_webhook.py",
        "hpar_agent/__main__.py",
        "hpar_agent/_version.py",
        "hpar_agent/tools/cli.py",
        "hpar_agent/tools/report.py",
    }
    assert want <= names, sorted(want - names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert "License-Expression: Apache-2.0" in text and "Requires-Dist: numpy" in text
    assert "Requires-Dist: plotly" in text
    assert not any(n.endswith("generate.py") for n in names)  # the generators stay in the source tree
    # developer tooling and test helpers stay in the source tree too
    assert not any(n.startswith(("scripts/", "testkit/", "benchmarks/", "tests/")) for n in names)
    assert not {"hpar_agent/docs.py", "hpar_agent/cli.py"} & names and not any(
        n.endswith("gen_docs.py") for n in names
    )
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "hpar-agent = hpar_agent.tools.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
    # Installed from the wheel (a pure-Python wheel is a zip of site-packages), export needs no clone.
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = "import sys, hpar_agent.tools.cli as c; print(c.__file__); sys.exit(c.main(sys.argv[1:]))"
    res = subprocess.run(
        [sys.executable, "-c", code, "export", "rules", "--out", str(tmp_path / "rules")],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
    )
    assert res.returncode == 0 and res.stdout.startswith(str(site)), res.stdout + res.stderr
    for rule in (REPO / "deploy/prometheus/rules").glob("*.yml"):
        assert filecmp.cmp(tmp_path / "rules" / rule.name, rule, shallow=False)


@pytest.mark.parametrize(
    ("environ", "addr"), [({}, "127.0.0.1"), ({"HPAR_METRICS_ADDR": "0.0.0.0"}, "0.0.0.0")]
)
def test_demo_binds_loopback_unless_told_otherwise(tmp_path, monkeypatch, environ, addr):
    """The demo's ranks serve on 127.0.0.1; HPAR_METRICS_ADDR (compose sets 0.0.0.0, so Prometheus
    in another container scrapes them) is passed on to every rank."""
    from types import SimpleNamespace

    from hpar_agent.tools import cli

    seen: dict[str, str] = {}

    def launch(nproc, module, argv, *, log_dir, env, timeout):  # stands in for torchrun: stopped at once
        seen.update(env)
        return SimpleNamespace(interrupted=True, timed_out=False, stopped_workers=0, returncode=130)

    monkeypatch.delenv("HPAR_METRICS_ADDR", raising=False)
    for k, v in environ.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(cli, "launch_observed", launch)
    assert cli.main(["demo", "--run-dir", str(tmp_path / "run"), "--steps", "2"]) == 130
    assert seen["HPAR_METRICS_ADDR"] == addr and seen["HPAR_RUN_DIR"] == str(tmp_path / "run")
