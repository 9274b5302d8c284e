"""Tests of zero_engine.ops: CPUAdam / FusedAdam parity with torch, state dicts, the builder and the fallback.

[Note: parity tolerance]
CPUAdam and torch compute in fp32 with the same operations in the same order, except that CPUAdam
multiplies by 1 / sqrt(1 - beta2^t) where torch divides, and fuses multiply-adds (FMA) that torch
may round twice: an ulp or two of an intermediate per step. Over 50 steps with lr=1e-2 and O(1)
parameters that stays below 1e-5 absolute (measured: at most 4.3e-6 over 10^6 elements), while a
wrong formula (missing bias correction, wrong decay, swapped betas) moves parameters by ~1e-3 or
more, and a kernel that does nothing misses by ~0.5.
"""

from __future__ import annotations

import copy
import functools
import io
import pickle
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from zero_engine.ops import (CPUAdam, FusedAdam, OpBuildError, load_op, make_adam, op_report, op_report_text)
from zero_engine.ops import builder, fallback

pytestmark = pytest.mark.timeout(300)  # the first test builds the op (seconds; minutes on a slow CI machine)

SIZES = [1, 7, 4097, 10**6 + 3]
STEPS = 50
LR = 1e-2
WEIGHT_DECAY = 0.1
ATOL = 1e-5  # see [Note: parity tolerance]
RTOL = 1e-5
# Without bias correction the first updates are ~(1 - beta1) / sqrt(1 - beta2) = 3.2x larger than lr,
# and so are the rounding differences (measured: ~1.3e-5 at 10^6 elements).
ATOL_NO_BIAS_CORRECTION = 4e-5


