"""A gradient bucket's layout and its copy groups: the data the reducer (grads.py) fills, reduces and hands to the
optimizer. See grads.py's notes: [Note: gradient buffers] for the ``[world, per_rank]`` send buffer and the column of
each parameter, [Note: one copy per unit] for copy groups, [Note: buckets of one group] for ``comm`` and ``scale``.
"""

from __future__ import annotations

import torch

from .partition import ShardedParam

__all__ = ["CopyGroup", "GradBucket"]


class GradBucket:
    """Consecutive parameters of one shard group whose gradients are reduce-scattered together, with where each one's
    shard lies in the bucket's gradient shards (``offsets``) and the state of this pass and window."""

    def __init__(self, params: list[ShardedParam], index: int, comm):
        self.params = list(params)
        self.index = index
        self.name = f"grads bucket {index}"  # its reduce-scatter's name (built once, not per collective)
        # the group its gradients are reduce-scattered over, and the factor after that average: the reducer's and 1,
        # or an MoE expert's edp group (its parameters' ShardedParam.group; see [Note: buckets of one group])
        group = self.params[0].group
        self.comm = comm if group is None else group.comm
        self.scale = 1.0 if group is None else group.grad_scale
        self.world = self.comm.world_size
        self.offsets: dict[int, int] = {}  # id(p) -> offset of its shard in the [per_rank] gradient shards
        offset = 0
        for p in self.params:
            self.offsets[id(p)] = offset
            offset += p.shard_numel
        self.per_rank = offset
        self.send: torch.Tensor | None = None  # [world * per_rank], see [Note: gradient buffers]
        self.arrived = 0  # its parameters whose gradient arrived this pass
        self.pending = None  # comm Pending of the launched reduce-scatter
        self.recv: torch.Tensor | None = None
        self.workspace = 0  # bytes its launched reduce-scatter holds beside send and recv (comm's workspace)
        self.shard_grads: torch.Tensor | None = None  # [per_rank]: this rank's accumulated gradient shards
        self.has_grads = False  # shard_grads holds data from an earlier micro-step (accumulate, do not overwrite)
        self.unaveraged = False  # shard_grads not yet averaged across replicas ([Note: gradients across replicas])
        self.irregular = 0  # parameters of this bucket reduced on their own at the end of this pass
        self.groups: list[CopyGroup] = []  # its copy groups, in order (GradReducer._index_buckets, grads.py)

    def slot(self, p: ShardedParam) -> torch.Tensor:
        """Where ``p``'s padded gradient goes in the send buffer: a [world, shard_numel] view (its column)."""
        column = self.offsets[id(p)]
        return self.send.view(self.world, self.per_rank)[:, column: column + p.shard_numel]


class CopyGroup:
    """Consecutive parameters of one bucket and one gather unit, whose gradients go into the send buffer together:
    see [Note: one copy per unit]."""

    __slots__ = ("bucket", "params", "column", "columns", "grads", "arrived", "copied", "summed", "chunks")

    def __init__(self, bucket: GradBucket, params: list[ShardedParam]):
        self.bucket = bucket
        self.params = params
        self.column = bucket.offsets[id(params[0])]  # its first column in the [world, per_rank] send buffer
        self.columns = sum(p.shard_numel for p in params)
        self.grads: list[torch.Tensor | None] = [None] * len(params)  # held until the group is complete
        # gradients held this pass; a parameter reduced on its own ([Note: a gradient on some ranks only]) never
        # arrives here, so its group is copied at launch (_flush)
        self.arrived = 0
        self.copied = False  # its gradients are in the send buffer (or adopted as it: _adopt)
        self.summed = False  # one of them is a sum of two, in the reduction dtype (the others may not be)
        # _chunk_cat cuts a flat gradient into rows of ceil(numel / world), the shard layout for any numel >= 1
        self.chunks = all(p.numel >= 1 for p in params)

    def reset(self) -> None:
        self.grads = [None] * len(self.params)
        self.arrived = 0
        self.copied = self.summed = False
