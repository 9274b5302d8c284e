"""The traced mode of torch.compile at ZeRO-3 (zero_engine/zero/traced.py): each block's all-gather and gradient
reduce-scatter are functional collectives inside its compiled graph.

Parity: the test GPT trained under the engine with its blocks traced and in one process on the full batch
(test_zero3's reference); losses and final parameters compared. Tolerance: 2e-4 relative on the losses (the issue's
bound) and 1e-5 relative (L2) on the parameters. The traced graph does float arithmetic the reference does not: the
gradient is averaged by a reduce-scatter ("avg") per rank inside the graph where the reference differentiates the
mean over the full batch (divide-then-sum against sum-then-divide: last bits per element), and AOTAutograd's
decompositions and the recomputed gather reorder some sums; these are ulps per step, compounded over 3 steps with
clipping (observed, aot_eager, this machine: at most 2.1e-7 on losses and 3.8e-7 on parameters). A real fault moves
them by far more: the gradient summed instead of averaged gives 1.7e-3 on losses and 1e-2 on parameters (SGD case).
bf16 and fp16 (with dynamic loss scaling and skipped steps) compare the traced engine with the eager engine (the
same 16-bit rounding of parameters and gradients, fp32 reduction) within 1e-2: bf16 keeps 8 bits, and the traced
graph rounds the reduced gradient to 16 bits once more before accumulating it (eager accumulates the fp32
reduction into the 16-bit shard).

Dynamo's counters are asserted as test_compile does: no graph break, one graph for both blocks (one shape), nothing
compiled after the first optimizer step. The memory property: the gather is recomputed in backward, counted with the
profiler (forward and backward each run one all-gather per flat shard), and no tensor the region saves for backward
has a parameter's whole shape.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist

import zero_engine
from zero_engine.config import load_config
from zero_engine.errors import ConfigError
from zero_engine.testing import run_ranks
from zero_engine.testing.loop import train_global_batch
from zero_engine.testing.models import GPT, GPTConfig, make_batches
from zero_engine.testing.shards import whole_from_shards

from test_compile import llama_body
from test_zero3 import ds_config, make_reference_optimizer, reference_step

TIMEOUT = 240
GATHER_OP = "_c10d_functional::all_gather_into_tensor"
REDUCE_OP = "_c10d_functional::reduce_scatter_tensor"


def _counters() -> dict:
    from torch._dynamo.utils import counters

    return {key: dict(value) for key, value in counters.items() if value}


def _config(seq: bool, **over) -> dict:
    # prefetch bucket large enough that each block's shards are one run (one flat shard, one collective)
    return ds_config(3, seq, stage3_prefetch_bucket_size=100_000, **over)


def _profile_one_micro_step(engine, x, y):
    """One forward and backward (no step): the functional collectives run in each, and the shapes of what the
    compiled regions saved for backward."""
    from torch.profiler import profile

    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with profile() as fwd, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = engine(x, y)
    with profile() as bwd:
        engine.backward(loss)
    counts = {name: (sum(e.name == name for e in fwd.events()), sum(e.name == name for e in bwd.events()))
              for name in (GATHER_OP, REDUCE_OP)}
    return counts, saved


def _train(config: dict, model_cfg: GPTConfig, steps: int = 3, backend: str = "aot_eager", how: str = "engine",
           profile: bool = False, frozen: tuple[str, ...] = (), reset: bool = True, mesh=None):
    """``steps`` optimizer steps with the blocks traced; returns (max loss rel err, param rel err, counters after the
    first step, counters at the end, profile of one more micro-step or None, this rank's losses, skipped steps).
    ``reset``: Dynamo's caches cleared first (what an earlier model compiled in this process left is gone); ``mesh``:
    initialize's."""
    import torch._dynamo

    if reset:
        torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(model_cfg)
    for name in frozen:  # a frozen parameter inside a block: its shard sits between trainable ones in the flat shard
        model.get_parameter(name).requires_grad_(False)
    reference = copy.deepcopy(model)
    if how == "config":
        config = {**config, "compile": {"enabled": True, "traced": True, "backend": backend}}
    engine, *_ = zero_engine.initialize(model=model, config=config, **({} if mesh is None else {"mesh": mesh}))
    if how == "engine":
        engine.compile(backend=backend, traced=True)
        engine.compile(backend=backend, traced=True)  # a second call changes nothing (the gradient buckets included)
    if how != "eager":
        assert [r.name for r in engine.traced_regions] == [f"blocks.{i}" for i in range(model_cfg.n_layer)]
        assert not any(u.name.startswith("blocks.") for u in engine.coordinator.units)
    gas, micro = config["gradient_accumulation_steps"], config["train_micro_batch_size_per_gpu"]
    ref_opt = make_reference_optimizer(reference, config["optimizer"]["type"], config["optimizer"]["params"]["lr"])
    worst, warm, losses = 0.0, None, []
    batches = list(make_batches(model_cfg, steps + 1, world * micro * gas))
    for step, (x, y) in enumerate(batches[:steps]):
        ref_loss = reference_step(reference, ref_opt, x, y, config["gradient_clipping"])
        ours = train_global_batch(engine, x, y, gas, micro, lambda _, loss: losses.append(loss.item()))
        worst = max(worst, abs(ours - ref_loss) / abs(ref_loss))
        if step == 0:
            warm = _counters()
    param_err = _param_err(engine, reference)
    profiled = None
    if profile:
        x, y = batches[steps]
        rank = dist.get_rank()
        profiled = _profile_one_micro_step(engine, x[rank * micro: (rank + 1) * micro],
                                           y[rank * micro: (rank + 1) * micro])
        engine.zero_grad()
    return worst, param_err, warm, _counters(), profiled, losses, engine.skipped_steps


def _param_err(engine, reference) -> float:
    """Relative L2 distance of the engine's parameters (gathered from its shards) from the reference's."""
    ours, ref = whole_from_shards(engine), dict(reference.named_parameters())
    diff = sum((ours[n].float() - ref[n].detach()).pow(2).sum() for n in ours).sqrt()
    norm = sum(ref[n].detach().pow(2).sum() for n in ours).sqrt()
    return (diff / norm).item()


def _check_graphs(warm: dict, final: dict) -> None:
    assert "graph_break" not in final, final.get("graph_break")
    assert final["stats"]["unique_graphs"] == 1, final["stats"]  # both blocks: one shape, one graph
    assert final == warm, (warm, final)  # nothing traced or compiled after the first optimizer step


def _body(seq: bool, how: str, optimizer: str, clip: float):
    return _train(_config(seq, optimizer=optimizer, lr=0.05 if optimizer == "SGD" else 1e-3, clip=clip), GPTConfig(),
                  how=how, profile=True, frozen=FROZEN if optimizer == "SGD" else ())


FROZEN = ("blocks.0.attn.qkv.bias", "blocks.1.attn.qkv.bias")  # in both blocks: they stay one shape (one graph)


# (world, sequential gathering, how it is switched on, optimizer, clipping); gas 2 in every case; the SGD cases
# freeze each block's attn.qkv.bias (the reducer then takes the block's gradient shards around it). SGD without
# clipping makes the gradient's scale visible (summed instead of averaged: loss off by 1.7e-3, parameters by 1e-2);
# AdamW with clipping at 0.5 (active: the global norm is 0.8-1.1 in these steps) checks the norm over the traced
# buckets.
CASES = [(2, False, "engine", "SGD", 0.0), (3, False, "config", "AdamW", 0.5), (2, True, "engine", "AdamW", 0.5),
         (3, True, "engine", "SGD", 0.0)]


@pytest.mark.parametrize("world,seq,how,optimizer,clip", CASES)
def test_traced_blocks_match_one_process_and_gather_again_in_backward(world, seq, how, optimizer, clip):
    params_per_block = len(list(GPT(GPTConfig()).blocks[0].parameters()))
    for loss_err, param_err, warm, final, (counts, saved), *_ in run_ranks(_body, world, seq, how, optimizer, clip,
                                                                           timeout=TIMEOUT):
        assert loss_err < 2e-4 and param_err < 1e-5, (loss_err, param_err)
        _check_graphs(warm, final)
        per_block = params_per_block if seq else 1
        # forward: one gather per flat shard (per parameter when sequential) of each of the 2 blocks; one
        # reduce-scatter each in backward, where the gathers run again (recomputed, not saved): all of them when
        # coalesced; when sequential, those of the parameters backward reads (not a Linear's bias: 8 of 12)
        forward, backward = counts[GATHER_OP]
        assert forward == 2 * per_block and counts[REDUCE_OP] == (0, 2 * per_block), counts
        assert backward == (2 * 8 if seq else forward), counts
        whole = {tuple(p.shape) for p in GPT(GPTConfig()).blocks[0].parameters() if p.dim() == 2}
        assert not whole & (set(saved) | {s[::-1] for s in saved}), (whole, saved)


def _hierarchy_body(hierarchy: str, optimizer: str, clip: float):
    config = _config(False, optimizer=optimizer, lr=0.05 if optimizer == "SGD" else 1e-3, clip=clip)
    mesh = None
    if hierarchy == "mics":
        config["zero_optimization"]["mics_shard_size"] = 2
    else:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    return _train(config, GPTConfig(), profile=True, mesh=mesh)[:5]


# MiCS (mics_shard_size 2) and HSDP (a dp_replicate 2 x dp_shard 2 mesh) at world 4: the graph gathers and
# reduce-scatters over the 2 ranks of the shard group, and the reducer averages each traced bucket's gradient shard
# across the 2 replicas. SGD without clipping shows a gradient not averaged across replicas (off by far more than the
# tolerance); gas 2: averaged once per window, in its last pass.
@pytest.mark.parametrize("hierarchy,optimizer,clip", [("mics", "SGD", 0.0), ("hsdp", "AdamW", 0.5)])
def test_traced_blocks_under_mics_and_hsdp_match_one_process(hierarchy, optimizer, clip):
    for loss_err, param_err, warm, final, (counts, _saved) in run_ranks(
            _hierarchy_body, 4, hierarchy, optimizer, clip, timeout=TIMEOUT):
        assert loss_err < 2e-4 and param_err < 1e-5, (loss_err, param_err)
        _check_graphs(warm, final)
        assert counts[GATHER_OP] == (2, 2) and counts[REDUCE_OP] == (0, 2), counts


class _Linears(torch.nn.Module):
    """Linear layers of the given widths, each its own traced region (units of one module each)."""

    def __init__(self, widths: list[int]):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


def _two_models_body():
    """Two models traced one after the other in one process (a notebook, a hyperparameter search): Dynamo compiles
    the second one's regions again and makes the sizes that changed (its flat shards') dynamic. Returns, for the
    second, the all-gathers of a forward and of a backward, and the collectives left unwaited after its steps."""
    from torch.profiler import profile

    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    torch._dynamo.reset()
    for widths in ([8, 8, 8], [6, 6, 6]):
        torch.manual_seed(0)
        engine, *_ = zero_engine.initialize(model=_Linears(widths), config=config)
        engine.compile(backend="aot_eager", traced=True)
        for _ in range(3):
            with profile() as fwd:
                loss = engine(torch.randn(4, widths[0]))
            with profile() as bwd:
                engine.backward(loss)
            engine.step()
        engine.destroy()
    gathers = [sum(e.name == GATHER_OP for e in p.events()) for p in (fwd, bwd)]
    return gathers, torch._C._distributed_c10d._get_work_registry_size()


def test_a_second_model_traced_in_one_process_gathers_once_and_leaves_no_collective_unwaited():
    """With the flat shards' sizes symbolic, the backward graph gathered a flat shard once more only to read the
    gathered tensor's size, and never waited for that gather: an all-gather more per region and backward (the first
    layer's backward needs no gather at all: its input needs no gradient), and a collective a step left in torch's
    registry of unwaited work, with its buffers, for the life of the process. The flat shards are marked static."""
    for gathers, unwaited in run_ranks(_two_models_body, 2, timeout=TIMEOUT):
        assert gathers == [2, 1], gathers  # forward: one per region; backward: the second layer's (its input grad)
        assert unwaited == 0, unwaited


def _lengths_body(traced: bool):
    """Six SGD steps at sequence lengths 16, 12, 8, 10, 14, 9 with the blocks compiled (traced or regionally) and,
    on the full batch, in one process. Returns (max loss rel err, param rel err, Dynamo's graphs, graph breaks,
    collectives left unwaited)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model_cfg = GPTConfig()
    model = GPT(model_cfg)
    reference = copy.deepcopy(model)
    config = {**_config(False, optimizer="SGD", lr=0.05, clip=0.0), "gradient_accumulation_steps": 1}
    engine, *_ = zero_engine.initialize(model=model, config=config)
    engine.compile(backend="aot_eager", traced=traced)
    ref_opt = make_reference_optimizer(reference, "SGD", 0.05)
    world, rank, micro = dist.get_world_size(), dist.get_rank(), config["train_micro_batch_size_per_gpu"]
    worst = 0.0
    for step, length in enumerate([16, 12, 8, 10, 14, 9]):
        g = torch.Generator().manual_seed(step)
        x, y = (torch.randint(0, model_cfg.vocab_size, (world * micro, length), generator=g) for _ in range(2))
        ref_loss = reference_step(reference, ref_opt, x, y, 0.0)
        mine = slice(rank * micro, (rank + 1) * micro)
        loss = engine(x[mine], y[mine])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        worst = max(worst, abs(mean.item() / world - ref_loss) / abs(ref_loss))
    final = _counters()
    return (worst, _param_err(engine, reference), final["stats"]["unique_graphs"], final.get("graph_break"),
            torch._C._distributed_c10d._get_work_registry_size())


@pytest.mark.parametrize("traced", [False, True], ids=["regional", "traced"])
def test_sequence_lengths_that_change_compile_twice_and_match_one_process(traced):
    """A sequence length per batch (packing off, the last batch short): Dynamo compiles the blocks once for the first
    length and once more with the length dynamic, not once per length; the flat shards stay static in the traced
    mode, so no gather is left unwaited. Parity bounds as above (observed 1.0e-7 on losses)."""
    for loss_err, param_err, graphs, breaks, unwaited in run_ranks(_lengths_body, 2, traced, timeout=TIMEOUT):
        assert loss_err < 2e-4 and param_err < 1e-5, (loss_err, param_err)
        assert graphs == 2 and breaks is None and unwaited == 0, (graphs, breaks, unwaited)


def _inductor_body():
    return _train(_config(False, optimizer="AdamW", clip=0.5), GPTConfig(), backend="inductor", profile=True)


def test_traced_blocks_with_inductor():
    """The real backend: Inductor compiles the region's graph with its collectives (its C++ kernels, fused and
    reordered float work: test_compile's bound for Inductor, 1e-4 here on parameters, observed 2.8e-7). Cost on this
    machine: ~34 s cold (a new Inductor cache), ~18 s warm."""
    for loss_err, param_err, warm, final, (counts, _), *_ in run_ranks(_inductor_body, 2, timeout=600):
        assert loss_err < 2e-4 and param_err < 1e-4, (loss_err, param_err)
        _check_graphs(warm, final)
        assert counts[GATHER_OP] == (2, 2) and counts[REDUCE_OP] == (0, 2), counts


def _half_body(dtype: str):
    # fp16: dynamic loss scaling from 2^17, where the first 2 of the 3 steps overflow (skipped) and the last applies
    extra = {"fp16": {"enabled": True, "initial_scale_power": 17}} if dtype == "fp16" else {"bf16": {"enabled": True}}
    config = {**_config(False, optimizer="AdamW"), **extra}
    eager = _train(config, GPTConfig(), how="eager")
    traced = _train(config, GPTConfig())
    return eager, traced


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_traced_16bit_matches_the_eager_engine(dtype):
    for eager, traced in run_ranks(_half_body, 2, dtype, timeout=TIMEOUT):
        worst = max(abs(a - b) / abs(b) for a, b in zip(traced[5], eager[5]))
        assert traced[6] == eager[6] == (2 if dtype == "fp16" else 0), (traced[6], eager[6])  # skipped steps
        assert worst < 1e-2, (traced[5], eager[5])  # observed: equal to the bit (16-bit losses, 3 steps)
        # as close to the fp32 reference as the eager engine (bf16, observed: 2.18e-3 against 2.22e-3)
        assert abs(traced[1] - eager[1]) < 0.1 * eager[1], (traced[1], eager[1])
        _check_graphs(traced[2], traced[3])


def test_a_hugging_face_llama_traces_its_decoder_layers():
    pytest.importorskip("transformers")
    for loss_err, warm, final, regions in run_ranks(llama_body, 2, True, timeout=TIMEOUT):
        assert loss_err < 2e-4, loss_err
        assert regions == ["model.layers.0", "model.layers.1"], regions
        _check_graphs(warm, final)


def _without_gradients_body():
    """A traced Llama that evaluates and generates before and between steps; returns Dynamo's graph count after each
    phase, the engine's tokens and the uncompiled model's, and the eval losses against the model's."""
    import transformers
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                   pad_token_id=0, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    reference = copy.deepcopy(model)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zero_engine.initialize(model=model, config=config)
    engine.compile(backend="aot_eager", traced=True)
    ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    prompt = ids[:, :5].contiguous()
    graphs, tokens, losses = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for phase in ("eval", "generate", "train", "eval", "generate"):
            if phase == "train":
                engine.backward(engine(input_ids=ids, labels=ids).loss)
                engine.step()  # lr 0: the weights stay the reference's
            elif phase == "eval":
                with torch.no_grad():
                    losses.append((engine(input_ids=ids, labels=ids).loss.item(),
                                   reference(input_ids=ids, labels=ids).loss.item()))
            else:
                tokens.append((engine.module.generate(input_ids=prompt, max_new_tokens=4, do_sample=False),  # TRL's
                               reference.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)))
            graphs.append(counters["stats"].get("unique_graphs", 0))
    engine.destroy()
    ours = [str(w.message) for w in caught if "zero_engine" in w.filename]  # e.g. a deprecated torch call of ours
    return graphs, tokens, losses, ours