@functools.lru_cache(maxsize=8)
def make_grads(size: int, steps: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Cached: several tests use the same gradients (callers must not modify them)."""
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(size, generator=generator).to(dtype) for _ in range(steps))


def make_param(size: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(seed))


def set_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    if grad.dtype != param.dtype:
        param.grad_dtype = grad.dtype  # torch refuses a gradient of another dtype unless told
    param.grad = grad


def reference_adam(param: torch.Tensor, grads: Sequence[torch.Tensor], *, adamw_mode: bool,
                   bias_correction: bool) -> torch.Tensor:
    """Adam in plain fp32 torch ops, in torch.optim.AdamW's order; also covers bias_correction=False,
    which torch has no switch for (checked against torch itself in test_reference_matches_torch)."""
    param = param.clone()
    exp_avg = torch.zeros_like(param)
    exp_avg_sq = torch.zeros_like(param)
    grad = torch.empty_like(param)
    denom = torch.empty_like(param)  # preallocated: fresh 4 MB tensors per op make this 10x slower
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    for step, raw_grad in enumerate(grads, start=1):
        grad.copy_(raw_grad)
        if adamw_mode:
            param.mul_(1 - LR * WEIGHT_DECAY)
        else:
            grad.add_(param, alpha=WEIGHT_DECAY)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step if bias_correction else 1.0
        bias_correction2 = 1 - beta2**step if bias_correction else 1.0
        torch.sqrt(exp_avg_sq, out=denom)
        denom.div_(bias_correction2**0.5).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-LR / bias_correction1)
    return param


def run_cpu_adam(param: torch.Tensor, grads: Sequence[torch.Tensor], **kwargs) -> tuple[torch.Tensor, CPUAdam]:
    param = param.clone().requires_grad_(True)
    optimizer = CPUAdam([param], lr=LR, weight_decay=WEIGHT_DECAY, **kwargs)
    for grad in grads:
        set_grad(param, grad)
        optimizer.step()
    return param.detach(), optimizer


def run_torch(param: torch.Tensor, grads: Sequence[torch.Tensor], adamw_mode: bool) -> torch.Tensor:
    param = param.clone().requires_grad_(True)
    torch_class = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    optimizer = torch_class([param], lr=LR, weight_decay=WEIGHT_DECAY, fused=True)  # fused: the fastest reference
    for grad in grads:
        param.grad = grad.float()  # torch needs fp32 grads; bf16 -> fp32 is exact, as in the kernel
        optimizer.step()
    return param.detach()


@pytest.fixture(scope="module", autouse=True)
def cpu_adam_op():
    # Built here once (the slow part of a cold run); a build failure fails every test, as it should in CI.
    return load_op("cpu_adam")


# Parity ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32_grad", "bf16_grad"])
def test_matches_torch(size, adamw_mode, grad_dtype):
    param = make_param(size)
    grads = make_grads(size, STEPS, grad_dtype)
    ours, _ = run_cpu_adam(param, grads, adamw_mode=adamw_mode)
    expected = run_torch(param, grads, adamw_mode)
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=RTOL)
    assert (ours - param).abs().max() > 100 * ATOL  # the parameters really moved


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam"])
def test_reference_matches_torch(adamw_mode):
    param = make_param(4097)
    grads = make_grads(4097, STEPS, torch.float32)
    ours = reference_adam(param, grads, adamw_mode=adamw_mode, bias_correction=True)
    torch.testing.assert_close(ours, run_torch(param, grads, adamw_mode), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam"])
def test_without_bias_correction(size, adamw_mode):
    param = make_param(size)
    grads = make_grads(size, STEPS, torch.bfloat16)
    ours, _ = run_cpu_adam(param, grads, adamw_mode=adamw_mode, bias_correction=False)
    expected = reference_adam(param, grads, adamw_mode=adamw_mode, bias_correction=False)
    torch.testing.assert_close(ours, expected, atol=ATOL_NO_BIAS_CORRECTION, rtol=RTOL)
    head = [grad[:64] for grad in grads]  # elementwise math: a slice suffices to show the switch matters
    with_correction = reference_adam(param[:64], head, adamw_mode=adamw_mode, bias_correction=True)
    assert (ours[:64] - with_correction).abs().max() > 100 * ATOL


def test_fp16_grads_match_torch():
    param = make_param(4097)
    grads = [(grad * 1e-2).half() for grad in make_grads(4097, STEPS, torch.float32)]  # inside fp16's range
    ours, _ = run_cpu_adam(param, grads)
    torch.testing.assert_close(ours, run_torch(param, grads, adamw_mode=True), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam"])
def test_grad_scale_in_the_kernel_equals_scaling_an_fp32_copy(grad_dtype, adamw_mode, device):
    """step(grad_scale=c) on 16-bit gradients is bitwise what ZeRO did before: grad.float() * c as an fp32
    gradient (c not a power of two, so it rounds). CPUAdam on the CPU (its vector body and tail: 4097 + 5
    elements), FusedAdam on CUDA (a 64 Ki chunk on its vector path, a 6-element chunk on its element path)."""
    size = 4097 + 5 if device == "cpu" else (1 << 16) + 6
    param = make_param(size).to(device)
    scales = [0.37, 1.0, 3.1e-3]
    grads = [grad.to(device) for grad in make_grads(size, 3, grad_dtype)]
    in_kernel = param.clone().requires_grad_(True)
    copied = param.clone().requires_grad_(True)
    optimizer = CPUAdam if device == "cpu" else FusedAdam
    opt_kernel = optimizer([in_kernel], lr=LR, weight_decay=WEIGHT_DECAY, adamw_mode=adamw_mode)
    opt_copied = optimizer([copied], lr=LR, weight_decay=WEIGHT_DECAY, adamw_mode=adamw_mode)
    for grad, scale in zip(grads, scales):
        set_grad(in_kernel, grad)
        opt_kernel.step(grad_scale=scale)
        copied.grad = grad.float() * scale
        opt_copied.step()
        assert torch.equal(in_kernel, copied), (grad_dtype, scale)
    assert opt_kernel._grad_scale == 1.0  # only for that step


def test_params_that_skip_steps_keep_their_own_step_count():
    # Bias correction depends on each parameter's own step count; CPUAdam batches by step.
    ours = [make_param(size, seed) for seed, size in enumerate([7, 4097, 33])]
    theirs = [param.clone().requires_grad_(True) for param in ours]
    ours = [param.clone().requires_grad_(True) for param in ours]
    optimizer = CPUAdam(ours, lr=LR, weight_decay=WEIGHT_DECAY)
    reference = torch.optim.AdamW(theirs, lr=LR, weight_decay=WEIGHT_DECAY, foreach=False)
    generator = torch.Generator().manual_seed(3)
    for step in range(12):
        for index, (mine, other) in enumerate(zip(ours, theirs)):
            skips = step % (index + 1) != 0  # param 0 every step, param 1 every other, param 2 every third
            grad = None if skips else torch.randn(mine.shape, generator=generator)
            mine.grad = grad
            other.grad = None if grad is None else grad.clone()
        optimizer.step()
        reference.step()
    for mine, other in zip(ours, theirs):
        torch.testing.assert_close(mine, other, atol=ATOL, rtol=RTOL)
    assert [int(optimizer.state[p]["step"]) for p in ours] == [12, 6, 4]



def _stepped_once(count: int, size: int = 5) -> tuple[list[torch.Tensor], CPUAdam]:
    """``count`` parameters of ``size`` elements with gradients of ones, and a CPUAdam that has stepped them once
    (the states are made on the first step)."""
    params = [make_param(size, seed).requires_grad_(True) for seed in range(count)]
    optimizer = CPUAdam(params, lr=LR)
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    return params, optimizer


def _python_calls_of_a_step(count: int) -> tuple[int, int]:
    """(zero_engine.ops Python calls, kernel calls) of one CPUAdam step over ``count`` parameters of one group."""
    import sys

    _, optimizer = _stepped_once(count)
    kernel_calls, python_calls = [], []
    optimizer._update_batch = lambda *args, update=optimizer._update_batch: (kernel_calls.append(1), update(*args))

    def count_calls(frame, event, arg):
        if event == "call" and f"zero_engine{os.sep}ops" in frame.f_code.co_filename:
            python_calls.append(frame.f_code.co_name)
    sys.setprofile(count_calls)
    try:
        optimizer.step()
    finally:
        sys.setprofile(None)
    return len(python_calls), len(kernel_calls)


def test_a_step_makes_no_python_call_per_parameter():
    # [Note: the step's Python per group] in adam_base.py: the checks, states, step counts and batching run once per
    # param group, so 40 parameters cost the Python calls of 4, and one kernel call.
    few, many = _python_calls_of_a_step(4), _python_calls_of_a_step(40)
    assert few == many and many[1] == 1, (few, many)


def test_a_step_reads_its_step_counts_in_one_call(monkeypatch):
    # one tolist() over the group's counters, not an item() per parameter (52 a step on the demo)
    params, optimizer = _stepped_once(40)
    reads = []
    monkeypatch.setattr(torch.Tensor, "item", lambda self, item=torch.Tensor.item: (reads.append(1), item(self))[1])
    optimizer.step()
    assert reads == [] and {int(optimizer.state[p]["step"]) for p in params} == {2}


def test_the_step_counts_stepped_together_are_views_of_one_buffer():
    # [Note: the step counts are views of one buffer]: one add_ a step instead of an op per parameter (0.34 ms a step
    # for the demo's 52 on CPU); each count is still a float32 scalar tensor a user can edit or replace
    params, optimizer = _stepped_once(6)
    optimizer.step()
    steps = [optimizer.state[p]["step"] for p in params]
    assert len({step.untyped_storage().data_ptr() for step in steps}) == 1
    assert all(step.dtype == torch.float32 and step.dim() == 0 for step in steps)
    steps[1].fill_(7)  # an edit in place is the count
    optimizer.state[params[2]]["step"] = torch.tensor(3.0)  # a tensor put in its place (a loaded checkpoint) too
    optimizer.step()
    assert [int(optimizer.state[p]["step"]) for p in params] == [3, 8, 4, 3, 3, 3]


def test_a_step_count_saved_as_a_plain_number_goes_on():
    # a checkpoint of an older torch stored the step as a number; it becomes a float32 tensor, one step further
    params, optimizer = _stepped_once(2, 7)
    optimizer.state[params[0]]["step"] = 5
    optimizer.step()
    steps = [optimizer.state[param]["step"] for param in params]
    assert all(isinstance(step, torch.Tensor) and step.dtype == torch.float32 for step in steps)
    assert [int(step) for step in steps] == [6, 2]

# Low-precision copy ---------------------------------------------------------------------------------

SPECIAL_VALUES = torch.tensor([
    0.0, -0.0, 1.0, -1.0, 1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-11, 1 + 3 * 2**-11,
    65504.0, 65519.0, 65520.0, -65520.0, 1e5, 6e-8, 3e-8, 2.9802322e-08, 1e-7, 1e-40, -1e-40, 1e-45,
    3.4e38, -3.4e38, float("inf"), float("-inf"), float("nan"), 2**-14, 2**-15 * 1.5, 2**-24, 2**-25,
])  # where a hand-written rounding goes wrong: ties, subnormals, overflow, signed zero, inf, NaN


def special_params() -> list[torch.Tensor]:
    """The special values in the vector body (a large tensor, sprinkled) and in the scalar tail
    (tensors of 15 elements, shorter than any vector), as separate parameters of one optimizer."""
    sprinkled = make_param(4097) * 100
    positions = torch.randperm(4097, generator=torch.Generator().manual_seed(6))[: 4 * len(SPECIAL_VALUES)]
    sprinkled[positions] = SPECIAL_VALUES.repeat(4)
    tensors = [sprinkled, SPECIAL_VALUES.clone(), SPECIAL_VALUES[:15].clone(), SPECIAL_VALUES[15:].clone()]
    return [tensor.requires_grad_(True) for tensor in tensors]


def assert_same_bits(copy: torch.Tensor, param: torch.Tensor) -> None:
    expected = param.to(copy.dtype)
    nan = expected.isnan()
    assert torch.equal(copy.isnan(), nan)
    assert torch.equal(copy[~nan].view(torch.int16), expected[~nan].view(torch.int16))


def check_copy_of_special_values(copy_dtype: torch.dtype) -> None:
    # lr=0 and weight_decay=0 leave the parameters unchanged, so special values reach the copy as they are.
    params = special_params()
    optimizer = CPUAdam(params, lr=0.0, weight_decay=0.0)
    copies = [torch.empty(param.numel(), dtype=copy_dtype) for param in params]
    for param, copy in zip(params, copies):
        optimizer.set_low_precision_copy(param, copy)
        param.grad = torch.ones_like(param)
    optimizer.step()
    for param, copy in zip(params, copies):
        assert_same_bits(copy, param.detach())


@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_copy_rounds_like_torch(copy_dtype):
    check_copy_of_special_values(copy_dtype)


@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_copy_follows_every_step(copy_dtype):
    size = 10**6 + 3
    param = make_param(size).requires_grad_(True)
    copy = torch.zeros(size, dtype=copy_dtype)
    optimizer = CPUAdam([param], lr=LR)
    optimizer.set_low_precision_copy(param, copy)
    for grad in make_grads(size, 3, torch.bfloat16):
        set_grad(param, grad)
        optimizer.step()
        assert_same_bits(copy, param.detach())
    optimizer.set_low_precision_copy(param, None)
    frozen = copy.clone()
    optimizer.step()
    assert torch.equal(copy, frozen)


def test_low_precision_copy_rejects_mismatches():
    param = torch.zeros(8, requires_grad=True)
    optimizer = CPUAdam([param])
    with pytest.raises(ValueError, match="bf16 or fp16"):
        optimizer.set_low_precision_copy(param, torch.zeros(8))
    with pytest.raises(ValueError, match="9 elements"):
        optimizer.set_low_precision_copy(param, torch.zeros(9, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="not in any param group"):
        optimizer.set_low_precision_copy(torch.zeros(8), torch.zeros(8, dtype=torch.bfloat16))


# Kernel levels --------------------------------------------------------------------------------------

def supported_levels() -> list[str]:
    flags = builder.cpu_flags()
    return [level.name for level in builder.SIMD_LEVELS if all(flag in flags for flag in level.cpu_flags)]


@pytest.mark.parametrize("level", ["avx2", "scalar"])
def test_other_kernel_levels(level, monkeypatch):
    """The AVX2 and scalar builds (chosen on other CPUs) give the same results as the best level here."""
    if level not in supported_levels():
        pytest.skip(f"this CPU cannot run the {level} kernel")
    size = 4097 + 5
    param = make_param(size)
    grads = make_grads(size, 10, torch.bfloat16)
    best, _ = run_cpu_adam(param, grads)
    monkeypatch.setenv(builder.SIMD_ENV, level)
    ours, optimizer = run_cpu_adam(param, grads)
    assert optimizer.kernel_info.startswith(level)
    if level == "scalar":
        # No FMA in a baseline x86-64 build: products are rounded separately, a few ulps apart.
        torch.testing.assert_close(ours, best, atol=ATOL, rtol=RTOL)
    else:
        assert torch.equal(ours, best)  # same operations, same FMAs: bitwise equal
    for copy_dtype in (torch.bfloat16, torch.float16):
        check_copy_of_special_values(copy_dtype)


def test_unknown_kernel_level_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(builder.SIMD_ENV, "sse9")
    with pytest.raises(ValueError, match="sse9"):
        CPUAdam([torch.zeros(2, requires_grad=True)])


# State dict -----------------------------------------------------------------------------------------

def test_state_dict_round_trip_resumes_bitwise():
    size = 4097
    param = make_param(size)
    grads = make_grads(size, 10, torch.float32)
    uninterrupted, _ = run_cpu_adam(param, grads)

    first_half, optimizer = run_cpu_adam(param, grads[:5])
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    resumed = first_half.clone().requires_grad_(True)
    restored = CPUAdam([resumed], lr=LR, weight_decay=WEIGHT_DECAY)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert set(restored.state[resumed]) == {"step", "exp_avg", "exp_avg_sq"}
    for grad in grads[5:]:
        resumed.grad = grad
        restored.step()
    assert torch.equal(resumed.detach(), uninterrupted)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_optimizer_steps_on_as_the_original(how):
    # torch's optimizers can be copied and pickled; ours kept the op and the kernel's settings outside the pickled
    # state, so a copy raised AttributeError at its first step
    params = [make_param(size, seed).requires_grad_(True) for seed, size in enumerate([7, 4097])]
    optimizer = CPUAdam(params, lr=LR, weight_decay=WEIGHT_DECAY)
    optimizer.num_threads = 1
    for step in range(3):
        for param in params:
            param.grad = torch.full_like(param, 0.1 * (step + 1))
        optimizer.step()
    copied = copy.deepcopy(optimizer) if how == "deepcopy" else pickle.loads(pickle.dumps(optimizer))
    assert copied.num_threads == 1
    copies = copied.param_groups[0]["params"]
    for mine, theirs in zip(params, copies):
        mine.grad = torch.full_like(mine, -0.2)
        theirs.grad = torch.full_like(theirs, -0.2)
    optimizer.step()
    copied.step()
    for mine, theirs in zip(params, copies):
        assert torch.equal(mine.detach(), theirs.detach())
    assert [int(copied.state[p]["step"]) for p in copies] == [4, 4]
    assert [int(optimizer.state[p]["step"]) for p in params] == [4, 4]


@pytest.mark.parametrize("direction", ["ours_to_torch", "torch_to_ours"])
def test_state_dict_interoperates_with_torch_adamw(direction):
    size = 4097
    param = make_param(size)
    grads = make_grads(size, 10, torch.float32)
    expected = run_torch(param, grads, adamw_mode=True)

    resumed = param.clone().requires_grad_(True)
    first, second = (CPUAdam, torch.optim.AdamW) if direction == "ours_to_torch" else (torch.optim.AdamW, CPUAdam)
    optimizer = first([resumed], lr=LR, weight_decay=WEIGHT_DECAY)
    for grad in grads[:5]:
        resumed.grad = grad.clone()
        optimizer.step()
    state = optimizer.state_dict()
    optimizer = second([resumed], lr=LR, weight_decay=WEIGHT_DECAY)
    optimizer.load_state_dict(state)
    for grad in grads[5:]:
        resumed.grad = grad.clone()
        optimizer.step()
    torch.testing.assert_close(resumed.detach(), expected, atol=ATOL, rtol=RTOL)


def test_state_dict_of_torch_adam_keeps_l2_mode():
    param = torch.zeros(3, requires_grad=True)
    state = torch.optim.Adam([param], weight_decay=WEIGHT_DECAY).state_dict()
    optimizer = CPUAdam([param])
    optimizer.load_state_dict(state)
    assert optimizer.param_groups[0]["adamw_mode"] is False


# Errors ---------------------------------------------------------------------------------------------

def test_amsgrad_is_a_clear_error():
    with pytest.raises(ValueError, match="amsgrad"):
        CPUAdam([torch.zeros(2, requires_grad=True)], amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        make_adam([torch.zeros(2, requires_grad=True)], "cpu", amsgrad=True)


def test_bad_arguments_are_clear_errors():
    param = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="betas"):
        CPUAdam([param], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr"):
        CPUAdam([param], lr=-1.0)
    half = torch.zeros(2, dtype=torch.float16, requires_grad=True)
    optimizer = CPUAdam([half])
    half.grad = torch.zeros(2, dtype=torch.float16)
    with pytest.raises(ValueError, match="fp32 CPU parameters"):
        optimizer.step()
    with pytest.raises(ValueError, match="unknown op"):
        load_op("adagrad")


# Builder, report and fallback -----------------------------------------------------------------------

@pytest.fixture
def fresh_fallback_log(monkeypatch):
    monkeypatch.setattr(fallback, "_logged", set())


def test_load_op_is_cached_in_process():
    assert load_op("cpu_adam") is load_op("cpu_adam")


def test_sources_hash_follows_headers(tmp_path, monkeypatch):
    """A header change changes the build flags, so torch and ninja rebuild (see builder's notes)."""
    csrc = tmp_path / "csrc"
    shutil.copytree(builder.CSRC_DIR, csrc)
    monkeypatch.setattr(builder, "CSRC_DIR", csrc)
    monkeypatch.setattr(builder, "INCLUDE_DIR", csrc / "includes")
    before = builder.plan_build("cpu_adam").cflags
    assert before == builder.plan_build("cpu_adam").cflags
    with open(csrc / "includes" / "simd.h", "a") as header:
        header.write("\n// changed\n")
    assert builder.plan_build("cpu_adam").cflags != before


def test_a_build_is_one_per_place_and_a_linked_package_builds_as_its_target(tmp_path, monkeypatch):
    """[Note: one build per source version]: the same sources elsewhere (another checkout) build in a directory of
    their own, and the package imported through a link plans the build of the directory it links to (the same
    name and source paths, so torch's ninja file is the same and nothing rebuilds)."""
    import sys

    real = builder.plan_build("cpu_adam")
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "zero_engine").symlink_to(Path(builder.__file__).parents[1], target_is_directory=True)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from zero_engine.ops import builder; "
            "plan = builder.plan_build('cpu_adam'); print(builder.__file__); print(plan.name); "
            "print(*plan.sources, sep='\\n')")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "tree")], capture_output=True, text=True,
                         timeout=120, check=True).stdout.splitlines()
    assert out[0].startswith(str(tmp_path / "tree")), out  # imported through the link
    assert out[1] == real.name and out[2:] == [str(path) for path in real.sources], (out, real)
    copy = tmp_path / "csrc"  # the same sources, in another place
    shutil.copytree(builder.CSRC_DIR, copy)
    monkeypatch.setattr(builder, "CSRC_DIR", copy)
    monkeypatch.setattr(builder, "INCLUDE_DIR", copy / "includes")
    elsewhere = builder.plan_build("cpu_adam")
    assert elsewhere.name != real.name and builder.build_directory(elsewhere) != builder.build_directory(real)


