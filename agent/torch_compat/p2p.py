"""The pipelining schedules' p2p helpers (``_batch_p2p`` / ``_wait_batch_p2p``) and their wrapper.

gloo's flight recorder records no send/recv, and gloo p2p Works have no future, so the wrapper gives
pipeline traffic its only source: the issue time, the ops, and the observed completion (the Work was
already complete when the schedule waited, else wait's return). On the training thread each wrapped
call costs O(ops) and one ``put``; the collector turns the records into counts, bytes and spans on the
agent thread. Records (``IssueRecord``, ``WaitRecord``; mypy tells them apart by their first item):

- ``("issue", t0_ns, (op "send"/"recv", global peer, bytes, group, op, peer, ...), (id(Work), ...), timed)``
  (``timed``: the step in progress has detail, ``StepCollector.stride``; the others' ops are counted, not timed)
- ``("enter", t_enter_ns, (id(Work), ...))``: the Works not complete as the schedule began to wait for
  them, put before the wait blocks (none when all were complete): while no ``wait`` record follows, the
  rank waits in those ops (a hang's p2p edge: whom it waits for)
- ``("wait", t_enter_ns, (id(Work), was_completed, id(Work), ...), t_exit_ns)``

One buffer keeps them in call order (a wait follows its issue; a freed Work's id comes back). Records
are tuples two deep of ints, strings and process groups (``ops_of`` and ``waits_of`` read the flat
fields back), not NamedTuples: the garbage collector stops tracking a plain tuple once it sees that
everything in it is untracked, which for the inner tuples is at the first young collection and for the
record at the latest at the next, and never stops tracking a NamedTuple. A record lives until the agent
thread's next pass (up to a second), long enough in a busy training loop to reach the oldest generation
if it stayed tracked, and every object that does counts towards the next full collection (a stall of
the training thread of up to hundreds of ms).

The module is patched only once the program imported pipelining (``p2p_module``), never imported here.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

#: The ops a ``_batch_p2p`` call issued: see the module docstring.
IssueRecord = tuple[Literal["issue"], int, tuple[Any, ...], tuple[int, ...], bool]
#: A ``_wait_batch_p2p`` call that blocks, as it begins: see the module docstring.
EnterRecord = tuple[Literal["enter"], int, tuple[int, ...]]
#: A ``_wait_batch_p2p`` call: see the module docstring.
WaitRecord = tuple[Literal["wait"], int, tuple[Any, ...], int]
P2PRecord = IssueRecord | EnterRecord | WaitRecord


def p2p_module() -> Any:
    """The module whose globals the pipelining schedules call ``_batch_p2p`` through, once the program
    imported it (None before: importing pipelining pulls in DTensor and sympy, seconds of a start-up
    that a program without pipelines should not pay)."""
    schedules = sys.modules.get("torch.distributed.pipelining.schedules")
    return schedules if hasattr(schedules, "_batch_p2p") else None


def p2p_ops_info(p2p_ops: Any, sends: tuple[Any, ...]) -> tuple[Any, ...]:
    """op ("send"/"recv"), global peer, bytes and group of each ``dist.P2POp``, one after the other
    (``sends``: the functions that send, ``dist.isend`` and ``dist.send``): O(ops)."""
    out: list[Any] = []
    for p in p2p_ops or ():
        out += (
            "send" if p.op in sends else "recv",
            int(getattr(p, "peer", -1)),
            p.tensor.nbytes,
            getattr(p, "group", None),
        )
    return tuple(out)


def ops_of(info: tuple[Any, ...]) -> Iterator[tuple[str, int, int, Any]]:
    """``(op, peer, bytes, group)`` of each op of an issue record's flat field."""
    it = iter(info)
    return zip(it, it, it, it, strict=True)


def waits_of(done: tuple[Any, ...]) -> Iterator[tuple[int, bool]]:
    """``(id(Work), was_completed)`` of each Work of a wait record's flat field."""
    it = iter(done)
    return zip(it, it, strict=True)


def works_of(result: Any) -> list[Any] | tuple[Any, ...]:
    """What ``_batch_p2p`` returned as a sequence of Works, across versions (a list, returned as it is; a
    dict by peer; one Work; None)."""
    if type(result) is list or type(result) is tuple:
        return result
    if result is None:
        return ()
    if isinstance(result, dict):
        return [w for ws in result.values() for w in works_of(ws)]
    if isinstance(result, (list, tuple)):
        return result
    return (result,)


class P2PWrapper:
    """Wraps the schedules' p2p helpers while installed and puts one record per call (see above)."""

    def __init__(self, put: Callable[[P2PRecord], Any], on_error: Callable[[BaseException], Any]) -> None:
        self.put = put
        self.on_error = on_error
        self.active = False
        self.steps: Any = None  # the StepCollector whose ``detailed`` says whether an issue is timed
        self._patch: tuple[Any, Any, Any] | None = None

    @property
    def patched(self) -> bool:
        return self._patch is not None

    def patch(self) -> None:
        """Wrap the helpers once the program imported pipelining (at attach, else on the first poll
        after: a schedule built after attach imports it before its first step)."""
        mod = p2p_module() if self._patch is None and self.active else None
        if mod is None:
            return
        orig_batch = mod._batch_p2p
        orig_wait = getattr(mod, "_wait_batch_p2p", None)
        mod._batch_p2p = self.wrap_batch(orig_batch)
        if orig_wait is not None:
            mod._wait_batch_p2p = self.wrap_wait(orig_wait)
        self._patch = (mod, orig_batch, orig_wait)

    def restore(self) -> None:
        """Stop recording and put the originals back where ours still sit (a later wrapper stays)."""
        self.active = False
        if self._patch is not None:
            mod, orig_batch, orig_wait = self._patch
            if getattr(mod._batch_p2p, "__wrapped__", None) is orig_batch:
                mod._batch_p2p = orig_batch
            if orig_wait is not None and getattr(mod._wait_batch_p2p, "__wrapped__", None) is orig_wait:
                mod._wait_batch_p2p = orig_wait
            self._patch = None

    def wrap_batch(self, orig: Any) -> Any:
        import torch.distributed as dist

        put, sends, clock, steps = self.put, (dist.isend, dist.send), time.time_ns, self.steps

        @functools.wraps(orig)
        def batch_p2p(p2p_ops: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            out = orig(p2p_ops, *args, **kwargs)
            if self.active:
                try:
                    put(
                        (
                            "issue",
                            t0,
                            p2p_ops_info(p2p_ops, sends),
                            tuple(map(id, works_of(out))),
                            steps is None or steps.detailed,
                        )
                    )
                except Exception as exc:
                    self.on_error(exc)
            return out

        return batch_p2p

    def wrap_wait(self, orig: Any) -> Any:
        put, clock = self.put, time.time_ns

        @functools.wraps(orig)
        def wait_batch_p2p(work: Any, *args: Any, **kwargs: Any) -> Any:
            done: tuple[Any, ...] = ()
            t0 = clock()
            if self.active:
                try:
                    flat: list[Any] = []
                    for w in works_of(work):
                        flat += (id(w), w.is_completed() is True)
                    done = tuple(flat)
                    open_ids = tuple(wid for wid, was_done in waits_of(done) if not was_done)
                    if open_ids:
                        put(("enter", t0, open_ids))
                except Exception as exc:
                    self.on_error(exc)
            out = orig(work, *args, **kwargs)
            if done:
                put(("wait", t0, done, clock()))
            return out

        return wait_batch_p2p
