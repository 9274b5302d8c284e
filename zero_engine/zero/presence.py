"""Which parameters get a gradient in this backward pass on some ranks but not on others (stage 3).

[Note: a gradient on some ranks only]
A branch taken on one rank only (``out + h @ extra if use_extra else out``) leaves ``extra`` without a gradient on
the other ranks. The reducer launches a bucket when all its parameters have reported; at stage 3 the all-gathers of
backward are interleaved with those launches, so a rank still waiting for ``extra`` would issue its next all-gather
while the rank that has it issues the bucket's reduce-scatter: the ranks would disagree on a collective.

Before backward runs, each rank walks its autograd graph from the loss to the parameters it will reach (one Python
pass over the graph's nodes), and one all-reduce of a presence count per parameter makes the result common
knowledge. A parameter reached on some ranks only is *irregular* for this pass: every rank leaves it out of its
bucket's readiness (it contributes zeros there) and reduces it on its own at the end of backward, where every rank
is again in step. A parameter reached on no rank needs nothing: its bucket already contributes zeros everywhere.
"""

from __future__ import annotations

import torch

from .partition import ShardedParam

__all__ = ["params_reached", "irregular_params"]


def params_reached(root: torch.Tensor) -> set[int]:
    """ids of the leaf tensors whose gradient a backward from ``root`` will accumulate."""
    reached: set[int] = set()
    if root.grad_fn is None:
        return reached
    seen = {root.grad_fn}
    stack = [root.grad_fn]
    while stack:
        node = stack.pop()
        variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf it accumulates into
        if variable is not None:
            reached.add(id(variable))
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return reached


def irregular_params(root: torch.Tensor, params: list[ShardedParam], comm, device: torch.device) -> set[int]:
    """ids of the ``params`` that a backward from ``root`` reaches on some ranks but not on all (one all-reduce)."""
    reached = params_reached(root)
    counts = torch.tensor([id(sp.param) in reached for sp in params], dtype=torch.int32, device=device)
    comm.all_reduce(counts, op="sum", name="gradient presence")
    if counts.device.type == "meta":
        return set()  # shape-only run (fake process group): there are no values
    world = comm.world_size
    return {id(sp) for sp, n in zip(params, counts.tolist()) if 0 < n < world}