def test_disabled_op_cannot_be_built(monkeypatch):
    monkeypatch.setenv(builder.DISABLE_ENV, "cpu_adam")
    with pytest.raises(OpBuildError, match="disabled by ZERO_ENGINE_DISABLE_OPS"):
        CPUAdam([torch.zeros(2, requires_grad=True)])
    rows = {row.name: row for row in op_report()}
    assert not rows["cpu_adam"].available and "ZERO_ENGINE_DISABLE_OPS" in rows["cpu_adam"].reason


def test_fallback_to_torch_fused_adamw_warns_once(monkeypatch, caplog, fresh_fallback_log):
    monkeypatch.setenv(builder.DISABLE_ENV, "1")
    caplog.set_level(logging.INFO, logger=fallback.__name__)
    params = [make_param(7).requires_grad_(True)]
    optimizer, description = make_adam(iter(params), "cpu", lr=LR, weight_decay=WEIGHT_DECAY)
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"]
    assert description == "torch.optim.AdamW(fused=True)"
    make_adam(params, "cpu", lr=LR)
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "ZERO_ENGINE_DISABLE_OPS" in warnings[0].getMessage() and "fused=True" in warnings[0].getMessage()
    # The fallback is a working optimizer with the same arguments.
    params[0].grad = torch.ones(7)
    optimizer.step()

    adam, description = make_adam(params, "cpu", adamw_mode=False)
    assert type(adam) is torch.optim.Adam
    with pytest.raises(NotImplementedError, match="bias_correction"):
        make_adam(params, "cpu", bias_correction=False)


