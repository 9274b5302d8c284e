"""Which optimizer the engine builds from the config, and what it accepts from the user."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

import zero_engine
from zero_engine.testing import RankError, run_ranks
from zero_engine.testing.models import GPT, GPTConfig, make_batches


def _built_optimizer_body(opt_params, disable_ops, precision):
    os.environ.pop("ZERO_ENGINE_DISABLE_OPS", None)
    if disable_ops:
        os.environ["ZERO_ENGINE_DISABLE_OPS"] = "1"
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig())
        reference = copy.deepcopy(model)
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, **opt_params}}}
        if precision == "bf16":
            config["bf16"] = {"enabled": True}
        engine, optimizer, *_ = zero_engine.initialize(model=model, config=config)
        x, y = make_batches(model.cfg, 1, 2)[0]  # the same batch on every rank: the averaged gradient is its own
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        trainable = [sp for sp in engine.sharded if sp.master is not None]
        if precision == "fp32":
            # The master IS the compute shard here, so "shard follows master" says nothing: compare the updated
            # parameters with torch's AdamW on one process instead (first Adam step: ~lr * sign(grad) per element).
            ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-3,
                                        weight_decay=0.0)
            reference(x, y).backward()
            ref_opt.step()
            ref = dict(reference.named_parameters())
            worst = 0.0
            for sp in trainable:
                assert sp.master_is_shard and sp.master.data_ptr() == sp.shard.data_ptr()
                full = torch.empty(sp.padded_numel)
                dist.all_gather_into_tensor(full, sp.shard)
                worst = max(worst, (full[: sp.numel].view(sp.shape) - ref[sp.fqn].detach()).abs().max().item())
            in_sync = worst < 1e-6
        else:
            # Separate tensors in bf16: the compute shard must follow the master (written by CPUAdam itself).
            in_sync = all(not sp.master_is_shard and torch.equal(sp.shard, sp.master.to(sp.shard.dtype))
                          for sp in trainable)
        return type(optimizer.optimizer).__name__, in_sync
    finally:
        os.environ.pop("ZERO_ENGINE_DISABLE_OPS", None)


@pytest.mark.parametrize("opt_params,disable,precision,expected", [
    ({}, False, "fp32", "CPUAdam"),
    ({}, False, "bf16", "CPUAdam"),
    ({"torch_adam": True}, False, "fp32", "AdamW"),
    ({}, True, "bf16", "AdamW"),  # the op "fails to build": torch's AdamW, one warning
])
def test_config_adamw_uses_cpu_adam_unless_told_or_unavailable(opt_params, disable, precision, expected):
    for name, in_sync in run_ranks(_built_optimizer_body, 2, opt_params, disable, precision, timeout=180):
        assert name == expected and in_sync


def _user_optimizer_body():
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 and p.requires_grad]
    user_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                 lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(user_opt, lambda step: 0.5 ** step)  # built before initialize
    engine, optimizer, _, lr_scheduler = zero_engine.initialize(
        model=model, optimizer=user_opt, lr_scheduler=sched,
        config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}})
    x, y = make_batches(model.cfg, 1, 2)[0]
    for _ in range(2):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    return optimizer.optimizer is user_opt, [g["weight_decay"] for g in optimizer.param_groups], engine.get_lr()


def test_user_optimizer_groups_and_scheduler_survive():
    for same, decays, lrs in run_ranks(_user_optimizer_body, 2, timeout=120):
        assert same and decays == [0.1, 0.0] and lrs == [2.5e-4, 2.5e-4]


def _amsgrad_body():
    zero_engine.initialize(model=GPT(GPTConfig()), config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "amsgrad": True}}})


def test_amsgrad_is_refused_clearly():
    with pytest.raises(RankError, match="amsgrad"):
        run_ranks(_amsgrad_body, 1, timeout=120)


def _foreign_params_body(stage, what):
    """An optimizer holding a parameter the model does not have: refused. One holding frozen parameters of the model
    (``model.parameters()`` with some frozen): they are left out, and training goes on."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(frozen_param=True))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
    params = list(model.parameters())
    if what == "foreign":
        params.append(torch.nn.Parameter(torch.zeros(3, 5)))  # e.g. a loss module's, or another model's
    if what == "model_parameters":
        config["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
        engine, *_ = zero_engine.initialize(model=model, model_parameters=params + [torch.nn.Parameter(torch.ones(7))],
                                            config=config)
    else:
        engine, *_ = zero_engine.initialize(model=model, optimizer=torch.optim.SGD(params, lr=0.1), config=config)
    x, y = make_batches(model.cfg, 1, 2)[0]
    engine.backward(engine(x, y))
    engine.step()
    engine.destroy()


@pytest.mark.parametrize("stage", [0, 3])
def test_an_optimizer_over_parameters_the_model_does_not_have_is_refused(stage):
    """Before, the engine left them out without a word, and they were never updated (a client optimizer built before
    torch's parallelize_module replaced the split weights trained the rest of the model only)."""
    for what, shape in (("foreign", r"\(3, 5\)"), ("model_parameters", r"\(7,\)")):
        with pytest.raises(RankError, match=r"optimizer: 1 of the parameters to optimize \(the first of shape "
                                            rf"{shape}\) are not trainable parameters of the model"):
            run_ranks(_foreign_params_body, 2, stage, what, timeout=120)
    run_ranks(_foreign_params_body, 2, stage, "frozen", timeout=120)


def _fp32_grads_body():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    cfg = GPTConfig()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5, "bf16": {"enabled": True},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": 10000, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zero_engine.initialize(model=GPT(cfg), config=config)
    x, y = next(iter(make_batches(cfg, 1, 2)))
    engine.backward(engine(x, y))
    runs = sum(len(engine.reducer.shard_grad_runs(group)) for group in engine.optimizer.sub_groups)
    with Count() as count:
        engine.step()
    return count.ops.count("_to_copy"), count.ops.count("mul_"), runs, len(engine.sharded), len(
        engine.reducer.buckets)


def test_fp32_gradients_for_a_torch_optimizer_are_converted_once_per_run_of_shards():
    """bf16 gradient shards for an optimizer without CPUAdam's in-kernel scaling (FusedAdam on CUDA, torch's): one
    conversion and one scaling per run of adjacent shards in a bucket, not per parameter (the 1.1B GPU profile: 739
    copies and 244 mul_ a step). The values are each parameter's converted alone (elementwise ops on the same
    elements): the parity tests hold bitwise."""
    for copies, muls, runs, params, buckets in run_ranks(_fp32_grads_body, 2, timeout=120):
        assert muls == runs == buckets == 4, (muls, runs, buckets)  # one sub-group; each bucket one run
        assert copies <= runs + 2, copies  # and the norm's own (its fp64 sum); 30 and 28 mul_ one per parameter
        assert params == 28


def _zero_grad_mid_window_body(stage):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    reference[0].sparse = False  # the same model with dense gradients (torch's SGD on the sparse ones rounds its
    # momentum in another order: within 2.4e-7 here)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": stage}}
    engine, optimizer, *_ = zero_engine.initialize(model=model, config=config)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)  # the same micro-batches on every rank
    for _ in range(3):
        for micro in range(2):
            x = torch.randn(2, 8, generator=g)
            if micro == 1:  # the user's zero_grad inside the window: the first micro-step's gradient is dropped
                optimizer.zero_grad()
                ref_opt.zero_grad()
            (reference(x).square().mean() / 2).backward()
            engine.backward(engine(x).square().mean())
            engine.step()
        ref_opt.step()
        ref_opt.zero_grad()
    from zero_engine.zero import GatheredParameters

    params = list(engine.module.parameters())
    with GatheredParameters(params):
        return [torch.equal(p.detach(), r.detach()) for p, r in zip(params, reference.parameters())]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_users_zero_grad_inside_an_accumulation_window_clears_it_at_every_stage(stage):
    """optimizer.zero_grad() between micro-steps drops the gradients accumulated so far, as in PyTorch and
    DeepSpeed, at every stage (stage 1 kept them: its gradients wait in the parameters' .grad until the step)."""
    for same in run_ranks(_zero_grad_mid_window_body, 2, stage, timeout=120):
        assert all(same), same


