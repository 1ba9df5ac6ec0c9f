"""The detectors component: every alert exported from the start, its own parameters, the store client it
opens, and the exchange's cadence (ranks publish at one pass and read each other at the next, each at its
offset into the pass on a large job)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import pytest
import torch
from torch import nn

from hpar_agent import catalogue as cat
from hpar_agent.agent import Agent
from hpar_agent.crossrank import Exchange, cadence
from hpar_agent.detectors.component import DetectorsComponent
from hpar_agent.thresholds import COMPONENT_DEFAULTS
from tests.unit.harness import Fake, make_agent, steps


def test_every_alert_exported_from_the_start_and_clean_loop_is_quiet(tmp_path: Any) -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = Agent(model, optimizer=opt, metrics_port=-1, traces="none", run_dir=str(tmp_path), trace_every=0)
    try:
        agent.start()
        agent.tick()
        for name in cat.ALERT_NAMES:
            labels = {"rank": "0", "pp_stage": "0", "alert": name}
            assert agent.registry.get_sample_value("hpar_alert_active", labels) == 0.0
            assert agent.registry.get_sample_value("hpar_alerts_total", labels) == 0.0
        det = agent.component("detectors")
        assert isinstance(det, DetectorsComponent)  # after every collector it reads; only goodput follows
        assert [c.name for c in agent.components[agent.components.index(det) + 1 :]] == ["goodput"]
        for _ in range(6):  # a clean loop with the real collectors: no alert, no detector error
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            agent.tick()
        assert agent.errors.get("detectors", 0) == 0
        assert not any(s["active"] for s in det.summary().values())
    finally:
        agent.stop()


def test_every_component_parameter_is_a_valid_setting(tmp_path: Any) -> None:
    """``detectors.<param>`` settings the component reads are accepted by the config and applied."""
    from hpar_agent.thresholds import COMPONENT_DEFAULTS

    overrides = {f"detectors.{k}": v / 2 for k, v in COMPONENT_DEFAULTS.items()}
    _agent, det = make_agent(tmp_path, comps=(steps(1),), **overrides)
    ex = det.crossrank
    applied = {
        "exchange_s": ex.exchange_s,
        "exchange_min_s": ex.exchange_min_s,
        "stale_s": ex.stale_s,
        "log_interval_s": det.book.log_interval_s,
    }
    assert set(applied) == set(COMPONENT_DEFAULTS)
    for k, v in COMPONENT_DEFAULTS.items():
        assert applied[k] == v / 2, k


def test_the_store_client_the_agent_opened_is_dropped_on_detach(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed as dist

    from hpar_agent.detectors import exchange as exchange_mod

    store = dist.HashStore()
    monkeypatch.setattr(exchange_mod, "open_store", lambda: store)
    agent, det = make_agent(tmp_path, rank=0, world=2, comps=(steps(3),))
    agent.tick()
    assert det.exchange is not None and det.exchange.store is store  # opened by the agent itself
    det.uninstall()
    assert det.exchange is None
    given = Exchange(store, "job", 0)
    _agent2, det2 = make_agent(tmp_path / "b", exchange=given)
    det2.uninstall()
    assert det2.exchange is given  # a caller's exchange stays the caller's


def _entry(seq: int, t: float) -> dict[str, Any]:
    return {
        "pg": "dp",
        "seq": seq,
        "op": "all_reduce",
        "is_p2p": False,
        "record_id": seq,
        "input_sizes": [[4]],
        "input_dtypes": ["Float"],
        "time": t,
    }


def _pair(store: Any, tmp_path: Any) -> list[tuple[DetectorsComponent, deque, Any, Agent]]:
    """Two dp ranks on one store at the default exchange thresholds: (detectors, FR window, steps, agent)."""
    out = []
    t = time.time()
    for r in range(2):
        window, st = deque((_entry(i, t + 0.01 * i) for i in range(8)), maxlen=2048), steps(10)
        agent, det = make_agent(
            tmp_path,
            rank=r,
            world=2,
            comps=(st, Fake("collectives", recent_entries=window)),
            exchange=Exchange(store, "job", r),
            coords={"dp": r, "dpn": 2},
        )
        agent.config.evidence = False
        assert (
            det.crossrank.exchange_s == COMPONENT_DEFAULTS["exchange_s"] == 3.0
            and det.crossrank.exchange_min_s == 1.0
        )
        out.append((det, window, st, agent))
    return out


def _poll(pair: list, now: float) -> list[bool]:
    """One pass of every rank at the same wall-clock tick: each rank's ``snapshot.exchange.fresh`` after it."""
    for det, *_ in pair:
        det.poll(now)
    assert [dict(agent.errors) for *_, agent in pair] == [{}, {}]
    return [det.snapshot.exchange.fresh for det, *_ in pair]