def test_make_adam_uses_cpu_adam_when_it_builds(caplog, fresh_fallback_log):
    caplog.set_level(logging.INFO, logger=fallback.__name__)
    optimizer, description = make_adam([torch.zeros(3, requires_grad=True)], "cpu", lr=LR)
    assert isinstance(optimizer, CPUAdam)
    assert description.startswith("zero_engine.ops.CPUAdam(cpu_adam op")
    assert [record.levelno for record in caplog.records] == [logging.INFO]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA; this machine has a GPU")
def test_fused_adam_without_cuda_is_a_clear_error(caplog, fresh_fallback_log):
    with pytest.raises(OpBuildError, match="CUDA|cuda"):
        FusedAdam([torch.zeros(2, requires_grad=True)])
    caplog.set_level(logging.WARNING, logger=fallback.__name__)
    optimizer, description = make_adam([torch.zeros(2, requires_grad=True)], "cuda")
    assert description.startswith("torch.optim.AdamW(")
    assert len(caplog.records) == 1 and "fused_adam" in caplog.records[0].getMessage()


def test_op_report_lists_every_op():
    rows = op_report()
    assert [row.name for row in rows] == ["cpu_adam", "fused_adam"]
    assert rows[0].available and "kernel" in rows[0].reason
    text = op_report_text()
    assert "cpu_adam" in text and "fused_adam" in text
    if not torch.cuda.is_available():
        assert not rows[1].available and rows[1].reason


