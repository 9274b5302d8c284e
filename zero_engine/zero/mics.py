"""MiCS's hierarchical parameter gather (``zero_optimization.mics_hierarchical_params_gather: true``): a shard group
that spans several nodes all-gathers in two steps, so that each node's data crosses the slow inter-node links once.

[Note: the two-step gather]
A shard group of k ranks spans k / L nodes of L ranks (LOCAL_WORLD_SIZE); shard rank s = node j x L + local rank l
(consecutive ranks: [Note: rank layout of a hierarchical mesh] in mesh.py). A flat all-gather of chunks of n
elements leaves chunk s at ``out[s*n:(s+1)*n]``, from one collective of k ranks across nodes. In two steps:

1. across nodes, over the ``gather_inter`` group (the shard group's ranks with local rank l, one per node): each rank
   receives the chunks of its counterparts, ``across[j] = chunk(j*L + l)``: a collective of k/L ranks moving 1/L of
   the gathered bytes per rank (with rings ordered node by node, k - L chunks over each node's incoming link against
   the flat ring's k - 1, and L times fewer ranks and steps across nodes);
2. within the node, over ``gather_intra`` (the node's L ranks of the shard group): each rank receives the others'
   ``across``, ``by_local[l'][j] = chunk(j*L + l')``, over NVLink;
3. ``out.view(k/L, L, n) = by_local.view(L, k/L, n).transpose(0, 1)``: the flat gather's layout, bit for bit (the
   values are moved, never combined).

This is DeepSpeed's order (mics.py: the inter-node all-gather first, then the intra-node one). The permutation of
step 3 costs a copy and a transient buffer of the gathered size (counted in ``comm_buffers`` while it lives); with
one rank per node (L = 1) step 1 is the whole gather, straight into ``out``. Step 1 is waited for when the gather is
issued (step 2 reads its result), so only step 2 overlaps with compute as a prefetched gather does.

What uses it: the gatherers of the engine (forward and backward gathers at stage 3, the refresh after a step at
stages 1-2, qwZ's int8 gathers) call ``all_gather_into_tensor`` of a ``TwoStepAllGather`` instead of the shard
group's communicator; everything else on the shard group (the gradient reduce-scatter, the norm, checkpoints,
GatheredParameters) stays one collective over it.
"""

from __future__ import annotations

import torch

__all__ = ["TwoStepAllGather"]


class _TwoStepPending:
    """Step 2 in flight; ``wait()`` finishes it and lays the result out as the flat gather's (step 3)."""

    def __init__(self, pending, output: torch.Tensor, across: torch.Tensor, by_local: torch.Tensor, nodes: int,
                 done_bytes):
        self.pending, self.tensor = pending, output
        self.across, self.by_local, self.nodes = across, by_local, nodes
        self.done_bytes = done_bytes

    @property
    def work(self):  # streams.py asks whether a work handle is left to order the readers
        return self.pending.work

    def wait(self) -> torch.Tensor:
        if self.by_local is None:
            return self.tensor
        self.pending.wait()
        local, n = self.by_local.numel() // self.across.numel(), self.across.numel() // self.nodes
        self.tensor.view(self.nodes, local, n).copy_(self.by_local.view(local, self.nodes, n).transpose(0, 1))
        if self.by_local.is_cuda:  # allocated on the all-gather stream, read here on the current one
            self.by_local.record_stream(torch.cuda.current_stream(self.by_local.device))
        self.done_bytes(self.across, self.by_local)
        self.across = self.by_local = None
        return self.tensor


class TwoStepAllGather:
    """The shard group's all-gather as the gatherers see it (``world_size``, ``rank``, ``all_gather_into_tensor``),
    done in two steps over ``inter`` then ``intra`` (see [Note: the two-step gather])."""

    def __init__(self, shard_comm, inter, intra, accounting=None):
        if inter.world_size * intra.world_size != shard_comm.world_size:
            raise AssertionError(f"two-step gather: {inter.world_size} nodes x {intra.world_size} ranks != shard group "
                                 f"of {shard_comm.world_size}")
        self.world_size, self.rank = shard_comm.world_size, shard_comm.rank
        self.inter, self.intra = inter, intra
        self.accounting = accounting

    def communicators(self) -> dict:
        return {"gather_inter": self.inter, "gather_intra": self.intra}

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                               name: str = ""):
        n, nodes = input.numel(), self.inter.world_size
        if output.numel() != n * self.world_size:
            raise ValueError(f"all_gather {name!r} on shard rank {self.rank}: output has {output.numel()} elements; "
                             f"expected world_size x input = {self.world_size} x {n}")
        if self.intra.world_size == 1:  # one rank per node: step 1 is the whole gather
            return self.inter.all_gather_into_tensor(output, input, async_op=async_op, name=f"{name} (inter-node)")
        across = torch.empty(nodes * n, dtype=input.dtype, device=input.device)
        by_local = torch.empty(output.numel(), dtype=input.dtype, device=input.device)
        self._count(across, by_local, sign=1)
        self.inter.all_gather_into_tensor(across, input.reshape(-1), name=f"{name} (inter-node)")
        pending = self.intra.all_gather_into_tensor(by_local, across, async_op=True, name=f"{name} (intra-node)")
        result = _TwoStepPending(pending, output, across, by_local, nodes,
                                 lambda *buffers: self._count(*buffers, sign=-1))
        if not async_op:
            result.wait()
        return result

    def _count(self, *buffers: torch.Tensor, sign: int) -> None:
        if self.accounting is not None:
            self.accounting.add("comm_buffers", sign * sum(b.numel() * b.element_size() for b in buffers))
