"""ZeRO++ hpZ (``zero_optimization.zero_hpz_partition_size: k``): a secondary partition of the compute-dtype
parameters within groups of k ranks, so backward all-gathers never leave the group.

Model states stay sharded over the whole data-parallel world (16 Psi / N per rank). Each rank also keeps, for every
partitioned parameter, one k-th of its gathered (padded) data: the slice of its rank within its hpZ group (k
consecutive ranks, a node). Forward gathers from the primary shards over the world, as plain ZeRO-3 does; as each
such gather completes, this rank copies its slice of the result into its secondary shard (no extra collective).
Backward then gathers each parameter from the secondary shards within the hpZ group: the cross-group all-gather bytes
of a step go from 2 Psi (forward and backward) to Psi. Extra memory: 2 Psi / k in bf16/fp16 (``memory_stats()``'s
``params_secondary``).

[Note: gathers from the secondary]
A request's parameters are gathered from the secondary as the coalesced strategy gathers from the primary
(gather.py): one of at least ``DIRECT_GATHER_NUMEL`` elements, or alone in its run, straight into its storage; the
small ones in runs of up to ``bucket_numel`` elements, one collective a run into a staging buffer of ``[k, run]``
rows, each parameter's columns then copied into its ``[k, padded / k]`` storage by one ``split_with_sizes_copy`` a run
at ``wait()``. Each had one collective of its own before: a block's dozen small parameters (norms, biases) were a
dozen collectives of a fixed ~0.3 ms each on gloo. The bytes are the same, and so are the values (a copy).
With ``stage3_allgather_sequential`` every parameter is gathered on its own, as that key says.

[Note: when a secondary shard may be read]
A secondary shard is a copy of the parameter as the last primary gather saw it, so it is stale as soon as a shard
changes (the optimizer step, load_checkpoint, GatheredParameters(modifier_rank=...)). Every ``engine(...)`` forward
starts by forgetting all of them (``invalidate``), an edit in a modifier_rank block forgets those of the block's
parameters (``forget_secondaries``: a block inside a forward, between the forward's gather and backward's),
and a gather reads the secondary of a parameter only if a primary gather refreshed it since: in practice every
backward gather (and a second use within the forward, a reused block), while a parameter gathered for the first time
in the pass, or a refresh after the step, goes to the primary shards. Shards do not otherwise change between a
forward and its backward, so a refreshed secondary is exact: backward sees the same bits as forward (tested against
flat ZeRO-3, bitwise). Which group a gather uses depends only on what this pass did before it, the same on every
rank, so ranks issue the same collectives.
"""

from __future__ import annotations

import weakref

import torch

from .gather import DIRECT_GATHER_NUMEL, _all_gather, _runs
from .partition import ShardedParam, foreach_alloc_full, foreach_to_available, foreach_to_inflight

__all__ = ["HpzGather", "forget_secondaries"]


def forget_secondaries(params: list[ShardedParam]) -> None:
    """``params``' shards changed during a pass: their secondary copies are stale, so their next gathers go to the
    primary shards (see [Note: when a secondary shard may be read]). Called by every rank (a modifier_rank block's
    exit is collective), so every rank then issues the same gathers."""
    for hpz in list(HpzGather.live):
        for p in params:
            hpz.valid.discard(id(p))