def test_a_traced_region_without_gradients_runs_eagerly_evaluate_and_generate():
    """[Note: a traced region without gradients runs eagerly]: an evaluation forward and generate() compile no
    graph (the training's one graph for both layers is the only one) and compute the uncompiled model's values."""
    pytest.importorskip("transformers")
    for graphs, tokens, losses, warned in run_ranks(_without_gradients_body, 2, timeout=TIMEOUT):
        assert graphs == [0, 0, 1, 1, 1], graphs
        assert warned == [], warned  # (torch 2.13: all_gather_tensor is deprecated; the eager gather called it)
        assert all(torch.equal(ours, expected) for ours, expected in tokens), tokens
        assert all(abs(ours - expected) <= 1e-6 * abs(expected) for ours, expected in losses), losses


# ---- the parameters' other readers and writers: checkpoints, GatheredParameters, safe_get, save_16bit_model --------
def _state_body(save_dir: str):
    """One traced step, then everything that reads or writes the shards outside the graph. An edit through
    GatheredParameters and a checkpoint load both write the shards in place: the next traced forward must compute
    with them (the graph's flat shards alias the shards)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    config = _config(False, gas=1, optimizer="AdamW", stage3_gather_16bit_weights_on_model_save=True)
    engine, *_ = zero_engine.initialize(model=model, config=config)
    engine.compile(backend="aot_eager", traced=True)
    (x, y), (x2, y2) = make_batches(GPTConfig(), 2, 2 * world)
    mine = slice(2 * rank, 2 * rank + 2)
    engine.backward(engine(x[mine], y[mine]))
    engine.step()
    engine.save_checkpoint(save_dir, tag="one")
    whole = whole_from_shards(engine)
    fc = engine.module.blocks[0].mlp.fc.weight
    with zero_engine.zero.GatheredParameters([fc]):
        gathered_ok = torch.equal(fc.detach(), whole["blocks.0.mlp.fc.weight"])
    fp32_ok = torch.equal(zero_engine.utils.safe_get_full_fp32_param(fc), whole["blocks.0.mlp.fc.weight"])
    engine.save_16bit_model(save_dir)

    reference = GPT(GPTConfig())  # the trained values, in one process
    reference.load_state_dict(whole, strict=False)
    with zero_engine.zero.GatheredParameters([fc], modifier_rank=0):
        if rank == 0:
            fc.data.mul_(0.5)
    with torch.no_grad():
        reference.blocks[0].mlp.fc.weight.mul_(0.5)
        edited = (engine(x2[mine], y2[mine]).item(), reference(x2[mine], y2[mine]).item())
    engine.load_checkpoint(save_dir, tag="one")  # back to the saved (unedited) values, in place
    reference.load_state_dict(whole, strict=False)
    with torch.no_grad():
        loaded = (engine(x2[mine], y2[mine]).item(), reference(x2[mine], y2[mine]).item())
    engine.destroy()
    return gathered_ok, fp32_ok, edited, loaded, {k: v for k, v in whole.items()}


def test_checkpoints_gathered_edits_and_16bit_save_see_the_traced_shards(tmp_path):
    results = run_ranks(_state_body, 2, str(tmp_path), timeout=TIMEOUT)
    for gathered_ok, fp32_ok, edited, loaded, _ in results:
        assert gathered_ok and fp32_ok
        assert edited[0] == pytest.approx(edited[1], rel=1e-6), edited  # the edit is what the graph gathered
        assert loaded[0] == pytest.approx(loaded[1], rel=1e-6), loaded  # and so is the checkpoint load
        assert abs(edited[0] - loaded[0]) > 1e-4  # the edit mattered
    state_dict = torch.load(tmp_path / "pytorch_model.bin")
    whole = results[0][4]
    assert all(torch.equal(state_dict[name], value) for name, value in whole.items()), sorted(whole)


# ---- refusals ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("change,key", [
    ({"zero_optimization": {"stage": 2}}, "stage 3"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, "offload_param"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "zero_quantized_weights"),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}, "zero_hpz_partition_size"),
    ({"zero_optimization": {"stage": 3, "mics_shard_size": 2, "mics_hierarchical_params_gather": True}},
     "mics_hierarchical_params_gather"),
])
def test_config_refuses_what_traced_does_not_support(change, key):
    config = {"train_micro_batch_size_per_gpu": 1, "compile": {"enabled": True, "traced": True}, **change}
    with pytest.raises(ConfigError, match=f"compile.traced.*{key}.*|compile.traced.*needs zero_optimization.stage 3"):
        load_config(config, world_size=4)
    load_config({**config, "compile": {"enabled": True}}, world_size=4)  # without traced: accepted


def test_config_traced_needs_enabled():
    with pytest.raises(ConfigError, match="compile.traced.*needs compile.enabled"):
        load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                     "compile": {"traced": True}}, world_size=2)


class _Tied(torch.nn.Module):
    """A block whose weight is tied to the head outside the blocks."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
                                          for _ in range(2))
        self.head = torch.nn.Linear(8, 8)
        self.head.weight = self.blocks[1][0].weight

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def _refusal_body(kind: str):
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    if kind == "stage2":
        engine, *_ = zero_engine.initialize(model=GPT(GPTConfig()), config={**config, "zero_optimization":
                                                                              {"stage": 2}})
    elif kind == "tied":
        engine, *_ = zero_engine.initialize(model=_Tied(), config=config)
    elif kind == "reads-outside":  # a block reads the tied embedding, which is no parameter of its
        model = GPT(GPTConfig())
        block = model.blocks[0]
        block.mlp.forward = lambda x, mlp=block.mlp, wte=model.wte: mlp.proj(torch.nn.functional.gelu(mlp.fc(x))) \
            + wte.weight[0]
        engine, *_ = zero_engine.initialize(model=model, config=config)
    else:
        model = GPT(GPTConfig())
        if kind == "external":
            zero_engine.zero.register_external_parameter(model.blocks[0].mlp, model.wte.weight)
        engine, *_ = zero_engine.initialize(model=model, config=config)
        if kind == "compiled":
            engine.compile(backend="eager")
    try:
        engine.compile(backend="eager", traced=True)
        if kind == "reads-outside":
            engine(*make_batches(GPTConfig(), 1, 1)[0])
    except (NotImplementedError, RuntimeError) as error:
        return str(error)
    finally:
        engine.destroy()
    return None


@pytest.mark.parametrize("kind,message", [
    ("stage2", "needs zero_optimization.stage 3"),
    ("tied", "the region blocks.1 shares a parameter with head.weight, outside it"),
    ("external", "blocks.0.mlp has external parameters registered"),
    ("compiled", "blocks.0 is compiled already"),
    ("reads-outside", "reads wte.weight, which ZeRO-3 has partitioned"),
])
def test_engine_compile_traced_refuses_by_name(kind, message):
    for error in run_ranks(_refusal_body, 1, kind, timeout=TIMEOUT):
        assert error is not None and message in error and "compile.traced" in error, error
