"""One benchmark configuration, one rank: build the model, wrap it in a system, train, write what was measured.

Run by ``compare.py`` under ``python -m torch.distributed.run --standalone --nproc_per_node N`` (or as a plain
``python`` for the single-process reference); each rank writes ``<out>/rank<r>.json``. The step plan is
[warm-up][timed][memory warm-up][memory measured][profiled], each part optional; compare.py uses two processes:

* time pass, default allocator: ``--warmup W --steps S --profile-comm``: W warm-up steps, S timed steps (a barrier
  before each, so every step starts together and lasts until its slowest rank is done), then one more step under
  the profiler to count communication;
* memory pass, started with ``MALLOC_MMAP_THRESHOLD_=65536`` (see _measure.py): ``--memory-steps M``: one warm-up
  step, then M measured steps with the peak-RSS counters reset at their start and the model-state bytes read at
  their end (grads and optimizer states then exist for every system).

Only torch and this folder are needed here; zero_engine is imported for our systems and DeepSpeed for its own, so
a Python with DeepSpeed but without zero_engine can run the DeepSpeed configuration.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from _common import (ADAMW, DATA_SEED, DTYPE_BYTES, GRADIENT_CLIPPING, MODEL_SEED, REPO_ROOT, SIZES, SYSTEMS,
                     deepspeed_config, load_gpt_module, zero_engine_config)
from _measure import RssSampler, profile_collectives, reset_rss_peak, rss_bytes, rss_peak_bytes


def _tensor_bytes(t) -> int:
    if t is None:
        return 0
    if hasattr(t, "to_local"):  # a DTensor (FSDP2): count this rank's shard only
        t = t.to_local()
    return t.numel() * t.element_size()


def _optimizer_state_bytes(optimizer) -> int:
    return sum(_tensor_bytes(v) for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def _adamw(params):
    return torch.optim.AdamW(params, foreach=True, **ADAMW)


class TorchRunner:
    """Reference (one process), DDP, or FSDP2: a plain torch training step."""

    def __init__(self, model, system: str, world: int, dtype: str = "fp32", tp_mesh=None):
        """``tp_mesh``: the ("dp", "tp") mesh the model's MLPs were split over (tensor_parallel), or None."""
        self.system = system
        self.model = model
        self.tp_mesh = tp_mesh
        # bf16 for torch: FSDP2 casts parameters (MixedPrecisionPolicy, fp32 reduce), DDP runs under autocast; the
        # reference stays fp32 (what every system is checked against).
        self.autocast = dtype == "bf16" and system == "ddp"
        if system == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            self.wrapped = DistributedDataParallel(model)
        elif system.startswith("fsdp2"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            from torch.distributed.fsdp import MixedPrecisionPolicy

            k = SYSTEMS[system].hsdp  # HSDP: shard within groups of k, replicate across world / k of them
            mesh = init_device_mesh("cpu", (world // k, k), mesh_dim_names=("dp_replicate", "dp_shard")) if k \
                else init_device_mesh("cpu", (world,))
            if tp_mesh is not None:  # FSDP2 + TP (torchtitan's recipe): shard over dp, the MLPs split over tp
                mesh = tp_mesh["dp"]
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == "bf16" \
                else MixedPrecisionPolicy()
            for block in model.blocks:
                fully_shard(block, mesh=mesh, mp_policy=mp)
                if SYSTEMS[system].compiled:  # torchtitan's recipe: each sharded block compiled (Inductor)
                    block.compile()
            fully_shard(model, mesh=mesh, mp_policy=mp)
            self.wrapped = model
        else:
            self.wrapped = model
        self.optimizer = _adamw(self.wrapped.parameters())

    def step(self, x, y) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)  # here, not after step: the grads stay for the state count
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            loss = self.wrapped(x, y)
        loss.backward()
        if self.tp_mesh is None:
            torch.nn.utils.clip_grad_norm_(self.wrapped.parameters(), GRADIENT_CLIPPING, foreach=True)
        else:
            _clip_dtensor_grads(list(self.wrapped.parameters()), GRADIENT_CLIPPING)
        self.optimizer.step()
        return loss.detach()

    def model_states(self) -> dict:
        params = list(self.wrapped.parameters())
        return {"params": sum(_tensor_bytes(p) for p in params),
                "master_params": 0,
                "grads": sum(_tensor_bytes(p.grad) for p in params),
                "optimizer_states": _optimizer_state_bytes(self.optimizer)}

    def reset_peaks(self) -> None:
        pass

    def extras(self) -> dict:
        return {}

    def close(self) -> None:
        """Before destroy_process_group(): drop DDP (its Reducer) and FSDP2's state, which hold the process group.

        [Note: the group's last holder] Whatever holds the process group last destroys it, and the group's
        destructor joins gloo's worker threads. After destroy_process_group() has dropped torch's reference, DDP's C++
        Reducer is that holder, so the DDP module's garbage collection joins those threads with the GIL held. A
        worker thread still destroying its last finished work (a decref of the tensors' Python objects needs the
        GIL) then waits for the GIL forever, and the rank hangs at exit. bench/comm_floor.py did that twice in about
        120 runs here, once in CI (py-spy: the main thread in ~ProcessGroupGloo under the Reducer's dealloc, a gloo
        thread in gil_scoped_acquire). Dropped here, while torch's registry still holds the group, the Reducer is not
        the last holder: destroy_process_group() destroys the group there and then, as zero_engine's own shutdown
        has it do ([Note: clean shutdown] in zero_engine/comm/watchdog.py), and no gloo thread is left
        (tests/test_profile_step.py)."""
        self.wrapped = self.model = self.optimizer = None
        gc.collect()  # whatever of them a reference cycle still keeps goes now, not at interpreter exit


def _clip_dtensor_grads(params, max_norm: float) -> None:
    """clip_grad_norm_ for FSDP2 + TP, whose gradients are DTensors on two meshes (dp x tp for the split ones, dp for
    the rest), which torch's foreach norm cannot stack: each norm made whole (full_tensor), then one coefficient."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = [torch.linalg.vector_norm(g) for g in grads]
    total = torch.stack([n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]).norm()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)


class ZeroEngineRunner:
    def __init__(self, model, config: dict, mesh=None):
        import zero_engine

        self.engine, _, _, _ = zero_engine.initialize(model=model, config=config, mesh=mesh)

    def step(self, x, y) -> torch.Tensor:
        loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()

    def model_states(self) -> dict:
        stats = self.engine.memory_stats()
        if self.engine.stage < 3:
            # Stages 1 and 2 keep every parameter whole (params_gathered, persistent) and update a separate fp32
            # shard of it (params_sharded; the master IS that shard in fp32): both are model state. Gradient shards
            # live only within an accumulation window: counted at their peak (grads_peak).
            return {"params": stats["params_gathered"], "master_params": stats["params_sharded"],
                    "grads": stats["grads_peak"], "optimizer_states": stats["optimizer_states"]}
        return {"params": stats["params_sharded"], "master_params": stats["master_params"],
                "grads": stats["grads_peak"], "optimizer_states": stats["optimizer_states"]}

    def reset_peaks(self) -> None:
        self.engine.reset_memory_peaks()

    def comm_stats(self) -> dict:
        return self.engine.comm_stats()

    def extras(self) -> dict:
        return {"memory_stats": self.engine.memory_stats(), "comm_stats_total": self.engine.comm_stats()}

    def close(self) -> None:
        """Before destroy_process_group(), as README's shutdown section says: every rank done, nothing in flight."""
        self.engine.destroy()


class DeepSpeedRunner:
    def __init__(self, model, config: dict):
        import deepspeed

        self.version = deepspeed.__version__
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=_adamw(model.parameters()),
                                                                 config=config)

    def step(self, x, y) -> torch.Tensor:
        loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()

    def model_states(self) -> dict:
        """Read from the ZeRO-3 optimizer's own buffers; attribute names as in DeepSpeed 0.19's stage3.py."""
        zero = self.optimizer
        flat16 = getattr(zero, "fp16_partitioned_groups_flat", [])
        flat32 = getattr(zero, "fp32_partitioned_groups_flat", [])
        same = {t.data_ptr() for t in flat16}
        grads = getattr(zero, "grad_partitions_flat_buffer", None)
        return {"params": sum(_tensor_bytes(t) for t in flat16),
                "master_params": sum(_tensor_bytes(t) for t in flat32 if t.data_ptr() not in same),
                "grads": _tensor_bytes(grads),
                "optimizer_states": _optimizer_state_bytes(zero.optimizer)}

    def reset_peaks(self) -> None:
        pass

    def extras(self) -> dict:
        return {"deepspeed_version": self.version}

    def close(self) -> None:
        pass


def tensor_parallel(model, world: int, tp: int):
    """A (world / tp, tp) ("dp", "tp") mesh, and each block's MLP split over its tp dim: fc column-wise, proj
    row-wise (torch's parallelize_module)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    for block in model.blocks:
        parallelize_module(block.mlp, mesh["tp"], {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
    return mesh


def build_runner(system: str, model, size, world: int, dtype: str = "fp32"):
    spec = SYSTEMS.get(system)
    mesh = tensor_parallel(model, world, spec.tp) if spec is not None and spec.tp else None
    if system == "reference" or (spec and spec.family == "torch"):
        return TorchRunner(model, system, world, "fp32" if system == "reference" else dtype, mesh)
    if spec.family == "ours":
        return ZeroEngineRunner(model, zero_engine_config(size, spec, world, dtype), mesh)
    if spec.family == "deepspeed":
        return DeepSpeedRunner(model, deepspeed_config(size, world, dtype))
    raise ValueError(f"--system {system!r}: unknown; use reference or one of {', '.join(SYSTEMS)}")


def probe_runner(system: str, size, steps: int, rank: int, world: int):
    """The runner and this rank's slices of ``steps`` global batches that the one-rank probes time
    (profile_step.py, engine_cpu.py, cpu_split.py): the GPT of ``size`` from seed 0, its data from seed 1."""
    gpt = load_gpt_module()
    cfg = gpt.GPTConfig(**size.gpt)
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    micro = size.global_batch // world
    batches = [(x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro])
               for x, y in gpt.make_batches(cfg, steps, size.global_batch, seed=1)]
    return build_runner(system, model, size, world), batches


def import_system(system: str) -> None:
    """Import what the system needs before the RSS floor is read, so the floor includes every library's import."""
    spec = SYSTEMS.get(system)
    if spec is None:
        return
    if spec.family == "ours":
        sys.path.insert(0, str(REPO_ROOT))
        import zero_engine  # noqa: F401
    elif spec.family == "deepspeed":
        import deepspeed  # noqa: F401
    elif system.startswith("fsdp2"):
        import torch.distributed.fsdp  # noqa: F401
    else:
        import torch.nn.parallel  # noqa: F401


def init_process_group(system: str) -> tuple[int, int]:
    if system == "reference":
        return 0, 1
    if system == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group(backend="gloo")
    return dist.get_rank(), dist.get_world_size()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--system", required=True, help="reference, or one of " + ", ".join(SYSTEMS))
    parser.add_argument("--size", required=True, choices=sorted(SIZES))
    parser.add_argument("--warmup", type=int, required=True, help="steps before the timed ones")
    parser.add_argument("--steps", type=int, required=True, help="timed steps (0: no timing)")
    parser.add_argument("--memory-steps", type=int, default=0,
                        help="steps measured for memory after one more warm-up step (0: no memory measurement)")
    parser.add_argument("--profile-comm", action="store_true", help="one last step under the profiler")
    parser.add_argument("--total-steps", type=int, default=None,
                        help="reference only: how many steps to train (the longest any configuration runs)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="compute dtype (see compare.py)")
    parser.add_argument("--out", required=True, help="folder for rank<r>.json")
    return parser.parse_args(argv)


class Plan:
    """Which step does what: [warm-up][timed][memory warm-up][memory measured][profiled]."""

    def __init__(self, args):
        self.timed = range(args.warmup, args.warmup + args.steps)
        memory_start = args.warmup + args.steps
        self.memory = range(memory_start + 1, memory_start + 1 + args.memory_steps) if args.memory_steps else range(0)
        end = memory_start + (1 + args.memory_steps if args.memory_steps else 0)
        self.profiled = end if args.profile_comm else None
        self.total = end + (1 if args.profile_comm else 0)
        if args.total_steps is not None:
            self.total = max(self.total, args.total_steps)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    size = SIZES[args.size]
    plan = Plan(args)
    rss_at_start = rss_bytes()
    import_system(args.system)
    rank, world = init_process_group(args.system)
    rss_after_init = rss_bytes()
    gpt = load_gpt_module()
    cfg = gpt.GPTConfig(**size.gpt)
    torch.manual_seed(MODEL_SEED)
    model = gpt.GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    spec = SYSTEMS.get(args.system)
    dp = spec.data_parallel(world) if spec is not None else world
    dp_rank = rank // (world // dp)  # tp innermost: the tp ranks of a dp rank read the same rows
    micro = size.global_batch // dp
    batches = [(x[dp_rank * micro:(dp_rank + 1) * micro], y[dp_rank * micro:(dp_rank + 1) * micro])
               for x, y in gpt.make_batches(cfg, plan.total, size.global_batch, seed=DATA_SEED)]

    runner = build_runner(args.system, model, size, world, args.dtype)
    del model
    result: dict = {"rss_after_setup": rss_bytes(), "setup_peak_rss": rss_peak_bytes()}
    sampler = RssSampler().start() if plan.memory else None
    losses, times = [], []
    for step, (x, y) in enumerate(batches):
        if step == plan.memory.start and plan.memory:
            runner.reset_peaks()
            result["peak_reset"] = reset_rss_peak()
            sampler.reset()
        if world > 1:
            dist.barrier()
        if step == plan.profiled:
            before = runner.comm_stats() if hasattr(runner, "comm_stats") else None
            loss, result["comm_profile_step"] = profile_collectives(lambda: runner.step(x, y), DTYPE_BYTES[args.dtype])
            if before is not None:
                after = runner.comm_stats()
                result["engine_comm_step"] = {k: {f: after[k][f] - before[k][f] for f in ("calls", "bytes")}
                                              for k in after}
        else:
            start = time.perf_counter()
            loss = runner.step(x, y)
            if step in plan.timed:
                times.append(time.perf_counter() - start)
            elif step == 0:  # includes what the first step pays once: Dynamo/Inductor compiling, the trace
                result["first_step_s"] = time.perf_counter() - start
        loss = loss.float()
        if world > 1:
            dist.all_reduce(loss)
        losses.append(loss.item() / world)
        if plan.memory and step == plan.memory[-1]:
            result.update(model_states=runner.model_states(), train_peak_rss=rss_peak_bytes(),
                          train_peak_rss_sampled=sampler.peak, train_peak_anon_sampled=sampler.peak_anon,
                          memory_extras=runner.extras())
    if sampler:
        sampler.stop()

    result.update({
        "system": args.system, "size": args.size, "dtype": args.dtype, "world": world, "rank": rank,
        "warmup": args.warmup, "steps": args.steps, "memory_steps": args.memory_steps, "n_params": n_params,
        "losses": losses, "step_times": times, "rss_at_start": rss_at_start, "rss_after_init": rss_after_init,
        "rss_at_end": rss_bytes(), "extras": runner.extras(), "torch_version": torch.__version__,
        "python": sys.executable, "omp_threads": os.environ.get("OMP_NUM_THREADS"),
        "malloc_mmap_threshold_env": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
    })
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    runner.close()
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
