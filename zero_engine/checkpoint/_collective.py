"""Collective error handling for checkpoints: every rank fails together, or none does.

[Note: why every phase is agreed]
Saving and loading are collectives. If one rank raised (a corrupt file it verified, a full disk) while the others
went on to the next collective, they would wait forever. So each phase that can fail runs through ``agree``: each
rank runs its part, then one all_gather_object tells every rank who failed, and all raise. A rank that failed
raises its own exception; the others raise CheckpointError naming the failing rank and its message.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable

import torch.distributed as dist

from ._errors import CheckpointError

__all__ = ["agree", "rendezvous"]

def agree(comm, phase: str, fn: Callable[[], Any], share: bool = False) -> Any:
    """Run ``fn`` on this rank and return its result, or raise on every rank if it raised on any.

    ``share``: return every rank's result as a list indexed by rank (results must be small and picklable).
    """
    try:
        result, error = fn(), None
    except Exception as exc:  # noqa: BLE001 -- a bug too must fail every rank, not leave the others waiting
        result, error = None, exc
    outcomes = comm.all_gather_object(("ok", result if share else None) if error is None else
                                      ("error", f"{type(error).__name__}: {error}"))
    failed = [(rank, message) for rank, (status, message) in enumerate(outcomes) if status == "error"]
    if not failed:
        return [value for _, value in outcomes] if share else result
    if error is not None:
        raise error
    rank, message = failed[0]
    raise CheckpointError(f"{phase} failed on rank {rank} (this is rank {comm.rank}): {message}")


def rendezvous(comm, what: str, timeout_s: float) -> None:
    """Wait until every rank has called ``what``, or raise after ``timeout_s`` naming the ranks missing (gloo).

    For collectives a user might call on some ranks only (``if rank == 0: engine.save_16bit_model(...)``): the
    ranks that did call get an error instead of waiting forever in the first gather.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    hint = (f"{what} is a collective: every rank must call it (not only rank 0). Waited "
            f"{timeout_s:g}s (zero_engine.collective_timeout_s) on rank {comm.rank}")
    try:
        if comm.backend == "gloo":
            # Names the missing ranks (on rank 0; the others time out waiting for rank 0's answer).
            dist.monitored_barrier(group=comm.group, timeout=timeout, wait_all_ranks=True)
        else:
            dist.barrier(group=comm.group, async_op=True).wait(timeout=timeout)
    except RuntimeError as error:
        raise RuntimeError(f"{hint}: {error}") from error
