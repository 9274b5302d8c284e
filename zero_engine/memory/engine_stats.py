"""What an engine holds, in bytes per category: ``engine.memory_stats()`` and the 16Psi/N figure.

The engine's own accounting (exact bytes of shards, masters, gradient shards, optimizer states, gathered
parameters and communication buffers) beside the process's RSS (psutil / procfs), and where each model state
lives (device / host / nvme: Placement.by_location in offload/placement.py). README's memory_stats section says
what each key means.
"""

from __future__ import annotations

from .accounting import rss_bytes, rss_peak_bytes

__all__ = ["memory_stats", "model_state_bytes"]


def memory_stats(engine) -> dict:
    """Bytes on ``engine``'s rank per category, and ``by_location``: see ZeroEngine.memory_stats."""
    esize = engine.compute_dtype.itemsize
    if engine.stage == 0:
        params = [p for p in engine.module.parameters()]
        sharded = 0
        gathered = peak = sum(p.numel() * p.element_size() for p in params)
        grads = grads_peak = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    else:
        sharded = sum(sp.shard.numel() * sp.shard.element_size() for sp in engine.sharded)
        if engine.coordinator is not None:
            gathered = engine.coordinator.live_numel * esize
            peak = engine.coordinator.peak_live_numel * esize
        else:
            gathered = peak = sum(sp.full_bytes for sp in engine.sharded)
        whole = sum(sp.param.grad.numel() * sp.param.grad.element_size()
                    for sp in engine.sharded if sp.param.grad is not None)  # stage 1 accumulates whole grads
        grads = engine.reducer.grad_bytes + whole
        grads_peak = max(engine.accounting.peak["grads"] + whole, grads)
    stats = {
        "params_sharded": sharded,
        "params_gathered": gathered,
        "params_gathered_peak": peak,
        "master_params": engine.optimizer.master_bytes if engine.optimizer is not None else 0,
        "grads": grads,
        "grads_peak": grads_peak,
        "optimizer_states": engine.optimizer.state_bytes if engine.optimizer is not None else 0,
        "comm_buffers_peak": engine.accounting.peak["comm_buffers"],
        "params_secondary": engine.hpz.bytes if engine.hpz is not None else 0,  # ZeRO++ hpZ (zero/hpz.py)
        "rss": rss_bytes(),
        "rss_peak": rss_peak_bytes(),
    }
    swapper = getattr(engine.optimizer, "swapper", None)
    nvme_bytes = swapper.store.nbytes() if swapper is not None else 0
    buffer_bytes = swapper.buffer_bytes if swapper is not None else 0
    if engine.param_swapper is not None and not engine.param_swapper.closed:
        nvme_bytes += engine.param_swapper.file_bytes()
        buffer_bytes += engine.param_swapper.resident_bytes  # shard buckets in memory now
    stats["by_location"] = engine.placement.by_location(stats, nvme_bytes=nvme_bytes, swap_buffer_bytes=buffer_bytes)
    if engine.hpz is not None:  # hpZ's secondary partition lives beside the gathered parameters (zero/hpz.py)
        stats["by_location"]["device"]["params_secondary"] = engine.hpz.bytes
        stats["by_location"]["device"]["total"] += engine.hpz.bytes
    return stats


def model_state_bytes(stats: dict) -> int:
    """Partitioned model states (shards, masters, gradient shards, optimizer states): what 16Ψ/N predicts.

    Gradient shards exist only inside an accumulation window (see [Note: gradient shard lifetime] in
    zero/grads.py), so they are counted at their peak (``grads_peak``): this is the model states' peak, the
    quantity the formula bounds; between windows a rank holds 16Ψ/N minus the gradient shards.
    At stages 1 and 2 every rank also holds the whole parameters; they are ``stats["params_gathered"]``, not
    included here (at stage 3 that figure is the transient gathered working set).
    """
    return (stats["params_sharded"] + stats["master_params"] + stats.get("grads_peak", stats["grads"])
            + stats["optimizer_states"] + stats.get("params_secondary", 0))  # hpZ: 16 Psi / N + 2 Psi / k
