"""NVMe offload of the stage-3 compute shards (ZeRO-Infinity's parameter offload): ``offload_param: {device: nvme}``.

The unit swapped is a *shard bucket* (``ShardBucket``, see [Note: flat shard storage] in zero/partition.py): the
flat buffer every ``ShardedParam.shard`` of consecutive parameters is a view of. Under parameter offload buckets are
capped at ``offload_param.buffer_size`` elements, so that a bucket is a few modules' shards, not the whole model.

[Note: a swapped-out bucket keeps its tensors]
A bucket is *out* when its buffer's storage is resized to zero bytes and its values are in its file; *in* when the
storage has its bytes again and holds the file's values. Resizing the storage (as ``ShardedParam.release`` does for
the full data) keeps every tensor that aliases the bucket valid across a swap: the shard views, the fp32 master
that IS the shard in fp32 training, the 16-bit copy CPUAdam writes in bf16 training. None of them is re-pointed;
they see the new bytes after the next swap-in. Reading a view of an *out* bucket would touch freed memory, so every
reader goes through this swapper first: the gathers (``SwapInGather`` wraps the engine's gatherer), the optimizer's
sub-group updates (``around_update``), and everything that runs inside ``ZeroOptimizer.states_in_memory()``
(checkpoints, GatheredParameters' edits, zero_engine.utils) (``all_in``). Buckets are read and written as they are:
the storage of a resized buffer is not 4096-byte aligned, so the store's O_DIRECT path goes through its per-thread
bounce buffer (one extra memory copy per chunk).

[Note: parameter read-ahead]
On the first training step (the coordinator records its trace) buckets are read on demand, just before the
all-gather that needs them. From the next step on, at every module fetch the swapper looks at the coordinator's
trace from the next module on and reads ahead the buckets the upcoming gathers will need, in order of use: at most
``buffer_count`` buckets and at most ``max_in_cpu`` elements in memory together (buckets in use included). A bucket
is given back (storage freed; no write: its file is still current) as soon as no gather in flight reads it and it is
not in the read-ahead window. A gather that needs a bucket over those limits still gets it (a module's shards must
be in memory for its all-gather): the limits only bound read-ahead, and this is logged once.

The step. The optimizer updates the shards sub-group by sub-group: before each sub-group the buckets it touches are
read in (evicting, written back, the buckets of earlier sub-groups beyond the limits); after the step every updated
bucket is written back, waited, and freed, so between steps the files are whole and a rank holds no shard bytes.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from .._profiling import profile_range
from ..zero.partition import ParamStatus, ShardBucket, ShardedParam
from .nvme import NvmeStore, store_options

__all__ = ["ParamSwapper", "SwapInGather"]

log = logging.getLogger("zero_engine.offload")


class _Slot:
    """One shard bucket's swap state."""

    __slots__ = ("bucket", "key", "nbytes", "read", "write", "resident", "dirty", "holds", "has_persistent")

    def __init__(self, bucket: ShardBucket):
        self.bucket = bucket
        self.key = f"bucket{bucket.index}"
        self.nbytes = bucket.numel * bucket.flat.element_size()
        self.read = None  # IoHandle of a read in flight
        self.write = None  # IoHandle of a write in flight (the bucket must not change nor be freed until it ends)
        self.resident = True  # the storage has its bytes (read done or in flight)
        self.dirty = True  # memory is newer than the file (at start: nothing written yet)
        self.holds = 0  # callers that need it in memory now (a sub-group update, all_in, GatheredParameters)
        self.has_persistent = any(p.is_persistent for p in bucket.params)  # re-gathered after each step

    @property
    def numel(self) -> int:
        return self.bucket.numel

    def in_use(self) -> bool:
        return self.holds > 0 or any(p.status is ParamStatus.INFLIGHT for p in self.bucket.params)


