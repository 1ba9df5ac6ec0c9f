"""The pipelining p2p wrapper on its own (``torch_compat.p2p``): lazy patching, records, restore."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import torch
import torch.distributed as dist

from hpar_agent.torch_compat import p2p

SCHEDULES = "torch.distributed.pipelining.schedules"


class Work:
    def __init__(self, done: bool) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done


def _fake_schedules(works: list[Work]) -> types.ModuleType:
    mod = types.ModuleType(SCHEDULES)
    mod._batch_p2p = lambda ops, desc=None: {1: works[:1], 3: works[1:]}  # type: ignore[attr-defined]
    mod._wait_batch_p2p = lambda work: None  # type: ignore[attr-defined]
    return mod


def test_patches_only_an_imported_module_records_issue_and_wait_and_restores(monkeypatch):
    records: list[tuple] = []
    errors: list[BaseException] = []
    w = p2p.P2PWrapper(records.append, errors.append)
    monkeypatch.delitem(sys.modules, SCHEDULES, raising=False)
    w.active = True
    w.patch()  # pipelining not imported: nothing patched, nothing imported
    assert not w.patched and SCHEDULES not in sys.modules

    works = [Work(False), Work(True)]
    mod = _fake_schedules(works)
    orig_batch, orig_wait = mod._batch_p2p, mod._wait_batch_p2p
    monkeypatch.setitem(sys.modules, SCHEDULES, mod)
    w.patch()
    assert (
        w.patched
        and mod._batch_p2p.__wrapped__ is orig_batch
        and mod._wait_batch_p2p.__wrapped__ is orig_wait
    )
    ops = [
        SimpleNamespace(op=dist.isend, tensor=torch.zeros(8), peer=1, group=None),
        SimpleNamespace(op=dist.irecv, tensor=torch.zeros(2, 3, dtype=torch.float64), peer=3, group=None),
    ]
    mod._wait_batch_p2p(mod._batch_p2p(ops))
    (kind, t0, infos, ids, timed), (ekind, t_begin, open_ids), (wkind, t_enter, done, t_exit) = records
    assert (kind, ekind, wkind, timed) == ("issue", "enter", "wait", True)  # no step collector: timed
    assert list(p2p.ops_of(infos)) == [("send", 1, 32, None), ("recv", 3, 48, None)]
    assert ids == tuple(id(x) for x in works)
    assert open_ids == (id(works[0]),)  # the one it blocks on, recorded before it blocks
    assert list(p2p.waits_of(done)) == [(id(works[0]), False), (id(works[1]), True)]
    assert t0 <= t_begin == t_enter <= t_exit and not errors
    works[0].done = True
    mod._wait_batch_p2p(mod._batch_p2p(ops))
    assert [r[0] for r in records[3:]] == ["issue", "wait"]  # nothing to block on: no enter record

    w.restore()
    assert mod._batch_p2p is orig_batch and mod._wait_batch_p2p is orig_wait and not w.patched
    mod._wait_batch_p2p(mod._batch_p2p(ops))
    assert len(records) == 5  # restored: no more records


def test_a_failing_record_is_reported_not_raised_and_a_later_wrapper_stays(monkeypatch):
    errors: list[BaseException] = []

    def put(_record: tuple) -> None:
        raise RuntimeError("buffer broke")

    work = Work(True)
    mod = _fake_schedules([work])
    monkeypatch.setitem(sys.modules, SCHEDULES, mod)
    w = p2p.P2PWrapper(put, errors.append)
    w.active = True
    w.patch()
    assert mod._batch_p2p([]) == {1: [work], 3: []}  # training goes on
    assert [str(e) for e in errors] == ["buffer broke"]
    theirs = mod._wait_batch_p2p = lambda work: "theirs"  # someone wrapped after us
    w.restore()
    assert mod._wait_batch_p2p is theirs  # not clobbered
    assert p2p.works_of(None) == () and p2p.works_of(work) == (work,)
    listed = [work]
    assert p2p.works_of(listed) is listed  # the schedules' own list, not a copy


def test_records_are_untracked_by_the_garbage_collector() -> None:
    """A record lives until the agent's next pass: one the collector tracked would outlive the young
    generations of a busy loop and count towards the next full collection."""
    import gc

    records: list[tuple] = []
    w = p2p.P2PWrapper(records.append, lambda exc: None)
    w.active = True
    works = [Work(True)]
    batch = w.wrap_batch(lambda ops, desc=None: works)
    wait = w.wrap_wait(lambda work: None)
    ops = [
        SimpleNamespace(op=dist.isend, tensor=torch.zeros(4), peer=1, group=None)
    ]  # a ProcessGroup is untracked too
    wait(batch(ops))
    gc.collect()  # the first collection that sees them untracks the inner tuples, the second the records
    gc.collect()
    assert len(records) == 2 and not any(gc.is_tracked(r) for r in records)


def test_an_issue_in_a_step_without_detail_is_recorded_untimed() -> None:
    """A fast loop details every k-th step (``StepCollector.stride``): the others' ops are still
    recorded (counts, bytes, in flight), flagged so the agent does not time them."""
    records: list[tuple] = []
    w = p2p.P2PWrapper(records.append, lambda exc: None)
    w.active = True
    w.steps = steps = SimpleNamespace(detailed=False)
    batch = w.wrap_batch(lambda ops, desc=None: [Work(True)])
    ops = [SimpleNamespace(op=dist.isend, tensor=torch.zeros(4), peer=1, group=None)]
    batch(ops)
    steps.detailed = True
    batch(ops)
    assert [r[-1] for r in records] == [False, True]
