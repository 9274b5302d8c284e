"""Is a rank alive, and if it is not, why: heartbeats, process identities and failure notes in the store.

[Note: what makes a rank lost]
The heartbeat is a Python thread, so a main thread that holds the GIL in one long C call (``json.loads`` of a large
dataset index, a pathological regex, a tokenizer or another C extension) silences it for as long as the call lasts,
although the process is healthy and will go on. A silent heartbeat alone is therefore not enough to call a rank
lost. Each rank posts its process identity (host, machine, pid and the process's start time) and:

* a rank on this machine (same boot id and pid namespace) is lost exactly when that process has ended (or is a
  zombie, or its pid now names a newer process: the rule of [Note: provably abandoned] in _owned_dirs.py); while it
  lives it is waited for, however long its heartbeat is silent (up to ``collective_timeout_s``, like any slow
  rank);
* a rank on another machine, whose process cannot be looked at, is lost when its heartbeat is silent for
  ``heartbeat_timeout_s`` and the backend reported a broken connection (a killed process's sockets are closed by its
  kernel, so its peers' collectives fail at once), or when its heartbeat is silent for ``UNREACHABLE_FACTOR`` times
  ``heartbeat_timeout_s`` (a machine that went down or off the network closes nothing).

[Note: failure notes]
A rank that fails tells the others why before it goes: ``post_failure(error)`` writes ``zero_engine/failed/<rank>``
(the exception's type and message, and where the rank was) into the default process group's store. An exception
that escapes the program posts one through ``sys.excepthook`` (installed while a watchdog lives, chained to the
previous hook), and so does ``engine.destroy()`` when it runs while an exception propagates (``finally:``). A rank
waiting for a rank with a note raises ``RankFailedError`` naming the error, instead of guessing from what the
failing rank's exit looks like (its watchdog's "left" key, or a broken connection). A new watchdog in a process
clears that rank's note: the process went on after the failure.

A reader marks the note as read (``mark_read``), and a failing process waits for that before it exits, at most
``stall_timeout_s`` and a little (``StallWatchdog.await_failure_readers``): the ranks waiting in a collective read
the note at their next stall check, and the store may be hosted by the failing process itself (rank 0 with
``MASTER_ADDR``), so without the wait a fast exit would take the note with it and leave the others with only "the
store is unreachable". A rank that is failing, exiting or done itself is not waited for. The exit waits through the
last watchdog stopped without a word when none lives: an initialize() that raises undoes its engine before the
excepthook posts the note.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import weakref
from typing import Optional

import torch.distributed as dist

from zero_engine._owned_dirs import boot_id, pid_namespace, process_start_time
from zero_engine.errors import DistributedError

__all__ = ["post_failure", "failure_of", "clear_failure", "mark_read", "was_read", "posted_failure",
           "install_excepthook", "process_identity",
           "process_state", "describe_process", "ALIVE", "GONE", "UNKNOWN", "UNREACHABLE_FACTOR"]

HEARTBEAT_PERIOD_S = 0.5
HEARTBEAT_KEY = "zero_engine/heartbeat/"
FAILURE_KEY = "zero_engine/failed/"
UNREACHABLE_FACTOR = 4  # silence bound, in heartbeat_timeout_s, for a rank whose process cannot be looked at

ALIVE, GONE, UNKNOWN = "alive", "gone", "unknown"


def default_store():
    """The default process group's store (the one it rendezvoused through), or None when it has none."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 -- a fake or exotic group: no watchdog, the engine still works
        return None


# ---- process identity ---------------------------------------------------------------------------------------------
def _machine() -> str:
    """Which kernel and pid namespace this process sees: two processes with the same value can check each other's
    pid; "-" where /proc cannot tell (another OS)."""
    boot, namespace = boot_id(), pid_namespace()
    return f"{boot}:{namespace}" if boot and namespace else "-"


def process_identity() -> str:
    """"<host> <pid> <start time> <machine>" of this process, for ``process_state`` on another rank."""
    pid = os.getpid()
    return f"{socket.gethostname()} {pid} {process_start_time(pid)!r} {_machine()}"


def describe_process(identity: str) -> str:
    host, _, rest = identity.partition(" ")
    return f"pid {rest.split(' ', 1)[0]} on {host}" if rest else "process unknown"


def process_state(identity: str) -> str:
    """ALIVE or GONE for a process on this machine (see [Note: what makes a rank lost]), UNKNOWN otherwise."""
    parts = identity.split(" ")
    if len(parts) != 4 or parts[3] == "-" or parts[3] != _machine() or not parts[1].isdigit():
        return UNKNOWN
    started = process_start_time(int(parts[1]))  # None: ended or a zombie; -1.0: exists, start time unreadable
    return ALIVE if started is not None and (started == -1.0 or repr(started) == parts[2]) else GONE