# CUDA sources ---------------------------------------------------------------------------------------

CSRC = builder.CSRC_DIR


def run_compiler(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{(result.stdout + result.stderr)[-4000:]}"


def require_nvcc() -> str:
    nvcc = builder.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (no CUDA toolkit on PATH or under $CUDA_HOME): cannot compile the CUDA sources")
    return nvcc


def test_multi_tensor_plan_covers_every_chunk_once(tmp_path):
    """The launch planning of the CUDA multi-tensor apply is plain C++: check it here, GPU or not
    (tensor limit, block limit, a tensor carried over between launches, empty tensors, errors)."""
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        pytest.skip("no C++ compiler on PATH")
    binary = tmp_path / "multi_tensor_plan_test"
    run_compiler([compiler, "-std=c++17", "-O1", "-I", str(CSRC / "includes"),
                  str(CSRC / "tests" / "multi_tensor_plan_test.cpp"), "-o", str(binary)])
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "all scenarios passed" in result.stdout


def test_cuda_kernels_compile_standalone_with_nvcc(tmp_path):
    """fused_adam.cu includes no torch header, so nvcc compiles it on machines without a GPU or a CUDA
    build of torch (CI), and it cannot rot there."""
    nvcc = require_nvcc()
    output = tmp_path / "fused_adam.o"
    run_compiler([nvcc, "-c", "-std=c++17", "-O3", "-arch=sm_90", "-I", str(CSRC / "includes"),
                  str(CSRC / "adam" / "fused_adam.cu"), "-o", str(output)])
    assert output.stat().st_size > 0


def test_cuda_binding_compiles_against_torch_headers(tmp_path):
    """The torch side of FusedAdam, checked for syntax and types against this torch's headers."""
    nvcc = require_nvcc()
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        pytest.skip("no C++ compiler on PATH")
    # nvcc knows its own include directories (they differ between toolkit layouts); ask it.
    dryrun = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                            capture_output=True, text=True, timeout=60, check=False)
    include_dirs = re.findall(r'(?:-I|"-isystem" ")([^" ]+)', dryrun.stdout + dryrun.stderr)
    cuda_include = next((path for path in include_dirs if (Path(path) / "cuda_runtime_api.h").is_file()), None)
    if cuda_include is None:
        pytest.skip(f"cuda_runtime_api.h not found in nvcc's include directories {include_dirs}")
    # torch's CPU wheels ship c10/cuda headers but not the generated cuda_cmake_macros.h.
    stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    torch_include = Path(torch.__file__).parent / "include"
    run_compiler([compiler, "-std=c++20", "-fsyntax-only", "-w", "-I", str(torch_include), "-I", str(tmp_path / "stub"),
                  "-I", cuda_include, "-I", str(CSRC / "includes"), str(CSRC / "adam" / "fused_adam_binding.cpp")])


