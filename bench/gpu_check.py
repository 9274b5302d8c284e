"""`make gpu-check`'s benchmark: a short set of GPU measurements written as JSON and markdown.

    python bench/gpu_check.py [--out bench/results/gpu_check] [--parts adam,zero3,...] [--tiny]

Parts, each run in its own subprocess (one part's memory or failure never touches another's figures):

  adam          FusedAdam vs torch's fused AdamW on the same fp32 tensors: time per step, and time / the HBM bound
                (28 bytes per element moved: read p, g, m, v; write p, m, v) at the copy bandwidth measured here
  zero3         zero_engine ZeRO-3, world 1 (NCCL), bf16, GPT of ~1.1B parameters: step time, peak
                torch.cuda.max_memory_allocated
  torch         plain torch on the same model: fp32 parameters, bf16 autocast, fused AdamW (what ZeRO-3 saves at
                world 1 is nothing; this is the single-GPU baseline)
  fsdp2         FSDP2 (fully_shard per block + root; bf16 params, fp32 reduce), world 1 (NCCL)
  deepspeed     DeepSpeed ZeRO-3 bf16, world 1, torch AdamW as the client optimizer, where `import deepspeed` works
  zero3_compiled  zero3 with each block compiled by Inductor (the config's ``compile`` section: engine.compile())
  fsdp2_compiled  fsdp2 with each block compiled (torchtitan's recipe: ``block.compile()`` after fully_shard)
  fake8_zero3   per-rank peak GPU memory at world 8 on torch's fake process group (no data moves; shapes, buffers
  fake8_fsdp2   and allocations are real): zero_engine under zero.Init vs FSDP2 built on meta
  fake8_zero3_reuse0  fake8_zero3 with ``stage3_max_reuse_distance: 0`` (each block released after its forward, as
                FSDP2 does; docs/benchmarks.md, "Where the world-8 peak gap comes from")
  syncs         host synchronisations per phase (forward, backward, step) of each of 4 steps, counted by
                ``torch.cuda.set_sync_debug_mode("warn")``: world 1 over NCCL, and world 2 on the fake process group
                (where the gradient-presence walk and the step fingerprint run); each sync's Python line is listed

``--size demo`` swaps the 1.1B GPT for `make demo`'s (4 layers, n_embd 256, vocab 512, seq 64, micro-batch 8) with
the demo config's stage-3 keys (its buckets, and each Block one unit, as FSDP2's fully_shard per block): a step
that is launch-bound on a GPU, so its time is the runtime's CPU per step. (The 2026-11-27 GPU run's demo figures
were taken before the Block units were added here: each module with parameters was its own unit.)

Without CUDA the full run refuses (exit status 2, "no CUDA device"); ``--tiny`` runs every part at toy size on
whatever device there is (CPU here: memory figures are then n/a), which is how tests/test_gpu_check.py checks the
logic without a GPU. Timings: CUDA events around ``--steps`` steps after ``--warmup`` steps. ``--profile DIR`` then
runs ``--steps`` more steps of each part under torch.profiler and writes its op table to DIR/<part>.txt (a part's
peak memory is then read after those steps too).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("adam", "zero3", "torch", "fsdp2", "deepspeed", "zero3_compiled", "fsdp2_compiled", "fake8_zero3",
         "fake8_fsdp2", "fake8_zero3_reuse0", "syncs")
NO_CUDA_EXIT = 2
BYTES_PER_ADAM_ELEMENT = 28  # fp32: read param, grad, exp_avg, exp_avg_sq (16); write param, exp_avg, exp_avg_sq


def model_config(tiny: bool, size: str = "1b"):
    from zero_engine.testing.models import GPTConfig

    if tiny:
        return GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32), 2
    if size == "demo":  # examples/train_gpt.py's defaults and examples/configs/zero3.json's micro-batch
        return GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=8, n_embd=256), 8
    # 20 x 12 x 2048^2 + 32768 x 2048 (tied) + 1024 x 2048 = 1.076e9 parameters
    return GPTConfig(vocab_size=32768, block_size=1024, n_layer=20, n_head=16, n_embd=2048), 4


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_peak() -> None:
    if torch.cuda.is_available():
        synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_bytes():
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


PROFILE: tuple[Path, str] | None = None  # (--profile's folder, the part running): see profile_steps


def profile_steps(step, steps: int) -> None:
    """With ``--profile DIR``: ``steps`` more calls of ``step()`` under torch.profiler, after the timed ones, and its
    table of ops by self time (CUDA time on a GPU; totals over those steps) appended to DIR/<part>.txt. Where a
    part's time goes, e.g. which ops a compiled step spends more on than another runtime's."""
    folder, part = PROFILE
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        synchronize()
    by = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    folder.mkdir(parents=True, exist_ok=True)
    averages = prof.key_averages()
    with open(folder / f"{part}.txt", "a") as f:
        f.write(f"# {part}: {steps} steps under torch.profiler, sorted by {by} (totals over the {steps} steps)\n")
        if on_gpu:  # the GPU's kernel time against the step: what is left, the GPU waited
            busy_ms = sum(e.self_device_time_total for e in averages) / 1e3 / steps
            f.write(f"# GPU kernel time {busy_ms:.1f} ms a step (kernels on every stream, summed)\n")
        f.write(averages.table(sort_by=by, row_limit=45, max_name_column_width=70) + "\n")
        if on_gpu:  # and the host's side: where a step that waits on the CPU spends it
            f.write(f"# {part}: the same steps sorted by self_cpu_time_total\n")
            f.write(averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70) + "\n")


def time_steps(step, warmup: int, steps: int) -> float:
    """Seconds per call of ``step()``, after ``warmup`` calls (CUDA events on a GPU, wall clock otherwise); with
    ``--profile``, then ``steps`` more calls profiled (not timed)."""
    seconds = _time_steps(step, warmup, steps)
    if PROFILE is not None:
        profile_steps(step, steps)
    return seconds


STEP_MS: list[float] = []  # each timed step of the part running, ms (its result's step_ms_each)


def _time_steps(step, warmup: int, steps: int) -> float:
    """Seconds per step over ``steps`` steps; each step's own time goes to STEP_MS, so that a slow run shows whether
    every step was slow or a few were (a CUDA event between steps costs the GPU nothing and syncs nothing)."""
    for _ in range(warmup):
        step()
    synchronize()
    if torch.cuda.is_available():
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        marks[0].record()
        for mark in marks[1:]:
            step()
            mark.record()
        marks[-1].synchronize()
        STEP_MS[:] = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
        return marks[0].elapsed_time(marks[-1]) / 1e3 / steps
    marks = [time.perf_counter()]
    for _ in range(steps):
        step()
        marks.append(time.perf_counter())
    STEP_MS[:] = [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]
    return (marks[-1] - marks[0]) / steps


def batch(cfg, micro: int, dev):
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (micro, cfg.block_size + 1), generator=g)
    return idx[:, :-1].contiguous().to(dev), idx[:, 1:].contiguous().to(dev)


# ---- parts ---------------------------------------------------------------------------------------------------------
def part_adam(args) -> dict:
    from zero_engine.ops import make_adam

    dev = device()
    numel = 1 << 12 if args.tiny else 1 << 27  # 134M fp32 elements: 3.75 GB moved per step
    sizes = [numel // 8] * 8

    def tensors(seed):
        g = torch.Generator().manual_seed(seed)
        params = [torch.randn(n, generator=g).to(dev).requires_grad_(True) for n in sizes]
        for p in params:
            p.grad = torch.randn(p.numel(), generator=g).to(dev) * 1e-2
        return params

    ours_params, torch_params = tensors(0), tensors(0)
    ours, description = make_adam([{"params": ours_params}], dev.type, adamw_mode=True, lr=1e-3, weight_decay=0.1)
    reference = torch.optim.AdamW(torch_params, lr=1e-3, weight_decay=0.1, fused=True)
    ours_s = time_steps(ours.step, args.warmup, args.steps)
    torch_s = time_steps(reference.step, args.warmup, args.steps)
    # copy bandwidth: one read + one write per element of a buffer far larger than any cache
    src = torch.empty(numel * 2, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    copy_s = time_steps(lambda: dst.copy_(src), 2, 5)
    bandwidth = 2 * src.numel() * 4 / copy_s
    bound_s = BYTES_PER_ADAM_ELEMENT * numel / bandwidth
    return {"optimizer": description, "numel": numel, "ours_ms": ours_s * 1e3, "torch_fused_ms": torch_s * 1e3,
            "ours_over_torch_fused": ours_s / torch_s, "copy_bandwidth_GBps": bandwidth / 1e9,
            "hbm_bound_ms": bound_s * 1e3, "ours_over_hbm_bound": ours_s / bound_s,
            "torch_fused_over_hbm_bound": torch_s / bound_s}


def _train_step(model_or_engine, optimizer, x, y, engine: bool):
    def step():
        if engine:
            loss = model_or_engine(x, y)
            model_or_engine.backward(loss)
            model_or_engine.step()
        else:
            with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):
                loss = model_or_engine(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return step


def _result(cfg, seconds: float, tokens: int) -> dict:
    return {"step_ms": seconds * 1e3, "step_ms_each": [round(ms, 2) for ms in STEP_MS],
            "tokens_per_s": tokens / seconds, "peak_bytes": peak_bytes(),
            "model": {"n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "vocab": cfg.vocab_size, "seq": cfg.block_size}}


def _build_model(cfg):
    from zero_engine.testing.models import GPT

    torch.manual_seed(0)
    return GPT(cfg)


def _zero3_config(micro: int, compiled: bool = False, size: str = "1b", **zero_optimization) -> dict:
    compile_section = {"compile": {"enabled": True, "backend": "inductor"}} if compiled else {}
    if size == "demo":  # examples/configs/zero3.json's stage-3 keys
        buckets = {"reduce_bucket_size": 500_000, "stage3_prefetch_bucket_size": 1_000_000,
                   "stage3_param_persistence_threshold": 1000, "stage3_max_live_parameters": 2_000_000,
                   "stage3_max_reuse_distance": 100_000, "leaf_module": {"classes": ["Block"]}}
    else:
        buckets = {"reduce_bucket_size": 50_000_000, "stage3_prefetch_bucket_size": 50_000_000,
                   "stage3_param_persistence_threshold": 100_000}
    return {**compile_section, "train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
            "zero_optimization": {"stage": 3, "overlap_comm": True, **buckets, **zero_optimization}}


def part_zero3(args, compiled: bool = False) -> dict:
    import zero_engine

    cfg, micro = model_config(args.tiny, args.size)
    zero_engine.init_distributed()
    overrides = json.loads(args.zero_optimization)
    config = _zero3_config(micro, compiled, args.size, **overrides)
    engine, *_ = zero_engine.initialize(model=_build_model(cfg), config=config)
    x, y = batch(cfg, micro, engine.device)
    reset_peak()
    step = _train_step(engine, None, x, y, engine=True)
    seconds = time_steps(step, args.warmup, args.steps)
    out = _result(cfg, seconds, micro * cfg.block_size)
    out["params"] = sum(sp.numel for sp in engine.sharded)
    # one more steady step, its collectives counted (after the peak was read): how the units were gathered
    engine.reset_comm_stats()
    step()
    out["collectives_per_step"] = {kind: stat["calls"] for kind, stat in engine.comm_stats().items() if stat["calls"]}
    if overrides:
        out["zero_optimization_overrides"] = overrides
    return out


def part_zero3_compiled(args) -> dict:
    return part_zero3(args, compiled=True)


def part_torch(args) -> dict:
    cfg, micro = model_config(args.tiny, args.size)
    dev = device()
    model = _build_model(cfg).to(dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    x, y = batch(cfg, micro, dev)
    reset_peak()
    seconds = time_steps(_train_step(model, optimizer, x, y, engine=False), args.warmup, args.steps)
    return _result(cfg, seconds, micro * cfg.block_size)


def _fully_shard(model, mesh, compiled: bool = False):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
        if compiled:
            block.compile()
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _time_fsdp2(model, cfg, micro: int, dev, warmup: int, steps: int) -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)
    x, y = batch(cfg, micro, dev)
    reset_peak()

    def step():
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _result(cfg, time_steps(step, warmup, steps), micro * cfg.block_size)


def part_fsdp2(args, compiled: bool = False) -> dict:
    import zero_engine
    from torch.distributed.device_mesh import init_device_mesh

    cfg, micro = model_config(args.tiny, args.size)
    zero_engine.init_distributed()
    dev = device()
    mesh = init_device_mesh(dev.type, (1,))
    model = _fully_shard(_build_model(cfg).to(dev), mesh, compiled)
    return _time_fsdp2(model, cfg, micro, dev, args.warmup, args.steps)


def part_fsdp2_compiled(args) -> dict:
    return part_fsdp2(args, compiled=True)


def part_deepspeed(args) -> dict:
    try:
        import deepspeed
    except Exception as error:  # noqa: BLE001 -- any import failure means "not available here"
        return {"skipped": f"import deepspeed failed: {type(error).__name__}: {error}"}
    cfg, micro = model_config(args.tiny, args.size)
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    model = _build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    config = {k: v for k, v in _zero3_config(micro, size=args.size).items() if k != "optimizer"}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    x, y = batch(cfg, micro, engine.device)
    reset_peak()

    def step():
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()

    out = _result(cfg, time_steps(step, args.warmup, args.steps), micro * cfg.block_size)
    out["deepspeed"] = deepspeed.__version__
    return out


def part_fake8_zero3(args, **zero_optimization) -> dict:
    import zero_engine
    from zero_engine.testing import fake_world

    cfg, micro = model_config(args.tiny, args.size)
    with fake_world(8):
        with zero_engine.zero.Init():
            model = _build_model(cfg)
        config = _zero3_config(micro, size=args.size, **zero_optimization)
        engine, *_ = zero_engine.initialize(model=model, config=config)
        x, y = batch(cfg, micro, engine.device)
        reset_peak()
        seconds = time_steps(_train_step(engine, None, x, y, engine=True), 1, 2)
        if engine.skipped_steps:  # a skipped step allocates no optimizer states: its peak would be too low
            return {"error": f"{engine.skipped_steps} of {engine.global_steps} steps skipped as non-finite on the "
                             "fake group; the peak would miss the optimizer's states"}
        out = _result(cfg, seconds, micro * cfg.block_size)
        out["model_state_bytes"] = engine.model_state_bytes(engine.memory_stats())
    return out


def part_fake8_zero3_reuse0(args) -> dict:
    return part_fake8_zero3(args, stage3_max_reuse_distance=0)


def _count_syncs(engine, cfg, micro: int, steps: int = 4) -> list:
    """Per step, for forward, backward and step: the Python lines (file:line) of each synchronising CUDA call."""
    from zero_engine.testing import cuda_syncs

    x, y = batch(cfg, micro, engine.device)
    counted = []
    for _ in range(steps):
        loss, forward = cuda_syncs(lambda: engine(x, y))
        _, backward = cuda_syncs(lambda: engine.backward(loss))
        _, step = cuda_syncs(engine.step)
        counted.append({"forward": forward, "backward": backward, "step": step})
    return counted


def part_syncs(args) -> dict:
    import zero_engine
    from zero_engine.testing import fake_world

    if not torch.cuda.is_available():
        return {"skipped": "CUDA only (set_sync_debug_mode); tests/test_host_syncs.py counts them on the CPU"}
    cfg, micro = model_config(args.tiny, "demo")
    zero_engine.init_distributed()
    engine, *_ = zero_engine.initialize(model=_build_model(cfg), config=_zero3_config(micro, size="demo"))
    world1 = _count_syncs(engine, cfg, micro)
    engine.destroy()
    torch.distributed.destroy_process_group()
    with fake_world(2):
        with zero_engine.zero.Init():
            model = _build_model(cfg)
        engine, *_ = zero_engine.initialize(model=model, config=_zero3_config(micro, size="demo"))
        fake2 = _count_syncs(engine, cfg, micro)
        engine.destroy()
    return {"world1_nccl": world1, "world2_fake": fake2}


def part_fake8_fsdp2(args) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from zero_engine.testing import fake_world

    cfg, micro = model_config(args.tiny, args.size)
    dev = device()
    with fake_world(8):
        with torch.device("meta"):
            model = _build_model(cfg)
        mesh = init_device_mesh(dev.type, (8,))
        model = _fully_shard(model, mesh)
        model.to_empty(device=dev)
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().normal_(0.0, 0.02)  # values do not matter for memory; finite ones keep it honest
        return _time_fsdp2(model, cfg, micro, dev, 1, 2)


# ---- driver ----------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_part(name: str, args) -> dict:
    """One part in a fresh process (world-1 rendezvous on a free local port); its JSON result or its error."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, __file__, "--run-part", name, "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--size", args.size]
    if args.tiny:
        cmd.append("--tiny")
    if args.profile:
        cmd += ["--profile", str(Path(args.profile).resolve())]
    cmd += ["--zero-optimization", args.zero_optimization]
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.part_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.part_timeout}s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            result["wall_s"] = round(time.perf_counter() - started, 1)
            return result
    return {"error": f"exit status {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}"}


