"""Host synchronisations of a training step (issue 22 item 3): none in forward and backward, at most one in step().

See [Note: host syncs per step] in zero_engine/zero/optimizer.py for which one and why. On CPU there is no device
to wait for, so the test counts the calls that would synchronise on an accelerator: ``Tensor.item``, ``tolist``,
``__bool__``, ``__float__``, ``__int__`` (what Python code uses to read a tensor's value) and stream, event and
device synchronize. On CUDA, torch.cuda.set_sync_debug_mode("error") makes any synchronising CUDA call raise.
The counted step is the fourth (the first records the module trace and walks the autograd graph for gradient
presence, with their own synchronisations; see [Note: when the presence walk runs] in zero/presence.py).
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zero_engine
from zero_engine.testing import cuda_syncs, fake_world, run_ranks
from zero_engine.testing.models import GPT, GPTConfig, make_batches

from session_run import run_in_session

TIMEOUT = 120
ROOT = Path(__file__).resolve().parent.parent
_READS = ("item", "tolist", "__bool__", "__float__", "__int__")


@contextlib.contextmanager
def _counting_host_reads(calls: list[str], host_resident: set[int] = frozenset()):
    """Wrap the tensor reads and the synchronize calls; each call appends its caller (file:line) to ``calls``.
    Reads of the tensors in ``host_resident`` (ids) are not counted: they are on the host with an accelerator too."""
    originals = []

    def wrap(owner, name):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            if not (args and id(args[0]) in host_resident):
                frame = traceback.extract_stack(limit=2)[0]
                calls.append(f"{name} at {frame.filename}:{frame.lineno}")
            return original(*args, **kwargs)
        originals.append((owner, name, original))
        setattr(owner, name, counted)

    for name in _READS:
        wrap(torch.Tensor, name)
    wrap(torch.cuda, "synchronize")
    wrap(torch.cuda.Stream, "synchronize")
    wrap(torch.cuda.Event, "synchronize")
    try:
        yield
    finally:
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)


def _config(dtype: str) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3}}  # everything else at its default
    if dtype != "fp32":  # fp16: a small initial scale, so that the counted step is not skipped (an overflow)
        config[dtype] = {"enabled": True, "initial_scale_power": 8} if dtype == "fp16" else {"enabled": True}
    return config


def _count_body(dtype: str):
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = GPTConfig()
    engine, *_ = zero_engine.initialize(model=GPT(cfg), config=_config(dtype))
    batches = make_batches(cfg, 4, 2 * dist.get_world_size())
    counted = {}
    for i, (idx, targets) in enumerate(batches):
        idx, targets = idx[2 * rank: 2 * rank + 2], targets[2 * rank: 2 * rank + 2]
        calls_fb, calls_step = [], []
        with _counting_host_reads(calls_fb):
            loss = engine(idx, targets)
            engine.backward(loss)
        # The optimizer's step counters: host tensors even with an accelerator (as torch's Adam keeps them unless
        # capturable), so reading them waits for nothing; the optimizer reads them through the buffer they are views
        # of ([Note: the step counts are views of one buffer] in ops/adam_base.py).
        steps = [state["step"] for state in engine.optimizer.state.values() if "step" in state]
        counters = {id(step) for step in steps} | {id(step._base) for step in steps if step._base is not None}
        with _counting_host_reads(calls_step, counters):
            engine.step()
        counted[i] = (calls_fb, calls_step)
    engine.destroy()
    return counted


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_a_steady_step_has_no_host_sync_in_forward_backward_and_one_in_step(dtype):
    for counted in run_ranks(_count_body, 2, dtype, timeout=TIMEOUT):
        forward_backward, step = counted[3]
        assert forward_backward == [], forward_backward
        assert len(step) <= 1, step
        # the first step also records the trace and walks for gradient presence: it synchronises more
        assert len(counted[0][0]) > 0, counted[0]


def _cuda_body(dtype: str):
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = GPTConfig()
    engine, *_ = zero_engine.initialize(model=GPT(cfg), config=_config(dtype))
    device = next(engine.module.parameters()).device
    batches = make_batches(cfg, 3, 2 * dist.get_world_size())
    for i, (idx, targets) in enumerate(batches):
        idx, targets = idx[2 * rank: 2 * rank + 2].to(device), targets[2 * rank: 2 * rank + 2].to(device)
        if i == 2:
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss = engine(idx, targets)
            engine.backward(loss)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        engine.step()
    engine.destroy()
    return True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (run `make gpu-check` on a GPU)")
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_cuda_forward_backward_do_not_synchronize(dtype):
    # World 1 over NCCL, started by torchrun as test_cuda.py's engine tests: NCCL's wait() is a stream dependency,
    # where gloo's (the simulated ranks' backend) waits on the host for CUDA tensors, which is gloo's sync, not ours
    # (the first GPU run, 2026-11-27, failed here under run_ranks for that reason). The hooks, the reducer and the
    # coordinator run as at any size; the presence walk and the fingerprint need 2 ranks.
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", __file__, dtype]
    proc = run_in_session(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0 and "OK" in proc.stdout, f"{' '.join(cmd)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (run `make gpu-check` on a GPU)")
def test_cuda_step_synchronizes_once_at_world_2_on_the_fake_group():
    # The step fingerprint and the presence walk run only with 2 ranks or more, and on one GPU only the fake group
    # runs them without gloo's host waits. The count the CPU test above cannot make: a tensor built on the GPU from
    # host values (the fingerprint's all-reduce input, by torch.tensor(..., device=cuda)) waits for its own copy;
    # that was a second sync per step until the first GPU count (bench/gpu_check.py's syncs part, an H100).
    torch.manual_seed(0)
    cfg = GPTConfig()
    with fake_world(2):
        engine, *_ = zero_engine.initialize(model=GPT(cfg), config=_config("bf16"))
        device = next(engine.module.parameters()).device
        assert device.type == "cuda", device
        try:
            for i, (idx, targets) in enumerate(make_batches(cfg, 4, 2)):
                # the batch's copy from pageable host memory syncs: the test's, not the engine's (an H100 counted it)
                idx, targets = idx.to(device), targets.to(device)
                loss, forward = cuda_syncs(lambda: engine(idx, targets))
                _, backward = cuda_syncs(lambda: engine.backward(loss))
                _, step = cuda_syncs(engine.step)
                if i >= 1:  # the first step records the trace and walks for gradient presence
                    assert forward == [] and backward == [], (i, forward, backward)
                    assert len(step) == 1, (i, step)  # the grad norm with the fingerprint's verdict
        finally:
            engine.destroy()


if __name__ == "__main__":  # one rank of the CUDA test above, under torchrun
    zero_engine.init_distributed()  # NCCL where CUDA is available
    assert dist.get_backend() == "nccl", dist.get_backend()
    print("OK" if _cuda_body(sys.argv[1]) else "FAILED")
