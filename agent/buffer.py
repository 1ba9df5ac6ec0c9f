"""A bounded, lock-free (GIL-atomic) buffer between training-thread hooks and the agent thread.

Records: a hook that puts one per step, chunk or op puts a plain tuple, typed by an alias beside it
(``steps.Boundary``, ``anatomy_hooks.Mark``, ``pipeline.Chunk``, ``p2p.IssueRecord``, ...), not a
NamedTuple or a dataclass. The garbage collector stops tracking a tuple of atomic values at its first
collection and never stops tracking a NamedTuple; a tracked record that waits a second for the agent's
pass reaches the oldest generation in a busy loop and brings the next full collection (a stall of the
training thread of hundreds of ms) nearer. A NamedTuple also costs several times a tuple to build.
Records put a few times per run (compile events, tp gradient samples) are NamedTuples.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class BoundedBuffer(Generic[T]):
    """Hooks ``put``; the agent thread ``drain``s. When full, new items are dropped and counted.

    ``deque.append``/``popleft`` and ``len`` are atomic under the GIL, so no lock sits on the
    training thread's path. Dropping the newest (not the oldest) keeps drain's view consistent.
    """

    __slots__ = ("_items", "capacity", "dropped", "name")

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self.dropped = 0
        self._items: deque[T] = deque()

    def put(self, item: T) -> None:
        if len(self._items) >= self.capacity:
            self.dropped += 1
            return
        self._items.append(item)

    def drain(self) -> list[T]:
        items = self._items
        out = []
        for _ in range(len(items)):
            out.append(items.popleft())
        return out

    def peek(self) -> list[T]:
        """A copy of the items not drained yet, left in place (any thread)."""
        return list(self._items)

    def __len__(self) -> int:
        return len(self._items)
