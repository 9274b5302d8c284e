"""Training steps as a long run takes them, and what this process holds after them: the pieces that
tests/test_long_run.py and bench/soak.py share to find anything that grows with the number of steps."""

from __future__ import annotations

import gc
import threading
import tracemalloc
from typing import NamedTuple

import psutil
import torch

from ..memory.accounting import rss_bytes

__all__ = ["Held", "held", "run_steps"]


class Held(NamedTuple):
    """What this process holds now. ``heap``: Python's heap as ``tracemalloc`` traces it (0 when not tracing)."""

    heap: int
    objects: int  # tracked by the garbage collector
    threads: int
    files: int  # open file descriptors
    rss: int


def held() -> Held:
    """``Held`` now, after a full garbage collection."""
    gc.collect()
    heap = tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else 0
    return Held(heap, len(gc.get_objects()), threading.active_count(), psutil.Process().num_fds(), rss_bytes())


def run_steps(engine, batches: list, first: int, steps: int, eval_every: int = 0, save_every: int = 0,
              save_dir: str | None = None) -> None:
    """Steps ``first`` to ``first + steps - 1``: each one ``gradient_accumulation_steps`` micro-steps (forward,
    backward, step) on ``batches`` in turn, then, as a real run interleaves them, an evaluation forward without
    gradients every ``eval_every`` steps and a checkpoint save into ``save_dir`` every ``save_every`` steps (three
    tags in turn, as a run keeps its last few). 0 turns either off."""
    gas = engine.gradient_accumulation_steps()
    for step in range(first, first + steps):
        for micro in range(step * gas, (step + 1) * gas):
            x, y = batches[micro % len(batches)]
            engine.backward(engine(x, y))
            engine.step()
        if eval_every and step % eval_every == 0:
            engine.eval()
            with torch.no_grad():
                engine(x, y)
            engine.train()
        if save_every and step % save_every == 0:
            engine.save_checkpoint(save_dir, tag=f"run{step // save_every % 3}")
