"""Process lifecycle around the agent: exit, fork and termination signals.

Exit: ``Agent.stop`` (the summary, the last spans) runs at interpreter exit and at the end of a
``multiprocessing`` child that was forked (``AtExit``).

Fork: a child (a DataLoader worker, a ``multiprocessing`` fork) inherits the agent's objects but none of
its threads. Left alone its exit would run ``Agent.stop`` from atexit, which waits for a server loop
that does not exist in the child (forever), and it would hold the listening socket and the event log's
descriptor. The fork handler (registered by ``hpar_agent.agent``) has the agent forget itself in the
child (``Agent.forget_in_child``: each part forgets what it holds): no atexit work, no server, the log
descriptors pointed at /dev/null. It takes no lock another thread may have held at fork time.

Signals: SIGTERM (what torchrun sends the surviving ranks) and SIGINT flush the agent (summary, last
events, queued spans, bounded), then the process does what it would have done without the agent: the
previous Python handler is called, or the default action is restored and the signal re-raised. Handlers
are installed only from the main thread and only over the default or Python handlers (an ignored
signal stays ignored; a handler installed from C is left alone).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from typing import Any

log = logging.getLogger("hpar_agent")

#: Seconds the flush on a signal may take in all (thread join, final tick, span export).
SIGNAL_FLUSH_S = 5.0
SIGNALS = ("SIGTERM", "SIGINT")
#: Seconds the watcher gives the main thread to start the Python handler before acting itself.
HANDLER_GRACE_S = 1.0


# ---------------------------------------------------------------------------------------------- exit
class AtExit:
    """``fn`` at interpreter exit, and at the end of a ``multiprocessing`` child started by fork: such a
    child (``multiprocessing.Process``, the fork start method's default) ends with ``os._exit`` after
    its target, which skips atexit but runs multiprocessing's exit finalizers."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self._finalizer: Any = None

    def install(self) -> None:
        atexit.register(self.fn)
        try:
            from multiprocessing import util

            self._finalizer = util.Finalize(None, self.fn, exitpriority=100)
        except Exception as exc:  # an interpreter without multiprocessing: atexit only
            log.debug("hpar_agent: no multiprocessing exit finalizer (%s)", exc)

    def uninstall(self) -> None:
        atexit.unregister(self.fn)
        finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            with contextlib.suppress(Exception):
                finalizer.cancel()


# ---------------------------------------------------------------------------------------------- fork
class ProcessHooks:
    """The agent's hooks on its process: the exit flush (``AtExit``), SIGTERM/SIGINT (``SignalFlush``)
    and ``sys.excepthook`` (``ExceptHook``). Installed last at attach, removed first at detach."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.at_exit: AtExit | None = None
        self.signals: SignalFlush | None = None
        self.excepthook: ExceptHook | None = None

    def install(self) -> None:
        agent = self.agent
        self.at_exit = AtExit(agent.stop)  # flush traces and write the summary if the user never detaches
        self.at_exit.install()
        self.signals = SignalFlush(agent)
        agent.guard("agent", self.signals.install)  # SIGTERM/SIGINT: flush, then what they did before
        self.excepthook = ExceptHook(agent)
        self.excepthook.install()  # an uncaught exception: how the rank ended (rankstate, RankGone)

    def uninstall(self) -> None:
        if self.at_exit is not None:
            self.at_exit.uninstall()
        if self.signals is not None:
            self.agent.guard("agent", self.signals.uninstall)
        if self.excepthook is not None:
            self.excepthook.uninstall()

    def forget_in_child(self) -> None:
        """After fork, in the child: no exit work of the parent's agent (the child's copies of the atexit
        entry and of the multiprocessing finalizer); the signal and exception hooks see a stopped agent."""
        with contextlib.suppress(Exception):
            if self.at_exit is not None:
                self.at_exit.uninstall()
            else:
                atexit.unregister(self.agent.stop)


# ---------------------------------------------------------------------------------------------- exceptions
class ExceptHook:
    """The agent's ``sys.excepthook``: an uncaught exception of the main thread is noted in
    ``AgentContext.exit_reason`` (what the rank's state file and its last exchange payload say of how
    it ended) and handed to every component (``Component.on_uncaught``: the out-of-memory record), then
    to the previous hook. A forked child's copy does nothing of the agent's."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.previous: Any = None
        self.pid = os.getpid()

    def install(self) -> None:
        self.previous = sys.excepthook
        sys.excepthook = self._hook

    def uninstall(self) -> None:
        if sys.excepthook == self._hook:
            sys.excepthook = self.previous

    def _hook(self, etype: type[BaseException], value: BaseException, tb: Any) -> None:
        if os.getpid() == self.pid and self.agent.started:
            with contextlib.suppress(Exception):
                text = str(value).strip().splitlines()
                self.agent.context.exit_reason = f"exception: {etype.__name__}: {text[0] if text else ''}"[
                    :240
                ]
            for comp in list(self.agent.components):
                self.agent.guard(comp.name, comp.on_uncaught, value)
        (self.previous or sys.__excepthook__)(etype, value, tb)


