"""Optimizer step throughput: zero_engine's CPUAdam (or FusedAdam) against torch's AdamW, in one run.

    python bench/optimizer.py                     # CPU: 1M, 10M, 100M parameters
    python bench/optimizer.py --device cuda       # GPU: FusedAdam vs torch's fused / foreach AdamW

Prints a markdown table: parameters updated per second, effective GB/s, the ratio to torch's fused
AdamW, and the share of the memory-bandwidth bound. Adam must move at least 28 bytes per fp32
parameter (read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq); "effective
GB/s" is params/s x 28 for every variant, i.e. the useful bytes, whatever extra passes a variant
makes. The bound is a STREAM-like triad (``a = b + s * c``) measured in the same run, before and
after the optimizers, counted with its real traffic (see [Note: which bandwidth bounds Adam]).

Variants run round-robin, one repeat of each in turn, so that a noisy neighbour slows all of them
alike; the table reports medians. All variants update the same parameter and gradient tensors
(each with its own moments), which keeps 100M parameters within a few GB.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zero_engine.ops import CPUAdam, FusedAdam  # noqa: E402

ADAM_BYTES_PER_PARAM = 28  # fp32 param, grad, exp_avg, exp_avg_sq read; param, exp_avg, exp_avg_sq written


@dataclass
class Variant:
    name: str
    step: Callable[[], None]
    bytes_per_param: int
    times: list[float]


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Bandwidth(NamedTuple):
    triad_stream: float  # bytes/s of a = b + s * c counted as STREAM does: 12 B per element
    triad_traffic: float  # the same run counting the write-allocate read of `a` too: 16 B per element
    in_place: float  # bytes/s of a += s * b: 12 B per element, no write-allocate (like Adam's streams)


def timed_median(function: Callable[[], object], device: str, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first run is a warm-up
        synchronize(device)
        started = time.perf_counter()
        function()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def measure_bandwidth(device: str, numel: int, repeats: int) -> Bandwidth:
    """Memory bandwidth over arrays much larger than the last-level cache.

    [Note: which bandwidth bounds Adam]
    Ordinary stores to a line that is not in cache first read it (write-allocate), so a triad
    really moves 16 B per element while STREAM counts 12. Adam writes only lines it has just read,
    so its 28 B per parameter are its real traffic; the fair bound is the triad's real traffic,
    16 B per element. The in-place a += s * b (no write-allocate) is printed as a cross-check:
    where it matches the 16 B figure, the write-allocate traffic is real on this machine.
    """
    b = torch.rand(numel, device=device)
    c = torch.rand(numel, device=device)
    a = torch.empty_like(b)
    triad_seconds = timed_median(lambda: torch.add(b, c, alpha=3.0, out=a), device, repeats)
    in_place_seconds = timed_median(lambda: a.add_(b, alpha=3.0), device, repeats)
    return Bandwidth(12 * numel / triad_seconds, 16 * numel / triad_seconds, 12 * numel / in_place_seconds)


def cpu_variants(param: torch.Tensor, lr: float) -> list[Variant]:
    numel = param.numel()
    grad = torch.randn(numel) * 1e-2
    grad_bf16 = grad.bfloat16()
    copy_bf16 = torch.empty(numel, dtype=torch.bfloat16)
    param.grad_dtype = None  # the same parameter takes fp32 and bf16 gradients below
    variants = []

    def add(name: str, step: Callable[[], None], bytes_per_param: int = ADAM_BYTES_PER_PARAM) -> None:
        variants.append(Variant(name, step, bytes_per_param, []))

    ours = CPUAdam([param], lr=lr)
    add(f"CPUAdam ({ours.kernel_info.split(' (')[0]})", with_grad(param, grad, ours.step))
    foreach = torch.optim.AdamW([param], lr=lr, foreach=True)
    add("torch AdamW foreach", with_grad(param, grad, foreach.step))
    fused = torch.optim.AdamW([param], lr=lr, fused=True)
    add("torch AdamW fused", with_grad(param, grad, fused.step))

    # ZeRO-offload's real step: bf16 gradient shard in, bf16 compute copy of the new params out.
    # Same 28 useful bytes per parameter (param 4+4, grad 2, moments 8+8, copy 2).
    ours_offload = CPUAdam([param], lr=lr)
    ours_offload.set_low_precision_copy(param, copy_bf16)
    add("CPUAdam, bf16 grad + bf16 copy", with_grad(param, grad_bf16, ours_offload.step))
    fused_offload = torch.optim.AdamW([param], lr=lr, fused=True)
    grad_fp32 = torch.empty(numel)

    def torch_offload_step() -> None:
        grad_fp32.copy_(grad_bf16)  # torch's AdamW needs the gradient in the parameter's dtype
        param.grad = grad_fp32
        fused_offload.step()
        copy_bf16.copy_(param)

    add("torch fused, bf16 grad + bf16 copy", torch_offload_step)
    return variants


def cuda_variants(param: torch.Tensor, lr: float) -> list[Variant]:
    grad = torch.randn_like(param) * 1e-2
    ours = FusedAdam([param], lr=lr)
    fused = torch.optim.AdamW([param], lr=lr, fused=True)
    foreach = torch.optim.AdamW([param], lr=lr, foreach=True)
    return [Variant("FusedAdam", with_grad(param, grad, ours.step), ADAM_BYTES_PER_PARAM, []),
            Variant("torch AdamW foreach", with_grad(param, grad, foreach.step), ADAM_BYTES_PER_PARAM, []),
            Variant("torch AdamW fused", with_grad(param, grad, fused.step), ADAM_BYTES_PER_PARAM, [])]


def with_grad(param: torch.Tensor, grad: torch.Tensor, step: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        param.grad = grad
        step()

    return run


def measure(variants: list[Variant], device: str, steps_per_repeat: int, repeats: int, warmup: int) -> None:
    for variant in variants:
        for _ in range(warmup):
            variant.step()  # moments allocated, pages touched, kernels loaded
    for _ in range(repeats):
        for variant in variants:
            synchronize(device)
            started = time.perf_counter()
            for _ in range(steps_per_repeat):
                variant.step()
            synchronize(device)
            variant.times.append((time.perf_counter() - started) / steps_per_repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7, 1e8])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPUAdam follows it)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = args.device
    make_variants = cpu_variants if device == "cpu" else cuda_variants

    bandwidth_numel = 1 << 25 if device == "cpu" else 1 << 28  # 128 MiB / 1 GiB per array, beyond any cache
    load_before = os.getloadavg()[0]
    before = measure_bandwidth(device, bandwidth_numel, args.repeats)
    rows = []
    for size in args.sizes:
        numel = int(size)
        param = torch.randn(numel, device=device) * 1e-1
        variants = make_variants(param, lr=1e-4)
        # Aim for >= ~20 ms per timed repeat so that timer and launch noise stay below 1%.
        steps_per_repeat = max(1, int(2e7 // numel)) if device == "cpu" else max(1, int(2e9 // numel))
        measure(variants, device, steps_per_repeat, args.repeats, args.warmup)
        rows.append((numel, variants))
        del param, variants
    after = measure_bandwidth(device, bandwidth_numel, args.repeats)
    load_after = os.getloadavg()[0]
    bound = statistics.median([before.triad_traffic, after.triad_traffic])

    threads = torch.get_num_threads() if device == "cpu" else 0
    print(f"device: {device}{f', {threads} threads' if threads else ''}; torch {torch.__version__}; "
          f"medians of {args.repeats} repeats; load average {load_before:.1f} before, {load_after:.1f} after "
          f"({os.cpu_count()} CPUs: a load above that means other processes shared the cores)")
    for label, value in (("before", before), ("after", after)):
        print(f"bandwidth {label}: triad {value.triad_stream / 1e9:.1f} GB/s as STREAM counts (12 B/elem), "
              f"{value.triad_traffic / 1e9:.1f} GB/s real traffic (16 B/elem); in-place a += s*b "
              f"{value.in_place / 1e9:.1f} GB/s")
    print(f"bound: {bound / 1e9:.1f} GB/s / {ADAM_BYTES_PER_PARAM} B per param = "
          f"{bound / ADAM_BYTES_PER_PARAM / 1e6:.0f} M params/s\n")
    print("| params | optimizer | ms / step | M params/s | effective GB/s | vs torch fused | % of bound |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for numel, variants in rows:
        fused_time = next(statistics.median(v.times) for v in variants if v.name == "torch AdamW fused")
        for variant in variants:
            seconds = statistics.median(variant.times)
            params_per_second = numel / seconds
            gigabytes_per_second = params_per_second * variant.bytes_per_param / 1e9
            print(f"| {numel / 1e6:g}M | {variant.name} | {seconds * 1e3:.2f} | {params_per_second / 1e6:.0f} | "
                  f"{gigabytes_per_second:.1f} | {fused_time / seconds:.2f}x | "
                  f"{100 * gigabytes_per_second * 1e9 / bound:.0f}% |")


if __name__ == "__main__":
    main()