class _SecondaryWork:
    """A request's gathers from the secondary shards (the GatherWork interface): see [Note: gathers from the
    secondary]."""

    def __init__(self, params: list[ShardedParam], accounting=None):
        self.params, self.accounting = params, accounting
        self.numel = sum(p.padded_numel for p in params)
        self.pending: list = []
        self.keep_alive: list = []  # the collectives' inputs, until wait() (streams.py's rule)
        self.runs: list = []  # (staging rows [k, run elements], the run's parameters)
        self.staged = 0  # bytes of the staging buffers
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        for handle in self.pending:
            handle.wait()
        for rows, run in self.runs:
            k = rows.shape[0]  # the secondary group's ranks
            sizes = [p.padded_numel // k for p in run]
            fulls = foreach_alloc_full(run)
            torch.split_with_sizes_copy(rows, sizes, dim=1, out=[full.view(k, n) for full, n in zip(fulls, sizes)])
        if self.staged and self.accounting is not None:
            self.accounting.add("comm_buffers", -self.staged)
        self.runs.clear()
        self.keep_alive.clear()
        foreach_to_available(self.params)
        self.done = True


class _ForwardWork:
    """A primary gather that refreshes the secondary shards of its parameters once it completes."""

    def __init__(self, inner: GatherWork, hpz: "HpzGather"):
        self.inner, self.hpz = inner, hpz
        self.params, self.numel = inner.params, inner.numel

    @property
    def done(self) -> bool:
        return self.inner.done

    def wait(self) -> None:
        if self.inner.done:
            return
        self.inner.wait()
        for p in self.params:
            self.hpz.refresh_from_full(p)


class _Works:
    """Several gathers issued together, waited together (secondary ones and primary ones of one request)."""

    def __init__(self, works: list):
        self.works = works
        self.params = [p for w in works for p in w.params]
        self.numel = sum(w.numel for w in works)

    @property
    def done(self) -> bool:
        return all(w.done for w in self.works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()


class HpzGather:
    """Wraps the engine's primary gatherer (over the world) with the secondary partition over ``hpz_comm``; an MoE
    expert parameter's secondary lies over its group's ``hpz_comm`` instead ([Note: hpZ of experts] in expert.py)."""

    live: "weakref.WeakSet[HpzGather]" = weakref.WeakSet()  # every engine's: for forget_secondaries

    def __init__(self, primary, hpz_comm, params: list[ShardedParam], accounting=None, streams=None,
                 bucket_numel: int = 0):
        """``bucket_numel``: the longest run of small parameters one collective gathers from the secondary (the
        prefetch bucket over the hpZ group, as the primary's); 0: every parameter on its own."""
        self.primary = primary
        self.comm = hpz_comm
        self.bucket_numel = int(bucket_numel)
        self.accounting = accounting
        self.streams = streams
        self.name = f"{primary.name} + hpZ secondary within {hpz_comm.world_size} ranks"
        self.secondary: dict[int, torch.Tensor] = {}
        self.comm_of: dict[int, object] = {}  # id(param) -> the group its secondary lies over
        self.valid: set[int] = set()
        for p in params:
            comm = hpz_comm if p.group is None else p.group.hpz_comm
            if p.is_persistent or comm is None:
                continue  # never released (always whole), or an expert gathered within its edp group anyway
            if p.padded_numel % comm.world_size:
                raise AssertionError(f"{p.fqn}: padded to {p.padded_numel} elements, not a multiple of the hpZ group "
                                     f"of {comm.world_size}")
            self.secondary[id(p)] = torch.empty(p.padded_numel // comm.world_size, dtype=p.dtype,
                                                device=p.compute_device)
            self.comm_of[id(p)] = comm
            if p.is_available:  # built whole (not under zero.Init): its slice now
                self.refresh_from_full(p)
        self.bytes = sum(t.numel() * t.element_size() for t in self.secondary.values())
        HpzGather.live.add(self)
        if accounting is not None:
            accounting.add("params_secondary", self.bytes)

    def invalidate(self) -> None:
        """A forward begins: see [Note: when a secondary shard may be read]."""
        self.valid.clear()

    def refresh_from_full(self, p: ShardedParam) -> None:
        secondary = self.secondary.get(id(p))
        if secondary is not None:
            n, rank = secondary.numel(), self.comm_of[id(p)].rank
            secondary.copy_(p.full[rank * n: (rank + 1) * n])
            self.valid.add(id(p))

    def issue(self, params: list[ShardedParam], name: str = "", refresh: bool = False):
        from_secondary = [] if refresh else [p for p in params if id(p) in self.valid]
        works = []
        if from_secondary:
            works.append(self._gather_secondary(from_secondary, name))
        rest = [p for p in params if id(p) not in self.valid] if from_secondary else list(params)
        if rest:
            works.append(_ForwardWork(self.primary.issue(rest, name=name, refresh=refresh), self))
        return works[0] if len(works) == 1 else _Works(works)

    def _gather_secondary(self, params: list[ShardedParam], name: str) -> _SecondaryWork:
        """See [Note: gathers from the secondary]: per secondary group (the world's hpZ group, an expert group's), in
        the order the request names them, the same on every rank."""
        work = _SecondaryWork(params, self.accounting)
        foreach_to_inflight(params)
        by_comm: dict[int, tuple] = {}
        for p in params:
            comm = self.comm_of[id(p)]
            by_comm.setdefault(id(comm), (comm, []))[1].append(p)
        for comm, group in by_comm.values():
            small, alone = [], []
            for p in group:
                coalesced = self.bucket_numel > 0 and p.padded_numel < DIRECT_GATHER_NUMEL and not p.gather_sequential
                (small if coalesced else alone).append(p)
            runs = _runs(small, self.bucket_numel)
            alone += [run[0] for run in runs if len(run) == 1]  # alone in its run: no staging either
            for p in alone:
                _all_gather(comm, self.streams, work, p.alloc_full(), self.secondary[id(p)], f"{name or p.fqn} (hpZ)")
            for run in runs:
                if len(run) == 1:
                    continue
                send = torch.cat([self.secondary[id(p)] for p in run])
                rows = torch.empty(comm.world_size, send.numel(), dtype=send.dtype, device=send.device)
                _all_gather(comm, self.streams, work, rows, send, f"{name or run[0].fqn} (hpZ, {len(run)} params)")
                work.runs.append((rows, run))
                work.staged += rows.numel() * rows.element_size()
        if work.staged and self.accounting is not None:
            self.accounting.add("comm_buffers", work.staged)
        return work
