"""An initialize() that raises leaves the model, and the client optimizer, as a corrected initialize() can take them.

Each case on 2 simulated ranks: a realistic mistake makes initialize() raise after the engine claimed the model (a
client optimizer that already has state, a scheduler that cannot be built, a torch optimizer refusing its config
after stage 3 partitioned and hooked the model, an NVMe path that does not exist while the other NVMe store is
already open). The original error must come out unchanged; nothing of the failed engine may stay on the model (hooks,
NVMe files); then a corrected initialize() on the same model (and, where one was given, the same optimizer object)
must train as one process does on the full batch.

Tolerance: relative 1e-5 on losses and parameters, as test_zero3's parity (the engine averages the ranks'
gradients, the reference computes the full batch's: same math, different summation order). A failed engine that
was not undone does not come near it: the second initialize is refused, or the optimizer steps the dead engine's
masters and the model never changes.
"""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch
import torch.distributed as dist

import zero_engine
from zero_engine.testing import run_ranks
from zero_engine.testing.models import GPT, GPTConfig, make_batches

from test_zero3 import full_params, reference_step

TIMEOUT = 120
MICRO, STEPS, LR = 2, 3, 0.05


def config(stage: int, optimizer=True, **zero) -> dict:
    c = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
         "zero_optimization": {"stage": stage, "reduce_bucket_size": 700, "stage3_prefetch_bucket_size": 3000,
                               "stage3_param_persistence_threshold": 40, **zero}}
    if optimizer:
        c["optimizer"] = {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}}
    return c


def nvme(path: str) -> dict:
    return {"device": "nvme", "nvme_path": path, "buffer_count": 3}


def _fail_then_train_body(case: str, tmp: str):
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    reference = copy.deepcopy(model)
    x, y = make_batches(model.cfg, 1, 2)[0]
    if case == "optimizer_with_state":  # stage 0: the optimizer of an earlier plain run passed by mistake
        used = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)  # lr 0: state made, parameters unchanged
        model(x, y).backward()
        used.step()
        model.zero_grad()
        bad = dict(config=config(0, optimizer=False), optimizer=used)
        client = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        good = dict(config=config(0, optimizer=False), optimizer=client)
        expected = (ValueError, "already has state")
    elif case == "scheduler":  # stage 2: the client optimizer is bound to the engine's masters when the scheduler fails
        client = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        bad = dict(config=config(2, optimizer=False), optimizer=client,
                   lr_scheduler=lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR))
        good = dict(config=config(2, optimizer=False), optimizer=client)  # the same optimizer object again
        expected = (ValueError, "total_steps")
    elif case == "scheduler_bf16_then_fp32":  # stage 2: the corrected initialize also leaves bf16 for fp32
        client = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        bad = dict(config={**config(2, optimizer=False), "bf16": {"enabled": True}}, optimizer=client,
                   lr_scheduler=lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR))
        good = dict(config=config(2, optimizer=False), optimizer=client)  # the fp32 masters, not their bf16 rounding
        expected = (ValueError, "total_steps")
    elif case == "optimizer_config":  # stage 3: torch refuses the config's optimizer after the model was partitioned
        conflicting = config(3)
        conflicting["optimizer"]["params"] = {"lr": LR, "momentum": 0.0, "nesterov": True}
        bad, good = dict(config=conflicting), dict(config=config(3))
        expected = (ValueError, "Nesterov")
    elif case == "nvme_path":  # stage 3: the parameters' NVMe store is open when the optimizer's path fails
        client = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        zero = {"offload_param": {**nvme(tmp), "buffer_size": 1200}, "sub_group_size": 900}
        bad = dict(config=config(3, optimizer=False, offload_optimizer=nvme(os.path.join(tmp, "missing")), **zero),
                   optimizer=client)
        good = dict(config=config(3, optimizer=False, offload_optimizer=nvme(tmp), **zero), optimizer=client)
        expected = (OSError, "does not exist")
    with pytest.raises(expected[0], match=expected[1]):
        zero_engine.initialize(model=model, **bad)
    hooked = [name for name, m in model.named_modules() if m._forward_pre_hooks or m._forward_hooks]
    hooked += [name for name, p in model.named_parameters() if p._post_accumulate_grad_hooks]
    files_left = [f for f in os.listdir(tmp) if f.endswith(f"-rank{dist.get_rank()}")]  # the other rank may lag

    engine, *_ = zero_engine.initialize(model=model, **good)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    rank, world = dist.get_rank(), dist.get_world_size()
    worst_loss = 0.0
    for x, y in make_batches(model.cfg, STEPS, world * MICRO):
        ref_loss = reference_step(reference, ref_opt, x, y, clip=1.0)
        loss = engine(x[rank * MICRO: (rank + 1) * MICRO], y[rank * MICRO: (rank + 1) * MICRO])
        engine.backward(loss)
        engine.step()
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        worst_loss = max(worst_loss, abs(loss.item() / world - ref_loss) / abs(ref_loss))
    with engine.optimizer.states_in_memory() if engine.stage else contextlib.nullcontext():  # NVMe: read in
        ours, ref = full_params(engine), dict(reference.named_parameters())
    diff = sum((ours[n] - ref[n].detach()).pow(2).sum() for n in ours).sqrt()
    norm = sum(ref[n].detach().pow(2).sum() for n in ours).sqrt()
    engine.destroy()
    return hooked, files_left, worst_loss, (diff / norm).item()


