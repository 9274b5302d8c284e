"""What the offload tests share (test_offload_optimizer.py, test_offload_param.py): the model, the training loop,
reading the parameters, the checkpoint round trip, the bitwise comparison, and the accelerator's code path on the
CPU; and what the optimizer kernels are handed as gradients (also test_cuda.py's FusedAdam check)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import zero_engine
from zero_engine.offload.placement import Placement
from zero_engine.testing.models import GPT, GPTConfig, make_batches

MODEL = GPTConfig(vocab_size=48, block_size=8, n_layer=2, n_head=3, n_embd=33)


def gathered_params(engine) -> dict[str, torch.Tensor]:
    """Every parameter whole, from the shards (read in from the files first under NVMe offload)."""
    out = {}
    with engine.optimizer.states_in_memory():
        for sp in engine.sharded:
            buf = torch.empty(sp.padded_numel, dtype=sp.shard.dtype)
            dist.all_gather_into_tensor(buf, sp.shard)
            out[sp.fqn] = buf[: sp.numel].clone()
    return out


def run_steps(engine, batches) -> list[float]:
    """Per batch, two micro-steps of 2 sequences per rank (gradient_accumulation_steps 2): one update."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for x, y in batches:
        for m in range(2):
            lo = (m * world + rank) * 2
            loss = engine(x[lo: lo + 2].to(engine.device), y[lo: lo + 2].to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float().item())
    return losses


def checkpoint_body(save_cfg: dict, load_cfg: dict, ckpt: str):
    """Train 2 steps under save_cfg, save, train 2 more; a fresh engine under load_cfg loads and trains the same 2."""
    batches = make_batches(MODEL, 4, dist.get_world_size() * 4)
    torch.manual_seed(0)
    first, *_ = zero_engine.initialize(model=GPT(MODEL), config=save_cfg)
    run_steps(first, batches[:2])
    first.save_checkpoint(ckpt, tag="t")
    after_save = run_steps(first, batches[2:]), gathered_params(first)
    first.destroy()
    torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
    second, *_ = zero_engine.initialize(model=GPT(MODEL), config=load_cfg)
    second.load_checkpoint(ckpt, tag="t")
    resumed = run_steps(second, batches[2:]), gathered_params(second)
    second.destroy()
    return after_save, resumed


def assert_same(a, b, what: str) -> None:
    """(losses, params, ...) of two runs: equal bitwise."""
    assert a[0] == b[0], f"{what}: losses differ: {a[0]} vs {b[0]}"
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), f"{what}: {name} differs"


@contextlib.contextmanager
def accelerator_code_path():
    """Engines built in the block take the accelerator's code path (host and compute device separate: host copies,
    host gradient shards, host parameter shards) on this CPU-only machine; the class's own property after."""
    own = Placement.__dict__["has_separate_host"]
    Placement.has_separate_host = property(lambda self: True)
    try:
        yield
    finally:
        Placement.has_separate_host = own


def record_kernel_grads(engine, in_kernel: bool) -> list[tuple[torch.dtype, bool, bool]]:
    """A list that each call of the ZeRO optimizer's kernel appends to: per parameter with a gradient, (its dtype,
    whether it is the reducer's gradient shard itself, whether the kernel was given a scale below 1).
    ``in_kernel=False`` forces the path from before the kernels took 16-bit gradients: fp32 copies, scaled first."""
    opt = engine.optimizer
    if not in_kernel:
        opt.grads_in_kernel = False
        for master in opt.masters.values():
            master.grad_dtype = torch.float32
    seen = []
    kernel_step = opt.optimizer.step

    def recording_step(*args, **kwargs):
        for sp in engine.sharded:
            grad = opt.masters[id(sp.param)].grad
            if grad is not None:
                shard = opt.reducer.shard_grad(sp)
                seen.append((grad.dtype, grad.data_ptr() == shard.data_ptr(), kwargs.get("grad_scale", 1.0) < 1))
        return kernel_step(*args, **kwargs)

    opt.optimizer.step = recording_step
    return seen