def _published(pair: list) -> list[int]:
    return [det.exchange.published for det, *_ in pair]


def _seqs(det: DetectorsComponent, peer: int) -> list[int]:
    return [e[1] for e in det.snapshot.exchange.peers[peer]["fr"]]


def _slot_start() -> float:
    """A tick at the start of an exchange slot (a multiple of ``exchange_s``): polls run at ticks."""
    return 3.0 * (time.time() // 3.0)


def test_ranks_publish_at_one_pass_and_read_each_other_at_the_next(store: Any, tmp_path: Any) -> None:
    pair = _pair(store, tmp_path)
    t0 = _slot_start()
    assert _poll(pair, t0) == [False, False]  # published, nothing read in the same pass
    assert _published(pair) == [1, 1]
    assert _poll(pair, t0 + 1) == [True, True]  # read: both peers' payloads of the pass before
    assert _published(pair) == [1, 1]
    for det, *_ in pair:
        assert set(det.snapshot.exchange.peers) == {0, 1} and _seqs(det, 1 - det.snapshot.rank) == list(
            range(8)
        )
        assert all(
            type(e) is tuple for e in det.snapshot.exchange.peers[1 - det.snapshot.rank]["fr"]
        )  # unpacked on read
    assert _poll(pair, t0 + 2) == [False, False]  # read once per publish


def test_new_fr_entries_wait_for_the_regular_exchange(store: Any, tmp_path: Any) -> None:
    pair = _pair(store, tmp_path)
    t0 = _slot_start()
    _poll(pair, t0)
    _poll(pair, t0 + 1)
    for _det, window, *_ in pair:  # the job runs on: new entries at every read
        window.extend(_entry(i, t0 + 0.01 * i) for i in range(8, 16))
    assert _poll(pair, t0 + 2) == [False, False]  # past exchange_min_s, yet nothing that is due early
    assert not any(
        st.streak for det, *_ in pair for st in det.states.values()
    )  # no alert awaiting confirmation
    assert _published(pair) == [1, 1]
    for _det, window, *_ in pair:
        window.extend(_entry(i, t0 + 0.01 * i) for i in range(16, 20))
    assert _poll(pair, t0 + 3.0004) == [False, False]  # the next slot (a poll starts a little after its tick)
    assert _published(pair) == [2, 2]
    assert _poll(pair, t0 + 4) == [True, True]
    for det, *_ in pair:
        assert _seqs(det, 1 - det.snapshot.rank) == list(range(20))


def test_warmup_token_change_publishes_after_exchange_min_s(store: Any, tmp_path: Any) -> None:
    pair = _pair(store, tmp_path)
    for _det, _window, st, _agent in pair:
        st.total = 1  # before the detectors' warm-up step
    t0 = _slot_start()
    _poll(pair, t0)
    for _det, _window, st, _agent in pair:
        st.total = 3  # warm-up step reached: peers act on it at once
    assert _poll(pair, t0 + 1) == [True, True] and _published(pair) == [2, 2]  # exchange_min_s on, same slot
    assert _poll(pair, t0 + 2) == [True, True]
    for det, *_ in pair:
        assert det.snapshot.exchange.peers[1 - det.snapshot.rank]["step"] == 3
    for _det, _window, st, _agent in pair:
        st.total = 10  # past warm-up: the token (capped at 3) is unchanged
    assert _published(pair) == [2, 2]
    assert _poll(pair, t0 + 2.9996) == [False, False] and _published(pair) == [
        3,
        3,
    ]  # next slot: a poll a bit early


def test_a_rank_that_started_a_poll_late_publishes_in_the_same_slots(store: Any, tmp_path: Any) -> None:
    """Ranks attach and settle at different polls: the regular publishes still fall in the same
    polls on every rank, so what each reads was made at one instant (windows that overlap)."""
    pair = _pair(store, tmp_path)
    t0 = _slot_start()
    pair[0][0].poll(t0)  # rank 1's agent is not up yet
    assert _published(pair) == [1, 0]
    assert _poll(pair, t0 + 1) == [True, False] and _published(pair) == [1, 1]  # its first publish
    assert _poll(pair, t0 + 2) == [False, True] and _published(pair) == [1, 1]
    assert _poll(pair, t0 + 3) == [False, False] and _published(pair) == [2, 2]  # the same slot on both
    assert _poll(pair, t0 + 4) == [True, True]


# ------------------------------------------------------------------------------------------ spread
def _rank_at(world: int, lo: float, hi: float, interval: float = 1.0) -> int:
    """A rank of a ``world``-rank job whose offset into its pass is within ``lo..hi`` seconds."""
    c = cadence(world, COMPONENT_DEFAULTS["exchange_s"], interval)
    return next(r for r in range(world) if lo <= c.offset(r)[1] <= hi)


def _after_tick(every: float = 1.0) -> float:
    """Sleep to just after the next multiple of ``every`` on the wall clock (a pass's tick); that tick."""
    t = every * (time.time() // every + 1)
    time.sleep(t - time.time() + 0.001)
    return t


def test_a_large_jobs_rank_sets_its_payload_at_its_offset_but_at_once_when_stopping_or_final(
    store: Any, tmp_path: Any
) -> None:
    def rank(r: int, name: str) -> tuple[Agent, DetectorsComponent]:
        return make_agent(
            tmp_path / name, rank=r, world=1024, comps=(steps(10),), exchange=Exchange(store, "job", r)
        )

    (waits, det), (final, det_f) = rank(_rank_at(1024, 0.3, 0.4), "a"), rank(_rank_at(1024, 0.4, 0.5), "b")
    t = _after_tick()
    waits.tick()
    assert (
        time.time() - t >= cadence(1024, 3.0, 1.0).offset(det.snapshot.rank)[1] - 0.002
    )  # waited its offset
    assert det.exchange.published == 1
    waited = waits.loop._waited
    assert waited >= 0.25 and waits.collect_seconds["detectors"] < waited  # the poll's work, not its wait
    before = final.loop._waited
    final.tick(final=True)  # a flush or detach: the last pass must end soon, so it waits for no offset
    assert final.loop._waited == before and det_f.exchange.published == 1

    stopped, det_s = rank(_rank_at(1024, 0.4, 0.5), "c")
    stopped.started = True  # stop() then does what it does to a running agent (no thread here)
    _after_tick()
    ended: list[float] = []
    th = threading.Thread(target=lambda: (stopped.tick(), ended.append(time.perf_counter())))
    th.start()
    time.sleep(0.1)
    t0 = time.perf_counter()
    stopped.stop()
    th.join(5)
    assert ended and ended[0] - t0 < 0.05  # not the ~0.3 s left of its offset
    assert det_s.exchange.published >= 1


def test_a_small_jobs_pass_is_not_delayed(store: Any, tmp_path: Any) -> None:
    jobs = {
        world: [
            make_agent(
                tmp_path / f"{world}-{r}",
                rank=r,
                world=world,
                comps=(steps(10),),
                exchange=Exchange(store, f"job{world}", r),
            )
            for r in range(world)
        ]
        for world in (2, 4, 8)
    }
    asked: dict[int, list[float]] = {world: [] for world in jobs}
    for world, ranks in jobs.items():
        for agent, _det in ranks:
            wait = agent.context.wait
            agent.context.wait = lambda s, wait=wait, out=asked[world]: (out.append(s), wait(s))[1]  # type: ignore[misc]
    t = _after_tick(3.0)  # an exchange slot starts
    for at in (t, t + 1):  # a pass that publishes, then one that reads
        time.sleep(max(0.0, at + 0.001 - time.time()))
        for ranks in jobs.values():
            for agent, _det in ranks:
                agent.tick()
    for world, ranks in jobs.items():
        assert all(det.exchange.published == 1 and det.snapshot.exchange.fresh for _a, det in ranks)
        window = cadence(world, 3.0, 1.0).window_s
        assert window <= 0.004 and all(s <= 2 * window for s in asked[world])  # at most 8 ms of a 1 s pass
    assert asked[2] == []


def test_a_pass_that_reads_and_publishes_reads_before_any_rank_publishes(store: Any, tmp_path: Any) -> None:
    """64 ranks at a 0.2 s interval: 31 ms windows, a pass may read one exchange and publish the next.
    Rank a sets its next payload early in its window, its peer b = a-26 (2 x 64 // 5, moved to even) reads later in its own:
    without the read window first, b would read a's new payload against its own old one."""
    th = {"detectors.exchange_s": 1.0, "detectors.exchange_min_s": 0.1}
    a = _rank_at(64, 0.0005, 0.002, interval=0.2)
    b = (a - 26) % 64  # -26 x 0.618 = 0.93 of the window further (mod 1): later
    pair = [
        make_agent(
            tmp_path / str(r), rank=r, world=64, comps=(steps(1),), exchange=Exchange(store, "job", r), **th
        )
        for r in (a, b)
    ]
    for agent, det in pair:
        agent.config.interval = 0.2
        assert det.crossrank.cadence().gap == 1 and det.crossrank.cadence().window_s == 64 / 2048

    def passes() -> None:
        threads = [threading.Thread(target=agent.tick) for agent, _ in pair]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    t = _after_tick()  # a slot of exchange_s
    passes()
    for agent, _det in pair:
        agent.components[0].total = 3  # the warm-up step: a new payload at the next pass
    time.sleep(t + 0.2 - time.time() + 0.001)
    passes()
    assert [det.exchange.published for _, det in pair] == [2, 2]  # the next exchange came in the read pass
    assert [det.snapshot.exchange.peers[r]["step"] for (_, det), r in zip(pair, (b, a), strict=True)] == [
        1,
        1,
    ]
    assert [dict(agent.errors) for agent, _ in pair] == [{}, {}]


def test_a_very_large_job_spreads_a_phase_over_passes_and_reads_after_every_publish(
    store: Any, tmp_path: Any
) -> None:
    """8,192 ranks at 1 s: a phase spans 8 passes; a rank sets its payload at its pass of the 8 and reads
    8 passes later, and the next exchange waits for every read (no early publish on a change)."""
    c = cadence(8192, 3.0, 1.0)
    r = next(r for r in range(8192) if c.offset(r)[0] == 3)
    st = steps(1)
    agent, det = make_agent(tmp_path, rank=r, world=8192, comps=(st,), exchange=Exchange(store, "job", r))
    t0 = c.interval_s * (time.time() // c.interval_s - 4)  # a slot start in the past: no pass waits
    published, fresh = [], []
    for i in range(2 * int(c.interval_s)):
        if i == 5:
            st.total = 3  # the warm-up step: would publish early on a small job
        det.poll(t0 + i)
        published.append(det.exchange.published)
        fresh.append(det.snapshot.exchange.fresh)
    assert published == [0] * 3 + [1] * 16 + [2] * 13
    assert [i for i, f in enumerate(fresh) if f] == [3 + 8, 16 + 3 + 8]
    assert dict(agent.errors) == {}


class _FailingSets:
    """A store whose sets fail where ``fails(n)`` says of the n-th (from 1): after the first few, as
    when its host went away mid-run, or once, as a timeout of this rank's store connection; reads work."""

    def __init__(self, store: Any, fails: Callable[[int], bool]) -> None:
        self.store, self.fails, self.sets = store, fails, 0

    def multi_set(self, keys: list[str], values: list[str]) -> None:
        self.sets += 1
        if self.fails(self.sets):
            raise torch.distributed.DistStoreError("store gone")
        self.store.multi_set(keys, values)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def test_a_read_before_the_store_failed_is_judged_once_not_through_the_pause(
    store: Any, tmp_path: Any
) -> None:
    def rank(r: int) -> tuple[Agent, DetectorsComponent]:
        exchange = Exchange(_FailingSets(store, lambda n: n > 2) if r == 0 else store, "job", r)
        th = {"detectors.exchange_s": 0.0}
        return make_agent(tmp_path / str(r), rank=r, world=2, comps=(steps(10),), exchange=exchange, **th)

    (agent, det), (_, peer) = rank(0), rank(1)
    t0 = time.time() // 1 - 20  # ticks in the past: no pass waits
    fresh = []
    for i in range(4):
        peer.poll(t0 + i)
        det.poll(t0 + i)
        fresh.append(det.snapshot.exchange.fresh)
    # the third pass's publish fails, and again at the next exchange (every pass here): one call each
    assert agent.errors["detectors"] == 2
    assert fresh == [False, True, True, False]  # read at passes 2 and 3, not again after the failure


def test_a_failed_store_call_costs_one_exchange_at_most_so_no_peer_names_the_rank_gone(
    store: Any, tmp_path: Any
) -> None:
    """One failed publish: the exchange calls the store again at its next slot, so this rank's payloads
    are never more than two exchange intervals apart, a silence RankGone never names (a live peer one
    exchange late, ``test_detection_sim_faults``); its peers' re-read finds the newer payload. A store
    that fails every call gets one call an exchange (torch prints a line for each)."""
    ex = Exchange(_FailingSets(store, lambda n: n == 3), "job", 0)
    agent, det = make_agent(tmp_path, rank=0, world=2, comps=(steps(10),), exchange=ex)
    every = det.crossrank.cadence().interval_s  # 3 s at 2 ranks
    t0 = every * (time.time() // every - 20)  # a slot start in the past: no pass waits
    at = []
    for i in range(int(6 * every)):
        det.poll(t0 + i)
        if ex.published > len(at):
            at.append(i)
    assert agent.errors["detectors"] == 1 and ex.store.sets == 6
    assert at == [0, 3, 9, 12, 15]  # the third publish (pass 6) failed: published again at the next slot
    assert max(b - a for a, b in pairwise(at)) == 2 * every

    down = _FailingSets(store, lambda n: True)
    agent, det = make_agent(
        tmp_path / "down", rank=0, world=2, comps=(steps(10),), exchange=Exchange(down, "job", 0)
    )
    calls = []
    for i in range(int(4 * every)):
        det.poll(t0 + i)
        calls.append(agent.errors["detectors"])
    assert calls == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]  # every failed set is a call: one an exchange


def test_a_publish_after_a_failed_one_sets_the_payloads_set_only_when_changed(store: Any) -> None:
    ex = Exchange(_FailingSets(store, lambda n: n == 1), "job", 0)
    parts = {"s": {"step": 1}, "gs": {"g": [1.0]}}  # ``gs`` is set only when it changed
    with pytest.raises(torch.distributed.DistStoreError):
        ex.publish(parts)
    ex.publish(parts)
    assert Exchange(store, "job", 1).read({"gs": [0]})["gs"][0]["g"] == [1.0]


class _FailingGets(_FailingSets):
    """A store whose reads fail as torch's do when the store's host went away."""

    def multi_get(self, keys: list[str]) -> list[bytes]:
        raise torch.distributed.DistStoreError("store gone")


def test_a_read_on_demand_that_fails_says_nothing_and_backs_the_exchange_off(
    store: Any, tmp_path: Any
) -> None:
    """RankGone's read of a silent peer's ``s`` (and ReplicaDivergence's checksums by name) when the
    store's host went away: nothing read (the peer is not judged on it), no agent error, and no store
    call during the back-off."""
    store.set("hpar/job/x/s/1", '{"t":1.0}')
    ex = Exchange(_FailingGets(store, lambda n: False), "job", 0)
    agent, det = make_agent(tmp_path, rank=0, world=2, comps=(steps(1),), exchange=ex)
    det.crossrank.begin(time.time())
    assert det.crossrank.fetch("s", [1]) == {} and not det.crossrank.up()
    ex.store = None  # any store call now would raise
    assert det.crossrank.fetch("s", [1]) == {} and dict(agent.errors) == {}


def test_the_stores_host_waits_at_exit_for_its_peers_goodbyes(store: Any, tmp_path: Any) -> None:
    """Rank 0 hosts the store (no torchrun agent store): its exit closes it, so it waits (bounded) for the
    peers it saw to say goodbye; a peer stopping makes no read of the store, only its goodbye."""
    from hpar_agent.detectors import exchange

    pair = [
        make_agent(tmp_path / str(r), rank=r, world=2, comps=(steps(4),), exchange=Exchange(store, "job", r))
        for r in (0, 1)
    ]
    t = _after_tick(3.0)
    for at in (t, t + 1):  # publish, then read each other
        time.sleep(max(0.0, at + 0.001 - time.time()))
        for agent, _det in pair:
            agent.tick()
    (host, det0), (peer, det1) = pair
    assert 1 in det0.snapshot.exchange.seen and 0 in det1.snapshot.exchange.seen
    for agent, _ in pair:
        agent.started = True
    ended: list[float] = []
    th = threading.Thread(target=lambda: (host.stop(), ended.append(time.monotonic())))
    th.start()
    time.sleep(0.3)
    assert not ended  # still waiting for rank 1
    reads = det1.exchange.bytes_in
    before = time.monotonic()
    peer.stop()
    th.join(exchange.BYE_WAIT_S + 5)
    assert ended and ended[0] >= before
    assert det1.exchange.bytes_in == reads
    assert store.get("hpar/job/x/bye/1") == b"exit" and host.errors == {} and peer.errors == {}


def test_the_component_names_no_detector_and_every_alert_has_one() -> None:
    """A detector is its module, its catalogue entry, its parameters, its rule, docs and tests: the
    component reaches every detector through the base's hooks only (a name of a detector or alert in
    its source would be one more place to edit)."""
    import inspect

    from hpar_agent import catalogue
    from hpar_agent.detectors import component
    from hpar_agent.detectors.base import detector_classes

    source = inspect.getsource(component)
    assert [a for a in catalogue.ALERT_NAMES if a in source] == []
    assert [c.name for c in detector_classes()] == list(catalogue.ALERT_NAMES)


def test_a_detector_s_conclusion_is_read_only_once_it_could_have_fired(tmp_path: Any) -> None:
    """Before ``confirm`` verdicts a detector's silence is no judgement: the rest of the agent (the
    step anatomy's verdict, the goodput ledger) reads Straggler's conclusion as not known yet, not as
    "nobody is slow"."""
    from hpar_agent.context import Conclusion

    _agent, det = make_agent(tmp_path, world=2)
    ctx = det.require_ctx()
    st = det.states["Straggler"]
    for judged in (0, 1):
        st.judged = judged
        det._publish_conclusions(ctx)
        assert "Straggler" not in ctx.conclusions, judged
    st.judged = 2
    det._publish_conclusions(ctx)
    assert ctx.conclusions["Straggler"] == Conclusion()  # judged: nobody slow
    st.active, st.value = True, 0.4
    det._publish_conclusions(ctx)
    assert ctx.conclusions["Straggler"] == Conclusion(True, None, 0.4)
