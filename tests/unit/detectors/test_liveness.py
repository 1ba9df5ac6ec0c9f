"""RankGone and Hang's culprits, on the last word of each peer."""

from __future__ import annotations

import dataclasses
import io
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from hpar_agent import rankstate
from hpar_agent.detectors.liveness import RankGone
from hpar_agent.detectors.snapshot import PeerView, Snapshot
from hpar_agent.topology import Topology
from tests.unit.conftest import train_linear

HOST = socket.gethostname()


def _ctx(
    seen: dict[int, dict[str, Any]], now: float, read_ok_at: float | None = None, rank: int = 0
) -> Snapshot:
    """A pass of rank ``rank`` whose exchange last heard ``seen`` (the exchange every 3 s)."""
    view = PeerView(seen=seen, read_ok_at=now if read_ok_at is None else read_ok_at, interval_s=3.0)
    return Snapshot(now=now, topology=Topology(rank=rank), coords={}, exchange=view)


def _payload(t: float, pid: int, step: int = 40, host: str = HOST, **kw: Any) -> dict[str, Any]:
    return {"t": t, "step": step, "id": [pid, host, rankstate.start_ticks(pid) or 0], **kw}


@pytest.fixture
def sleeper() -> Any:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_silent_peer_whose_process_is_stopped_is_named(sleeper: Any) -> None:
    now = time.time()
    os.kill(sleeper.pid, signal.SIGSTOP)
    time.sleep(0.2)
    v = RankGone().evaluate(_ctx({1: _payload(now - 9, sleeper.pid)}, now))
    assert v is not None and v.active and v.details["culprits"] == [1]
    assert v.details["ranks"]["1"]["process"] == "stopped" and v.details["ranks"]["1"]["last_step"] == 40


def test_a_silent_peer_whose_process_runs_is_only_late() -> None:
    now = time.time()
    v = RankGone().evaluate(_ctx({1: _payload(now - 9, os.getpid())}, now))
    assert v is not None and not v.active