@pytest.mark.parametrize("case", ["optimizer_with_state", "scheduler", "scheduler_bf16_then_fp32", "optimizer_config",
                                  "nvme_path"])
def test_a_failed_initialize_is_undone_and_a_corrected_one_trains_as_one_process(case, tmp_path):
    for hooked, files_left, loss_err, param_err in run_ranks(_fail_then_train_body, 2, case, str(tmp_path),
                                                            timeout=TIMEOUT):
        assert hooked == [], f"hooks of the failed engine left on {hooked}"
        assert files_left == [], f"NVMe files of the failed engine left: {files_left}"
        assert loss_err < 1e-5 and param_err < 1e-5, (loss_err, param_err)


def _refused_second_initialize_body():
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    engine, *_ = zero_engine.initialize(model=model, config=config(3))
    refusals = []
    for _ in range(2):  # the first refusal's undo must not release the live engine's claim
        with pytest.raises(RuntimeError, match="already wrapped") as caught:
            zero_engine.initialize(model=model, config=config(3))
        refusals.append(str(caught.value))
    x, y = make_batches(model.cfg, 1, MICRO)[0]
    engine.backward(engine(x, y))
    engine.step()
    engine.destroy()
    return len(refusals), engine.global_steps


def test_a_refused_second_initialize_leaves_the_live_engine_wrapping_the_model():
    for refusals, steps in run_ranks(_refused_second_initialize_body, 2, timeout=TIMEOUT):
        assert (refusals, steps) == (2, 1)


def _evaluation_engine_with_nvme_params_body(tmp: str):
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    zero = {"offload_param": {**nvme(tmp), "buffer_size": 1200}}
    engine, *_ = zero_engine.initialize(model=model, config=config(3, optimizer=False, **zero))
    x, y = make_batches(model.cfg, 1, MICRO)[0]
    with torch.no_grad():
        loss = engine(x, y).item()
    files_while_open = bool(os.listdir(tmp))
    engine.destroy()
    return files_while_open, sorted(os.listdir(tmp)), loss == loss


def test_destroy_removes_the_nvme_files_of_an_engine_without_optimizer(tmp_path):
    """destroy() closed the parameters' NVMe store through the optimizer only: without one its files stayed."""
    for rank, (while_open, left, finite) in enumerate(run_ranks(_evaluation_engine_with_nvme_params_body, 2,
                                                               str(tmp_path), timeout=TIMEOUT)):
        assert while_open and left == [] and finite, (rank, while_open, left, finite)
