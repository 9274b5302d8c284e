"""The loop each simulated rank runs: receive a pickled call, run it, send back the result or the traceback.

This module is the rank processes' target. They are forked from a server that imported it, torch, torch._dynamo and
zero_engine once (see [Note: ranks forked from a preloaded server] in _pool.py); it is the first thing the server
imports, so keep its own imports light.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import signal
import sys
import traceback
from typing import Any, NamedTuple, Optional

# Sent to a rank to make it write every thread's Python stack to its stack file (see _pool.dump_stacks).
STACK_DUMP_SIGNAL = signal.SIGUSR1

READY = "ready"


class Task(NamedTuple):
    """One call: ``payload`` is pickle.dumps((fn, args, kwargs)) made in the parent."""

    payload: bytes
    sys_path: list
    store_path: str
    process_group_timeout_s: float


class Reply(NamedTuple):
    ok: bool
    result: Optional[bytes]  # pickled return value when ok
    exception: str  # "ValueError: boom" when not ok
    traceback: str


def _init_process_group_if_needed(rank: int, world_size: int, task: Task) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    store = dist.FileStore(task.store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=task.process_group_timeout_s))


def _end_of_call_barrier() -> None:
    """Keep a call's leftovers out of the next call.

    Collectives pair up by order, so a collective one rank issued and the others did not (e.g. an async op on a
    rank-dependent branch) would silently pair with the next call's first collective. A barrier at the end of every
    call makes such a leftover fail or hang here instead -- the call then errors or times out, and the pool is
    replaced -- rather than corrupting a later test.
    """
    import torch.distributed as dist

    if not dist.is_initialized():  # the function destroyed the group; the next call makes a fresh one
        return
    try:
        dist.barrier()
    except Exception as error:  # noqa: BLE001 -- re-raised with the likely cause
        raise RuntimeError(
            f"the end-of-call barrier failed after the function returned ({error}); a rank probably left a "
            "collective that the other ranks did not issue"
        ) from error


def _run(rank: int, world_size: int, task: Task) -> Reply:
    try:
        # The parent may have imported test modules from directories added to sys.path after this rank started.
        sys.path[:] = task.sys_path
        _init_process_group_if_needed(rank, world_size, task)
        fn, args, kwargs = pickle.loads(task.payload)
        result: Any = fn(*args, **kwargs)
        _end_of_call_barrier()
        return Reply(True, pickle.dumps(result), "", "")
    except BaseException as error:  # noqa: BLE001 -- everything, pytest.fail/skip included, goes back to the parent
        # This loop is the rank's top level, so it does what sys.excepthook does in a real rank process: tell the
        # ranks still waiting for this one why it stopped (the pool process itself lives on).
        from zero_engine.comm.liveness import post_failure

        post_failure(error)
        return Reply(False, None, f"{type(error).__name__}: {error}", traceback.format_exc())


def worker_main(rank: int, world_size: int, connection, stack_path: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    # Kept open for the life of the process: faulthandler writes to its file descriptor from a signal handler,
    # which works even while the main thread is blocked inside a C++ collective.
    stack_file = open(stack_path, "w")
    faulthandler.register(STACK_DUMP_SIGNAL, file=stack_file, all_threads=True)
    # A rank killed by a fatal signal (SIGABRT from a C++ abort such as gloo's on a collective mismatch, SIGSEGV)
    # leaves its stacks there too, for the report of the call it died in (_pool.fatal_stack).
    faulthandler.enable(file=stack_file, all_threads=True)

    import torch

    # Several ranks share a small machine; one or two intra-op threads each avoids oversubscription.
    torch.set_num_threads(max(1, 2 // world_size))
    connection.send(READY)
    while True:
        try:
            task = connection.recv()
        except (EOFError, OSError):  # the parent went away
            break
        if task is None:
            break
        reply = _run(rank, world_size, task)
        try:
            connection.send(reply)
        except Exception as error:  # noqa: BLE001 -- e.g. a result that pickles but is too exotic to send
            connection.send(Reply(False, None, f"could not send the result back: {error!r}", traceback.format_exc()))
    stack_file.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: destroying a live gloo group at exit takes seconds per rank, and nothing in a
    # rank process needs cleaning up once the parent has stopped sending work.
    os._exit(0)
