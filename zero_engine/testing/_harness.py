"""run_ranks: run one function on N local gloo ranks and bring back results, tracebacks or stacks.

[Note: which functions can run on ranks]
The function is sent to the ranks by reference (pickle stores its module and qualified name), so it must be
defined at module level in an importable module. Functions in ``tests/test_*.py`` work with pytest's default
import mode ("prepend", no ``__init__.py`` in tests/): pytest puts tests/ on ``sys.path`` and imports the file as
module ``test_<name>``; each call sends the parent's current ``sys.path`` along, so the ranks import the same module.
Lambdas, nested functions and ``--import-mode=importlib`` (whose module names are not importable) do not work.
Arguments and return values are pickled too. Rank processes import test modules without pytest's assertion
rewriting, so a failing ``assert`` in a rank reports its line (in the remote traceback) without introspection:
put the values in the assert message where they matter.
"""

from __future__ import annotations

import functools
import importlib
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time
from typing import Any, Callable, NamedTuple, Optional

from zero_engine.testing._pool import discard_pool, get_pool
from zero_engine.testing._worker import Reply, Task

# After one rank fails, the others are probably blocked in a collective that will never complete; this is how long
# they get to finish (or fail) on their own before they are killed and their stacks reported.
_GRACE_AFTER_FAILURE_S = 3.0
# The gloo group's own timeout; the harness's `timeout` normally fires first. Only bounds leaks.
_PROCESS_GROUP_TIMEOUT_S = 600.0


class RankFailure(NamedTuple):
    rank: int
    exception: str  # "ValueError: boom", or why no result came back
    traceback: str  # the rank's own traceback, or its Python stack when it was stuck


class RankError(RuntimeError):
    """One or more ranks raised (or died, or did not finish). ``failures`` holds each one, by rank."""

    def __init__(self, message: str, failures: list[RankFailure]) -> None:
        super().__init__(message)
        self.failures = failures

    @property
    def ranks(self) -> list[int]:
        return [failure.rank for failure in self.failures]


class RankTimeoutError(RankError, TimeoutError):
    """The call did not finish within its timeout; the message has every rank's Python stack."""


class _DecoratedBody(NamedTuple):
    """Picklable reference to the function under an ``on_ranks`` decorator (its module name now means the wrapper)."""

    module: str
    qualname: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        target: Any = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            target = getattr(target, part)
        return target.rank_body(*args, **kwargs)