def _equal_to_one_process(model, reference) -> bool:
    """Every parameter's fp32 value, gathered, bitwise equal to the one-process reference's (a collective)."""
    return all(torch.equal(zero_engine.utils.safe_get_full_fp32_param(p), r.detach())
               for p, r in zip(model.parameters(), reference.parameters()))


class _LayerDrop(torch.nn.Module):
    """Residual layers, some skipped in a step (LayerDrop, a tower a batch does not use): the same on every rank."""

    def __init__(self, vocab: int = 64, dim: int = 16, layers: int = 3):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab)
        self.skip: set[int] = set()

    def forward(self, idx):
        h = self.emb(idx)
        for i, layer in enumerate(self.layers):
            if i not in self.skip:
                h = h + torch.tanh(layer(h))
        return self.head(h).logsumexp(-1).mean()


def _no_gradient_anywhere_body(stage):
    torch.manual_seed(0)
    model = _LayerDrop()
    reference = copy.deepcopy(model)
    params = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": params},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zero_engine.initialize(model=model, config=config)
    ref_opt = torch.optim.SGD(reference.parameters(), **params)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        model.skip = reference.skip = {step % 3}  # the same micro-batch and the same skip on every rank
        idx = torch.randint(0, 64, (2, 5), generator=g)
        ref_opt.zero_grad(set_to_none=True)
        reference(idx).backward()
        for p in reference.parameters():  # what DeepSpeed does (stages 0-2), and this engine: zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        ref_opt.step()
        engine.backward(engine(idx))
        engine.step()
    same = _equal_to_one_process(model, reference)
    engine.destroy()
    return same


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_parameter_without_a_gradient_on_any_rank_is_stepped_with_zeros_as_deepspeed_does(stage):
    """A layer skipped on every rank for a step is stepped with a zero gradient at every stage, as DeepSpeed fills
    missing gradients with zeros (0.19.8, stages 0-2): weight decay and momentum move it. torch's optimizers, DDP and
    FSDP2 leave a parameter whose .grad is None untouched (README, "Every rank issues the same collectives"). Bitwise
    against one process whose missing gradients are zeros (world 2, the same micro-batch on every rank); against
    torch's skip it fails."""
    assert run_ranks(_no_gradient_anywhere_body, 2, stage, timeout=120) == [True, True]


