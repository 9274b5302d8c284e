"""Stage 0 (plain data parallel, no partitioning): every gradient averaged across ranks, a flat bucket at a time.

The ZeRO stages reduce-scatter into gradient shards instead (grads.py's GradReducer).
"""

from __future__ import annotations

import torch

__all__ = ["all_reduce_grads"]


def all_reduce_grads(params: list[torch.nn.Parameter], comm, bucket_numel: int,
                     into: list[torch.Tensor] | None = None, reduce_dtype: torch.dtype | None = None) -> None:
    """Stage 0 (plain data parallel): average every gradient across ranks, a flat bucket at a time.

    Every parameter takes part, in the fixed order of ``params``: one that got no gradient on this rank (a branch
    not taken here) contributes zeros, so every rank all-reduces the same buffers (as the reducer's buckets do).
    ``into``: one tensor per parameter that receives the average instead of ``param.grad`` (fp16/bf16 training:
    the fp32 master's gradient). ``reduce_dtype``: the dtype the buckets are averaged in (communication_data_type;
    default the destination's dtype: 16-bit gradients are averaged in fp32, as at the other stages), but a float64
    or complex gradient in its own dtype (``_reduced_in``), a bucket cut where that changes."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif p.grad.is_sparse:  # nn.Embedding(sparse=True)'s: averaged dense, as at the other stages
            p.grad = p.grad.to_dense()
    grads = [p.grad for p in params]
    outs = grads if into is None else into
    start = 0
    while start < len(grads):
        end, size = start, 0
        dtype = _reduced_in(outs[start], reduce_dtype)
        while end < len(grads) and (end == start or size + grads[end].numel() <= bucket_numel
                                    and _reduced_in(outs[end], reduce_dtype) == dtype):
            size += grads[end].numel()
            end += 1
        flat = torch.cat([g.reshape(-1).to(dtype) for g in grads[start:end]])
        comm.all_reduce(flat, op="avg", name="grads")
        offset = 0
        for out in outs[start:end]:
            out.copy_(flat[offset: offset + out.numel()].view_as(out))
            offset += out.numel()
        start = end


def _reduced_in(out: torch.Tensor, reduce_dtype: torch.dtype | None) -> torch.dtype:
    """``reduce_dtype`` (communication_data_type, as configured), but a float64 or complex gradient in its own."""
    return out.dtype if reduce_dtype is None or out.dtype.itemsize > 4 else reduce_dtype
