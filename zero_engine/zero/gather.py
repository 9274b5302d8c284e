"""All-gather strategies: turn a list of sharded parameters into full ones.

Both strategies issue asynchronous collectives and return a handle; ``wait()`` on the handle makes the parameters
AVAILABLE. Both write the result into each parameter's own ``full`` storage (see partition.py's notes), so autograd's
saved views see the gathered values.

- ``CoalescedGather`` (default): a parameter of at least ``DIRECT_GATHER_NUMEL`` elements is gathered by its own
  collective straight into its storage (no copy; on NCCL the large ones of a request in one group: [Note: large
  parameters gathered as one group]); the small ones of a request are coalesced into one collective per
  ``bucket_numel`` elements through a staging buffer and copied out (see [Note: flat shard storage]). The engine's
  coordinator asks for whole prefetch buckets at a time; transient cost beyond the parameters themselves: the small
  parameters' staging buffer.
- ``SequentialGather`` (``stage3_allgather_sequential``): one collective per parameter straight into that parameter's
  storage, and the coordinator prefetches one parameter ahead: the working set is the parameters in use plus one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import logging

from .partition import (DIRECT_GATHER_NUMEL, ShardBucket, ShardedParam, foreach_alloc_full, foreach_to_available,
                        foreach_to_inflight)

log = logging.getLogger("zero_engine.gather")

__all__ = ["GatherWork", "CoalescedGather", "SequentialGather", "make_gatherer", "choose_sequential_buckets"]


@dataclass
class GatherWork:
    """An issued gather: the parameters it covers and how to finish it."""

    params: list[ShardedParam]
    pending: list  # comm Pending handles, one per collective
    # [Note: coalesced gather buffer lifetime] the staging buffers of small parameters live exactly from issue to
    # wait(): they are dropped as soon as every parameter has been copied out, so the transient peak is one run of
    # small parameters, never a whole bucket of large ones (those are gathered in place). Each entry: the staging
    # buffer, the run's parameters, and, for a gather that left this rank's row out, (this rank, its shards).
    flat: list[tuple[torch.Tensor, list[ShardedParam], tuple[int, torch.Tensor] | None]] = \
        field(default_factory=list)
    accounting: object = None  # MemoryAccounting: the staging buffers count as comm_buffers while they live
    numel: int = 0  # gathered elements this work makes live
    done: bool = False
    # Every input a collective reads, until wait(): on CUDA a side stream reads it, and streams.py's rule is that the
    # caller holds such a buffer until the compute stream waited (a cat's output would otherwise be freed at once).
    keep_alive: list = field(default_factory=list)

    def wait(self) -> None:
        if self.done:
            return
        for handle in self.pending:
            handle.wait()
        staged = 0  # bytes of the staging buffers
        for out, layout, own in self.flat:
            staged += out.numel() * out.element_size()
            # One copy-out kernel per staged run (as FSDP2's): the [world, elements per rank] rows split by columns,
            # each column block written into its parameter's own storage, viewed [world, shard_numel].
            sizes = [p.shard_numel for p in layout]
            foreach_alloc_full(layout)
            if own is None:
                torch.split_with_sizes_copy(out.view(-1, sum(sizes)), sizes, dim=1,
                                            out=[p.full_rows for p in layout])
            else:
                _copy_out_around(out, own, layout, sizes)
        if staged and self.accounting is not None:
            self.accounting.add("comm_buffers", -staged)
        self.flat.clear()
        self.keep_alive.clear()
        foreach_to_available(self.params)
        self.done = True


def _copy_out_around(peers: torch.Tensor, own: tuple[int, torch.Tensor], layout: list[ShardedParam],
                     sizes: list[int]) -> None:
    """[Note: a gather that leaves this rank's row out]
    Where an all-gather runs as an all-to-all (gloo, CPU tensors), the staging buffer need not hold this rank's
    row: it is the run's shards, which the copy-out reads where they lie. So the collective receives only the other
    ranks' rows (``Communicator.all_gather_peers``): a buffer (world - 1) / world the size, no copy of this rank's
    shards into it, and nothing sent to itself. The copy-out then writes each parameter's rows from up to three
    places: the peers' rows before this rank's, its own shards, the peers' rows after. The same bytes land in the
    same places as from a full buffer."""
    rank, shards = own
    rows = peers.view(-1, sum(sizes))
    before, mine, after = zip(*[p.rows_around(rank) for p in layout])
    torch.split_with_sizes_copy(shards, sizes, out=list(mine))
    if rank > 0:
        torch.split_with_sizes_copy(rows[:rank], sizes, dim=1, out=list(before))
    if rank < rows.shape[0]:
        torch.split_with_sizes_copy(rows[rank:], sizes, dim=1, out=list(after))


def _runs(params: list[ShardedParam], run_numel: int) -> list[list[ShardedParam]]:
    """Groups of one dtype holding at most ``run_numel`` gathered elements each (order kept within a dtype)."""
    runs: list[list[ShardedParam]] = []
    current: list[ShardedParam] = []
    size = 0
    for p in params:
        if current and (size + p.padded_numel > run_numel or p.dtype != current[0].dtype):
            runs.append(current)
            current, size = [], 0
        current.append(p)
        size += p.padded_numel
    if current:
        runs.append(current)
    return runs


def _all_gather(comm, streams, work: GatherWork, out: torch.Tensor, inp: torch.Tensor, name: str,
                peers_only: bool = False) -> None:
    """Issue one all-gather into ``work``, on the all-gather stream on CUDA (see [Note: streams, events and buffer
    lifetime]: ``out`` was allocated on the compute stream before this call, ``work`` holds ``inp`` until its
    ``wait()``, which orders the readers of ``out``). ``peers_only``: ``out`` gets the other ranks' rows only ([Note:
    a gather that leaves this rank's row out]; CPU tensors, so no side stream)."""
    work.keep_alive.append(inp)
    if peers_only:
        work.pending.append(comm.all_gather_peers(out, inp, async_op=True, name=name))
        return
    if streams is None or streams.all_gather is None:  # not CUDA: no side stream (streams.collective_on's no-op)
        work.pending.append(comm.all_gather_into_tensor(out, inp, async_op=True, name=name))
        return
    work.pending.append(streams.collective_on(
        streams.all_gather, lambda: comm.all_gather_into_tensor(out, inp, async_op=True, name=name)))


def _gather_direct(comm, work: GatherWork, p: ShardedParam, name: str, streams=None) -> None:
    _all_gather(comm, streams, work, p.alloc_full(), p.shard, name or p.fqn)


def _gather_direct_grouped(comm, work: GatherWork, params: list[ShardedParam], name: str, streams=None) -> None:
    """Each of ``params`` gathered straight into its storage, as ``_gather_direct``, in one call of the backend: see
    [Note: large parameters gathered as one group]."""
    outputs = [p.alloc_full() for p in params]
    inputs = [p.shard for p in params]
    work.keep_alive.extend(inputs)
    if streams is None or streams.all_gather is None:
        work.pending.append(comm.all_gather_grouped(outputs, inputs, async_op=True, name=name))
        return
    work.pending.append(streams.collective_on(
        streams.all_gather, lambda: comm.all_gather_grouped(outputs, inputs, async_op=True, name=name)))


class CoalescedGather:
    """[Note: large parameters gathered as one group]
    A parameter of at least ``DIRECT_GATHER_NUMEL`` elements is all-gathered straight into its own storage (no
    staging, no copy-out: [Note: flat shard storage] in partition.py), one collective each. Where the backend runs a
    group of collectives as one call (NCCL: ``Communicator.groups_all_gathers``), the large parameters of one request
    (a unit, or a prefetch of several) go out as one group instead: one launch, as FSDP2's one all-gather per group,
    still without its copy-out. The compiled 1.1B step of bench/gpu_check.py issued 127 all-gathers a step, one per
    weight matrix, where FSDP2 issues 21. On gloo a group is its collectives run one by one, and measured slower than
    separate ones from 512k elements up (bench/gather_probe.py, world 2, 4 parameters of 1M elements: 13.3 ms against
    10.2), so there they stay separate.
    ``group_large`` overrides the backend's answer (tests run the grouped path on gloo)."""

    name = "coalesced"

    def __init__(self, comm, bucket_numel: int, accounting=None, streams=None, group_large: bool | None = None):
        self.comm = comm
        self.bucket_numel = max(1, int(bucket_numel))
        self.accounting = accounting
        self.streams = streams  # CommStreams on CUDA (None: issue on the current stream)
        self.group_large = getattr(comm, "groups_all_gathers", False) if group_large is None else group_large
        # a Communicator's (not MiCS's two-step gather): [Note: a gather that leaves this rank's row out]
        self.gathers_peers_only = getattr(comm, "gathers_peers_only", None)

    def issue(self, params: list[ShardedParam], name: str = "", refresh: bool = False) -> GatherWork:
        work = GatherWork(params=list(params), pending=[], accounting=self.accounting)
        foreach_to_inflight(params, refresh)
        small, large = [], []
        for p in params:
            work.numel += p.padded_numel
            if p.padded_numel < DIRECT_GATHER_NUMEL:
                small.append(p)
            elif self.group_large:
                large.append(p)
            else:
                _gather_direct(self.comm, work, p, name, self.streams)
        if len(large) == 1:
            _gather_direct(self.comm, work, large[0], name, self.streams)
        elif large:  # one dtype per group: a collective's records carry one
            for run in _runs(large, sum(p.padded_numel for p in large)):
                _gather_direct_grouped(self.comm, work, run, name, self.streams)
        staged = 0  # bytes of the staging buffers
        for run in _runs(small, self.bucket_numel):
            if len(run) == 1:  # alone, it needs no staging either
                _gather_direct(self.comm, work, run[0], name, self.streams)
                continue
            inp = run[0].bucket.run_view(run) if run[0].bucket is not None else None
            if inp is None:
                inp = torch.cat([p.shard for p in run])
            peers_only = self.gathers_peers_only is not None and self.gathers_peers_only(inp)
            rows = self.comm.world_size - 1 if peers_only else self.comm.world_size
            out = torch.empty(inp.numel() * rows, dtype=inp.dtype, device=inp.device)
            _all_gather(self.comm, self.streams, work, out, inp, name, peers_only)
            # the run's shards lie back to back in each rank's row
            work.flat.append((out, run, (self.comm.rank, inp) if peers_only else None))
            staged += out.numel() * out.element_size()
        if staged and self.accounting is not None:
            self.accounting.add("comm_buffers", staged)
        return work


class SequentialGather:
    name = "sequential"

    def __init__(self, comm, streams=None):
        self.comm = comm
        self.streams = streams

    def issue(self, params: list[ShardedParam], name: str = "", refresh: bool = False) -> GatherWork:
        work = GatherWork(params=list(params), pending=[], numel=sum([p.padded_numel for p in params]))
        foreach_to_inflight(params, refresh)
        for p in params:
            _gather_direct(self.comm, work, p, name, self.streams)
        return work


def make_gatherer(comm, zero_config, accounting=None, streams=None):
    if zero_config.allgather_sequential is True:
        return SequentialGather(comm, streams)
    return CoalescedGather(comm, zero_config.prefetch_bucket_size, accounting, streams)


def choose_sequential_buckets(buckets: list[ShardBucket], headroom_bytes: int, states_to_come: int, comm,
                              source: str = "") -> list[ShardBucket]:
    """``stage3_allgather_sequential: "auto"``: mark the buckets that must be gathered one parameter at a time.

    [Note: auto gather strategy]
    Decided once, at initialize, per shard bucket (fixed: see [Note: flat shard storage]). The budget is this
    rank's headroom (memory_budget) minus the model states still to come (gradient shards, optimizer states,
    fp32 masters: allocated at the first backward and step). Gathering a bucket coalesced can hold it twice (the
    prefetched bucket while the previous one is in use); sequentially it holds its largest parameter beside the
    module running. A bucket whose coalesced cost does not fit in what is left is gathered sequentially (its
    parameters are prefetched one at a time, alone), the others coalesced. Every rank must issue the same
    collectives, so the smallest headroom over the ranks decides (one all-reduce). Logged once, on rank 0.
    """
    left = torch.tensor([float(headroom_bytes - states_to_come)], dtype=torch.float64,  # on the compute device:
                        device=buckets[0].params[0].compute_device if buckets else "cpu")  # host shards, NCCL
    if comm.world_size > 1:
        comm.all_reduce(left, op="min", name="auto gather budget")
    left = float(left.item())
    chosen = []
    for bucket in buckets:
        coalesced = 2 * sum(p.full_bytes for p in bucket.params if not p.is_persistent)
        if coalesced > left:
            chosen.append(bucket)
            for p in bucket.params:
                p.gather_sequential = True
    if comm.rank == 0:
        if chosen:
            log.info("stage3_allgather_sequential=auto: %.1f MiB left after model states (%s); %d of %d buckets "
                     "gathered sequentially (coalesced they would need up to %.1f MiB), the rest coalesced",
                     left / 2**20, source, len(chosen), len(buckets),
                     max(2 * sum(p.full_bytes for p in b.params) for b in chosen) / 2**20)
        else:
            log.info("stage3_allgather_sequential=auto: %.1f MiB left after model states (%s); every bucket "
                     "gathered coalesced", left / 2**20, source)
    return chosen