def test_a_silent_peer_that_is_gone_or_elsewhere_is_named(sleeper: Any) -> None:
    now = time.time()
    ticks = rankstate.start_ticks(sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    seen = {
        1: {**_payload(now - 9, sleeper.pid), "id": [sleeper.pid, HOST, ticks]},
        2: _payload(now - 10, 12345, host="another-host"),
    }
    v = RankGone().evaluate(_ctx(seen, now))
    assert v is not None and v.details["culprits"] == [1, 2]
    assert v.details["ranks"]["1"]["process"] == "gone"
    assert v.details["ranks"]["2"]["process"] == "unknown (another host)"


def test_a_peer_is_judged_only_past_two_exchanges_and_a_clean_goodbye_never(sleeper: Any) -> None:
    now = time.time()
    os.kill(sleeper.pid, signal.SIGSTOP)
    seen = {1: _payload(now - 6.9, sleeper.pid), 2: _payload(now - 60, sleeper.pid, bye="exit")}
    v = RankGone().evaluate(_ctx(seen, now))
    assert v is not None and not v.active  # 6.9 s < 2 x 3 s + 1 s; a rank that finished is not gone


def test_a_peer_silent_past_the_bound_since_the_last_read_is_read_again_once() -> None:
    """The last read came 7 s after the peer's payload (its reader's offset): at 7.5 s of silence its
    ``s`` alone is read again. A newer payload (it was late) names nothing; the same one names it, and
    later passes ask the store nothing more until a newer payload comes."""
    now = time.time()
    old = _payload(now - 7.5, 12345, host="another-host")
    store: dict[int, dict[str, Any]] = {1: _payload(now - 0.5, 12345, host="another-host")}
    asked: list[list[int]] = []

    def fetch(purpose: str, ranks: Any) -> dict[int, dict[str, Any]]:
        asked.append(list(ranks))
        return {r: store[r] for r in ranks if r in store} if purpose == "s" else {}

    def snap(at: float) -> Snapshot:
        view = PeerView(seen={1: old}, read_ok_at=now - 0.5, interval_s=3.0, fetch=fetch)
        return Snapshot(now=at, topology=Topology(rank=0), coords={}, exchange=view)

    gone = RankGone()
    v = gone.evaluate(snap(now))
    assert v is not None and not v.active and asked == [[1]]
    v = gone.evaluate(snap(now + 1))  # the newer payload is its last word: 1.5 s old
    assert v is not None and not v.active and asked == [[1]]
    store[1] = old  # dead: the store holds the same payload
    gone = RankGone()
    assert [gone.evaluate(snap(now + i)).details["culprits"] for i in range(3)] == [[1]] * 3  # type: ignore[union-attr]
    assert asked == [[1], [1]]
    store.clear()  # the store did not answer: nothing is said of the peer
    assert RankGone().evaluate(snap(now)).details["culprits"] == []  # type: ignore[union-attr]


def test_a_silent_peer_is_judged_at_the_time_of_the_re_read_not_the_passs_start() -> None:
    """6.5 s of silence at the pass's start (bound: 2 x 3 s + 1 s); the pass waited for its offsets, and
    its re-read of the peer comes 7.1 s after the peer's payload: the peer is named in this pass, not
    at the next. A re-read 6.9 s after asks the store nothing."""
    now = time.time()
    old = _payload(now - 6.5, 12345, host="another-host")
    asked: list[list[int]] = []

    def fetch(purpose: str, ranks: Any) -> dict[int, dict[str, Any]]:
        asked.append(list(ranks))
        return {r: old for r in ranks}

    def verdict(waited: float) -> Any:
        view = PeerView(
            seen={1: old}, read_ok_at=now - 3, interval_s=3.0, fetch=fetch, clock=lambda: now + waited
        )
        return RankGone().evaluate(Snapshot(now=now, topology=Topology(rank=0), coords={}, exchange=view))

    assert verdict(0.4).details["culprits"] == [] and asked == []
    assert verdict(0.6).details["culprits"] == [1] and asked == [[1]]


def test_a_late_pass_is_an_agent_interval_where_that_is_longer_than_a_second() -> None:
    """HPAR_INTERVAL=5: the exchange every 5 s, and a live peer's pass up to 5 s late (a pass starts at
    the next tick): 14 s of silence is one exchange and a late pass, 15.5 s is more."""
    now = time.time()

    def culprits(silent: float) -> Any:
        old = _payload(now - silent, 12345, host="another-host")
        view = PeerView(
            seen={1: old}, read_ok_at=now, interval_s=5.0, fetch=lambda p, rs: {1: old}, pass_s=5.0
        )
        v = RankGone().evaluate(Snapshot(now=now, topology=Topology(rank=0), coords={}, exchange=view))
        return v.details["culprits"] if v is not None else None

    assert culprits(14.0) == [] and culprits(15.5) == [1]


def test_a_goodbye_with_an_exception_names_the_rank_at_the_next_pass() -> None:
    """No silence to wait for; the pass that first sees the ending names no one (a job that fails
    everywhere at once ends the judging rank within it), the next one names the rank."""
    now = time.time()
    seen = {
        1: _payload(now - 0.5, 999_999, bye="exception: RuntimeError: CUDA error: an illegal memory access")
    }
    gone = RankGone()
    first, v = gone.evaluate(_ctx(seen, now)), gone.evaluate(_ctx(seen, now + 1))
    assert first is not None and not first.active and first.details["culprits"] == []
    assert v is not None and v.active and v.details["culprits"] == [1]
    assert v.details["ranks"]["1"]["ended"].startswith("exception: RuntimeError")


def test_nothing_is_said_without_a_recent_read_of_the_store_or_while_stopping() -> None:
    now = time.time()
    seen = {1: _payload(now - 60, 999_999)}
    assert RankGone().evaluate(_ctx(seen, now, read_ok_at=now - 10)) is None  # the store went away
    assert RankGone().evaluate(dataclasses.replace(_ctx(seen, now), stopping=True)) is None


def test_proc_state_tells_a_reused_pid_from_the_process() -> None:
    me = os.getpid()
    assert rankstate.proc_state(me, rankstate.start_ticks(me), HOST) == "running"
    assert (
        rankstate.proc_state(me, (rankstate.start_ticks(me) or 0) + 1, HOST) == "gone"
    )  # another process now
    assert rankstate.proc_state(me, None, "another-host") == ""


def test_exit_status_is_read_from_an_unreaped_child() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    deadline = time.time() + 10
    while rankstate.proc_state(proc.pid, None, HOST) != "zombie" and time.time() < deadline:
        time.sleep(0.02)
    status = rankstate.exit_status(proc.pid)
    proc.wait()
    assert status is not None and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def test_a_peer_that_ended_of_a_communication_timeout_is_a_victim_never_named() -> None:
    """A hang's waiting ranks end at the process group's timeout, a killed rank's peers of a reset
    connection: consequences. The rank that stayed (here: this one) sees them go and names none."""
    now = time.time()
    timeout = "exception: RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms for recv operation to complete"
    closed = "exception: DistBackendError: Connection closed by peer [127.0.0.1]:4321"
    seen = {1: _payload(now - 1, 999_991, bye=timeout), 3: _payload(now - 1, 999_993, bye=closed)}
    v = RankGone().evaluate(_ctx(seen, now, rank=2))
    assert v is not None and not v.active and v.details["culprits"] == [] and v.details["victims"] == [1, 3]
    # one that went on its own is named; the launcher's SIGTERM to the others after it is a consequence
    seen[0] = _payload(now - 1, 999_990, bye="exception: ValueError: bad batch")
    seen[2] = _payload(now - 1, 999_992, bye="signal: SIGTERM")
    gone = RankGone()
    held = gone.evaluate(_ctx(seen, now, rank=4))  # the pass that first sees them end names no one
    assert held is not None and not held.active and held.details["victims"] == [1, 2, 3]
    v = gone.evaluate(_ctx(seen, now + 1, rank=4))
    assert v is not None and v.active and (v.details["culprits"], v.details["victims"]) == ([0], [1, 2, 3])
    assert v.value == 1.0


def test_endings_tell_a_consequence_from_a_cause() -> None:
    from hpar_agent import endings

    for text in (
        "exception: RuntimeError: Timed out waiting 20000ms for send operation to complete",
        "exception: DistBackendError: NCCL communicator was aborted on rank 1.",
        "exception: RuntimeError: Connection reset by peer",
        "exception: DistNetworkError: failed to recv, got 0 bytes",
    ):
        assert endings.communication_failure(text), text
    for text in (
        "exception: ValueError: bad batch",
        "exception: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "",
    ):
        assert not endings.communication_failure(text), text
    assert endings.launcher_signal("killed by signal 15 (SIGTERM)") and not endings.launcher_signal(
        "killed by signal 9 (SIGKILL)"
    )


def test_a_rank_its_peers_step_on_without_is_idle_not_hung() -> None:
    """Out of data under DDP's Join, a rank steps no more while it shadows its peers' collectives: its
    Hang fired at 60 s without a step, with no op in flight and the job training on."""
    from hpar_agent.detectors.liveness import Hang

    now = time.time()

    def judge(peer_step: int) -> Any:
        view = PeerView(peers={1: {"t": now - 1, "step": peer_step}}, seen={}, read_ok_at=now)
        snap = Snapshot(
            now=now,
            topology=Topology(rank=0, world_size=2),
            coords={},
            steps_done=100,
            last_step_ts=now - 90,
            exchange=view,
        )
        return Hang().evaluate(snap)

    idle = judge(2600)
    assert not idle.active and idle.details["peers_ahead_steps"] == 2500 and idle.details["no_step_s"] == 0
    hung = judge(101)  # a peer a step ahead: waiting for this rank, whose 90 s without a step are a hang
    assert hung.active and hung.details["no_step_s"] >= 90


class _Phases:
    """A real agent (Hang after 1 s without progress) and a watcher that records, every 0.1 s, what the
    training thread is doing and whether Hang is active."""

    def __init__(self, tmp_path: Any) -> None:
        import threading

        import hpar_agent

        self.agent = hpar_agent.attach(
            metrics_port=-1, traces="none", run_dir=str(tmp_path), interval=0.2, evidence=False,
            thresholds={"Hang.timeout_s": 1.0},
        )  # fmt: skip
        self.seen: list[tuple[str, bool]] = []
        self.doing = "steps"
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            self.seen.append((self.doing, any(a.name == "Hang" for a in self.agent.active_alerts())))

    def __enter__(self) -> _Phases:
        train_linear(3)
        self._watcher.start()
        return self

    def __exit__(self, *exc: object) -> None:
        import hpar_agent

        self._stop.set()
        if self._watcher.is_alive():
            self._watcher.join()
        hpar_agent.detach()

    def hung_in(self) -> set[str]:
        return {doing for doing, hang in self.seen if hang}


class _SlowDisk(io.BytesIO):
    """A file whose writes wait on the disk (a network file system): the thread saving uses no CPU."""

    def write(self, b: Any) -> int:
        time.sleep(0.25)
        return super().write(b)


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="no per-thread schedstat")
def test_work_a_compile_or_a_checkpoint_between_steps_is_progress_and_a_sleep_is_not(tmp_path: Any) -> None:
    """An evaluation of minutes between training steps fired a critical Hang on every rank (no step for
    the timeout). The training thread working on a CPU (its schedstat) is progress, and so is a compile
    that leaves it waiting (a backend that sleeps, as inductor's workers do) and a checkpoint save that
    waits on its disk; a sleep is not."""
    import torch

    with _Phases(tmp_path) as ph:
        steps = ph.agent.component("steps")
        ph.doing = "work"
        x, t_end = torch.randn(256, 256), time.time() + 2.5
        while time.time() < t_end:  # an evaluation's work
            torch.mm(x, x)
        # progress marked during the work, 1 s or more after the last step (whatever the passes' timing)
        assert steps.last_progress_ts > steps.last_step_ts + 1.0

        def slow_backend(gm: Any, inputs: Any) -> Any:
            time.sleep(2.5)
            return gm.forward

        ph.doing = "compile"
        torch.compile(lambda t: t * 2 + 1, backend=slow_backend)(x)
        ph.doing = "checkpoint"
        disk = _SlowDisk()
        torch.save({f"w{i}": torch.randn(64, 64) for i in range(4)}, disk)
        assert disk.tell() > 0
        ph.doing = "sleep"
        time.sleep(2.5)  # blocked
    assert ph.hung_in() == {"sleep"}, ph.seen


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="no per-thread schedstat")
def test_on_a_gpu_rank_a_busy_thread_that_does_not_move_is_not_progress(tmp_path: Any) -> None:
    """On a GPU the thread waiting for a kernel spins on a CPU; a kernel that never ends left Hang
    silent. There a busy pass is progress only if the thread ran Python (handing the GIL over to the
    agent thread) or the allocator's count of allocations served moved: one long C call with the count
    held still (a GPU rank's wait, here a CPU matmul) is a hang, Python work or the count moving is not.
    tests/gpu/test_hang.py: the real wait."""
    import threading

    import torch

    with _Phases(tmp_path) as ph:
        memory = ph.agent.component("memory")
        memory.served = 1  # what a GPU rank's allocator read gives (a CPU rank reads none)
        t, n = time.perf_counter(), 1024
        torch.mm(torch.randn(n, n), torch.randn(n, n))
        n = min(8192, int(n * (5.0 / max(time.perf_counter() - t, 1e-4)) ** (1 / 3)))
        a = torch.randn(n, n)
        ph.doing = "one call"
        t = time.perf_counter()
        torch.mm(a, a)  # seconds in one call: its frame stays where it is
        one_call_s = time.perf_counter() - t
        ph.doing, t_end = "settle", time.time() + 30.0  # Python work until the call's Hang clears
        while ph.seen[-1][1] and time.time() < t_end:
            sorted(range(1000), key=lambda i: -i)
        ph.doing, t_end = "python", time.time() + 2.0
        while time.time() < t_end:
            sorted(range(1000), key=lambda i: -i)
        stop = threading.Event()

        def serve() -> None:  # the allocator serving allocations, as a GPU evaluation's do
            while not stop.wait(0.05):
                memory.served += 1

        feeder = threading.Thread(target=serve, daemon=True)
        feeder.start()
        ph.doing = "one call, allocating"
        torch.mm(a, a)
        stop.set()
        feeder.join()
    assert one_call_s > 1.6, one_call_s  # the call outlasted the timeout with a pass to spare
    assert ph.hung_in() - {"settle"} == {"one call"}, ph.seen
