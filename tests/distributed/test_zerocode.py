"""Zero-code mode: ``hpar-agent run -- ...`` observes scripts that never import hpar_agent.

The scripts (tests/zerocode_scripts/) are not the reference trainer: DDP, DTensor TP and FSDP2 on 2
gloo ranks under torchrun, a single-process loop without an optimizer, a script that exits 3.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hpar_agent.collectors.zerocode import NO_STEPS
from hpar_agent.tools.run_cmd import NOT_ATTACHED
from testkit.ports import free_base_port
from testkit.zerocode import attach_event, clean_env, events, hpar_run, run_cmd, summaries

pytestmark = pytest.mark.distributed

SCRIPTS = Path(__file__).resolve().parents[1] / "zerocode_scripts"
STEPS = 4
TORCHRUN = Path(sys.executable).with_name("torchrun")


def torchrun(script: str, *args: str, launcher: str = "module", nproc: int = 2) -> list[str]:
    head = [str(TORCHRUN)] if launcher == "torchrun" else [sys.executable, "-m", "torch.distributed.run"]
    return [*head, "--standalone", f"--nproc-per-node={nproc}", str(SCRIPTS / script), *args]


def _assert_every_rank_observed(
    run_dir: Path,
    proc: subprocess.CompletedProcess[str] | None = None,
    backend: str = "gloo",
    degrees: dict[str, str] | None = None,
) -> None:
    """Both ranks, their rank, world, backend and the degrees the wrapper or mesh built after attach
    says (``degrees``: the summary's topology values)."""
    why = "" if proc is None else proc.stderr[-3000:]
    ranks = summaries(run_dir)
    assert sorted(ranks) == [0, 1], why
    for r, s in ranks.items():
        assert s["rank"] == r
        assert s["topology"]["world_size"] == "2" and s["topology"]["backend"] == backend
        assert {k: s["topology"][k] for k in degrees or {}} == (degrees or {}), s["topology"]
        if (degrees or {}).get("dp") == "2":
            assert s["topology"]["dp_rank"] == str(r)
        assert s["components"]["steps"]["steps"] == STEPS, why
        zc = s["components"]["zerocode"]
        assert zc == {"attached_at": "init_process_group", "step_boundaries": STEPS}
        assert sum(t["count"] for t in s["components"]["collectives"]["table"]) > 0  # FR read after attach
        assert s["errors"] == {}, s["errors"]
        assert attach_event(run_dir, r)["topology"]["world_size"] == "2"


def _scrape(url: str) -> dict[str, list[Any]]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, list[Any]] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def test_ddp_under_torchrun_scraped_mid_run(tmp_path: Path) -> None:
    """(a) DDP with an optimizer, launched by the ``torchrun`` script: every rank serves its own
    /metrics while the job runs, with the right rank info and every step counted."""
    base = free_base_port(2)
    release = tmp_path / "release"
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        run_cmd(torchrun("ddp_train.py", str(STEPS), str(release), launcher="torchrun")),
        env=clean_env(run_dir, HPAR_METRICS_PORT=str(base)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 60
        seen: dict[int, dict[str, list[Any]]] = {}
        while len(seen) < 2 and time.time() < deadline and proc.poll() is None:
            for r in (0, 1):
                try:
                    fams = _scrape(f"http://127.0.0.1:{base + r}/metrics")
                except OSError:
                    continue
                steps = fams.get("hpar_steps_total", [])
                if steps and steps[0].value == STEPS:
                    seen[r] = fams
            time.sleep(0.3)
        release.touch()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert sorted(seen) == [0, 1], err[-3000:]
    for r, fams in seen.items():
        (info,) = fams["hpar_rank_info"]
        assert info.labels["rank"] == str(r) and info.labels["world_size"] == "2"
        assert info.labels["backend"] == "gloo" and info.labels["local_rank"] == str(r)
        assert 0 < fams["hpar_goodput_ratio"][0].value <= 1  # where the time went, live
        assert "startup" in {x.labels["cause"] for x in fams["hpar_lost_seconds_total"]}
    assert proc.returncode == 0, err[-3000:]
    assert f"outputs in {run_dir.resolve()}" in err and "exit code 0" in err
    assert "hpar-agent run: goodput " in err  # the closing line
    _assert_every_rank_observed(run_dir, degrees={"dp": "2", "dp_replicate": "2"})


def test_tp_dtensor(tmp_path: Path) -> None:
    """(b) TP with DTensor: ``init_device_mesh`` creates the process group itself, with no backend
    named (``dist.get_backend()`` says "undefined"): the label names the one its CPU tensors use."""
    proc = hpar_run(tmp_path, torchrun("tp_train.py", str(STEPS)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    # an unnamed mesh says nothing of which dim it is: the degrees stay unknown (1), never guessed
    _assert_every_rank_observed(tmp_path, proc, backend="gloo", degrees={"dp": "1", "tp": "1"})


def test_fsdp2(tmp_path: Path) -> None:
    """(c) FSDP2 (``fully_shard``, its default mesh) on gloo: dp is the sharding dim."""
    proc = hpar_run(tmp_path, torchrun("fsdp2_train.py", str(STEPS)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_every_rank_observed(tmp_path, proc, degrees={"dp": "2", "dp_shard": "2", "dp_replicate": "1"})


def test_a_clean_2d_fsdp_tp_program_raises_no_alert(tmp_path: Path) -> None:
    """(c') FSDP2 over dp and TP over tp on a named 2 x 2 mesh, compiled, 4 ranks: every rank observed
    with its degrees, the cross-rank detectors judged (exchanges over ~10 s), and no alert on any rank:
    the TP shards' scatters from rank 0 are no CollectiveMismatch."""
    proc = hpar_run(tmp_path, torchrun("fsdp_tp_train.py", "120", nproc=4), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = summaries(tmp_path)
    assert sorted(ranks) == [0, 1, 2, 3], proc.stderr[-3000:]
    for r, s in ranks.items():
        topo = s["topology"]
        assert (topo["dp"], topo["tp"], topo["dp_rank"], topo["tp_rank"]) == (
            "2",
            "2",
            str(r // 2),
            str(r % 2),
        )
        judged = s["components"]["detectors"]
        assert judged["CollectiveMismatch"]["judged"] > 0 and judged["CollectiveMismatch"]["fired"] == 0, (
            judged
        )
        assert s["errors"] == {}, s["errors"]
    every = [e for r in range(4) for e in events(tmp_path, r)]
    alerts = [e for e in every if e.get("kind") == "alert"]
    assert len(every) > 4 and alerts == [], alerts[:3]


def test_loop_without_optimizer_says_so_once(tmp_path: Path) -> None:
    """(d) no process group, no optimizer, no compile: nothing attaches, and the end of the run names
    the call that marks steps; applying it observes every step. A rank (a process group) that updates
    its weights by hand is observed, and says once per host (every summary carries it) that it gave
    no step boundary."""
    proc = hpar_run(tmp_path / "plain", [sys.executable, str(SCRIPTS / "no_optimizer.py"), "3"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no-optimizer loop done" in proc.stdout
    assert proc.stderr.count(NOT_ATTACHED) == 1 and "no step boundaries" not in proc.stderr, proc.stderr
    assert summaries(tmp_path / "plain") == {}

    fixed = hpar_run(tmp_path / "fixed", [sys.executable, str(SCRIPTS / "no_optimizer.py"), "3", "mark"])
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert "no step boundaries" not in fixed.stderr
    (s,) = summaries(tmp_path / "fixed").values()
    assert s["components"]["steps"]["steps"] == 3
    assert s["components"]["zerocode"] == {"attached_at": "hpar_agent.current()", "step_boundaries": 3}

    ranks = hpar_run(tmp_path / "ranks", torchrun("no_optimizer.py", "3", "pg"))
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    assert ranks.stderr.count(NO_STEPS) == 1, ranks.stderr  # one line for the host
    assert "hpar_agent.current().step()" in NO_STEPS
    for s in summaries(tmp_path / "ranks").values():
        assert s["components"]["zerocode"]["note"] == NO_STEPS
        assert s["components"]["zerocode"]["attached_at"] == "init_process_group"


def test_exit_code_and_disable(tmp_path: Path) -> None:
    """(e) the script's exit status is the command's, observed or not; HPAR_DISABLE=1 installs nothing."""
    cmd = [sys.executable, str(SCRIPTS / "exit_code.py"), "3"]
    proc = hpar_run(tmp_path / "on", cmd)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "exit code 3" in proc.stderr
    assert list(summaries(tmp_path / "on")) == [0]
    off = hpar_run(tmp_path / "off", cmd, HPAR_DISABLE="1")
    assert off.returncode == 3
    assert not (tmp_path / "off").exists() or not any((tmp_path / "off").iterdir())


def test_sigterm_reaches_the_whole_process_group(tmp_path: Path) -> None:
    """SIGTERM to ``hpar-agent run`` reaches the child and its own children; status 128 + 15."""
    pid_file = tmp_path / "grandchild.pid"
    code = (
        "import subprocess, sys, time; p = subprocess.Popen(['sleep', '60']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    proc = subprocess.Popen(
        run_cmd([sys.executable, "-c", code]),
        env=clean_env(tmp_path / "run"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 20
        while not (pid_file.exists() and pid_file.read_text()) and time.time() < deadline:
            time.sleep(0.05)
        grandchild = int(pid_file.read_text())
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    deadline = time.time() + 5
    while _alive(grandchild) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def _alive(pid: int) -> bool:
    """Running (a zombie left to an init that does not reap counts as dead)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