class ParamSwapper:
    """Keeps the stage-3 shard buckets in files under ``offload_param.nvme_path``; see the module docstring."""

    def __init__(self, buckets: list[ShardBucket], offload, rank: int, aio=None):
        devices = {b.flat.device.type for b in buckets}
        if devices - {"cpu"}:
            raise NotImplementedError(
                f"offload_param.device=nvme with the shards on {sorted(devices)}: only a CPU compute device is "
                "supported so far (the device<->host copies of the accelerator path are not written); use "
                'offload_param.device "cpu" or "none" there')
        self.store = NvmeStore(offload.nvme_path, rank=rank, purpose="params",
                               **(store_options(aio) if aio is not None else {}))
        self.slots = [_Slot(b) for b in buckets]
        self._slot_of = {id(b): s for b, s in zip(buckets, self.slots)}
        self.max_in_cpu = int(offload.max_in_cpu)
        self.read_ahead = max(1, int(offload.buffer_count))
        self.resident_numel = sum(s.numel for s in self.slots)
        self.peak_resident_numel = self.resident_numel
        self.reads = self.writes = 0
        self.demand_reads = 0  # reads a gather or an update had to wait for from the start (not read ahead)
        self._said_over_limit = False
        self._closed = False

    # ---- lifecycle -----------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Write every bucket once and free it (after the optimizer has aliased its masters to the shards)."""
        with profile_range("zero3::param_swap start"):
            self._write_back(self.slots)
            for slot in self.slots:
                self._free(slot)
            self.peak_resident_numel = 0  # from here on: what training holds

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Read every shard back into memory and remove this run's files (engine.destroy()): the parameters stay
        readable after destroy (GatheredParameters, zero_engine.utils), as without offload."""
        if self._closed:
            return
        try:
            self._read_all()
        finally:
            self._closed = True
            self.store.close()

    # ---- what the gathers, the step and the coordinator call -----------------------------------------------------
    def ensure_in(self, params: list[ShardedParam]) -> None:
        """Every bucket holding a shard of ``params`` is in memory when this returns (read on demand if needed)."""
        needed = self._slots_of(params)
        missing = [s for s in needed if not s.resident]
        if missing:
            self._make_room(sum(s.numel for s in missing), keep=needed)
            for slot in missing:
                self._read(slot)
            self.demand_reads += len(missing)
        for slot in needed:
            self._wait_read(slot)

    def after_fetch(self, upcoming) -> None:
        """The coordinator fetched a module; ``upcoming``: the parameters of the trace's next events (empty when no
        trace is followed). Free what is no longer needed, read ahead what is; see [Note: parameter read-ahead]."""
        if self._closed:
            return
        window = self._window(upcoming)
        for slot in self.slots:
            if slot.resident and slot not in window and not slot.in_use() and not slot.dirty:
                self._free(slot)
        self._read_ahead(window)

    def around_update(self, update, groups: list[list[ShardedParam]]):
        """Wrap the optimizer's per-sub-group update (``groups``: the sub-groups, in the order the step runs them).

        [Note: the step's swap pipeline] Before sub-group ``i``: its buckets in (on demand if not read ahead), then
        reads issued for the buckets of ``i + 1, ...`` (within buffer_count and max_in_cpu). After it: the buckets
        no later sub-group touches are written back asynchronously and freed once written, so writing ``i``
        overlaps the update of ``i + 1``. ``after_step`` waits for the last writes."""
        order = {id(g[0]): i for i, g in enumerate(groups) if g}
        later = [set() for _ in groups]  # slots touched by sub-groups after i
        touched: set = set()
        for i in range(len(groups) - 1, -1, -1):
            later[i] = set(touched)
            touched.update(self._slots_of(groups[i]))

        def update_in_memory(group: list[ShardedParam], *args, **kwargs):
            i = order.get(id(group[0])) if group else None
            slots = self._slots_of(group)
            for slot in slots:
                slot.holds += 1
            try:
                self.ensure_in(group)
                for slot in slots:
                    self._finish_write(slot)  # never change a bucket while its write is in flight
                if i is not None:
                    self._free_written()
                    self._read_ahead(self._window(groups[i + 1:], for_gather=False))
                update(group, *args, **kwargs)
            finally:
                for slot in slots:
                    slot.holds -= 1
                    slot.dirty = True
            for slot in slots:
                # a bucket with persistent (always gathered) parameters is written after the step, once the engine
                # has re-gathered them from it; the others as soon as no later sub-group touches them
                if i is not None and slot not in later[i] and not slot.has_persistent:
                    self._start_write(slot)
        return update_in_memory

    def after_step(self, upcoming=()) -> None:
        """Write back every updated bucket and wait: the files are whole again. Then free everything but the
        read-ahead window of ``upcoming`` (the next forward's first gathers, along the trace)."""
        if self._closed:
            return
        with profile_range("zero3::param_swap write back"):
            self._write_back([s for s in self.slots if s.resident and (s.dirty or s.write is not None)])
            self.after_fetch(upcoming)

    @contextlib.contextmanager
    def holding(self, params: list[ShardedParam]):
        """``params``' buckets in memory for the block, read-only (gathers outside the coordinator:
        GatheredParameters, save_16bit_model, zero_engine.hf). After it, buckets stay in memory within max_in_cpu
        (the next parameter is likely in the same bucket); the coordinator's next fetch frees them."""
        slots = self._slots_of(params)
        for slot in slots:
            slot.holds += 1
        try:
            self.ensure_in(params)
            yield
        finally:
            for slot in slots:
                slot.holds -= 1
            self._trim()

    @contextlib.contextmanager
    def all_in(self):
        """Every shard in memory for the block (checkpoints, zero_engine.utils, GatheredParameters' edits), which
        may change them: written back and freed after."""
        for slot in self.slots:
            slot.holds += 1
        try:
            self._read_all()
            yield
        finally:
            for slot in self.slots:
                slot.holds -= 1
                slot.dirty = True
            self.after_step()

    # ---- numbers -------------------------------------------------------------------------------------------------
    @property
    def resident_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots if s.resident)

    def file_bytes(self) -> int:
        return self.store.nbytes()

    # ---- internals -----------------------------------------------------------------------------------------------
    def _slots_of(self, params) -> list[_Slot]:
        seen: dict[int, _Slot] = {}
        for p in params:
            if p.bucket is not None and id(p.bucket) in self._slot_of:
                seen.setdefault(id(p.bucket), self._slot_of[id(p.bucket)])
        return list(seen.values())

    def _window(self, upcoming, for_gather: bool = True) -> list[_Slot]:
        """The buckets the next gathers (or sub-group updates) will read, in order of use, within buffer_count and
        max_in_cpu."""
        window: list[_Slot] = []
        numel = 0
        for params in upcoming:
            if for_gather:
                params = [p for p in params if p.status is ParamStatus.NOT_AVAILABLE and not p.is_persistent]
            for slot in self._slots_of(params):
                if slot in window:
                    continue
                if len(window) >= self.read_ahead or numel + slot.numel > self.max_in_cpu:
                    return window
                window.append(slot)
                numel += slot.numel
        return window

    def _read_ahead(self, window: list[_Slot]) -> None:
        for slot in window:
            if not slot.resident:
                if self.resident_numel + slot.numel > self.max_in_cpu:
                    return
                self._read(slot)

    def _trim(self) -> None:
        """Free clean buckets nothing uses, in order, until at most max_in_cpu elements are in memory."""
        for slot in self.slots:
            if self.resident_numel <= self.max_in_cpu:
                return
            if slot.resident and not slot.dirty and not slot.in_use():
                self._free(slot)

    def _free_written(self) -> None:
        """Free the buckets whose write-back has completed and that nothing needs now."""
        for slot in self.slots:
            if slot.write is not None and slot.write.done() and not slot.in_use():
                self._free(slot)

    def _make_room(self, numel: int, keep: list[_Slot]) -> None:
        """Free buckets not in ``keep`` and not in use (written back first if updated) until ``numel`` more fits
        under max_in_cpu; past that the read goes ahead anyway (a gather cannot wait for memory), said once."""
        for slot in self.slots:
            if self.resident_numel + numel <= self.max_in_cpu:
                return
            if slot.resident and slot not in keep and not slot.in_use():
                if slot.dirty:
                    self._write_back([slot])
                self._free(slot)
        if self.resident_numel + numel > self.max_in_cpu and not self._said_over_limit:
            self._said_over_limit = True
            log.info("zero_engine: offload_param.max_in_cpu=%d elements: a gather or an optimizer sub-group needs "
                     "%d elements of shard buckets in memory at once (with those in use); they are read anyway "
                     "(said once)", self.max_in_cpu, self.resident_numel + numel)

    def _read_all(self) -> None:
        """Every bucket in memory: reads issued for all that are out, then waited for."""
        for slot in self.slots:
            if not slot.resident:
                self._read(slot)
        for slot in self.slots:
            self._wait_read(slot)

    def _read(self, slot: _Slot) -> None:
        storage = slot.bucket.flat.untyped_storage()
        storage.resize_(slot.nbytes)
        flat = slot.bucket.flat
        slot.read = self.store.read(slot.key, flat.view(-1) if flat.numel() else flat)
        slot.resident = True
        slot.dirty = False
        self.reads += 1
        self.resident_numel += slot.numel
        self.peak_resident_numel = max(self.peak_resident_numel, self.resident_numel)

    def _wait_read(self, slot: _Slot) -> None:
        if slot.read is not None:
            with profile_range(f"zero3::param_swap wait read {slot.key}"):
                slot.read.wait()
            slot.read = None

    def _start_write(self, slot: _Slot) -> None:
        self._wait_read(slot)
        self._finish_write(slot)
        slot.write = self.store.write(slot.key, slot.bucket.flat)
        slot.dirty = False  # the file gets these bytes; the bucket must stay unchanged until _finish_write

    def _finish_write(self, slot: _Slot) -> None:
        if slot.write is not None:
            with profile_range(f"zero3::param_swap wait write {slot.key}"):
                handle, slot.write = slot.write, None
                handle.wait()
            self.writes += 1

    def _write_back(self, slots: list[_Slot]) -> None:
        for slot in slots:
            if slot.dirty:
                self._start_write(slot)
        for slot in slots:
            self._finish_write(slot)

    def _free(self, slot: _Slot) -> None:
        if self._closed:  # after close() the shards stay in memory: their files are gone
            return
        if slot.dirty:
            raise AssertionError(f"param offload: {slot.key} freed with values not yet written to "
                                 f"{self.store.directory}")
        self._wait_read(slot)
        self._finish_write(slot)
        slot.bucket.flat.untyped_storage().resize_(0)
        slot.resident = False
        self.resident_numel -= slot.numel


class SwapInGather:
    """The engine's gatherer under parameter offload: the shards' buckets are read in before each all-gather."""

    def __init__(self, inner, swapper: ParamSwapper):
        self.inner = inner
        self.swapper = swapper
        self.name = inner.name

    def issue(self, params: list[ShardedParam], name: str = "", refresh: bool = False):
        with profile_range(f"zero3::param_swap in {name}"):
            self.swapper.ensure_in(params)
        return self.inner.issue(params, name=name, refresh=refresh)
