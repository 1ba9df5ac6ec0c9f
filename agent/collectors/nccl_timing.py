"""Which NCCL groups time their collectives (CUDA events per op: ``duration_ms`` in the flight recorder).

ProcessGroupNCCL reads ``TORCH_NCCL_ENABLE_TIMING`` when a group is built, and
``_enable_collectives_timing`` switches an existing group on (``torch_compat.flight_recorder``). With
``HPAR_NCCL_TIMING`` on, the agent sets the variable at attach for the groups made later and switches
on every existing group as it appears; a group that existed untimed at attach and cannot be switched
on is said once, with the fix.
"""

from __future__ import annotations

import logging
import os

from hpar_agent.torch_compat import flight_recorder as fr

log = logging.getLogger("hpar_agent")


class NcclTiming:
    """The timing state of this process's NCCL groups, kept by the collectives collector."""

    def __init__(self) -> None:
        self.on = False  # some group's entries carry (or will carry) durations: reads wait for them
        self.env = False  # the user's TORCH_NCCL_ENABLE_TIMING as found at attach, before ours
        self.env_set = False  # the agent set the variable at attach
        self.timed: set[tuple[str, str]] = set()  # (name, desc) of groups the agent switched on
        self.untimed: set[tuple[str, str]] = set()  # groups that existed untimed at attach and stay so
        self._preexisting: set[tuple[str, str]] = set()
        self._seen: set[int] = set()  # id() of groups already offered timing

    def install(self, switch_on: bool) -> None:
        """Attaching thread: read the user's setting and, with ``switch_on``, set the variable for later
        groups (here, never from the agent thread: setenv races getenv in C++ threads) and switch the
        existing ones on."""
        self.on = self.env = fr.nccl_timing()
        if switch_on:
            self._preexisting = {fr.group_name(pg) for pg in fr.process_groups()}
            os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
            self.env_set = True
            self.enable()

    def enable(self) -> None:
        """Switch timing on for every NCCL group not offered it yet (agent thread, each poll: groups
        appear after attach too). One log line, with the fix, if a group cannot be timed."""
        for pg in fr.process_groups():
            if id(pg) in self._seen:
                continue
            self._seen.add(id(pg))
            if fr.group_backend(pg) != "nccl":
                continue
            key = fr.group_name(pg)
            try:
                ok = fr.enable_timing(pg)
            except Exception:
                ok = False
            if ok:
                self.timed.add(key)
                self.on = True
            elif self.env or key not in self._preexisting:
                self.on = True  # built with the variable set (the user's or ours): timed
            elif key not in self.untimed:
                self.untimed.add(key)
                if len(self.untimed) > 1:
                    continue  # one log line
                log.warning(
                    "hpar_agent: NCCL group %s is not timed (no latency, busbw or spans): set "
                    "TORCH_NCCL_ENABLE_TIMING=1 before init_process_group",
                    key[1] or key[0],
                )