# GPU ------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@needs_cuda
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam"])
def test_fused_adam_matches_torch_fp32(size, adamw_mode):
    param = make_param(size).cuda()
    grads = [grad.cuda() for grad in make_grads(size, STEPS, torch.float32)]
    ours = param.clone().requires_grad_(True)
    theirs = param.clone().requires_grad_(True)
    optimizer = FusedAdam([ours], lr=LR, weight_decay=WEIGHT_DECAY, adamw_mode=adamw_mode)
    torch_class = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    reference = torch_class([theirs], lr=LR, weight_decay=WEIGHT_DECAY, foreach=False)
    for grad in grads:
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        optimizer.step()
        reference.step()
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=RTOL)


@needs_cuda
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_adam_low_precision_params_match_torch_fused(param_dtype):
    # Both kernels keep p, m, v in the parameter's dtype, compute each step in fp32 and round once
    # per step, so they differ only where an fp32 ulp flips a 16-bit rounding: by a 16-bit ulp, rarely.
    size = 4097
    param = make_param(size).to(param_dtype).cuda()
    grads = [grad.to(param_dtype).cuda() for grad in make_grads(size, 10, torch.float32)]
    ours = param.clone().requires_grad_(True)
    theirs = param.clone().requires_grad_(True)
    optimizer = FusedAdam([ours], lr=LR, weight_decay=WEIGHT_DECAY)
    reference = torch.optim.AdamW([theirs], lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    for grad in grads:
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        optimizer.step()
        reference.step()
    ulp_at_largest = torch.finfo(param_dtype).eps * 2 ** param.float().abs().max().log2().ceil().item()
    torch.testing.assert_close(ours.float(), theirs.float(), atol=2 * ulp_at_largest, rtol=0)
    assert (ours.float() - param.float()).abs().max() > 2 * ulp_at_largest  # the parameters moved


@needs_cuda
def test_fused_adam_many_tensors_and_chunks():
    """More tensors than one launch holds (36), and one tensor spanning more blocks than a launch
    holds (320 chunks of 64 Ki), so tensors are carried over between launches."""
    sizes = [1, 7, 4097, 70_000] * 12 + [320 * 65536 + 5]
    params = [make_param(size, seed).cuda() for seed, size in enumerate(sizes)]
    ours = [param.clone().requires_grad_(True) for param in params]
    theirs = [param.clone().requires_grad_(True) for param in params]
    optimizer = FusedAdam(ours, lr=LR, weight_decay=WEIGHT_DECAY)
    reference = torch.optim.AdamW(theirs, lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)
    for step in range(3):
        for mine, other in zip(ours, theirs):
            grad = torch.randn_like(mine)
            mine.grad, other.grad = grad, grad.clone()
        optimizer.step()
        reference.step()
    for mine, other in zip(ours, theirs):
        torch.testing.assert_close(mine, other, atol=ATOL, rtol=RTOL)


@needs_cuda
def test_fused_adam_tensor_over_2_31_elements():
    numel = 2**31 + 5
    if torch.cuda.mem_get_info()[0] < 5 * 2 * numel + (1 << 30):
        pytest.skip("needs ~22 GB of free GPU memory for a bf16 tensor of 2^31 + 5 elements and its state")
    param = torch.zeros(numel, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    optimizer = FusedAdam([param], lr=1.0, weight_decay=0.0)
    param.grad = torch.ones_like(param)
    optimizer.step()
    # First step with bias correction: p -= lr * 1 / (1 + eps), i.e. -1 everywhere, the tail included.
    assert param.eq(-1.0).all().item()  # every element, the ones past 2^31 included


def test_changed_kernel_sources_build_and_load_under_their_own_name(tmp_path, monkeypatch):
    """[Note: one build per source version]: two installs with different sources never share a build directory
    or a torch.ops namespace, so one cannot load the library the other built (a stale operator signature)."""
    from zero_engine.ops import builder

    csrc = tmp_path / "csrc"
    shutil.copytree(builder.CSRC_DIR, csrc)
    monkeypatch.setattr(builder, "CSRC_DIR", csrc)
    monkeypatch.setattr(builder, "INCLUDE_DIR", csrc / "includes")
    before = builder.plan_build("cpu_adam")
    with open(csrc / "adam" / "cpu_adam.cpp", "a") as source:
        source.write("\n// another version of the kernel\n")
    after = builder.plan_build("cpu_adam")
    assert before.name != after.name and builder.build_directory(before) != builder.build_directory(after)
    assert f"-DZE_OP_NAMESPACE={after.name}" in after.cflags
    assert builder.plan_build("cpu_adam").name == after.name  # the same sources: the same build, found again


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_live_one_waited_for(tmp_path, caplog):
    """[Note: a build lock left behind]: torch waits forever while its build lock exists; one untouched for longer
    than any build of ours is a killed build's, removed with a warning, and a recent one is waited for."""
    import os
    import threading
    import time

    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - builder.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    with caplog.at_level("WARNING", logger=builder.logger.name):
        builder._wait_for_build_lock(str(tmp_path), poll_s=0.01)
    assert not lock.exists() and str(lock) in caplog.text

    lock.touch()  # a build running in another process: its lock goes when it ends
    threading.Timer(0.3, lock.unlink).start()
    started = time.perf_counter()
    builder._wait_for_build_lock(str(tmp_path), poll_s=0.01)
    assert time.perf_counter() - started >= 0.25 and not lock.exists()
