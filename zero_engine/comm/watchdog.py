"""Stall watchdog: a desync or a lost rank becomes an error on every rank, never a hang (the step fingerprint,
which catches collectives that paired up across modules, is fingerprint.py).

[Note: how a stall is diagnosed]
``Pending.wait()`` does not block in one call: it waits in slices (gloo: ``work.wait(timeout)``, which leaves the
work intact when it times out; other backends: ``is_completed()`` polling), so the main thread stays in Python and
can decide. After ``stall_timeout_s`` without completion, the rank publishes its recent progress records (see
[Note: progress records]) under its own key in the process group's store and reads the other ranks' keys:

* another rank published a different record at a sequence number both have -> ``RankDivergenceError`` naming each
  rank's record (every stuck rank reads the same keys, so every rank raises the same message);
* another rank has left (``destroy()`` ran there) while this one waits -> ``RankDivergenceError`` (it ran fewer
  collectives);
* another rank posted a failure note (it raised: see [Note: failure notes] in liveness.py) -> ``RankFailedError``
  naming its exception;
* another rank's process exited without ``destroy()``, or is gone, or unreachable (see [Note: what makes a rank
  lost] in liveness.py; a heartbeat starved by a long GIL-holding call is not enough) -> ``RankLostError`` naming it
  and its last known position (the heartbeat carries it);
* otherwise (all in the same collective, or a rank still computing) -> log once that it is slow, keep waiting, up to
  ``collective_timeout_s``, then ``DistributedError``.

A heartbeat thread (liveness.py) bumps ``zero_engine/heartbeat/<rank>`` (with the rank's position) every
``HEARTBEAT_PERIOD_S``. Nothing of this runs
in the normal path except the sliced wait, which costs nothing when the work is done.

[Note: holding back a collective that may not match]
gloo cannot survive a mismatched collective: a rank that receives more bytes than it posted aborts the process
(``terminate called after throwing an instance of 'gloo::EnforceNotMet'``), so a different-shaped divergence would
kill a rank before anyone could say why. The one place the engine knows a collective may not match is where a step
leaves the recorded module order (data-dependent control flow); the step that records it is checked collective by
collective instead ([Note: the recording step is checked] in zero/coordinator.py). Where a step leaves the order,
the coordinator asks for the next collective to be *agreed* first: the rank publishes the record it is about to
issue and waits until every other rank has published the record at that number (ranks that took the same turn do
so at once; a rank that did not stalls in its own collective and publishes after ``stall_timeout_s``). Same
records -> issue; different -> RankDivergenceError before a byte is exchanged.

[Note: clean shutdown]
`make demo` sometimes ended with one rank aborting after training ("terminate called without an active exception",
SIGABRT, exit 2); never with a barrier before ``destroy_process_group``. The abort is C++ terminating a thread that
is still running at interpreter exit: gloo's worker threads are still alive then because (a) the last collectives'
works can still be finishing on them when a rank that is ahead tears its group down or reaches interpreter exit,
and (b) the engine kept references to the process group, so ``destroy_process_group()`` did not destroy it and its
threads were left to garbage collection during interpreter finalization, where a thread that needs the GIL (to
free a tensor a finished work held) is force-unwound. ``engine.destroy()`` removes both: it waits for this rank's
gathers in flight, then waits (store only, no collective that could mismatch) until every rank is done, stops the
heartbeat thread (joined), and drops the communicator's references to the group, so that
``destroy_process_group()`` destroys it there and then, with its threads joined while the interpreter is whole.
A third holder was found later (a 1-in-20 abort in the two-host test): the thread that waits on gloo's
reduce-scatter works for the main thread kept the last work it waited for in its frame, and a work keeps its group
alive. It now drops each work when its wait ends, and the last watchdog to stop ends and joins that thread too.
A fourth holder was outside the engine (1 in ~40 demo runs; CI once): torch.distributed.nn.functional's collectives
take ``group=group.WORLD`` as a default argument, evaluated when the module is first imported, and the first
``torch.optim.Optimizer`` imports it (through torch._dynamo, torch.distributed.fsdp). Built after
``init_process_group``, as every engine's optimizer is, it kept the world group in those defaults for the life of the
process. zero_engine/comm/__init__.py imports it first, before any group exists; a test checks that no gloo thread is
left after ``destroy_process_group()``.
The last cause is the user's: a script that never calls ``destroy_process_group()`` (transformers' Trainer and
Lightning do not) leaves the group to interpreter exit, where the same race can abort it (6 of 16 plain torch jobs
under load: docs/benchmarks.md, "A gloo group left to interpreter exit"). The group is not the engine's to destroy,
so a rank whose engine ran on gloo says at exit how to end the script (``GROUP_LEFT_TO_EXIT``).
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import json
import logging
import sys
import time
import weakref
from typing import Optional

import torch.distributed as dist

from zero_engine.comm import _blocking_waiter as blocking_waiter, liveness
from zero_engine.comm._records import CollectiveRecord, ProgressLog, describe_pair
from zero_engine.comm.liveness import HEARTBEAT_PERIOD_S, default_store, heartbeat
from zero_engine.errors import DistributedError, RankDivergenceError, RankFailedError, RankLostError

log = logging.getLogger("zero_engine.watchdog")

__all__ = ["StallWatchdog", "default_store"]

_CHECK_PERIOD_S = 1.0  # how often a stalled rank re-reads the others' state
_HOLD_POLL_S = 0.01
_PUBLISHED_RECORDS = 48
# gloo's work.wait(timeout) returns on time for these (all_to_all: checked with torch 2.13, it raises "Operation
# timed out" on time, and is_completed() turns True without a wait). Its reduce-scatter (torch 2.13) ignores the
# timeout and its is_completed() stays False until wait() is called, so that one is waited on a helper thread
# (_blocking_waiter.py).
_WAIT_HONOURS_TIMEOUT = frozenset({"all_gather", "all_reduce", "all_to_all", "broadcast", "barrier"})

BRANCH_ADVICE = ("make data-dependent branches agree across ranks (decide on rank 0 and broadcast the decision), "
                 "and call engine(), engine.backward() and engine.step() the same number of times on every rank")
UNUSABLE = ("The process group cannot be used any more (a collective is left pending in the backend): end the job "
            "on every rank, fix the cause and restart from the last checkpoint.")

_instances = itertools.count()
_live: "weakref.WeakSet[StallWatchdog]" = weakref.WeakSet()
# The process's latest watchdog, when it stopped without a word to the others (an initialize() undone by its error, a
# broken group): the error may yet escape the program, whose excepthook posts a note after this watchdog stopped,
# and the exit must still wait for that note to be read (the store lives as long as the process group).
_stopped_silently: Optional["StallWatchdog"] = None


# An engine of this process ran on a gloo group, and no group failed since (a broken group is not one to destroy at
# exit: the failure's message says what to do). Read at exit by _stop_all_at_exit.
_advise_at_exit = False

# Said at exit by a rank of such a process whose group is still alive (a failing process says why it fails instead).
# torch's own warning of this kind covers NCCL only; docs/benchmarks.md, "A gloo group left to interpreter exit".
GROUP_LEFT_TO_EXIT = (
    "this process is exiting with its gloo process group not destroyed. A gloo rank that leaves its group to "
    "interpreter exit can abort after training has finished (\"terminate called without an active exception\"): end "
    "the script with engine.destroy() (a Trainer's: trainer.engine.destroy(), and with TRL each engine in "
    "trainer.reference_engines too; Lightning's: trainer.strategy.engine.destroy()), then "
    "torch.distributed.destroy_process_group(), on every rank (README, \"End the script\").")


def _stop_all_at_exit() -> None:
    if liveness.posted_failure():  # sys.excepthook posted why this process fails: let the others read it
        for watchdog in list(_live) or ([_stopped_silently] if _stopped_silently is not None else []):
            watchdog.await_failure_readers()
    for watchdog in list(_live):
        watchdog.stop(mark="exited")  # the process ends without engine.destroy()
    heartbeat.stop()
    blocking_waiter.close_shared()
    if _advise_at_exit and dist.is_initialized() and not liveness.posted_failure():
        log.warning("zero_engine, rank %d: %s", dist.get_rank(), GROUP_LEFT_TO_EXIT)


atexit.register(_stop_all_at_exit)


class StallWatchdog:
    """Watches this rank's waits; see [Note: how a stall is diagnosed]. One per Communicator on the world group.

    Args:
        store: the c10d store every rank of the group can reach (``default_store()``).
        rank, world_size: in the default group.
        progress: this rank's ProgressLog.
        stall_timeout_s: a wait longer than this makes the ranks compare notes.
        collective_timeout_s: a wait longer than this (all ranks alive and in the same collective) is an error.
        heartbeat_timeout_s: a rank whose heartbeat has not moved for this long may be lost: see [Note: what
            makes a rank lost] in liveness.py.
    """

    def __init__(self, store, rank: int, world_size: int, progress: ProgressLog, stall_timeout_s: float,
                 collective_timeout_s: float, backend: str, heartbeat_timeout_s: Optional[float] = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.progress = progress
        self.stall_timeout_s = float(stall_timeout_s)
        self.collective_timeout_s = float(collective_timeout_s)
        self.heartbeat_timeout_s = heartbeat_timeout_s or max(5.0, min(self.stall_timeout_s, 15.0))
        # Waits are sliced on gloo only. On NCCL, work.wait() only makes the current stream wait and returns at once
        # (polling is_completed() would be a host sync and end compute/communication overlap); stalls there are
        # left to NCCL's own watchdog and the process group's timeout, while records, holds, the step fingerprint
        # and the heartbeat work as on gloo.
        self.watches_waits = self.wait_with_timeout = backend == "gloo"
        global _advise_at_exit
        _advise_at_exit = _advise_at_exit or self.watches_waits
        # the first slice of every wait (see _wait): until the stall check, or the give-up time if that is sooner
        self._first_slice = datetime.timedelta(seconds=max(min(self.stall_timeout_s, self.collective_timeout_s), 1e-3))
        # Every rank builds its communicators in the same order, so the n-th watchdog has the same prefix everywhere
        # and a later engine in the same process group never reads an earlier one's keys.
        self.prefix = f"zero_engine/watchdog{next(_instances)}/"
        self.store = store
        self._published: Optional[int] = None
        self._slow_logged: set[int] = set()
        self._processes: dict[int, str] = {}  # rank -> its process identity (liveness.process_identity)
        self._hb_seen: dict[int, tuple[str, float]] = {}  # rank -> (last heartbeat value, when it changed)
        self._silence_logged: set[int] = set()
        self._waiter: Optional[blocking_waiter.BlockingWaiter] = None
        self.stopped = False
        self.failed = False  # a DistributedError was raised: the process group is unusable
        self.store.set(self._key("proc", rank), liveness.process_identity())
        liveness.clear_failure(store, rank)  # a note from an earlier failure of this process is stale now
        liveness.install_excepthook()
        heartbeat.track(store, rank, progress)
        _live.add(self)
        global _stopped_silently
        _stopped_silently = None  # an engine after the undone one: its watchdog waits at exit, if any does

    def _key(self, what: str, rank: int) -> str:
        return f"{self.prefix}{what}/{rank}"

    # ---- shutdown ----------------------------------------------------------------------------------------------
    def stop(self, mark: Optional[str] = "left", silently: bool = False) -> None:
        """Stop watching; the heartbeat thread stops (joined) with the last live watchdog of the process. ``mark``
        tells the other ranks why: "left" (engine.destroy(): this rank is done), "exited" (the process ends without
        it), None (nothing to say). ``silently``: the engine was undone, or its group broke, without a word to the
        others; this process may yet post a failure note, which its exit then waits through this watchdog to see
        read (``_stopped_silently``)."""
        global _stopped_silently
        if self.stopped:
            return
        self.stopped = True
        _live.discard(self)
        _stopped_silently = self if silently else None  # the latest watchdog of the process only
        if not _live:  # the last watchdog of the process: its threads end now, not at interpreter exit
            heartbeat.stop()
            blocking_waiter.close_shared()
        if mark is not None:
            try:
                self.store.set(self._key(mark, self.rank), self.progress.position())
            except Exception:  # noqa: BLE001 -- the store may already be gone at the end of a job
                pass
        _live.discard(self)

    def leave(self) -> None:
        """This rank is done (engine.destroy()): say so, and wait (store only) until every rank is done too.

        A rank still waiting in a collective this rank never issued gets RankDivergenceError from its watchdog
        (it reads the "left" key); this rank raises the same kind of error when it sees such a rank. A lost rank is
        logged, not waited for. See [Note: clean shutdown].

        Called while an exception propagates (``finally: engine.destroy()``), this rank failed: it posts the error
        (see [Note: failure notes] in liveness.py) and stops without waiting, so the others raise RankFailedError
        naming it instead of this rank blaming them for the collectives it never reached.
        """
        if self.stopped:
            return
        error = sys.exc_info()[1]
        if error is not None and not isinstance(error, (StopIteration, GeneratorExit)):
            if liveness.post_failure(error, self.store, self.rank):
                self.await_failure_readers()
            self.stop(mark=None)
            return
        self.store.set(self._key("left", self.rank), self.progress.position())
        deadline = time.monotonic() + self.stall_timeout_s + self.heartbeat_timeout_s
        try:
            while True:
                waiting_for = []
                for rank in range(self.world_size):
                    if rank == self.rank or self._read("left", rank) is not None:
                        continue
                    state = self._state_of(rank)
                    if state is not None and state["waiting"] is not None and state["waiting"] > self.progress.seq:
                        theirs = self._records_of(state)[state["waiting"]]
                        raise RankDivergenceError(
                            f"rank {rank} waits in collective #{theirs.seq} {theirs.describe()}, which rank "
                            f"{self.rank} never issued: rank {self.rank} finished (engine.destroy()) after "
                            f"{self.progress.position()}. The ranks ran a different number of collectives; "
                            f"{BRANCH_ADVICE}.")
                    failed = self._failed(rank)
                    gone = f"failed ({failed})" if failed is not None else self._lost(rank)
                    if gone is not None:
                        log.warning("rank %d: engine.destroy(): rank %d is gone: %s; not waiting for it",
                                    self.rank, rank, gone)
                        continue
                    waiting_for.append(rank)
                if not waiting_for:
                    return
                if time.monotonic() > deadline:
                    log.warning("rank %d: engine.destroy(): ranks %s did not finish within %.0fs; going on",
                                self.rank, waiting_for, self.stall_timeout_s + self.heartbeat_timeout_s)
                    return
                time.sleep(_HOLD_POLL_S * 2)
        finally:
            self.stop(mark=None)

    def await_failure_readers(self) -> None:
        """This rank posted why it fails: wait until every other rank has read it, or is failing, exiting or done
        itself, at most until their stall check has had time to run (see [Note: failure notes] in liveness.py)."""
        deadline = time.monotonic() + self.stall_timeout_s + 2 * _CHECK_PERIOD_S
        waiting = set(range(self.world_size)) - {self.rank}
        try:
            while waiting and time.monotonic() < deadline:
                waiting = {rank for rank in waiting if not (
                    liveness.was_read(self.store, self.rank, rank) or liveness.failure_of(self.store, rank)
                    or self._read("left", rank) is not None or self._read("exited", rank) is not None)}
                time.sleep(_HOLD_POLL_S * 5)
        except Exception:  # noqa: BLE001 -- the store is gone: nobody can read the note any more
            return

    # ---- the wait ------------------------------------------------------------------------------------------------
    def wait(self, work, record: Optional[CollectiveRecord], held: bool = False) -> None:
        """Wait for ``work`` in slices; diagnose a stall; turn a backend failure into a DistributedError. ``held``:
        ``work`` is the check of ``record`` (``Communicator._check_consistency``), not issued yet: a stall publishes
        it as an agreement does, so ranks whose checks never pair (on different groups) are told apart."""
        started = time.monotonic()
        try:
            # The common case in this one call: a work whose wait honours a timeout completes within the first
            # slice (what _wait_slice would wait). Anything else (a timeout, a failure, a work waited on the helper
            # thread) goes the whole way through _wait, from the same start: a timed-out or failed work's wait
            # raises again there, and is told apart and explained as before.
            if self.wait_with_timeout and record is not None and (held or record.kind in _WAIT_HONOURS_TIMEOUT):
                try:
                    work.wait(timeout=self._first_slice)
                    return
                except RuntimeError:
                    pass
            self._wait(work, record, started, held)
        except DistributedError:
            self._mark_failed()
            raise

    def agree(self, record: CollectiveRecord) -> None:
        """Block until every rank has published the same record at ``record.seq``; see [Note: holding back a
        collective that may not match]."""
        try:
            self._agree(record)
        except DistributedError:
            self._mark_failed()
            raise

    def _mark_failed(self) -> None:
        global _advise_at_exit
        self.failed = True
        _advise_at_exit = False
        if self._waiter is not None:
            blocking_waiter.abandon_if_stuck(self._waiter)

    def _wait(self, work, record: Optional[CollectiveRecord], started: float, held: bool = False) -> None:
        stall_at = started + self.stall_timeout_s
        give_up_at = started + self.collective_timeout_s
        while True:
            now = time.monotonic()
            until = stall_at if now < stall_at else now + _CHECK_PERIOD_S
            if self._wait_slice(work, max(0.0, min(until, give_up_at) - now), record, held):
                return
            now = time.monotonic()
            if now >= give_up_at:
                raise DistributedError(
                    f"rank {self.rank}: {self._what(record)} did not complete within "
                    f"zero_engine.collective_timeout_s={self.collective_timeout_s:g}s although every rank is alive "
                    f"({now - started:.0f}s waited). Raise collective_timeout_s if a step can legitimately take "
                    f"this long. {UNUSABLE}")
            if now >= stall_at:
                self._diagnose(record, now - started, held)

    def _wait_slice(self, work, seconds: float, record, held: bool = False) -> bool:
        """True when the work completed within ``seconds``; raises the translated error when it failed."""
        try:
            if self.wait_with_timeout:
                if record is not None and (held or record.kind in _WAIT_HONOURS_TIMEOUT):  # held: an all-gather
                    work.wait(timeout=datetime.timedelta(seconds=max(seconds, 1e-3)))
                    return True
                return self._blocking_waiter().wait(work, seconds)
            deadline = time.monotonic() + seconds
            delay = 2e-5
            while not work.is_completed():
                if time.monotonic() >= deadline:
                    return False
                time.sleep(delay)
                delay = min(delay * 1.5, 1e-3)  # overshoot at most ~1/3 of the wait, and at most 1 ms
            work.wait()
            return True
        except RuntimeError:
            if not work.is_completed():
                return False  # this slice timed out; the work goes on
            try:
                work.wait()
                return True
            except Exception as real:  # noqa: BLE001
                self.explain_failure(record, real)
                raise  # explain_failure raises; unreachable

    def _blocking_waiter(self) -> blocking_waiter.BlockingWaiter:
        self._waiter = blocking_waiter.shared()
        return self._waiter

    def _what(self, record: Optional[CollectiveRecord]) -> str:
        return f"collective #{record.seq} {record.describe()}" if record is not None else "a collective"

    # ---- publishing and reading ---------------------------------------------------------------------------------
    def _publish(self, waiting: Optional[CollectiveRecord], holding: bool = False) -> None:
        records = list(self.progress.recent)[-_PUBLISHED_RECORDS:]
        state = {"waiting": waiting.seq if waiting is not None else None, "holding": holding,
                 "module": self.progress.module,
                 "records": [r.as_list() for r in records], "position": self.progress.position()}
        if holding and waiting is not None and (not records or records[-1].seq < waiting.seq):
            state["records"].append(waiting.as_list())
        self.store.set(self._key("state", self.rank), json.dumps(state))
        self._published = waiting.seq if waiting is not None else None

    def _read(self, what: str, rank: int) -> Optional[str]:
        key = self._key(what, rank)
        if not self.store.check([key]):
            return None
        return self.store.get(key).decode()

    def _state_of(self, rank: int) -> Optional[dict]:
        text = self._read("state", rank)
        return json.loads(text) if text else None

    def _failed(self, rank: int) -> Optional[str]:
        """``rank``'s error from its failure note ("ValueError: ... (at ...)"), or None."""
        note = liveness.failure_of(self.store, rank)
        if note is None:
            return None
        liveness.mark_read(self.store, rank, self.rank)
        return f"{note['error']} (its last position: {note['position']})"

    def _lost(self, rank: int, connection_failed: bool = False) -> Optional[str]:
        """Why ``rank`` counts as lost, or None while it may be alive; see [Note: what makes a rank lost] in
        liveness.py. ``connection_failed``: the backend reported a broken connection."""
        exited = self._read("exited", rank)
        if exited is not None:
            return (f"its process exited without engine.destroy() after {exited} (an error handled by exiting, or "
                    f"a rank-dependent sys.exit(); its log says which)")
        identity = self._processes.get(rank) or self._read("proc", rank) or ""
        if identity:
            self._processes[rank] = identity
        beat = liveness.read_heartbeat(self.store, rank)
        now = time.monotonic()
        last, since = self._hb_seen.get(rank, (None, now))
        if beat != last:
            self._hb_seen[rank] = (beat, now)
            since = now
        silent = now - since
        position = beat.partition(" ")[2] or "unknown"
        state = liveness.process_state(identity)
        if state == liveness.GONE:
            return f"its process ({liveness.describe_process(identity)}) has ended; last known position: {position}"
        if silent < self.heartbeat_timeout_s:
            return None
        if state == liveness.ALIVE:
            if rank not in self._silence_logged:
                self._silence_logged.add(rank)
                log.warning("rank %d: rank %d's heartbeat has been silent for %.0fs but its process (%s) is alive "
                            "(busy in a long call that holds the GIL?); waiting for it", self.rank, rank, silent,
                            liveness.describe_process(identity))
            return None
        unreachable = liveness.UNREACHABLE_FACTOR * self.heartbeat_timeout_s
        if connection_failed or silent >= unreachable:
            why = "and its connection broke" if connection_failed else "and its host cannot be checked"
            return (f"its heartbeat stopped (no sign of life for {silent:.0f}s {why}); last known position: "
                    f"{position}")
        return None

    # ---- decisions -----------------------------------------------------------------------------------------------
    def _records_of(self, state: dict) -> dict[int, CollectiveRecord]:
        return {values[0]: CollectiveRecord.from_list(values) for values in state["records"]}

    def _first_difference(self, mine: dict[int, CollectiveRecord], other: dict[int, CollectiveRecord],
                          from_seq: int) -> Optional[int]:
        for seq in sorted(set(mine) & set(other)):
            if seq >= from_seq and not mine[seq].same_collective(other[seq]):
                return seq
        return None

    def _divergence(self, seq: int, mine: CollectiveRecord, rank: int, theirs: CollectiveRecord,
                    hold: bool = False, their_module: str = "") -> RankDivergenceError:
        a, b = describe_pair(mine, theirs)
        sides = sorted([(self.rank, a, self.progress.module), (rank, b, their_module)])
        detail = "; ".join(f"rank {r}: {d}" for r, d, _ in sides)
        if any(m for _, _, m in sides):
            detail += " (modules entered last: " + ", ".join(f"rank {r}: {m or '-'}" for r, _, m in sides) + ")"
        tail = ("Nothing was exchanged for it: this rank held the collective back until the ranks agreed. " if hold
                else "")
        return RankDivergenceError(
            f"ranks issued different collectives at collective #{seq}: {detail}. The ranks ran different code "
            f"(data-dependent control flow or a rank-dependent call); {BRANCH_ADVICE}. {tail}{UNUSABLE}")

    def _check_others(self, record: Optional[CollectiveRecord], hold: bool,
                      connection_failed: bool = False) -> Optional[list[int]]:
        """Raise when another rank diverged, failed, left or was lost; return the ranks not yet published at
        ``record``. ``connection_failed``: the backend reported a broken connection (see ``_lost``)."""
        mine = {r.seq: r for r in self.progress.recent}
        if record is not None:
            mine[record.seq] = record
        from_seq = min(mine) if mine else 0
        pending = []
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            state = self._state_of(rank)
            if state is not None:
                theirs = self._records_of(state)
                seq = self._first_difference(mine, theirs, from_seq)
                if seq is not None:
                    raise self._divergence(seq, mine[seq], rank, theirs[seq], hold=hold or state["holding"],
                                           their_module=state.get("module", ""))
                if record is not None and record.seq in theirs:
                    continue
            failed = self._failed(rank)
            if failed is not None:
                raise RankFailedError(
                    f"rank {rank} failed: {failed}. Rank {self.rank} was waiting for it in {self._what(record)}. "
                    f"Rank {rank}'s log has the traceback. {UNUSABLE}")
            left = self._read("left", rank)
            if left is not None:
                raise RankDivergenceError(
                    f"rank {rank} has finished (engine.destroy() after {left}) while rank {self.rank} waits in "
                    f"{self._what(record)}: the ranks ran a different number of collectives; {BRANCH_ADVICE}. "
                    f"{UNUSABLE}")
            lost = self._lost(rank, connection_failed)
            if lost is not None:
                raise RankLostError(
                    f"rank {rank} was lost: {lost}. Rank {self.rank} was waiting for it in {self._what(record)}. "
                    f"Check rank {rank}'s log and the kernel log (an OOM kill leaves no Python traceback). "
                    f"{UNUSABLE}")
            pending.append(rank)
        return pending

    def _diagnose(self, record: Optional[CollectiveRecord], waited: float, held: bool = False) -> None:
        if record is None or self._published != record.seq:
            self._publish(record, holding=held)
        pending = self._check_others(record, hold=held)
        key = record.seq if record is not None else -1
        if key not in self._slow_logged:
            self._slow_logged.add(key)
            busy = f"; ranks {pending} are not in a collective yet (still computing?)" if pending else ""
            log.warning("rank %d: %s is slow (%.0fs so far) but no rank diverged or was lost%s; still waiting "
                        "(up to zero_engine.collective_timeout_s=%gs)", self.rank, self._what(record), waited, busy,
                        self.collective_timeout_s)

    def _agree(self, record: CollectiveRecord) -> None:
        self._publish(record, holding=True)
        started = time.monotonic()
        while True:
            if not self._check_others(record, hold=True):
                self._published = None
                return
            if time.monotonic() - started > self.collective_timeout_s:
                raise DistributedError(
                    f"rank {self.rank}: the other ranks did not reach {self._what(record)} within "
                    f"zero_engine.collective_timeout_s={self.collective_timeout_s:g}s. {UNUSABLE}")
            time.sleep(_HOLD_POLL_S)

    def fail(self, record: Optional[CollectiveRecord], error: BaseException) -> None:
        """A collective that was not waited on here (a synchronous object exchange) failed in the backend: raise
        what ``explain_failure`` finds, and mark the group unusable as ``wait`` does."""
        try:
            self.explain_failure(record, error)
        except DistributedError:
            self._mark_failed()
            raise

    def explain_failure(self, record: Optional[CollectiveRecord], error: BaseException) -> None:
        """A backend error ("Connection reset by peer", an NCCL error): find the rank that caused it and raise."""
        self._publish(record)
        deadline = time.monotonic() + self.heartbeat_timeout_s + 2 * HEARTBEAT_PERIOD_S
        while time.monotonic() < deadline:
            try:
                self._check_others(record, hold=False, connection_failed=True)
            except DistributedError as found:
                raise found from error
            except Exception:  # noqa: BLE001 -- the store went with the rank that hosted it
                raise RankLostError(
                    f"rank {self.rank}: {self._what(record)} failed ({error}) and the store is unreachable, so the "
                    f"rank hosting it (rank 0, or the launcher) is gone. {UNUSABLE}") from error
            time.sleep(_CHECK_PERIOD_S / 4)
        raise DistributedError(f"rank {self.rank}: {self._what(record)} failed: {error}. Every other rank still "
                               f"looks alive. {UNUSABLE}") from error