# ---- heartbeat ----------------------------------------------------------------------------------------------------
class _Heartbeat:
    """One thread per process that keeps ``zero_engine/heartbeat/<rank>`` fresh in the store, with the position of
    the most recent watchdog's progress log. Liveness is a property of the process, so engines built one after the
    other (tests) share it instead of each starting a thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._store = None
        self._key = ""
        self._progress = lambda: None

    def track(self, store, rank: int, progress) -> None:
        with self._lock:
            self._progress = weakref.ref(progress)
            if self._store is not store:  # a new process group: beat into its store
                self._store = store.clone() if hasattr(store, "clone") else store
            self._key = f"{HEARTBEAT_KEY}{rank}"
            self._beat()
            if self._thread is None:
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name=f"zero_engine-heartbeat-rank{rank}",
                                                daemon=True)
                self._thread.start()

    def position(self) -> str:
        progress = self._progress()
        return progress.position() if progress is not None else "idle"

    def _beat(self) -> None:
        self._store.set(self._key, f"{time.monotonic_ns()} {self.position()}")

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_PERIOD_S):
            try:
                with self._lock:
                    self._beat()
            except Exception:  # noqa: BLE001 -- the store is gone (job ending): nothing left to tell anyone
                return

    def stop(self) -> None:
        """Stop and join the thread (interpreter exit, or the last engine destroyed)."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)


heartbeat = _Heartbeat()


def read_heartbeat(store, rank: int) -> str:
    """The rank's last heartbeat ("<ns> <position>"), or "" when it never beat."""
    key = f"{HEARTBEAT_KEY}{rank}"
    return store.get(key).decode() if store.check([key]) else ""


# ---- failure notes ------------------------------------------------------------------------------------------------
_posted = False  # this process posted a failure note
_hook_installed = False


def post_failure(error: BaseException, store=None, rank: Optional[int] = None) -> bool:
    """Tell the other ranks that this rank failed with ``error`` (see [Note: failure notes]); True when posted.

    For any phase (training, loading, checkpointing): call it where a rank-local error ends this rank's part in
    collective work, before raising it, so that the ranks waiting for this one raise ``RankFailedError`` naming it.
    ``store`` and ``rank``: the default process group's. Never raises (at worst nothing is posted).

    A ``DistributedError`` is not posted: it reports another rank's failure (lost, diverged, failed), which the
    waiting ranks find out for themselves; posted, it would make them name this rank instead of the cause."""
    global _posted
    if isinstance(error, DistributedError):
        return False
    try:
        store = store if store is not None else default_store()
        if store is None:
            return False
        rank = rank if rank is not None else dist.get_rank()
        message = str(error).strip().splitlines()
        note = {"error": f"{type(error).__name__}: {message[0] if message else ''}"[:500],
                "position": heartbeat.position()}
        store.set(f"{FAILURE_KEY}{rank}", json.dumps(note))
        _posted = True
        return True
    except Exception:  # noqa: BLE001 -- the store or the group is already gone: nothing to tell
        return False


def failure_of(store, rank: int) -> Optional[dict]:
    """The failure note of ``rank`` ({"error": "ValueError: ...", "position": "..."}), or None."""
    key = f"{FAILURE_KEY}{rank}"
    return json.loads(store.get(key).decode()) if store.check([key]) else None


def posted_failure() -> bool:
    """Whether this process posted a failure note (its exit then waits for the others to read it)."""
    return _posted


def mark_read(store, rank: int, reader: int) -> None:
    store.set(f"{FAILURE_KEY}{rank}/read/{reader}", "1")


def was_read(store, rank: int, reader: int) -> bool:
    return store.check([f"{FAILURE_KEY}{rank}/read/{reader}"])


def clear_failure(store, rank: int) -> None:
    """Forget ``rank``'s note: its process went on after the failure (a new engine)."""
    try:
        store.delete_key(f"{FAILURE_KEY}{rank}")
    except Exception:  # noqa: BLE001 -- a store without delete_key: the note stays, only a message is affected
        pass


def install_excepthook() -> None:
    """Post a failure note for an exception that escapes the program, then run the previous ``sys.excepthook``
    (which prints the traceback as usual). Installed once per process."""
    global _hook_installed
    if _hook_installed:
        return
    _hook_installed = True
    previous = sys.excepthook

    def post_then_report(kind, error, traceback):
        post_failure(error)
        previous(kind, error, traceback)

    sys.excepthook = post_then_report