def _gib(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def _ratio(a: dict, b: dict, key: str) -> str:
    if a.get(key) is None or b.get(key) is None:
        return "n/a"
    return f"{a[key] / b[key]:.2f}x"


def markdown(report: dict) -> str:
    r = report["results"]
    lines = [f"# gpu-check on {report['device']} (torch {report['torch']}, {report['date']})", ""]
    adam = r.get("adam", {})
    if "ours_ms" in adam:
        lines += ["## Adam step (fp32, %d elements)" % adam["numel"], "",
                  "| optimizer | ms/step | ÷ torch fused AdamW | ÷ HBM bound |", "|---|---|---|---|",
                  f"| {adam['optimizer']} | {adam['ours_ms']:.3f} | {adam['ours_over_torch_fused']:.2f} | "
                  f"{adam['ours_over_hbm_bound']:.2f} |",
                  f"| torch fused AdamW | {adam['torch_fused_ms']:.3f} | 1.00 | "
                  f"{adam['torch_fused_over_hbm_bound']:.2f} |", "",
                  f"HBM bound: {BYTES_PER_ADAM_ELEMENT} bytes/element at the measured copy bandwidth "
                  f"{adam['copy_bandwidth_GBps']:.0f} GB/s = {adam['hbm_bound_ms']:.3f} ms.", ""]
    lines += ["## Training step, world 1, bf16", "",
              "| runtime | ms/step | each step, min-max ms | tokens/s | peak allocated | step ÷ zero3 | peak ÷ zero3 |",
              "|---|---|---|---|---|---|---|"]
    zero3 = r.get("zero3", {})
    for name in ("zero3", "torch", "fsdp2", "deepspeed", "zero3_compiled", "fsdp2_compiled"):
        res = r.get(name, {})
        if "step_ms" in res:
            each = res.get("step_ms_each")  # results written before 2026-12-04 have none
            spread = f"{min(each):.1f}-{max(each):.1f}" if each else "n/a"
            lines.append(f"| {name} | {res['step_ms']:.1f} | {spread} | "
                         f"{res['tokens_per_s']:.0f} | {_gib(res['peak_bytes'])} | "
                         f"{_ratio(res, zero3, 'step_ms')} | {_ratio(res, zero3, 'peak_bytes')} |")
        else:
            lines.append(f"| {name} | {res.get('skipped') or res.get('error', 'not run')[:200]} | | | | | |")
    lines += ["", "## Per-rank peak at world 8 (fake process group)", "", "| runtime | peak allocated per rank |",
              "|---|---|"]
    for name in ("fake8_zero3", "fake8_fsdp2", "fake8_zero3_reuse0"):
        res = r.get(name, {})
        value = _gib(res["peak_bytes"]) if "step_ms" in res else res.get("error", "not run")[:200]
        lines.append(f"| {name.replace('fake8_', '')} | {value} |")
    syncs = r.get("syncs", {})
    if "world1_nccl" in syncs:
        lines += ["", "## Host syncs per phase (demo GPT, set_sync_debug_mode)", "",
                  "| world | step | forward | backward | step() | where (the step's calls) |", "|---|---|---|---|---|---|"]
        for world in ("world1_nccl", "world2_fake"):
            for i, phases in enumerate(syncs[world]):
                lines.append(f"| {world} | {i} | {len(phases['forward'])} | {len(phases['backward'])} | "
                             f"{len(phases['step'])} | {', '.join(sorted(set(phases['step'])))} |")
    lines += ["", f"Command: `{report['command']}`", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_check"))
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--tiny", action="store_true", help="toy sizes on any device (tests the logic on CPU)")
    parser.add_argument("--size", choices=("1b", "demo"), default="1b", help="the GPT: 1.1B, or make demo's")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--part-timeout", type=int, default=240)
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help="also profile each part's steps (torch.profiler) after timing them: DIR/<part>.txt")
    parser.add_argument("--zero-optimization", metavar="JSON", default="{}",
                        help="keys merged into the zero3 parts' zero_optimization section, e.g. "
                             "'{\"stage3_prefetch_bucket_size\": 60000000}'")
    parser.add_argument("--run-part", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        overrides = json.loads(args.zero_optimization)
    except json.JSONDecodeError as e:
        parser.error(f"--zero-optimization: not JSON ({e}); pass an object, e.g. "
                     "'{\"stage3_prefetch_bucket_size\": 60000000}'")
    if not isinstance(overrides, dict):
        parser.error("--zero-optimization: a JSON object of zero_optimization keys is needed, got "
                     f"{args.zero_optimization}")
    if args.run_part:
        global PROFILE
        PROFILE = (Path(args.profile), args.run_part) if args.profile else None
        result = globals()[f"part_{args.run_part}"](args)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if not torch.cuda.is_available() and not args.tiny:
        print("gpu-check: no CUDA device (torch.cuda.is_available() is False with torch "
              f"{torch.__version__}); nothing was run. Run it on a machine with a GPU and a CUDA build of torch.",
              file=sys.stderr)
        return NO_CUDA_EXIT
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": " ".join(["python", "bench/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
              "tiny": args.tiny, "results": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in parts:
        print(f"gpu-check: {name} ...", flush=True)
        report["results"][name] = result = run_part(name, args)
        print(f"gpu-check: {name}: {json.dumps(result)[:300]}", flush=True)
        # written after every part: a run stopped from outside keeps the figures of the parts that finished
        out.with_suffix(".json").write_text(json.dumps(report, indent=2))
        out.with_suffix(".md").write_text(markdown(report))
    print(f"gpu-check: wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    failed = [name for name, res in report["results"].items() if "error" in res]
    if failed:
        print(f"gpu-check: parts that failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
