"""fake_world: a shape-only process group in this process, for world sizes far beyond the machine (up to 1024+)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from zero_engine.comm import Communicator, _backend


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[Communicator]:
    """Initialize torch's fake process group as ``rank`` of ``world_size`` in this process; destroy it on exit.

    Collectives on the fake backend return at once without exchanging data (an all-gather fills the output with
    copies of this rank's input), so this checks shapes, padding arithmetic, counters and call sequences at world
    sizes no machine could run -- never numerics. Yields a ``Communicator`` on the fake world group.

    A reduce-scatter writes this rank's slice of its input, as if every rank had sent the same. torch's fake group
    leaves the output as it was: uninitialized memory, which on a GPU holds non-finite values (fp32 leftovers read as
    bf16), so every step was skipped as non-finite and a peak measured there missed the optimizer's states (the
    second GPU run, 2026-11-27: 8 bytes of model states per parameter instead of 16).

    On CUDA, the wait of an all-gather or a reduce-scatter orders the waiting stream after the stream that issued it,
    as NCCL's does (see _StreamOrderedWork). torch's fake work returns at once, so a consumer on the compute stream
    could read the output before a side stream's copy wrote it: 1 step in 3 was still skipped on an H100 (the
    third GPU run).
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
    real_gather, real_scatter = _backend._all_gather_single, _backend._reduce_scatter_single

    def all_gather_ordered(output, input, group=None, **kwargs):
        return _StreamOrderedWork.of(real_gather(output, input, group=group, **kwargs), output)

    def reduce_scatter_own_slice(output, input, group=None, **kwargs):
        work = real_scatter(output, input, group=group, **kwargs)
        output.view(-1).copy_(input.reshape(-1, output.numel())[dist.get_rank(group)])  # this rank in the group
        return _StreamOrderedWork.of(work, output)

    _backend._all_gather_single, _backend._reduce_scatter_single = all_gather_ordered, reduce_scatter_own_slice
    try:
        yield Communicator()
    finally:
        _backend._all_gather_single, _backend._reduce_scatter_single = real_gather, real_scatter
        dist.destroy_process_group()


class _StreamOrderedWork:
    """A fake collective's work whose ``wait()`` makes the current CUDA stream wait for the stream that issued it (an
    event recorded there after the output was written), without the host waiting: what NCCL's ``work.wait()`` does,
    and what the engine's consumers rely on ([Note: streams, events and buffer lifetime] in zero/streams.py)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.event = torch.cuda.current_stream(device).record_event()

    @classmethod
    def of(cls, work, output: torch.Tensor):
        if work is None or not output.is_cuda:  # synchronous, or no streams to order
            return work
        return cls(output.device)  # the fake work itself holds nothing and its wait() does nothing

    def wait(self, timeout=None) -> bool:
        torch.cuda.current_stream(self.device).wait_event(self.event)
        return True
