"""Feature combinations drawn at random: each trains a few steps against stage 0 and resumes from a checkpoint.

The parity tests pin one feature, or a chosen few, at a time; users turn on many at once. This draws configurations
from the grid below (the test GPT or a transformers Llama; world 1-4; stage 1-3; fp32, bf16, fp16; accumulation;
clipping; bucket, prefetch, live and reuse budgets; leaf units; sequential or "auto" gathers; CPU and NVMe offload
of parameters and optimizer; sub-groups; ZeRO++ qwZ, qgZ, hpZ; MiCS; torch.compile (aot_eager, inductor, the traced
mode); a model built under zero.Init; the config's AdamW, Adam with L2 decay (either on CPUAdam or torch's kernel)
or SGD with momentum, or the client's torch AdamW; a WarmupLR, WarmupDecayLR or WarmupCosineLR schedule; an fp16
loss scale that overflows at first; sequence lengths that vary from micro-step to micro-step; tensor parallelism
(world 4 = dp 2 x tp 2: the GPT's MLPs split by parallelize_module, or a Llama split by the config's AutoTP); MoE
layers in place of the GPT's MLPs, with every expert on every rank or split over ep 2; a frozen copy of the initial
model in a second engine without an optimizer, evaluated between each forward and its backward (TRL's DPO reference
model); the Llama's ``generate`` between steps (TRL's online trainers; its greedy tokens compared with stage 0's in
fp32); a frozen parameter; activation checkpointing (Hugging Face's for the Llama); and the test GPT's quirks: a
block run twice, a branch taken on some steps, or on some ranks only) and for each one:

- trains ``--steps`` steps on simulated ranks and compares the losses with stage 0 of the same precision,
  accumulation, clipping and model (the largest relative difference; 16-bit losses differ by a rounding step where
  the stages accumulate gradients in another order; with tp, stage 0 runs on the dp ranks alone; with experts split
  over ep ranks, stage 0 holds every expert on every rank);
- every third draw, trains again with a save at step 2, a new engine and a load: the losses after the load must be
  the uninterrupted run's, bitwise; and loads the same checkpoint on another number of ranks (resharded; at another
  ZeRO stage too where the draw has a ``load_stage``): the losses after the load must be within the tolerance of
  stage 0's doing the same, and the checkpoint's weights as the
  offline converter reads them (``get_fp32_state_dict_from_zero_checkpoint``, what ``zero-engine to-fp32`` writes),
  and those ``save_16bit_model`` wrote at the same step, within ``WEIGHT_TOLERANCE`` of stage 0's (experts split
  over ep 2 load on another world that 2 divides, ``reshard_world``; their files hold every expert whole, as stage
  0's with every expert on every rank);
- with a branch on some ranks only, expects every rank to raise ``RankDivergenceError`` (no rank killed, none hung).

[Note: Dynamo at the save]
A resumed run is a new process, whose Dynamo has compiled nothing; the uninterrupted run it is compared with carries
what it compiled before the save, and the two may run different code after it. Seed 61's draw 9 was that: a Llama
with AutoTP (its layers compile with ``dynamic=False``, compile.py) and lengths that vary, given a KV cache in every
forward then, compiled one graph per layer and length, reached Dynamo's recompile limit at the third length and ran
the fourth eagerly for good, where the resumed run compiled it; Inductor's kernels and eager round differently
(4.8e-7). So under compile both runs empty Dynamo at the save, and the bitwise comparison judges the checkpoint, not
Dynamo's cache. (The Llama now trains without the cache, as transformers' Trainer does: compile.py's
[Note: a KV cache in training forwards].)

Outcomes: ``ok``; ``refused`` (a combination we reject with "not supported yet"); ``diverged`` (the expected error);
``BAD`` (losses off, or a resume not bitwise); ``ERROR`` (anything else). Exit status 1 if any is BAD or ERROR.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python bench/combinations.py --draws 60 --seed 23 [--json FILE]

One draw, the grid's first values with those given (repeat ``--draw`` for more; ``--resume`` resumes each too):

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python bench/combinations.py --draw '{"model": "llama", "generate": true}'
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import tempfile

import torch
import torch._dynamo
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import zero_engine
from zero_engine.checkpoint import get_fp32_state_dict_from_zero_checkpoint
from zero_engine.moe import MoE, expert_parallel_groups
from zero_engine.testing import RankError, run_ranks
from zero_engine.testing.loop import resume_in_new_engine
from zero_engine.testing.models import GPT, GPTConfig, make_batches

GRID = dict(
    model=["gpt", "gpt", "gpt", "llama"], world=[1, 2, 2, 3, 4, 4], stage=[1, 2, 3, 3, 3],
    precision=["fp32", "bf16", "fp16"], accumulation=[1, 2],
    clipping=[0.0, 1.0], overlap_comm=[True, False], reduce_bucket=[3000, 500000], prefetch_bucket=[2000, 1000000],
    persistence=[0, 100, 100000], max_live=[6000, 10**9], reuse_distance=[0, 10**9], leaf=[True, False],
    sequential=[None, True, "auto"], offload_param=[None, None, "cpu", "nvme"],
    offload_optimizer=[None, None, "cpu", "nvme"], sub_group=[None, 5000], communication_fp32=[False, True],
    zeropp=[None, None, None, "qwZ", "qgZ", "hpZ", "MiCS"], frozen=[False, True], block_twice=[False, True],
    checkpointing=[False, True], branch=[None, "some steps", "some steps", "some ranks"],
    compile=[None, None, None, "aot_eager", "inductor", "traced"], zero_init=[False, True],
    optimizer=["AdamW", "AdamW", "Adam (L2)", "SGD", "client"], torch_adam=[False, True],
    scheduler=[None, None, "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"], fp16_scale_power=[8, 16],
    tp=[False, False, "parallelize_module", "autotp"], experts=[None, None, None, None, 1, 2],
    frozen_copy=[False, False, True], lengths=["fixed", "varying"], generate=[False, True],
    load_stage=[None, None, 0, 1, 2, 3],
)
STAGE_3_ONLY = ("prefetch_bucket", "persistence", "max_live", "reuse_distance", "leaf", "sequential", "offload_param",
                "zeropp", "zero_init")
COMPARED_WITH_STAGE_0 = ("model", "world", "precision", "accumulation", "clipping", "communication_fp32", "frozen",
                         "block_twice", "checkpointing", "branch", "optimizer", "torch_adam", "scheduler",
                         "fp16_scale_power", "tp", "experts", "frozen_copy", "lengths", "generate")
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 5e-3}  # relative; 16-bit: a few rounding steps of a loss near 4.7
QUANTIZED_TOLERANCE = 0.2  # qwZ and qgZ quantize to int8 and int4 on purpose
# the weights after 3 steps, relative L2: AdamW's division by sqrt(v) amplifies a rounding of a near-zero gradient
WEIGHT_TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 5e-3}
# with tp, stage 0 (no tp) sums in another order, and Adam turns that rounding of a near-zero gradient into an update
# of up to lr: tests/test_autotp.py's bound for Adam-family weights against one process (SGD stays within 2.5e-9).
# The key bias, whose gradient is zero but for rounding, is left out of the comparison: see seen_by_the_loss
TP_ADAM_WEIGHT_TOLERANCE = 2e-4
SAVE_AT = 2
LENGTHS = (16, 11, 7, 13)  # the sequence length of micro-step i, i modulo 4, in a draw whose lengths vary
TP = 2  # the tp size of a draw with tp: the last mesh dim, the test GPT's MLPs split as Megatron does
TP_WIDTH = 132  # their width then (the test GPT's odd default, 133, is not split evenly)
NUM_EXPERTS = 4  # of a draw with MoE layers
RESHARD_TO = {1: 2, 2: 3, 3: 2, 4: 2}  # the number of ranks a checkpoint is loaded on, by the number it was saved on
EP_RESHARD_TO = {2: 4, 4: 2}  # the same for experts over ep 2, whose ep size must divide the world
GENERATE = (5, 6)  # a Llama draw that generates: from the first 5 tokens of each row, 6 more, greedily


def effective(draw: dict) -> dict:
    """The draw with what its stage and world do not use turned off (None), so that it reads as what runs."""
    draw = dict(draw)
    if draw["stage"] != 3:
        for name in STAGE_3_ONLY:
            draw[name] = None
        if draw["compile"] == "traced":
            draw["compile"] = None
    if draw["precision"] != "fp16":
        draw["fp16_scale_power"] = None
    if draw["optimizer"] in ("SGD", "client"):  # torch_adam picks the kernel of an Adam built from the config
        draw["torch_adam"] = None
    if draw["world"] != 4 or not draw["stage"]:  # tp: world 4 = dp 2 x tp 2; stage 0 with tp is not supported
        draw["tp"] = None
    if draw["tp"]:
        draw["zero_init"] = None  # parallelize_module splits whole weights
    if draw["experts"] == 2 and draw["world"] % 2:
        draw["experts"] = 1  # its ep size must divide the world
    if draw["experts"] and draw["tp"]:  # the tp plans split the dense MLPs
        draw["experts"] = None
    if draw["world"] == 1 and draw["branch"] == "some ranks":  # one rank always agrees with itself
        draw["branch"] = "some steps"
    if draw["model"] == "llama":  # the quirks below are the test GPT's forward; AutoTP splits a Llama
        draw["block_twice"] = draw["branch"] = draw["experts"] = None
        draw["tp"] = draw["tp"] and "autotp"
    else:
        draw["generate"] = None  # Hugging Face's
        if draw["tp"] == "autotp":  # the test GPT's 3 heads cannot be split in 2
            draw["tp"] = "parallelize_module"
    if draw["tp"]:  # a frozen copy at stage 0 (the trained model's below 3) cannot take the tp plan
        draw["frozen_copy"] = None
    if draw["tp"] and draw["zeropp"] == "MiCS":  # parallelize_module: the mesh given to initialize says how ranks
        # group (a ConfigError says so); AutoTP: MiCS over the dp 2 is flat, and no size fits the resharded load (dp 1)
        draw["zeropp"] = None
    if draw["zeropp"] in ("hpZ", "MiCS") and draw["world"] != 4:  # a partition of 2 within a world of 4
        draw["zeropp"] = None
    if draw["load_stage"] == draw["stage"] or draw["tp"] and draw["load_stage"] == 0:
        draw["load_stage"] = None  # the same stage; stage 0 with tp is not supported
    return draw


def loading_draw(draw: dict, world: int) -> dict:
    """The draw that the resharded load on ``world`` ranks runs: at ``load_stage`` where the draw has one (a
    checkpoint resumes at another ZeRO stage); the stage-3 settings that a lower stage turned off take the grid's
    first values there. hpZ is left out where the load's data-parallel world is one rank (tp over all of it): a
    partition of 2 does not divide it (a ConfigError says so), and hpZ changes nothing that a checkpoint holds."""
    if draw["zeropp"] == "hpZ" and draw["tp"] and world // TP < 2:
        draw = {**draw, "zeropp": None}
    if draw["load_stage"] is None:
        return draw
    filled = {name: GRID[name][0] if draw[name] is None else draw[name] for name in STAGE_3_ONLY}
    return effective({**draw, **filled, "stage": draw["load_stage"], "load_stage": None})


def ds_config(draw: dict, scratch: str) -> dict:
    zero = {"stage": draw["stage"], "overlap_comm": draw["overlap_comm"], "reduce_bucket_size": draw["reduce_bucket"]}
    if draw["stage"] and draw["sub_group"]:
        zero["sub_group_size"] = draw["sub_group"]
    if draw["stage"] == 3:
        zero.update(stage3_prefetch_bucket_size=draw["prefetch_bucket"],
                    stage3_param_persistence_threshold=draw["persistence"],
                    stage3_max_live_parameters=draw["max_live"], stage3_max_reuse_distance=draw["reuse_distance"])
        if draw["leaf"]:
            zero["leaf_module"] = {"classes": ["LlamaDecoderLayer" if draw["model"] == "llama" else "Block"]}
        if draw["sequential"] is not None:
            zero["stage3_allgather_sequential"] = draw["sequential"]
        if draw["offload_param"] == "cpu":
            zero["offload_param"] = {"device": "cpu"}
        elif draw["offload_param"] == "nvme":
            zero["offload_param"] = {"device": "nvme", "nvme_path": os.path.join(scratch, "params"),
                                     "buffer_size": 4000, "buffer_count": 5, "max_in_cpu": 20000}
        zeropp = draw["zeropp"]
        if zeropp == "qwZ":
            zero["zero_quantized_weights"] = True
        elif zeropp == "qgZ":
            zero["zero_quantized_gradients"] = True
        elif zeropp == "hpZ" and draw["world"] == 4:
            zero["zero_hpz_partition_size"] = 2
        elif zeropp == "MiCS" and draw["world"] == 4:
            zero["mics_shard_size"] = 2
    if draw["stage"] and draw["offload_optimizer"]:
        zero["offload_optimizer"] = ({"device": "cpu"} if draw["offload_optimizer"] == "cpu" else
                                     {"device": "nvme", "nvme_path": os.path.join(scratch, "optimizer")})
    if draw["stage"] == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True  # save_16bit_model writes nothing without it
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": draw["accumulation"],
              "gradient_clipping": draw["clipping"], "zero_optimization": zero,
              }
    config.update(optimizer_and_scheduler(draw))
    if draw["tp"] == "autotp":
        config["tensor_parallel"] = {"autotp_size": TP}
    if draw["compile"]:
        config["compile"] = {"enabled": True, "backend": "aot_eager" if draw["compile"] == "aot_eager" else "inductor",
                             "traced": draw["compile"] == "traced"}
    if draw["communication_fp32"]:
        config["communication_data_type"] = "fp32"
    if draw["precision"] == "bf16":
        config["bf16"] = {"enabled": True}
    elif draw["precision"] == "fp16":
        # 2**16: the first steps overflow and are skipped, then the scale grows back every 2 steps
        config["fp16"] = {"enabled": True, "initial_scale_power": draw["fp16_scale_power"], "loss_scale_window": 2}
    return config


def optimizer_and_scheduler(draw: dict) -> dict:
    """The config's optimizer (none for the client's torch.optim.AdamW, passed to initialize; see train) and
    scheduler sections of a draw."""
    sections = {}
    if draw["optimizer"] == "SGD":
        sections["optimizer"] = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}}
    elif draw["optimizer"] != "client":
        params = {"lr": 1e-3, "weight_decay": 0.1, "torch_adam": draw["torch_adam"]}
        if draw["optimizer"] == "Adam (L2)":
            params["adam_w_mode"] = False  # weight decay added to the gradient, as torch.optim.Adam does
        sections["optimizer"] = {"type": "Adam" if draw["optimizer"] == "Adam (L2)" else "AdamW", "params": params}
    lr = 0.05 if draw["optimizer"] == "SGD" else 1e-3
    if draw["scheduler"] == "WarmupLR":
        params = {"warmup_min_lr": 0.0, "warmup_max_lr": lr, "warmup_num_steps": 3}
    elif draw["scheduler"] == "WarmupDecayLR":
        params = {"warmup_min_lr": 0.0, "warmup_max_lr": lr, "warmup_num_steps": 2, "total_num_steps": 8}
    elif draw["scheduler"] == "WarmupCosineLR":
        params = {"warmup_min_ratio": 0.1, "warmup_num_steps": 2, "total_num_steps": 8, "cos_min_ratio": 0.01}
    if draw["scheduler"]:
        sections["scheduler"] = {"type": draw["scheduler"], "params": params}
    return sections


def build_model(draw: dict, shape: GPTConfig) -> torch.nn.Module:
    """The test GPT of ``shape`` (its MLPs MoE layers of ``NUM_EXPERTS`` experts, top 2, with ``draw["experts"]``
    as the ep size), or a transformers Llama of about its size (4 heads, 2 key/value heads, tied
    embeddings; a frozen final norm and Hugging Face's gradient checkpointing where the draw has them)."""
    if draw["model"] == "gpt":
        model = GPT(shape)
        if draw["experts"]:  # the same weights whatever the ep size, for a given seed (zero_engine/moe.py)
            for block in model.blocks:
                block.mlp = MoE(shape.n_embd, 40, NUM_EXPERTS, top_k=2, groups=expert_parallel_groups(draw["experts"]))
        return model
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=shape.n_layer,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=shape.block_size,
        tie_word_embeddings=True))
    model.config.use_cache = False  # as transformers' Trainer trains (generate keeps its cache): see compile.py's
    # [Note: a KV cache in training forwards]; with it, compiled layers past Dynamo's recompile limit ran eagerly
    if draw["frozen"]:
        model.model.norm.weight.requires_grad_(False)
    if draw["checkpointing"]:
        model.activation_checkpointing_enable({"use_reentrant": False})
    return model


