"""All-gather strategies: turn a list of sharded parameters into full ones.

Both strategies issue asynchronous collectives and return a handle; ``wait()`` on the handle makes the parameters
AVAILABLE. Both write the result into each parameter's own ``full`` storage (see partition.py's note), so autograd's
saved views see the gathered values.

- ``CoalescedGather`` (default): one ``all_gather_into_tensor`` per bucket of up to ``bucket_numel`` elements into one
  flat buffer, then each parameter is copied out of it. Fewer, larger collectives; transient cost: the flat buffer
  plus the parameters being filled (about two bucket sizes).
- ``SequentialGather`` (``stage3_allgather_sequential``): one collective per parameter straight into that parameter's
  storage. More collectives, no copy, transient cost: nothing beyond the parameter itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .partition import ShardedParam

__all__ = ["GatherWork", "CoalescedGather", "SequentialGather", "make_gatherer"]


@dataclass
class GatherWork:
    """An issued gather: the parameters it covers and how to finish it."""

    params: list[ShardedParam]
    pending: list  # comm Pending handles, one per collective
    # [Note: coalesced gather buffer lifetime] the flat buffers live exactly from issue to wait(): they are dropped
    # as soon as every parameter has been copied out, so the transient peak is one bucket, not the whole step.
    flat: list[tuple[torch.Tensor, list[tuple[ShardedParam, int]]]] = field(default_factory=list)
    accounting: object = None  # MemoryAccounting: the flat buffers count as comm_buffers while they live
    done: bool = False

    @property
    def flat_bytes(self) -> int:
        return sum(out.numel() * out.element_size() for out, _ in self.flat)

    @property
    def numel(self) -> int:
        return sum(p.padded_numel for p in self.params)

    def wait(self) -> None:
        if self.done:
            return
        for handle in self.pending:
            handle.wait()
        for out, layout in self.flat:
            rows = out.view(-1, sum(p.shard_numel for p, _ in layout))  # [world, elements per rank]
            for p, offset in layout:
                p.alloc_full().view(rows.shape[0], p.shard_numel).copy_(rows[:, offset: offset + p.shard_numel])
        if self.accounting is not None:
            self.accounting.add("comm_buffers", -self.flat_bytes)
        self.flat.clear()
        for p in self.params:
            p.to_available()
        self.done = True


def _buckets(params: list[ShardedParam], bucket_numel: int) -> list[list[ShardedParam]]:
    """Consecutive runs of one dtype holding at most ``bucket_numel`` gathered elements (a larger param is alone)."""
    buckets: list[list[ShardedParam]] = []
    current: list[ShardedParam] = []
    size = 0
    for p in params:
        if current and (size + p.padded_numel > bucket_numel or p.dtype != current[0].dtype):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.padded_numel
    if current:
        buckets.append(current)
    return buckets


class CoalescedGather:
    name = "coalesced"

    def __init__(self, comm, bucket_numel: int, accounting=None):
        self.comm = comm
        self.bucket_numel = max(1, int(bucket_numel))
        self.accounting = accounting

    def issue(self, params: list[ShardedParam], name: str = "", refresh: bool = False) -> GatherWork:
        work = GatherWork(params=list(params), pending=[], accounting=self.accounting)
        for bucket in _buckets(params, self.bucket_numel):
            per_rank = sum(p.shard_numel for p in bucket)
            inp = torch.cat([p.shard for p in bucket]) if len(bucket) > 1 else bucket[0].shard
            out = torch.empty(per_rank * self.comm.world_size, dtype=inp.dtype, device=inp.device)
            for p in bucket:
                p.to_inflight(refresh)
            work.pending.append(self.comm.all_gather_into_tensor(out, inp, async_op=True, name=name))
            offsets, offset = [], 0
            for p in bucket:
                offsets.append((p, offset))
                offset += p.shard_numel
            work.flat.append((out, offsets))
        if self.accounting is not None:
            self.accounting.add("comm_buffers", work.flat_bytes)
        return work


class SequentialGather:
    name = "sequential"

    def __init__(self, comm):
        self.comm = comm

    def issue(self, params: list[ShardedParam], name: str = "", refresh: bool = False) -> GatherWork:
        work = GatherWork(params=list(params), pending=[])
        for p in params:
            p.to_inflight(refresh)
            work.pending.append(
                self.comm.all_gather_into_tensor(p.alloc_full(), p.shard, async_op=True, name=name or p.fqn))
        return work


def make_gatherer(comm, zero_config, accounting=None):
    if zero_config.allgather_sequential:
        return SequentialGather(comm)
    return CoalescedGather(comm, zero_config.prefetch_bucket_size, accounting)