# ---------------------------------------------------------------------------------------------- signals
class SignalFlush:
    """Flush-then-chain handlers for SIGTERM/SIGINT, installed for one agent.

    A Python handler runs only when the main thread next executes bytecode. A rank whose peer died is
    usually blocked in a collective inside C++, where it would sit until the launcher's SIGKILL (and
    without the agent, SIGTERM would have ended it at once). So a watcher thread also learns of the
    signal through ``signal.set_wakeup_fd`` (when no one else uses it, e.g. asyncio); if the handler
    has not started within ``HANDLER_GRACE_S`` and the previous action was the default one, the watcher
    flushes and ends the process by the signal itself."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.previous: dict[int, Any] = {}
        self._once = threading.Lock()  # one flush-and-terminate, whichever thread gets there first
        self._started = threading.Event()
        self._finished = threading.Event()
        self._wake: tuple[Any, Any] | None = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal works only there; an agent attached elsewhere flushes at exit
        for name in SIGNALS:
            signum = getattr(signal, name, None)
            if signum is None:
                continue
            try:
                prev = signal.getsignal(signum)
                if prev is signal.SIG_IGN or prev is None:
                    continue  # ignored stays ignored; a C-level handler is not ours to wrap
                signal.signal(signum, self._handle)
                self.previous[signum] = prev
            except (ValueError, OSError) as exc:
                log.debug("hpar_agent: no %s handler (%s)", name, exc)
        if self.previous.get(signal.SIGTERM) is signal.SIG_DFL:
            self._watch()

    def _watch(self) -> None:
        r, w = socket.socketpair()
        r.set_inheritable(False)
        w.set_inheritable(False)
        w.setblocking(False)
        try:
            old = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError):
            r.close()
            w.close()
            return
        if old != -1:  # someone else's (asyncio): give it back, rely on the Python handler only
            signal.set_wakeup_fd(old)
            r.close()
            w.close()
            return
        self._wake = (r, w)
        threading.Thread(target=self._watcher, args=(r,), name="hpar-signals", daemon=True).start()

    def _watcher(self, r: Any) -> None:
        while True:
            try:
                data = r.recv(64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM not in data or signal.getsignal(signal.SIGTERM) != self._handle:
                continue  # not ours any more: whoever replaced our handler decides
            if not self._started.wait(HANDLER_GRACE_S):
                self._terminate_from_watcher(signal.SIGTERM)
            elif not self._finished.wait(SIGNAL_FLUSH_S * 2 + 2):
                _die_by(signal.SIGTERM)  # the handler is stuck (a lock held by the interrupted code)

    def _terminate_from_watcher(self, signum: int) -> None:
        """The main thread is stuck in C: flush here and die by the signal, as without the agent."""
        if not self._once.acquire(blocking=False):
            return
        self._note(signum)
        with contextlib.suppress(Exception):
            self.agent.stop(timeout=SIGNAL_FLUSH_S / 2)
        _die_by(signum)

    def _note(self, signum: int) -> None:
        with contextlib.suppress(Exception):
            self.agent.context.exit_reason = f"signal: {signal.Signals(signum).name}"

    def uninstall(self) -> None:
        """Put the previous handlers back, unless someone replaced ours since."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, prev in self.previous.items():
            with contextlib.suppress(ValueError, OSError):
                if signal.getsignal(signum) == self._handle:
                    signal.signal(signum, prev)
        self.previous.clear()
        if self._wake is not None:
            r, w = self._wake
            self._wake = None
            with contextlib.suppress(ValueError, OSError):
                old = signal.set_wakeup_fd(-1)
                if old != w.fileno():
                    signal.set_wakeup_fd(old)  # replaced since (asyncio): it stays theirs
            with contextlib.suppress(OSError):
                r.shutdown(socket.SHUT_RDWR)  # the watcher thread ends
            r.close()
            w.close()

    def _handle(self, signum: int, frame: Any) -> None:
        self._finished.clear()
        self._started.set()
        prev = self.previous.get(signum, signal.SIG_DFL)
        agent = self.agent
        if not self._once.acquire(timeout=SIGNAL_FLUSH_S * 2):
            pass  # the watcher is flushing; it ends the process
        try:
            if prev is signal.SIG_DFL:
                self._note(signum)
                agent.stop(timeout=SIGNAL_FLUSH_S / 2)  # the process ends: a full, bounded stop
            else:
                agent.flush(timeout=SIGNAL_FLUSH_S)  # the previous handler decides what happens next
        except Exception as exc:
            with contextlib.suppress(Exception):
                agent.record_error("agent", exc)
        finally:
            self._started.clear()
            self._finished.set()
            with contextlib.suppress(RuntimeError):
                self._once.release()
        if callable(prev):
            prev(signum, frame)
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # the default action: the exit status says the signal


def _die_by(signum: int) -> None:
    """From any thread: the signal's default action (``signal.signal`` works only on the main thread,
    so the disposition is reset through libc), else an exit status that says the signal."""
    try:
        import ctypes

        ctypes.CDLL(None).signal(signum, 0)  # SIG_DFL
        os.kill(os.getpid(), signum)
    except Exception:
        pass
    os._exit(128 + signum)