def _describe(fn: Callable) -> str:
    if isinstance(fn, _DecoratedBody):
        return f"{fn.module}.{fn.qualname}"
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _pickle_call(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    try:
        return pickle.dumps((fn, args, kwargs))
    except Exception as error:  # noqa: BLE001 -- re-raised with the fix spelled out
        raise ValueError(
            f"run_ranks could not pickle {_describe(fn)} or its arguments ({error}); the function must be defined at "
            "module level (no lambda or nested function) and its arguments picklable. See [Note: which functions can "
            "run on ranks] in zero_engine/testing/_harness.py"
        ) from error


def _section(title: str, body: str) -> str:
    return f"--- {title}\n{body.rstrip()}"


def kill_this_rank() -> None:
    """SIGKILL the calling rank process at once, as the kernel's OOM killer would: no exception, no cleanup, no
    Python traceback. For tests of lost ranks; the pool is replaced after the call (see [Note: why a pool, and when
    it is thrown away]), so the next ``run_ranks`` gets fresh processes."""
    os.kill(os.getpid(), signal.SIGKILL)


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 60.0,
              grace_after_failure: float = _GRACE_AFTER_FAILURE_S, **kwargs: Any) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` local ranks (gloo, file store) and return each rank's result.

    Each rank already has the default process group initialized when ``fn`` starts (``dist.get_rank()`` tells it
    which rank it is). Results come back as a list indexed by rank. If any rank raises, ``RankError`` reports every
    rank that raised with its traceback; ranks left blocked get a few seconds' grace and are then killed, with their
    stacks in the message. If the call takes longer than ``timeout`` seconds, ``RankTimeoutError`` (a ``RankError``
    and a ``TimeoutError``) reports every rank's Python stack. Processes are pooled per world size and reused across
    calls; any failure kills the pool (see [Note: why a pool, and when it is thrown away] in _pool.py).
    ``grace_after_failure`` is how long the other ranks get after the first failure (a rank killed with
    ``kill_this_rank``) to finish or raise on their own -- raise it to test how survivors react.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_ranks: world_size={world_size!r} must be a positive int")
    if timeout <= 0:
        raise ValueError(f"run_ranks: timeout={timeout} must be positive (seconds)")
    payload = _pickle_call(fn, args, kwargs)
    label = f"{_describe(fn)} (world size {world_size})"

    pool = None
    try:
        pool = get_pool(world_size)
        task = Task(payload, list(sys.path), pool.next_store_path(), _PROCESS_GROUP_TIMEOUT_S)
        for connection in pool.connections:
            connection.send(task)
        replies, failures, timed_out = _collect(pool, timeout, grace_after_failure)
    except BaseException:
        # Interrupted (pytest-timeout, Ctrl-C) or the pool could not start: nothing of this call may survive.
        discard_pool(world_size, pool)
        raise

    if not failures and not timed_out:
        return [_unpickle_result(replies[rank].result, rank, label) for rank in range(world_size)]

    unfinished = [rank for rank in range(world_size) if rank not in replies and rank not in failures]
    try:
        stacks = pool.dump_stacks(list(range(world_size)) if timed_out else unfinished)
    finally:
        discard_pool(world_size, pool)
    if timed_out:
        sections = []
        for rank in range(world_size):
            state = "still running" if rank in unfinished else "finished"
            sections.append(_section(f"rank {rank} ({state}) Python stack:", stacks[rank]))
        stuck_failures = [RankFailure(rank, f"did not finish within {timeout:.1f}s", stacks[rank])
                          for rank in unfinished]
        message = (f"{label} did not finish within {timeout:.1f}s: ranks {unfinished} still running. "
                   "Python stacks of every rank (faulthandler):\n" + "\n".join(sections))
        raise RankTimeoutError(message, stuck_failures)

    sections = [_section(f"rank {f.rank}: {f.exception}" if f.exception.startswith(_EXITED) or not f.traceback
                         else f"rank {f.rank} raised {f.exception}", f.traceback) for f in sorted(failures.values())]
    stuck_failures = []
    for rank in unfinished:
        reason = f"did not finish within {grace_after_failure:.0f}s after the failure (killed)"
        sections.append(_section(f"rank {rank} {reason}; its Python stack:", stacks[rank]))
        stuck_failures.append(RankFailure(rank, reason, stacks[rank]))
    failed_ranks = sorted(failures)
    message = (f"{label}: {len(failed_ranks)} of {world_size} ranks failed (ranks {failed_ranks}):\n"
               + "\n".join(sections))
    raise RankError(message, sorted([*failures.values(), *stuck_failures]))


def _unpickle_result(result: bytes, rank: int, label: str) -> Any:
    try:
        return pickle.loads(result)
    except Exception as error:  # noqa: BLE001 -- e.g. a class that only exists inside the rank processes
        failure = RankFailure(rank, f"{type(error).__name__}: {error}", "")
        raise RankError(f"{label}: rank {rank} returned a value this process cannot unpickle ({error}); return "
                        "plain data (numbers, lists, dicts, tensors)", [failure]) from error


_EXITED = "process exited with code"


def _died(pool, rank: int) -> RankFailure:
    """A rank whose process ended without replying: its exit code and, killed by a fatal signal (a C++ abort, such
    as gloo's on a collective the ranks disagree on), the signal and where each of its threads was then."""
    pool.processes[rank].join(timeout=1.0)  # so that exitcode is known
    code = pool.processes[rank].exitcode
    if code is None or code >= 0:
        return RankFailure(rank, f"{_EXITED} {code} before returning", "")
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    stack = pool.fatal_stack(rank)
    where = "; its Python stacks when the signal came:" if stack else ""
    return RankFailure(rank, f"{_EXITED} {code} ({name}) before returning{where}", stack)


def _collect(pool, timeout: float, grace: float) -> tuple[dict[int, Reply], dict[int, RankFailure], bool]:
    """Wait for every rank's reply, stopping early (after a grace) once one fails.

    Returns (replies, failures, timed_out)."""
    deadline = time.monotonic() + timeout
    replies: dict[int, Reply] = {}
    failures: dict[int, RankFailure] = {}
    waiting = set(range(pool.world_size))
    while waiting:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return replies, failures, not failures
        handles = [pool.connections[r] for r in waiting] + [pool.processes[r].sentinel for r in waiting]
        ready = multiprocessing.connection.wait(handles, remaining)
        for rank in sorted(waiting):
            reply: Optional[Reply] = None
            if pool.connections[rank] in ready:
                try:
                    reply = pool.connections[rank].recv()
                except (EOFError, OSError):  # the process died; its sentinel tells how
                    reply = None
            elif pool.processes[rank].sentinel not in ready:
                continue
            if reply is None:
                failures[rank] = _died(pool, rank)
            elif reply.ok:
                replies[rank] = reply
            else:
                failures[rank] = RankFailure(rank, reply.exception, reply.traceback)
            waiting.discard(rank)
        if failures and waiting:
            deadline = min(deadline, time.monotonic() + grace)
    return replies, failures, False


def on_ranks(world_size: int, timeout: float = 60.0) -> Callable:
    """Decorator form of ``run_ranks`` for pytest: the decorated test body runs on ``world_size`` ranks.

        @on_ranks(2)
        def test_gather():          # runs on both ranks; pytest sees an ordinary test
            ...

    The body must be a module-level function (see [Note: which functions can run on ranks]); pytest parameters and
    fixtures it asks for are pickled and passed to every rank. The ranks' return values are discarded.
    """

    def decorate(body: Callable) -> Callable:
        if "<locals>" in body.__qualname__:
            raise ValueError(f"on_ranks: {body.__qualname__} must be defined at module level to run on ranks")

        @functools.wraps(body)
        def run_body_on_ranks(*args: Any, **kwargs: Any) -> None:
            run_ranks(_DecoratedBody(body.__module__, body.__qualname__), world_size, *args, timeout=timeout,
                      **kwargs)

        run_body_on_ranks.rank_body = body  # type: ignore[attr-defined]
        return run_body_on_ranks

    return decorate