def _sparse_embedding_body(stage):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 16, sparse=True), torch.nn.Linear(16, 64))
    reference = copy.deepcopy(model)
    reference[0].sparse = False  # the same model with dense gradients (torch's SGD on the sparse ones rounds its
    # momentum in another order: within 2.4e-7 here)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zero_engine.initialize(model=model, config=config)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for _ in range(2):  # the same micro-batches on every rank; the sparse gradients accumulate across them
            idx = torch.randint(0, 64, (2, 5), generator=g)
            (reference(idx).logsumexp(-1).mean() / 2).backward()
            engine.backward(engine(idx).logsumexp(-1).mean())
            engine.step()
        ref_opt.step()
        ref_opt.zero_grad()
    same = _equal_to_one_process(model, reference)
    engine.destroy()
    return same


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_embedding_with_sparse_gradients_trains_as_one_process(stage):
    """nn.Embedding(sparse=True) gives a sparse gradient, which every stage failed on ("reshape is not implemented
    for sparse tensors"); it is reduced dense now, and trains bitwise as one process does with sparse=False."""
    assert run_ranks(_sparse_embedding_body, 2, stage, timeout=120) == [True, True]


def _gan_body(stage):
    """DeepSpeedExamples' DCGAN loop with two engines: it calls the *modules'* zero_grad, and the generator's step
    backpropagates through the discriminator, whose gradients from it must not reach its next update."""
    torch.manual_seed(0)
    gen = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    disc = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LeakyReLU(0.2), torch.nn.Linear(16, 1),
                               torch.nn.Sigmoid())
    ref_gen, ref_disc = copy.deepcopy(gen), copy.deepcopy(disc)
    params = {"lr": 0.1, "momentum": 0.5}
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": params},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine_d, *_ = zero_engine.initialize(model=disc, config=config)
    engine_g, *_ = zero_engine.initialize(model=gen, config=config)
    opt_d = torch.optim.SGD(ref_disc.parameters(), **params)
    opt_g = torch.optim.SGD(ref_gen.parameters(), **params)
    bce, ones, zeros = torch.nn.BCELoss(), torch.ones(4, 1), torch.zeros(4, 1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        real, noise = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)  # the same on every rank
        ref_disc.zero_grad()
        bce(ref_disc(real), ones).backward()
        fake = ref_gen(noise)
        bce(ref_disc(fake.detach()), zeros).backward()
        opt_d.step()
        ref_gen.zero_grad()
        bce(ref_disc(fake), ones).backward()
        opt_g.step()
        disc.zero_grad()  # the module's, as the example calls it
        engine_d.backward(bce(disc(real), ones))
        fake = gen(noise)
        engine_d.backward(bce(disc(fake.detach()), zeros))
        engine_d.step()
        gen.zero_grad()
        engine_g.backward(bce(disc(fake), ones))
        engine_g.step()
    same = all([_equal_to_one_process(gen, ref_gen), _equal_to_one_process(disc, ref_disc)])
    engine_g.destroy()
    engine_d.destroy()
    return same


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_modules_zero_grad_drops_what_the_engine_holds_two_engines_as_deepspeeds_gan_example(stage):
    """[zero/module_zero_grad.py] At stages 2-3 the gradient hooks take each .grad as it comes, so a module's
    zero_grad dropped nothing: the discriminator's gradients from the generator's backward reached its next update
    (off one process by 0.11 after three steps). Bitwise now, at every stage."""
    assert run_ranks(_gan_body, 2, stage, timeout=120) == [True, True]


