"""One optimizer step over a global batch split across ranks and micro-steps: the loop parity tests and the demo
share, so every one of them feeds each rank the same rows for the same global batch whatever the world size."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

__all__ = ["train_global_batch", "resume_in_new_engine"]


def train_global_batch(engine, x: torch.Tensor, y: torch.Tensor, gas: int, micro: int,
                       each_micro: Optional[Callable] = None, **forward_kwargs) -> float:
    """``gas`` micro-steps (forward, ``engine.backward``, ``engine.step``) on this rank's rows of the global batch
    ``x, y``: micro-step ``m`` takes the ``micro`` rows from ``(m * world + rank) * micro``. ``each_micro(engine,
    loss)`` runs after each one. Returns the mean loss over every rank and micro-step (one all-reduce)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.zeros(())
    for m in range(gas):
        lo = (m * world + rank) * micro
        loss = engine(x[lo: lo + micro], y[lo: lo + micro], **forward_kwargs)
        engine.backward(loss)
        engine.step()
        total += loss.detach()
        if each_micro is not None:
            each_micro(engine, loss)
    dist.all_reduce(total)
    return total.item() / (world * gas)


def resume_in_new_engine(engine, build: Callable[[], Any], checkpoint_dir: str, tag: str = "resume"):
    """What a resumed run trains with: ``engine``'s checkpoint saved under ``tag``, ``engine`` destroyed, and a new
    engine from ``build()`` (built from other initial values, so that only the checkpoint can make it equal) with
    that checkpoint loaded."""
    engine.save_checkpoint(checkpoint_dir, tag=tag)
    engine.destroy()
    resumed = build()
    resumed.load_checkpoint(checkpoint_dir, tag=tag)
    return resumed
