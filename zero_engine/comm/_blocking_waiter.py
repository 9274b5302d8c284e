"""One helper thread per process that calls ``work.wait()`` for the collectives whose wait cannot be sliced (gloo's
reduce-scatter in torch 2.13 ignores a wait's timeout): the watchdog's main thread waits on an Event in slices
instead, and so can still diagnose a stall (see [Note: how a stall is diagnosed] in watchdog.py)."""

from __future__ import annotations

import queue
import threading
from typing import Optional

__all__ = ["BlockingWaiter", "abandon_if_stuck", "close_shared", "shared"]


class BlockingWaiter:
    """One helper thread that calls ``work.wait()`` for works whose wait cannot be sliced, so that the main thread
    waits on an Event (in slices) instead. A work stuck for good leaves this thread stuck with it, which is harmless:
    the process group is unusable by then and the thread is a daemon."""

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._current: Optional[tuple] = None
        self._thread = threading.Thread(target=self._run, name="zero_engine-blocking-wait", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._wait_for(*item)
            del item  # hold no work between waits: a work keeps its group (and gloo's threads) alive

    @staticmethod
    def _wait_for(work, done: threading.Event, outcome: list) -> None:
        try:
            work.wait()
        except BaseException as error:  # noqa: BLE001 -- handed to the waiting thread
            outcome.append(error)
        done.set()

    def wait(self, work, seconds: float) -> bool:
        """True once ``work`` completed (re-raising its error); False if ``seconds`` passed first."""
        if self._current is None or self._current[0] is not work:
            self._current = (work, threading.Event(), [])
            self._queue.put(self._current)
        _, done, outcome = self._current
        if not done.wait(seconds):
            return False
        self._current = None
        if outcome:
            raise outcome[0]
        return True

    def close(self) -> None:
        """End the thread and join it, unless it is stuck in a work of a failed group (then it stays a daemon)."""
        self._queue.put(None)
        if self._current is None:
            self._thread.join(timeout=5.0)


_shared: Optional[BlockingWaiter] = None  # one per process; replaced when a failed group leaves it stuck


def shared() -> BlockingWaiter:
    """The process's waiter, started on first use."""
    global _shared
    if _shared is None:
        _shared = BlockingWaiter()
    return _shared


def close_shared() -> None:
    """End the process's waiter (the last watchdog stopped, or the process exits); a later wait starts another."""
    global _shared
    waiter, _shared = _shared, None
    if waiter is not None:
        waiter.close()


def abandon_if_stuck(waiter: BlockingWaiter) -> None:
    """``waiter``'s group failed: if it is the shared one and its thread is inside a work of that group (stuck for
    good), the next group's waits get a fresh waiter."""
    global _shared
    if waiter is _shared and waiter._current is not None:
        _shared = None
