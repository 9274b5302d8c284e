"""NVMe offload of the optimizer (ZeRO-Infinity): fp32 masters and optimizer states live in per-rank files and
the step streams them, one sub-group at a time, through a few host buffers.

What is swapped. Per sub-group (``zero_optimization.sub_group_size`` elements of consecutive shards, the unit the
partitioned optimizer already steps over; see [Note: sub-groups] in zero/optimizer.py): the fp32 master shards when
they are separate tensors, and every optimizer state tensor shaped like a master (Adam's ``exp_avg`` and
``exp_avg_sq``, SGD's ``momentum_buffer``). In fp32 training on a CPU the master IS the compute shard (the tensor the
model's forward gathers from), so it stays in memory and only the moments swap: 8 bytes per parameter on disk
instead of 12. Scalar state (Adam's ``step``) stays in memory. The 16-bit compute shards never swap here (that is
``offload_param``).

[Note: the swap pipeline]
A sub-group is *in* when its tensors are views of one host buffer (``[master | state 1 | state 2]``, each region
the sub-group's numel) and *out* when they are 0-element placeholders and its values are in the files. The step::

    read(0)
    for i in sub-groups:    wait read(i); point the tensors at its buffer
                            if pipeline_read: read(i + 1) into another buffer        (overlaps the update of i)
                            update i (CPUAdam over the sub-group)
                            write(i) from its buffer; placeholders back               (overlaps i + 1 when
                            if not pipeline_write: wait write(i)                       pipeline_write)
    wait every write

Buffers come from a pool of ``buffer_count`` (allocated on first use, O_DIRECT-aligned through the store; pinned
when ``pin_memory`` and an accelerator is there). A read that finds no free buffer waits for the oldest write in
flight and takes its buffer: with 1 buffer everything is sequential, with 2 the next read overlaps the update, with 3
and both pipelines the read of ``i + 1``, the update of ``i`` and the write of ``i - 1`` all overlap (DeepSpeed's
pipelined swapper). The step ends with every write waited, so the files are whole between steps (checkpoints and a
crash between steps find complete states), and the host holds at most ``buffer_count`` sub-groups' states.

The knobs of ``offload_optimizer``: ``buffer_count`` (as above; at least 1), ``pipeline_read`` / ``pipeline_write``
(as above; pipeline_read needs buffer_count >= 2 -- with one buffer, which holds the sub-group being updated,
reads are sequential), ``pin_memory`` (pinned pool buffers on CUDA; nothing to pin on a CPU-only machine),
``nvme_path`` (the store's directory), ``fast_init``: no effect -- optimizer states are created by the first step and written then,
so start-up never writes zero moments (DeepSpeed's fast_init skips exactly that); only 16-bit training writes the
fp32 masters once at start-up.

States created by the optimizer's first step (or replaced by ``load_state_dict``) are separate tensors; the next
swap-out copies them into the sub-group's buffer once and from then on they are views of it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import torch

from .._profiling import profile_range

__all__ = ["OptimizerSwapper"]

log = logging.getLogger("zero_engine.offload")

_MASTER = "master"
_ALIGN_ELEMENTS = 4096 // 4  # fp32 elements per 4 KiB


@dataclass
class _SubGroup:
    index: int
    params: list  # ShardedParam
    masters: list  # nn.Parameter (the optimizer's keys), one per param
    numel: int
    swap_masters: bool  # 16-bit training (or a separate host copy): the fp32 masters swap too
    on_disk: list[str] = field(default_factory=list)  # slots written: "master", then state keys
    buffer: torch.Tensor | None = None  # while in: the host buffer its tensors are views of

    @property
    def stride(self) -> int:
        """Elements per slot in a buffer and per file: numel rounded up to 4 KiB, so that every region starts and
        ends on an O_DIRECT boundary of an aligned buffer (the tail is never read as data)."""
        return -(-self.numel // _ALIGN_ELEMENTS) * _ALIGN_ELEMENTS

    def key(self, slot: str) -> str:
        return f"subgroup{self.index}.{slot}"


class _Pending:
    """A write in flight: its handles and the buffer it reads from (returned to the pool once waited)."""

    def __init__(self, handles: list, buffer: torch.Tensor):
        self.handles = handles
        self.buffer = buffer

    def wait(self, stats: dict) -> torch.Tensor:
        waited = time.perf_counter()
        for handle in self.handles:
            handle.wait()
        stats["io_wait_seconds"] += time.perf_counter() - waited
        return self.buffer


class OptimizerSwapper:
    """Keeps masters and optimizer states of ``sub_groups`` in ``store`` and streams them through the step."""

    def __init__(self, sub_groups: list[list], masters: dict, optimizer: torch.optim.Optimizer, store, *,
                 buffer_count: int, pipeline_read: bool, pipeline_write: bool, pin_memory: bool = False):
        if buffer_count < 1:
            raise ValueError(f"offload_optimizer.buffer_count={buffer_count}: NVMe offload streams the optimizer "
                             "states through at least 1 host buffer; set buffer_count >= 1 (4 is DeepSpeed's "
                             "default)")
        self.optimizer = optimizer
        self.store = store
        self.buffer_count = buffer_count
        self.pipeline_read = pipeline_read
        self.pipeline_write = pipeline_write
        self.pin_memory = pin_memory
        self.groups = [_SubGroup(i, list(g), [masters[id(sp.param)] for sp in g], sum(sp.shard_numel for sp in g),
                                 swap_masters=any(not sp.master_is_shard for sp in g))
                       for i, g in enumerate(sub_groups)]
        self._free: list[torch.Tensor] = []
        self._allocated = 0  # pool buffers that exist (free, holding a sub-group, or under a write)
        self._writes: list[_Pending] = []
        self._all_in_depth = 0  # all_in() blocks entered
        # cumulative over run(): bytes through the store, the step's wall time, and the part of it spent waiting
        # for I/O (what the pipeline did not hide); bench/offload.py turns them into achieved bandwidth
        self.io_stats = {"read_bytes": 0, "write_bytes": 0, "step_seconds": 0.0, "io_wait_seconds": 0.0}
        self._empty = torch.empty(0, dtype=torch.float32)
        with profile_range("zero3::nvme_swap initial masters"):
            for group in self.groups:  # 16-bit: the fp32 masters made at initialize go to disk now
                if group.swap_masters:
                    group.buffer = self._acquire(group, needed=group.stride)
                    self._swap_out(group)
            self._trim()

    # ---- the step ----------------------------------------------------------------------------------------------
    def run(self, update) -> None:
        """``update(params)`` for every sub-group in order, each swapped in around it ([Note: the swap pipeline])."""
        started = time.perf_counter()
        reads: dict[int, list] = {}
        n = len(self.groups)
        for i, group in enumerate(self.groups):
            if i not in reads:
                reads[i] = self._start_read(group)
            self._finish_read(group, reads.pop(i))
            if self.pipeline_read and i + 1 < n and self._can_acquire():  # never with 1 buffer: it holds i
                reads[i + 1] = self._start_read(self.groups[i + 1])
            with profile_range(f"zero3::optimizer_step subgroup {i}"):
                update(group.params)
            self._swap_out(group)
            if not self.pipeline_write:
                self._wait_writes()
        self._trim()
        self.io_stats["step_seconds"] += time.perf_counter() - started

    @contextlib.contextmanager
    def all_in(self):
        """Every sub-group in memory for the block (checkpoint save and load), written back and freed after.

        Needs host memory for this rank's whole optimizer states for the length of the block. Re-entrant: an inner
        block (a safe_get_* helper inside GatheredParameters) finds everything in already."""
        if self._all_in_depth:
            self._all_in_depth += 1
            try:
                yield
            finally:
                self._all_in_depth -= 1
            return
        self._all_in_depth = 1
        reads = [(g, self._start_read(g, extra=True)) for g in self.groups]
        for group, handles in reads:
            self._finish_read(group, handles)
        try:
            yield
        finally:
            self._all_in_depth = 0
            for group in self.groups:
                self._swap_out(group)
            self._trim()  # buffers borrowed beyond the pool go back to the allocator

    def close(self) -> None:
        try:
            self._wait_writes()
        finally:
            self._free.clear()
            self.store.close()

    # ---- sizes -------------------------------------------------------------------------------------------------
    @property
    def state_bytes(self) -> int:
        """Optimizer states of this rank, wherever they are now (their size on disk between steps)."""
        return sum(4 * g.numel * len([s for s in g.on_disk if s != _MASTER]) for g in self.groups)

    @property
    def buffer_bytes(self) -> int:
        """Host memory of the swap buffers that exist now."""
        held = [g.buffer for g in self.groups if g.buffer is not None]
        return sum(b.numel() * b.element_size() for b in self._free + held + [p.buffer for p in self._writes])

    # ---- in and out --------------------------------------------------------------------------------------------
    def _slots_in_memory(self, group: _SubGroup) -> list[str]:
        """What group's tensors hold now: the master (when it swaps) and the optimizer's state tensors."""
        keys = {k for m in group.masters for k, v in self.optimizer.state.get(m, {}).items()
                if isinstance(v, torch.Tensor) and v.dim() > 0}
        return ([_MASTER] if group.swap_masters else []) + sorted(keys)

    def _tensors(self, group: _SubGroup, slot: str) -> list[tuple[int, torch.Tensor | None]]:
        out, offset = [], 0
        for sp, master in zip(group.params, group.masters):
            value = master.data if slot == _MASTER else self.optimizer.state.get(master, {}).get(slot)
            out.append((offset, value))
            offset += sp.shard_numel
        return out

    def _start_read(self, group: _SubGroup, extra: bool = False) -> list:
        if group.buffer is not None:
            raise AssertionError(f"optimizer sub-group {group.index} swapped in twice")
        group.buffer = self._acquire(group, needed=group.stride * max(1, len(group.on_disk)), extra=extra)
        self.io_stats["read_bytes"] += 4 * group.stride * len(group.on_disk)
        return [self.store.read(group.key(slot), self._region(group, i, padded=True))
                for i, slot in enumerate(group.on_disk)]

    def _finish_read(self, group: _SubGroup, handles: list) -> None:
        waited = time.perf_counter()
        for handle in handles:
            handle.wait()
        self.io_stats["io_wait_seconds"] += time.perf_counter() - waited
        for i, slot in enumerate(group.on_disk):
            self._point(group, slot, self._region(group, i))

    def _swap_out(self, group: _SubGroup) -> None:
        """Copy whatever is not yet a view of the buffer into it, write every slot, leave placeholders."""
        slots = self._slots_in_memory(group)
        needed = group.stride * max(1, len(slots))
        grown = group.buffer.numel() < needed
        if grown:  # the first step created the states: a larger buffer replaces this one from now on
            group.buffer = self._acquire(group, needed=needed, extra=True)
        handles = []
        for i, slot in enumerate(slots):
            region = self._region(group, i)
            for (offset, value), sp in zip(self._tensors(group, slot), group.params):
                if value is None or value.numel() != sp.shard_numel:
                    raise AssertionError(f"optimizer swap: {sp.fqn} has no {slot!r} of {sp.shard_numel} elements "
                                         f"while other parameters of its sub-group {group.index} have one")
                view = region[offset: offset + sp.shard_numel]
                if value.data_ptr() != view.data_ptr():
                    view.copy_(value.reshape(-1))
            handles.append(self.store.write(group.key(slot), self._region(group, i, padded=True)))
        if grown:  # the smaller buffer (its master copied above) is dropped, not pooled: were it kept, the next
            self._allocated -= 1  # sub-group's read could take it and grow too, every sub-group's states at once
        group.on_disk = slots
        self.io_stats["write_bytes"] += 4 * group.stride * len(slots)
        for slot in slots:
            self._point(group, slot, None)
        self._writes.append(_Pending(handles, group.buffer))
        group.buffer = None

    def _point(self, group: _SubGroup, slot: str, region: torch.Tensor | None) -> None:
        """Make the group's tensors of ``slot`` views of ``region`` (None: 0-element placeholders)."""
        offset = 0
        for sp, master in zip(group.params, group.masters):
            view = self._empty if region is None else region[offset: offset + sp.shard_numel]
            if slot == _MASTER:
                master.data = view
                sp.master = master.data
            else:
                self.optimizer.state[master][slot] = view
            offset += sp.shard_numel

    def _region(self, group: _SubGroup, i: int, padded: bool = False) -> torch.Tensor:
        start = i * group.stride
        return group.buffer[start: start + (group.stride if padded else group.numel)]

    # ---- the buffer pool ---------------------------------------------------------------------------------------
    def _acquire(self, group: _SubGroup, needed: int, extra: bool = False) -> torch.Tensor:
        """A free buffer of at least ``needed`` elements; waits for the oldest write when the pool is used up
        (``extra``: allocate beyond the pool instead, for all_in and a buffer that has to grow)."""
        while True:
            for i, buffer in enumerate(self._free):
                if buffer.numel() >= needed:
                    return self._free.pop(i)
            if self._allocated < self.buffer_count or extra:
                self._allocated += 1
                return self._new_buffer(needed)
            if self._free:  # only too small ones (the states appeared): drop one, allocate a larger one
                self._free.pop(0)
                self._allocated -= 1
                continue
            if not self._writes:
                raise AssertionError(f"optimizer swap: no free buffer for sub-group {group.index} and no write in "
                                     f"flight ({self.buffer_count} buffers all hold sub-groups)")
            self._free.append(self._writes.pop(0).wait(self.io_stats))

    def _can_acquire(self) -> bool:
        return bool(self._free or self._writes) or self._allocated < self.buffer_count

    def _new_buffer(self, numel: int) -> torch.Tensor:
        # Whole multiples of the largest sub-group, so that buffers are interchangeable between sub-groups.
        largest = max(g.stride for g in self.groups)
        numel = -(-numel // largest) * largest
        if self.pin_memory:  # cudaHostAlloc memory is page-aligned, as O_DIRECT needs
            return torch.empty(numel, dtype=torch.float32, pin_memory=True)
        return self.store.aligned_empty(numel, torch.float32)

    def _trim(self) -> None:
        """Nothing held: keep the ``buffer_count`` largest free buffers, give the others back."""
        self._wait_writes()
        self._free.sort(key=lambda b: b.numel(), reverse=True)
        del self._free[self.buffer_count:]
        self._allocated = len(self._free)

    def _wait_writes(self) -> None:
        while self._writes:
            self._free.append(self._writes.pop(0).wait(self.io_stats))


def make_swapper(zero_optimizer, offload, placement, rank: int, aio=None) -> OptimizerSwapper:
    """The swapper of a ZeroOptimizer under ``offload_optimizer: {device: nvme}``: its NvmeStore (per run and rank,
    under ``nvme_path``; see offload/nvme.py) and the pool of ``buffer_count`` buffers."""
    from .nvme import NvmeStore, store_options

    if not offload.nvme_path:
        raise ValueError('zero_optimization.offload_optimizer: device "nvme" needs nvme_path, a directory on the '
                         'NVMe drive (e.g. "/local_nvme")')
    store = NvmeStore(offload.nvme_path, rank=rank, purpose="optimizer", **(store_options(aio) if aio is not None else {}))
    try:
        swapper = OptimizerSwapper(zero_optimizer.sub_groups, zero_optimizer.masters, zero_optimizer.optimizer,
                                   store, buffer_count=offload.buffer_count, pipeline_read=offload.pipeline_read,
                                   pipeline_write=offload.pipeline_write, pin_memory=placement.pins)
    except BaseException:
        store.close()  # nobody else holds the store yet: its directory goes now, not at exit
        raise
    if rank == 0:
        log.info("zero_engine: optimizer states on nvme (%s): %d sub-group(s) of up to %d elements, %d buffer(s), "
                 "pipeline_read=%s, pipeline_write=%s%s", offload.nvme_path, len(swapper.groups),
                 max((g.numel for g in swapper.groups), default=0), offload.buffer_count, offload.pipeline_read,
                 offload.pipeline_write,
                 "" if any(g.swap_masters for g in swapper.groups) else
                 " (fp32 training: the masters are the compute shards, only the moments swap)")
    return swapper
