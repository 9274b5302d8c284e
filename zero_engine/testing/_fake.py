"""fake_world: a shape-only process group in this process, for world sizes far beyond the machine (up to 1024+)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist

from zero_engine.comm import Communicator


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[Communicator]:
    """Initialize torch's fake process group as ``rank`` of ``world_size`` in this process; destroy it on exit.

    Collectives on the fake backend return at once without exchanging data (an all-gather fills the output with
    copies of this rank's input), so this checks shapes, padding arithmetic, counters and call sequences at world
    sizes no machine could run -- never numerics. Yields a ``Communicator`` on the fake world group.
    """
    if dist.is_initialized():
        raise RuntimeError(
            f"fake_world({world_size}) needs this process to have no process group, but one is initialized "
            f"(backend {dist.get_backend()}, world size {dist.get_world_size()}); destroy it first "
            "(torch.distributed.destroy_process_group()) or run the shape-only test outside run_ranks"
        )
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"fake_world: rank={rank} must be in 0..world_size-1 (world_size={world_size})")
    # A private torch module, imported only here so that a torch without it fails only the shape-only tests.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield Communicator()
    finally:
        dist.destroy_process_group()
