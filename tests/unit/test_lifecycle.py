"""Fork and termination signals: a forked child exits normally, SIGTERM/SIGINT flush and then do what
they would have done without the agent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX only")

_ENV = {k: v for k, v in os.environ.items() if not k.startswith("HPAR_")}

_FORK = textwrap.dedent(
    """
    import os, sys, time, torch, hpar_agent
    from hpar_agent.agent import current
    run = sys.argv[1]
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    a = hpar_agent.attach(model, metrics_port=0, metrics_addr="127.0.0.1", traces="file", run_dir=run)
    model(torch.randn(2, 4)).sum().backward(); opt.step()
    sock_fd, log_fd = a.server.socket.fileno(), a.events._file._fh.fileno()
    assert not os.get_inheritable(sock_fd) and not os.get_inheritable(log_fd)  # close-on-exec
    pid = os.fork()
    if pid == 0:  # the child: a DataLoader worker would do its work and exit normally
        assert current() is None and not a.started and a.server is None
        assert os.readlink(f"/proc/self/fd/{log_fd}") == os.devnull  # the event log is not shared
        try:
            os.fstat(sock_fd)
            raise SystemExit("the child still holds the listening socket")
        except OSError:
            pass
        a.events.emit("from-child")  # harmless: goes nowhere
        sys.exit(0)  # normal exit: atexit runs
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        raise SystemExit("the forked child hung at exit")
    assert os.waitstatus_to_exitcode(status) == 0, status
    import urllib.request
    assert b"hpar_rank_info" in urllib.request.urlopen(a.metrics_url, timeout=10).read()  # parent serves on
    hpar_agent.detach()
    kinds = [__import__("json").loads(line)["kind"] for line in open(os.path.join(run, "events.rank0.jsonl"))]
    assert "from-child" not in kinds and kinds[-1] == "detach", kinds
    print("ok")
    """
)


def test_forked_child_exits_normally(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", _FORK, str(tmp_path)], capture_output=True, text=True, timeout=120, env=_ENV
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


_SIGNAL = textwrap.dedent(
    """
    import os, signal, sys, time, torch, hpar_agent
    run, how = sys.argv[1], sys.argv[2]
    if how == "user":
        def mine(signum, frame):
            print("user handler", flush=True)
            sys.exit(7)
        signal.signal(signal.SIGTERM, mine)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hpar_agent.attach(model, metrics_port=-1, traces="file", run_dir=run)
    step = 0
    while True:  # training, until the launcher terminates us
        model(torch.randn(2, 4)).sum().backward(); opt.step()
        step += 1
        if step == 30:  # traced steps are queued (every 10th) and not yet exported
            print("ready", flush=True)
        time.sleep(0.01)
    """
)


def _run_until_signal(tmp_path, sig: int, how: str = "default") -> subprocess.CompletedProcess[str]:
    # the child takes SIGINT as a terminal's Ctrl-C would reach it, even when this test run inherited
    # it ignored (started in the background of a shell without job control)
    proc = subprocess.Popen(
        [sys.executable, "-c", _SIGNAL, str(tmp_path), how],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_ENV,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _flushed(tmp_path) -> None:
    summary = json.loads((tmp_path / "summary.rank0.json").read_text())
    assert summary["components"]["steps"]  # the summary was written
    assert (tmp_path / "traces.rank0.jsonl").stat().st_size > 0  # queued spans reached the file


def test_sigterm_flushes_then_dies_by_the_signal(tmp_path):
    res = _run_until_signal(tmp_path, signal.SIGTERM)
    assert res.returncode == -signal.SIGTERM, res.stderr[-3000:]
    _flushed(tmp_path)
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "events.rank0.jsonl").read_text().splitlines()]
    assert kinds[-1] == "detach"


def test_sigterm_chains_to_the_users_handler(tmp_path):
    res = _run_until_signal(tmp_path, signal.SIGTERM, "user")
    assert res.returncode == 7 and "user handler" in res.stdout, res.stderr[-3000:]
    _flushed(tmp_path)


def test_sigint_flushes_then_raises_keyboard_interrupt(tmp_path):
    res = _run_until_signal(tmp_path, signal.SIGINT)
    assert "KeyboardInterrupt" in res.stderr and res.returncode == -signal.SIGINT, res.stderr[
        -3000:
    ]  # as plain Python
    _flushed(tmp_path)


_STUCK = textwrap.dedent(
    """
    import datetime, socket, sys, torch, hpar_agent
    import torch.distributed as dist
    run = sys.argv[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=600))
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hpar_agent.attach(model, metrics_port=-1, traces="none", run_dir=run)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward(); opt.step()
    print("ready", flush=True)
    store.get("never-set")  # the main thread blocks in C++, as in a collective whose peer died
    """
)


def test_sigterm_while_the_main_thread_is_stuck_in_cpp(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", _STUCK, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_ENV,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("SIGTERM did not end a process blocked in C++ (without the agent it would have)")
    assert proc.returncode == -signal.SIGTERM, err[-3000:]
    assert json.loads((tmp_path / "summary.rank0.json").read_text())["components"]["steps"]


def test_a_handler_installed_after_attach_is_left_to_decide(tmp_path):
    """A user's SIGTERM handler installed after attach (a graceful checkpoint) runs to its end: the
    watcher does not cut it short."""
    user = textwrap.dedent(
        """
        import signal, time
        def mine(signum, frame):
            time.sleep(3)  # saving a checkpoint; the watcher would act after 1 s if it ignored us
            print("user handler", flush=True)
            sys.exit(9)
        signal.signal(signal.SIGTERM, mine)
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    code = _STUCK.replace('print("ready", flush=True)', user)
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_ENV,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 9 and "user handler" in out, err[-3000:]
