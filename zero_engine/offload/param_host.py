"""``offload_param: {device: cpu}`` with an accelerator: the stage-3 compute shards live in host memory.

[Note: host parameter shards]
Each shard bucket (``ShardBucket``, see [Note: flat shard storage] in zero/partition.py) is rebound once, at
initialize, to a host tensor (page-locked with ``pin_memory``), so the device holds no parameter shards between uses,
only the gathered parameters the coordinator keeps live. An all-gather needs its input on the device (NCCL):
``DeviceCopyGather`` copies the buckets the gather reads to fresh device tensors (non-blocking from pinned memory, on
the compute stream, so the collective that follows on the all-gather stream is ordered after it by the stream events
of zero/streams.py), rebinds the buckets to those copies for the issue, and rebinds them back to the host tensors
right after: the collective holds its input, and the work object keeps the copies alive until ``wait()``. Because
the coordinator prefetches along the recorded trace, the copy of the next module's shards is issued ahead of the
all-gather that needs them, as the gather itself is.

Everything else sees host shards: the optimizer, which must run on the host too (``offload_optimizer`` cpu or nvme:
the step writes the updated 16-bit shard straight into host memory instead of copying it to the device), checkpoints
and Hugging Face loading (file I/O into host memory), ``GatheredParameters`` (its gather goes through
``holding``). Gradient reduction allocates its buffers on ``ShardedParam.compute_device``, not where the shard is.

On a CPU-only machine the compute device *is* host memory: none of this runs (the placement logs that once).
"""

from __future__ import annotations

import contextlib

import torch

from .._profiling import profile_range
from ..zero.partition import ShardBucket, ShardedParam

__all__ = ["HostShards", "DeviceCopyGather"]


class HostShards:
    """The shard buckets in (pinned) host memory and the device copies gathers read; see [Note: host parameter
    shards]."""

    def __init__(self, buckets: list[ShardBucket], device: torch.device, pin_memory: bool, offloads_optimizer: bool):
        if not offloads_optimizer:
            raise NotImplementedError(
                "offload_param.device=cpu with an accelerator needs offload_optimizer.device cpu or nvme as well: "
                "the step updates the shards where they live (host memory); set offload_optimizer.device to "
                '"cpu", or offload_param.device to "none"')
        self.device = device
        self.buckets = buckets
        self.closed = False  # the interface zero_engine.utils.shards_in_memory_of expects
        self.copied_bytes = 0  # host->device bytes copied for gathers (a cost memory_stats does not show)
        for bucket in buckets:
            host = torch.empty(bucket.numel, dtype=bucket.flat.dtype, device="cpu",
                               pin_memory=pin_memory and torch.cuda.is_available())
            host.copy_(bucket.flat)
            bucket.rebind(host)

    @property
    def host_bytes(self) -> int:
        return sum(b.numel * b.flat.element_size() for b in self.buckets)

    def stage(self, params: list[ShardedParam]) -> list[torch.Tensor]:
        """Rebind the buckets holding ``params``' shards to device copies; returns the copies (keep them alive until
        the collective reading them is waited on). ``unstage`` rebinds the buckets back to host memory."""
        copies = []
        seen = set()
        for p in params:
            bucket = p.bucket
            if bucket is None or id(bucket) in seen or bucket.flat.device == self.device and \
                    self.device.type != "cpu":
                continue
            seen.add(id(bucket))
            host = bucket.flat
            dev = torch.empty(bucket.numel, dtype=host.dtype, device=self.device)  # a real copy, also on a CPU
            dev.copy_(host, non_blocking=host.is_pinned())
            bucket.rebind(dev)
            copies.append((bucket, host, dev))
            self.copied_bytes += dev.numel() * dev.element_size()
        return copies

    @staticmethod
    def unstage(copies) -> None:
        for bucket, host, _ in copies:
            bucket.rebind(host)

    @contextlib.contextmanager
    def holding(self, params: list[ShardedParam]):
        """``params``' shards on the device for the block (GatheredParameters' own gather, waited inside it)."""
        copies = self.stage(params)
        try:
            yield
        finally:
            self.unstage(copies)


class DeviceCopyGather:
    """The engine's gatherer under host parameter shards: each gather's buckets copied to the device first."""

    def __init__(self, inner, shards: HostShards):
        self.inner = inner
        self.shards = shards
        self.name = inner.name

    def issue(self, params: list[ShardedParam], name: str = "", refresh: bool = False):
        with profile_range(f"zero3::param host->device {name}"):
            copies = self.shards.stage(params)
        try:
            work = self.inner.issue(params, name=name, refresh=refresh)
        finally:
            self.shards.unstage(copies)
        work.keep_alive.extend(dev for _, _, dev in copies)  # the collective's input until wait()
        return work