class _TwoTowers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        return (self.b(torch.tanh(self.a(x))) ** 2).mean()


def _submodule_zero_grad_body(stage, bucket):
    torch.manual_seed(0)
    model = _TwoTowers()
    reference = copy.deepcopy(model)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                    "reduce_bucket_size": bucket}}
    engine, *_ = zero_engine.initialize(model=model, config=config)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        for micro in range(2):
            x = torch.randn(4, 8, generator=g)  # the same micro-batch on every rank
            (reference(x) / 2).backward()
            engine.backward(engine(x))
            if micro == 0:  # one tower's gradients of the window's first micro-step dropped
                reference.a.zero_grad()
                model.a.zero_grad()
            engine.step()
        ref_opt.step()
        ref_opt.zero_grad()
    same = _equal_to_one_process(model, reference)
    engine.destroy()
    return same


@pytest.mark.parametrize("bucket", [10**6, 1], ids=["one-bucket", "bucket-per-param"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_submodules_zero_grad_inside_a_window_drops_only_its_parameters_gradients(stage, bucket):
    """A submodule's zero_grad drops its parameters' gradients alone: their slices of a shared gradient bucket
    zeroed (one-bucket), or their buckets freed (bucket-per-param), as torch does with their .grad."""
    assert run_ranks(_submodule_zero_grad_body, 2, stage, bucket, timeout=120) == [True, True]


def _backward_outside_the_engine_body(stage, gas):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": stage}}
    engine, optimizer, *_ = zero_engine.initialize(model=model, config=config)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))  # the same on every rank
    engine(x).square().mean().backward()  # not engine.backward: nothing would be counted, scaled or updated
    try:
        engine.step()
        refused = ""
    except zero_engine.UsageError as error:
        refused = str(error)
    engine.zero_grad()  # then the loop written right trains as one process
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(gas):
        (reference(x).square().mean() / gas).backward()
        engine.backward(engine(x).square().mean())
        engine.step()
    ref_opt.step()
    engine.step()  # after the update, with nothing waiting: the boundary is consumed, a warning as before
    same = _equal_to_one_process(model, reference)
    engine.destroy()
    return refused, same


