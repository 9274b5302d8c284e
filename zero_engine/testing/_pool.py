"""A pool of rank processes for one world size, kept alive across run_ranks calls.

[Note: why a pool, and when it is thrown away]
Starting a rank means a new process and a new gloo process group (and, for the first pool, the fork server's imports:
see [Note: ranks forked from a preloaded server]), so each world size keeps its processes, and their gloo process
group, alive across calls in the same Python process. A call that fails or times out may leave a rank stuck inside
a collective or holding unfinished async work that would poison the next call's collectives; so after any failure
the pool is killed outright and the next call starts a fresh one. Pools are shut down when the interpreter exits.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import time
from typing import Optional

from zero_engine.testing._worker import READY, STACK_DUMP_SIGNAL, worker_main

logger = logging.getLogger(__name__)

# How faulthandler starts the stacks of a process a fatal signal kills ("Fatal Python error: Aborted").
FATAL_DUMP_HEADER = "Fatal Python error"
_START_TIMEOUT_S = 180.0  # the fork server's first start imports torch, on a loaded 2-core machine
_STACK_DUMP_WAIT_S = 2.0
# Imported once by the fork server, before any rank forks from it: see [Note: ranks forked from a preloaded server].
_PRELOAD = ["zero_engine.testing._worker", "torch", "torch._dynamo", "zero_engine"]


def _rank_context():
    """[Note: ranks forked from a preloaded server]
    A rank is a fresh process: no gloo group, no module state or thread left by an earlier test. Spawned, each one
    imported torch, and then zero_engine and torch._dynamo (which any torch optimizer imports), about 4 s of CPU per
    rank, paid again by every pool replaced after a failure. The fork server imports them once; each rank is then a
    fork of that server, which has run no tensor op and holds no thread of ours (torch resets its thread pools in a
    forked child, as a DataLoader's workers rely on). Still a fresh process per rank, started in a fraction of a
    second."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


class RankPool:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.directory = tempfile.mkdtemp(prefix=f"zero_engine_ranks{world_size}_")
        self.calls = 0
        context = _rank_context()
        self.processes = []
        self.connections = []
        self.stack_paths = []
        try:
            for rank in range(world_size):
                parent_end, child_end = context.Pipe(duplex=True)
                stack_path = os.path.join(self.directory, f"stacks-rank{rank}.txt")
                # Not daemonic, so a rank function may itself start processes (e.g. DataLoader workers);
                # shutdown_all_pools (atexit) ends them before multiprocessing would join them.
                process = context.Process(target=worker_main, args=(rank, world_size, child_end, stack_path),
                                          name=f"zero_engine-rank{rank}-of-{world_size}")
                process.start()
                child_end.close()
                self.processes.append(process)
                self.connections.append(parent_end)
                self.stack_paths.append(stack_path)
            self._wait_until_ready()
        except BaseException:
            self.kill()
            raise
        logger.debug("started a pool of %d rank processes (pids %s)", world_size, self.pids)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        waiting = set(range(self.world_size))
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"ranks {sorted(waiting)} of a {self.world_size}-rank pool did not start within "
                                   f"{_START_TIMEOUT_S:.0f}s")
            ready = multiprocessing.connection.wait(
                [self.connections[r] for r in waiting] + [self.processes[r].sentinel for r in waiting], remaining)
            for rank in list(waiting):
                if self.connections[rank] in ready:
                    message = self.connections[rank].recv()
                    if message != READY:
                        raise RuntimeError(f"rank {rank} sent {message!r} instead of {READY!r} at start-up")
                    waiting.discard(rank)
                elif self.processes[rank].sentinel in ready:
                    self.processes[rank].join(timeout=1.0)  # so that exitcode is known
                    raise RuntimeError(f"rank {rank} of a {self.world_size}-rank pool exited at start-up with code "
                                       f"{self.processes[rank].exitcode}; its stderr is above")

    def next_store_path(self) -> str:
        """A fresh FileStore path; ranks only use it when they have no process group yet (first call, or the
        previous call's function destroyed the group on every rank)."""
        self.calls += 1
        return os.path.join(self.directory, f"store-{self.calls}")

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Every thread's Python stack for each living rank in ``ranks`` (faulthandler, triggered by a signal)."""
        offsets = {}
        for rank in ranks:
            if self.processes[rank].is_alive():
                offset = os.path.getsize(self.stack_paths[rank])
                try:
                    os.kill(self.processes[rank].pid, STACK_DUMP_SIGNAL)
                except ProcessLookupError:  # exited since is_alive()
                    continue
                offsets[rank] = offset
        stacks = {rank: "(process already exited, no stack)" for rank in ranks if rank not in offsets}
        deadline = time.monotonic() + _STACK_DUMP_WAIT_S
        last_sizes: dict[int, int] = {}
        while offsets:
            sizes = {rank: os.path.getsize(self.stack_paths[rank]) for rank in offsets}
            # A dump is complete once the file has grown and then stopped growing for one poll.
            settled = all(sizes[r] > offsets[r] and sizes[r] == last_sizes.get(r) for r in offsets)
            if settled or time.monotonic() > deadline:
                break
            last_sizes = sizes
            time.sleep(0.05)
        for rank, offset in offsets.items():
            with open(self.stack_paths[rank]) as stack_file:
                stack_file.seek(offset)
                stacks[rank] = stack_file.read().rstrip() or "(no stack was written in time)"
        return stacks

    def fatal_stack(self, rank: int) -> str:
        """The Python stacks ``rank`` wrote when a fatal signal killed it (faulthandler, see worker_main); "" if none.
        Only a living pool's file is read, and a pool is replaced after any failure, so a dump is of this call."""
        try:
            with open(self.stack_paths[rank]) as stack_file:
                text = stack_file.read()
        except OSError:
            return ""
        start = text.rfind(FATAL_DUMP_HEADER)
        return text[start:].rstrip() if start >= 0 else ""

    def shutdown(self) -> None:
        """Ask idle ranks to exit; kill whatever does not within a few seconds."""
        for connection in self.connections:
            try:
                connection.send(None)
            except (OSError, ValueError):
                pass
        for process in self.processes:
            process.join(timeout=5.0)
        self.kill()

    def kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(timeout=5.0)
        for connection in self.connections:
            connection.close()
        self.processes, self.connections = [], []
        shutil.rmtree(self.directory, ignore_errors=True)


_pools: dict[int, RankPool] = {}
_atexit_registered = False


def get_pool(world_size: int) -> RankPool:
    global _atexit_registered
    pool = _pools.get(world_size)
    if pool is None:
        if not _atexit_registered:
            # Registered after multiprocessing's own exit hook, so it runs before it (atexit is last-in first-out)
            # and the non-daemonic ranks are gone before multiprocessing would wait for them.
            atexit.register(shutdown_all_pools)
            _atexit_registered = True
        pool = _pools[world_size] = RankPool(world_size)
    return pool


def discard_pool(world_size: int, pool: Optional[RankPool]) -> None:
    """Kill a pool after a failure (see [Note: why a pool, and when it is thrown away])."""
    if pool is None:
        return
    pool.kill()
    if _pools.get(world_size) is pool:
        del _pools[world_size]


def shutdown_all_pools() -> None:
    for world_size in list(_pools):
        _pools.pop(world_size).shutdown()