def forward(engine, draw: dict, x: torch.Tensor, y: torch.Tensor, branch: bool = False) -> torch.Tensor:
    """The loss of one micro-batch (a Llama shifts the labels itself: it is given the inputs)."""
    if draw["model"] == "llama":
        return engine(input_ids=x, labels=x).loss
    return engine(x, y, use_branch=branch)


def train(draw: dict, steps: int, checkpoint_dir: str | None, part: str | None = None) -> list[float]:
    """On each rank: this rank's losses, micro-step by micro-step. With ``checkpoint_dir``: ``part`` None saves after
    step ``SAVE_AT`` and loads into a new engine built from another seed, on the same ranks; "save" trains to
    ``SAVE_AT`` and saves; "load" builds from another seed, loads, and trains the steps after ``SAVE_AT`` (on
    another number of ranks: the checkpoint is resharded)."""
    rank = dist.get_rank()
    dp_rank = rank // TP if draw["tp"] else rank  # the tp ranks of one dp rank read the same rows
    with tempfile.TemporaryDirectory() as scratch:
        os.makedirs(os.path.join(scratch, "params"))
        os.makedirs(os.path.join(scratch, "optimizer"))
        config = ds_config(draw, scratch)
        shape = GPTConfig(vocab_size=97, block_size=16, n_layer=3, n_embd=33, n_head=3, frozen_param=draw["frozen"],
                          reuse_block=draw["block_twice"], optional_branch=draw["branch"] is not None,
                          checkpoint_blocks=draw["checkpointing"],
                          mlp_hidden=TP_WIDTH if draw["tp"] or draw.get("tp_width") else None)

        if draw["compile"]:  # the rank processes outlive draws: earlier draws' models would use up Dynamo's
            torch._dynamo.reset()  # recompile limit, and this draw would run eagerly

        def build(seed: int, frozen_copy: bool = False):
            """The trained model's engine; or, ``frozen_copy``, the initial model's without an optimizer."""
            engine_config = frozen_copy_config(config) if frozen_copy else config
            torch.manual_seed(seed)
            if draw["zero_init"]:
                with zero_engine.zero.Init(config_dict_or_path=engine_config):
                    model = build_model(draw, shape)
            else:
                model = build_model(draw, shape)
            mesh = None
            if draw["tp"] == "parallelize_module":
                mesh = init_device_mesh("cpu", (dist.get_world_size() // TP, TP), mesh_dim_names=("dp", "tp"))
                for block in model.blocks:
                    parallelize_module(block.mlp, mesh["tp"], {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
            client = (torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
                      if draw["optimizer"] == "client" and not frozen_copy else None)
            return zero_engine.initialize(model=model, optimizer=client, config=engine_config, mesh=mesh)[0]

        engine = build(1 if part == "load" else 0)
        if part == "load":
            engine.load_checkpoint(checkpoint_dir)
        frozen = None
        if draw["frozen_copy"]:  # the initial model, evaluated at every micro-step, in an engine of its own
            frozen = build(0, frozen_copy=True)
            frozen.eval()
        batches = make_batches(shape, 8, 4, seed=dp_rank)
        accumulation = engine.gradient_accumulation_steps()
        losses = []
        for step in range(SAVE_AT + 1 if part == "load" else 0, SAVE_AT + 1 if part == "save" else steps):
            branch = (draw["branch"] == "some steps" and step % 2 == 0
                      or draw["branch"] == "some ranks" and (step + dp_rank) % 2 == 0)
            for micro in range(step * accumulation, (step + 1) * accumulation):
                x, y = batches[micro % len(batches)]
                if draw["lengths"] == "varying":  # as packed or unpadded batches are: torch.compile goes dynamic
                    length = LENGTHS[micro % len(LENGTHS)]
                    x, y = x[:, :length].contiguous(), y[:, :length].contiguous()
                loss = forward(engine, draw, x, y, branch)
                if frozen is not None:  # between the forward and its backward, as a DPO step reads its reference
                    with torch.no_grad():
                        losses.append(forward(frozen, draw, x, y).item())
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            if step == 1:  # an evaluation forward between steps, as a real run has
                engine.eval()
                with torch.no_grad():
                    forward(engine, draw, x, y)
                if draw["generate"]:  # as TRL's online trainers generate between steps; tokens checked in fp32 only
                    prompt, new = GENERATE
                    tokens = engine.generate(input_ids=x[:, :prompt].contiguous(), max_new_tokens=new,
                                             attention_mask=torch.ones_like(x[:, :prompt]), pad_token_id=0,
                                             do_sample=False)
                    if draw["precision"] == "fp32":  # 16-bit logits of a random model tie: argmax may differ
                        # judged with the losses, relative to stage 0's: + 1, as a token may be 0
                        losses.extend(float(t) + 1.0 for t in tokens[:, prompt:].flatten().tolist())
                engine.train()
            if part == "save" and step == SAVE_AT:
                engine.save_checkpoint(checkpoint_dir)
                engine.save_16bit_model(os.path.join(checkpoint_dir, "model16"))
            elif part is None and step == SAVE_AT:
                if draw["compile"]:  # a resumed run is a new process, its Dynamo empty; so is the uninterrupted
                    torch._dynamo.reset()  # run's from here, or their kernels differ: see [Note: Dynamo at the save]
                if checkpoint_dir is not None:
                    engine = resume_in_new_engine(engine, lambda: build(1), checkpoint_dir)
        engine.destroy()
        if frozen is not None:
            frozen.destroy()
        return losses


def frozen_copy_config(config: dict) -> dict:
    """The config of a frozen copy's engine, as TRL prepares a DPO reference model for DeepSpeed: no optimizer,
    ZeRO-3 kept (its parameters sharded as the trained model's), a lower stage turned into stage 0."""
    config = {k: v for k, v in config.items() if k not in ("optimizer", "scheduler")}
    zero = config["zero_optimization"]
    config["zero_optimization"] = ({k: v for k, v in zero.items() if k != "offload_optimizer"} if zero["stage"] == 3
                                   else {"stage": 0})
    return config


def run(draw: dict, steps: int, resume: bool = False) -> list[list[float]]:
    with tempfile.TemporaryDirectory() as checkpoint_dir:
        return run_ranks(train, draw["world"], draw, steps, checkpoint_dir if resume else None, timeout=240,
                         grace_after_failure=60)


def run_resharded(draw: dict, steps: int, world: int) -> tuple[list[list[float]], dict | str, dict]:
    """The losses after the load, on ``world`` ranks, of a run saved on ``draw["world"]`` ranks; the saved
    checkpoint's weights as the offline converter reads them (whole, fp32; "refused" where it says "not supported
    yet"); and the weights that ``save_16bit_model`` wrote beside it (compute dtype)."""
    with tempfile.TemporaryDirectory() as checkpoint_dir:
        run_ranks(train, draw["world"], draw, steps, checkpoint_dir, "save", timeout=240, grace_after_failure=60)
        try:
            weights = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir)
        except Exception as error:  # noqa: BLE001 -- a refusal is an outcome; anything else is raised again
            if "not supported yet" not in str(error):
                raise
            weights = "refused"
        weights16 = torch.load(os.path.join(checkpoint_dir, "model16", "pytorch_model.bin"), weights_only=True)
        losses = run_ranks(train, world, loading_draw(draw, world), steps, checkpoint_dir, "load", timeout=240,
                           grace_after_failure=60)
        return losses, weights, weights16


def reshard_world(draw: dict) -> int:
    """The number of ranks the draw's checkpoint is loaded on."""
    return (EP_RESHARD_TO if draw["experts"] == 2 else RESHARD_TO)[draw["world"]]


def resharded_deviation(draw: dict, steps: int, references: dict, key: tuple,
                        reference_draw: dict) -> tuple[float | str, float | str, float | str]:
    """How far the losses after a load on another number of ranks are from stage 0's doing the same; and how far
    the checkpoint's weights read offline, and those save_16bit_model wrote, are from stage 0's (relative L2 over
    the model); "refused" where we refuse that with "not supported yet"."""
    world = reshard_world(draw)
    if (key, world) not in references:
        references[key, world] = run_resharded(reference_draw, steps, world // TP if draw["tp"] else world)
    reference_losses, reference_weights, reference_weights16 = references[key, world]
    try:
        losses, weights, weights16 = run_resharded(draw, steps, world)
    except RankError as error:
        if all("not supported yet" in f.exception for f in error.failures):
            return "refused", "refused", "refused"
        raise
    deviation = largest_relative_difference(losses, per_rank(reference_losses, draw))
    if draw["tp"] and draw["optimizer"] != "SGD":  # see seen_by_the_loss
        weights, reference_weights = seen_by_the_loss(weights), seen_by_the_loss(reference_weights)
        weights16, reference_weights16 = seen_by_the_loss(weights16), seen_by_the_loss(reference_weights16)
    return (deviation, "refused" if weights == "refused" else relative_l2(weights, reference_weights),
            relative_l2(weights16, reference_weights16))


def seen_by_the_loss(weights: dict | str) -> dict | str:
    """``weights`` without the key projection's bias (the middle third of the test GPT's ``attn.qkv.bias``). Softmax
    ignores a shift that is the same for every key, so that bias changes no loss and its gradient is zero but for
    rounding, which Adam's division by sqrt(v) turns into an update of up to lr a step: with tp the rounding is
    another than stage 0's, and seed 97's draw 57 (fp32, Adam with L2 decay, losses bitwise stage 0's) had its key
    biases 1e-3 apart, 2.7e-4 of the whole model, every other parameter within 3e-7 (docs/benchmarks.md)."""
    if not isinstance(weights, dict):
        return weights  # "refused"
    kept = {}
    for name, tensor in weights.items():
        if name.endswith("attn.qkv.bias"):
            third = tensor.numel() // 3
            tensor = torch.cat([tensor[:third], tensor[2 * third:]])
        kept[name] = tensor
    return kept


def relative_l2(weights: dict, reference: dict) -> float | str:
    """|weights - reference| / |reference| over the whole model (fp32 arithmetic)."""
    if weights.keys() != reference.keys():
        return f"other names: {sorted(weights.keys() ^ reference.keys())[:4]}"
    difference = sum((weights[n].float() - reference[n].float()).pow(2).sum() for n in weights)
    return (difference / sum(w.float().pow(2).sum() for w in reference.values())).sqrt().item()


def largest_relative_difference(losses: list[list[float]], reference: list[list[float]]) -> float:
    """Over every rank and micro-step: |loss - stage 0's| / |stage 0's|, the largest."""
    return max(abs(a - b) / abs(b) for mine, theirs in zip(losses, reference) for a, b in zip(mine, theirs))


def per_rank(reference: list[list[float]], draw: dict) -> list[list[float]]:
    """Stage 0's losses for each rank of the draw: with tp, each tp rank has its dp rank's."""
    return [losses for losses in reference for _ in range(TP if draw["tp"] else 1)]


def stage_0_of(draw: dict) -> dict:
    """The draw a draw is compared with: stage 0 of the same model on the dp ranks alone (tp computes the same sums in
    another order)."""
    return dict(draw, stage=0, offload_param=None, offload_optimizer=None, sub_group=None, zeropp=None,
                zero_init=None, compile=None, tp=None, tp_width=draw["tp"],
                experts=draw["experts"] and 1,  # every expert on every rank
                load_stage=None,  # stage 0 loads at stage 0
                world=draw["world"] // TP if draw["tp"] else draw["world"])


def judge(draw: dict, steps: int, references: dict, resume: bool) -> dict:
    """One draw's outcome (see the module's docstring)."""
    try:
        if draw["branch"] == "some ranks" and draw["stage"] == 3:
            try:
                run(draw, steps)
            except RankError as error:
                messages = [f.exception for f in error.failures]
                if len(messages) == draw["world"] and all("DivergenceError" in m or "MismatchError" in m
                                                          for m in messages):
                    return {"outcome": "diverged"}
                raise
            return {"outcome": "BAD", "error": "a branch on some ranks only trained without an error"}
        key = tuple(draw[k] for k in COMPARED_WITH_STAGE_0)
        reference_draw = stage_0_of(draw)
        if key not in references:
            references[key] = run(reference_draw, steps)
        losses = run(draw, steps)
        deviation = largest_relative_difference(losses, per_rank(references[key], draw))
        if resume:
            resumed = max(abs(a - b) for mine, theirs in zip(run(draw, steps, resume=True), losses)
                          for a, b in zip(mine, theirs))
            resharded, weights, weights16 = resharded_deviation(draw, steps, references, key, reference_draw)
        else:
            resumed = resharded = weights = weights16 = None
        quantized = draw["stage"] == 3 and draw["zeropp"] in ("qwZ", "qgZ")
        tolerance = QUANTIZED_TOLERANCE if quantized else TOLERANCE[draw["precision"]]
        weight_tolerance = QUANTIZED_TOLERANCE if quantized else WEIGHT_TOLERANCE[draw["precision"]]
        if draw["tp"] and draw["optimizer"] != "SGD":
            weight_tolerance = max(weight_tolerance, TP_ADAM_WEIGHT_TOLERANCE)
        good = (deviation <= tolerance and resumed in (None, 0.0, "refused")
                and (resharded in (None, "refused") or resharded <= tolerance)
                and all(w in (None, "refused") or isinstance(w, float) and w <= weight_tolerance
                        for w in (weights, weights16)))
        return {"outcome": "ok" if good else "BAD", "deviation": deviation, "tolerance": tolerance,
                "resume_deviation": resumed, "resharded_deviation": resharded, "weights_deviation": weights,
                "weights16_deviation": weights16, "weight_tolerance": weight_tolerance}
    except RankError as error:
        messages = [f.exception for f in error.failures]
        if all("not supported yet" in m for m in messages):
            return {"outcome": "refused", "error": messages[0].splitlines()[-1][:300]}
        return {"outcome": "ERROR", "error": " | ".join(m[-600:] for m in messages)}


def given_draw(text: str) -> dict:
    """A draw from ``--draw``: the grid's first values, with the JSON object's in their place."""
    values = json.loads(text)
    unknown = sorted(set(values) - set(GRID))
    if unknown:
        raise SystemExit(f"--draw {text}: {unknown} are not dimensions of the grid; they are {sorted(GRID)}")
    return effective({**{name: choices[0] for name, choices in GRID.items()}, **values})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", default="", help="write one JSON line per draw here")
    parser.add_argument("--draw", action="append", default=[], metavar="JSON",
                        help="judge this draw instead of random ones (repeatable): the grid's first values, with "
                             "those given here, e.g. '{\"model\": \"llama\", \"stage\": 3, \"generate\": true}'")
    parser.add_argument("--resume", action="store_true", help="with --draw: resume each one from a checkpoint too")
    args = parser.parse_args()
    if args.steps < SAVE_AT + 2:
        parser.error(f"--steps {args.steps}: a resumed run needs a step after the save at step {SAVE_AT}; use "
                     f"{SAVE_AT + 2} or more")
    rng = random.Random(args.seed)
    references: dict = {}
    counts: collections.Counter = collections.Counter()
    out = open(args.json, "w") if args.json else None
    given = [given_draw(text) for text in args.draw]
    for i in range(len(given) or args.draws):
        draw = given[i] if given else effective({name: rng.choice(values) for name, values in GRID.items()})
        resume = args.resume if given else i % 3 == 0
        result = {"draw": i, **judge(draw, args.steps, references, resume=resume), **draw}
        counts[result["outcome"]] += 1
        line = json.dumps(result)
        print(line if result["outcome"] in ("BAD", "ERROR") else
              f"{i:3d} {result['outcome']:8s} " + " ".join(f"{k}={v}" for k, v in draw.items()
                                                           if v is not None and v is not False), flush=True)
        if out:
            out.write(line + "\n")
            out.flush()
    print("outcomes:", dict(counts))
    return 1 if counts["BAD"] or counts["ERROR"] else 0


if __name__ == "__main__":
    sys.exit(main())