@pytest.mark.parametrize("gas", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_step_after_loss_backward_is_refused_not_a_silent_no_op(stage, gas):
    """loss.backward() then engine.step() updated nothing at any stage: micro-steps are counted by engine.backward,
    so the boundary was never reached (gas 2: silently) or taken as consumed (gas 1: a warning that step() was
    "called again"). Now a UsageError says to call engine.backward(loss)."""
    for refused, same in run_ranks(_backward_outside_the_engine_body, 2, stage, gas, timeout=120):
        assert refused.startswith("rank ") and "found gradients from a backward that did not go through the " \
            "engine (loss.backward()?)" in refused, refused
        assert same


class _WithDtype(torch.nn.Module):
    """A float32 layer and a parameter of another dtype: float64 (scientific models), complex64 (spectral ones)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)
        self.w = torch.nn.Parameter(torch.randn(8, 8, dtype=dtype) * 0.1)

    def forward(self, x):
        return (self.layer(x).to(self.w.dtype) @ self.w).abs().square().mean()


def _other_dtype_body(stage, dtype):
    torch.manual_seed(0)
    model = _WithDtype(dtype)
    reference = copy.deepcopy(model)
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": stage}}
    try:
        engine, *_ = zero_engine.initialize(model=model, config=config)
    except NotImplementedError as error:
        return str(error)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 8, generator=g)  # the same on every rank
        ref_opt.zero_grad()
        reference(x).backward()
        ref_opt.step()
        engine.backward(engine(x))
        engine.step()
    same = all(torch.equal(p, r) for p, r in zip(model.parameters(), reference.parameters()))
    engine.destroy()
    return same


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64], ids=["float64", "complex64"])
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_a_float64_or_complex_parameter_trains_at_stage_0_and_is_refused_above(stage, dtype):
    """Stage 0 averaged every gradient in one float32 bucket: a float64 one lost precision (3e-10 off one process
    after 3 steps) and a complex one its imaginary part (4e-3 off). Buckets are cut where the dtype changes now, and
    never reduce narrower than the gradient: bitwise. Stages 1-3 cast such a parameter to the compute dtype (and
    then failed in the model's forward, "double != float"); they refuse it by name now."""
    for result in run_ranks(_other_dtype_body, 2, stage, dtype, timeout=120):
        if stage == 0:
            assert result is True
        else:
            name = str(dtype).removeprefix("torch.")
            assert result.startswith(f"w: a {name} parameter at zero_optimization.stage {stage} is not supported "
                                     "yet"), result


def _lazy_module_body(stage):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LazyLinear(16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": stage}}
    try:
        zero_engine.initialize(model=model, config=config)
        refused = ""
    except zero_engine.UsageError as error:
        refused = str(error)
    model(torch.zeros(1, 8))  # the fix the message gives: a dummy batch materializes the lazy parameters
    reference = copy.deepcopy(model)
    engine, *_ = zero_engine.initialize(model=model, config=config)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))  # the same on every rank
    reference(x).square().mean().backward()
    ref_opt.step()
    engine.backward(engine(x).square().mean())
    engine.step()
    same = _equal_to_one_process(model, reference)
    engine.destroy()
    return refused, same


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_a_lazy_module_not_materialized_is_refused_on_every_rank(stage):
    """nn.LazyLinear before its first forward: rank 0 failed alone broadcasting the uninitialized parameter while the
    others waited in the step's all-reduce (a hang until the collective timeout). Every rank refuses it now, with
    the fix; materialized, the model trains as one process."""
    for refused, same in run_ranks(_lazy_module_body, 2, stage, timeout=120):
        assert refused.startswith("0.weight is not initialized yet (nn.LazyLinear"), refused
        assert same
