"""What every system in the comparison shares: model sizes, data, optimizer hyper-parameters, ZeRO knobs.

This module is imported by the driver (``compare.py``) and by the workers, including a worker running in another
Python that has DeepSpeed but not necessarily zero_engine. So it imports neither zero_engine nor torch at module
level, and the GPT model is loaded from its source file rather than through the ``zero_engine`` package.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MODELS_FILE = REPO_ROOT / "zero_engine" / "testing" / "models.py"

DATA_SEED = 1
MODEL_SEED = 0

# One AdamW for everyone (torch.optim.AdamW, foreach), no LR schedule, clipping by the global grad norm.
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
GRADIENT_CLIPPING = 1.0

# Bytes of model state per parameter for AdamW in the ZeRO formula: 4 (fp32 param) + 4 (grad) + 8 (two moments);
# with 16-bit compute it is 2 + 2 + 12, the same 16 (DESIGN.md "Numbers").
MODEL_STATE_BYTES_PER_PARAM = 16
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ZeroKnobs:
    """The ZeRO settings given identically to zero_engine and DeepSpeed (DeepSpeed's key names, in elements)."""

    reduce_bucket_size: int
    prefetch_bucket_size: int
    param_persistence_threshold: int
    max_live_parameters: int
    max_reuse_distance: int
    allgather_bucket_size: int  # stages 1 and 2: the post-step refresh of whole parameters
    leaf_classes: tuple[str, ...] = ()  # stage 3 leaf modules (leaf_module.classes): DeepSpeed and System.leaf_units


@dataclass(frozen=True)
class BenchSize:
    name: str
    gpt: dict  # GPTConfig keyword arguments
    global_batch: int  # sequences per step over all ranks; each rank takes global_batch / world of them
    knobs: ZeroKnobs
    warmup: int  # timed pass: steps before timing starts
    steps: int  # timed pass: timed steps
    note: str = ""
    memory_measured_steps: int = 2  # memory pass: steps after one warm-up step

    def micro_batch(self, world: int) -> int:
        if self.global_batch % world:
            raise ValueError(f"size {self.name}: global batch {self.global_batch} is not divisible by world {world}; "
                             "choose world sizes that divide it")
        return self.global_batch // world


SIZES: dict[str, BenchSize] = {
    # The demo model (examples/train_gpt.py), with the ZeRO knobs of examples/configs/zero3.json: transformer blocks
    # as leaf modules (one gather unit per block, as FSDP2 wraps them), a prefetch bucket that holds one block
    # (789k elements) and a live budget for two of them (the one running and the next).
    "demo": BenchSize(
        name="demo",
        gpt=dict(vocab_size=512, block_size=64, n_layer=4, n_head=8, n_embd=256),
        global_batch=16,
        knobs=ZeroKnobs(reduce_bucket_size=500_000, prefetch_bucket_size=1_000_000, param_persistence_threshold=1_000,
                        max_live_parameters=2_000_000, max_reuse_distance=100_000, allgather_bucket_size=500_000,
                        leaf_classes=("Block",)),
        warmup=3, steps=10,
    ),
    # The demo model with an MLP hidden size of 4 x 256 = 1024 (not 1025) so that it splits over tp ranks: the size
    # the tensor-parallel systems run (zero3-tp, fsdp2-tp), with the others beside them on the same model.
    "demo-tp": BenchSize(
        name="demo-tp",
        gpt=dict(vocab_size=512, block_size=64, n_layer=4, n_head=8, n_embd=256, mlp_hidden=1024),
        global_batch=16,
        knobs=ZeroKnobs(reduce_bucket_size=500_000, prefetch_bucket_size=1_000_000, param_persistence_threshold=1_000,
                        max_live_parameters=2_000_000, max_reuse_distance=100_000, allgather_bucket_size=500_000,
                        leaf_classes=("Block",)),
        warmup=3, steps=10,
    ),
    # GPT-2-small-like blocks with a 16k vocabulary: 97.7M parameters. Buckets of about 2/3 of a block; the live
    # budget holds the tied embedding (12.6M) plus a prefetch bucket.
    "100m": BenchSize(
        name="100m",
        gpt=dict(vocab_size=16384, block_size=64, n_layer=12, n_head=12, n_embd=768),
        global_batch=8,
        knobs=ZeroKnobs(reduce_bucket_size=5_000_000, prefetch_bucket_size=5_000_000,
                        param_persistence_threshold=10_000, max_live_parameters=20_000_000,
                        max_reuse_distance=100_000, allgather_bucket_size=5_000_000),
        warmup=1, steps=3, memory_measured_steps=1,
    ),
    # 16 blocks of width 16: 197 parameters, all partitioned, and almost no compute, so that a step's CPU is mostly
    # the engine's work per parameter and per unit (bench/engine_cpu.py --size many-small).
    "many-small": BenchSize(
        name="many-small",
        gpt=dict(vocab_size=64, block_size=8, n_layer=16, n_head=2, n_embd=16),
        global_batch=8,
        knobs=ZeroKnobs(reduce_bucket_size=10_000, prefetch_bucket_size=10_000, param_persistence_threshold=0,
                        max_live_parameters=40_000, max_reuse_distance=10_000, allgather_bucket_size=10_000,
                        leaf_classes=("Block",)),
        warmup=5, steps=30,
    ),
}


@dataclass(frozen=True)
class System:
    key: str  # command-line name
    label: str  # table name
    short: str  # chart name
    family: str  # "torch", "ours" or "deepspeed"
    stage: int | None = None
    sequential: bool = False
    fully_sharded: bool = False  # params, grads and optimizer states all sharded: the 16Ψ/N formula applies
    leaf_units: bool = True  # ours: the size's leaf modules (ZeroKnobs.leaf_classes) apply; False: a unit per module
    compiled: bool = False  # each block torch.compile'd (Inductor): FSDP2 block.compile(), ours engine.compile()
    traced: bool = False  # ours, compiled: the traced mode (compile.traced: gathers and reduce-scatters in the graph)
    # Hierarchy (issue 24): ours mics_shard_size / zero_hpz_partition_size, FSDP2 a (world / k, k) HSDP mesh.
    mics: int = 0
    hpz: int = 0
    hsdp: int = 0
    quantized: bool = False  # ours: ZeRO++ zero_quantized_weights + zero_quantized_gradients (issue 24)
    # relative loss tolerance of this system (None: compare.py's for the dtype); quantized systems change numerics
    loss_rtol: float | None = None
    # Tensor parallelism (issue 25): a (world / tp, tp) ("dp", "tp") mesh, each block's MLP split over "tp" by
    # parallelize_module (fc column-wise, proj row-wise); ours ZeRO over "dp", FSDP2 fully_shard over mesh["dp"].
    tp: int = 0

    def data_parallel(self, world: int) -> int:
        """The ranks that read different rows of the batch (the tp ranks of one dp rank read the same)."""
        return world // self.tp if self.tp else world


SYSTEMS: dict[str, System] = {s.key: s for s in (
    System("ddp", "torch DDP", "DDP", "torch"),
    System("fsdp2", "torch FSDP2", "FSDP2", "torch", fully_sharded=True),
    System("fsdp2-compile", "torch FSDP2, blocks compiled", "FSDP2\ncompiled", "torch", fully_sharded=True,
           compiled=True),
    System("zero3", "ours ZeRO-3 coalesced", "ours Z3\ncoalesced", "ours", stage=3, fully_sharded=True),
    System("zero3-compile", "ours ZeRO-3, blocks compiled", "ours Z3\ncompiled", "ours", stage=3, fully_sharded=True,
           compiled=True),
    System("zero3-traced", "ours ZeRO-3, blocks traced (compile.traced)", "ours Z3\ntraced", "ours", stage=3,
           fully_sharded=True, compiled=True, traced=True),
    System("zero3-mics", "ours ZeRO-3, MiCS shard 2", "ours Z3\nMiCS 2", "ours", stage=3, mics=2),
    System("zero3-hpz", "ours ZeRO-3, hpZ 2", "ours Z3\nhpZ 2", "ours", stage=3, fully_sharded=True, hpz=2),
    # qwZ + qgZ: int8 weights and int4 gradients move the loss by ~1e-3 within a few steps at lr 1e-3 (measured
    # 2e-4 in tests/test_zeropp_quant.py's parity test); 1e-2 still catches a missing average or a stale parameter.
    System("zero3-hpz-qwz-qgz", "ours ZeRO-3, hpZ 2 + qwZ + qgZ", "ours Z3\nhpZ+qwZ+qgZ", "ours", stage=3,
           fully_sharded=True, hpz=2, quantized=True, loss_rtol=1e-2),
    System("fsdp2-hsdp", "torch FSDP2 HSDP 2 x 2", "FSDP2\nHSDP", "torch", hsdp=2),
    System("zero3-tp", "ours ZeRO-3 + TP 2 (dp x tp mesh)", "ours Z3\n+ TP 2", "ours", stage=3, tp=2),
    System("zero1-tp", "ours ZeRO-1 + TP 2 (dp x tp mesh)", "ours Z1\n+ TP 2", "ours", stage=1, tp=2),
    System("fsdp2-tp", "torch FSDP2 + TP 2 (dp x tp mesh)", "FSDP2\n+ TP 2", "torch", tp=2),
    System("zero3-seq", "ours ZeRO-3 sequential", "ours Z3\nsequential", "ours", stage=3, sequential=True,
           fully_sharded=True, leaf_units=False),
    System("zero3-module", "ours ZeRO-3 coalesced, a unit per module", "ours Z3\nper module", "ours", stage=3,
           fully_sharded=True, leaf_units=False),
    System("zero2", "ours ZeRO-2", "ours Z2", "ours", stage=2),
    System("zero1", "ours ZeRO-1", "ours Z1", "ours", stage=1),
    System("deepspeed", "DeepSpeed ZeRO-3", "DeepSpeed\nZ3", "deepspeed", stage=3, fully_sharded=True),
)}


def load_gpt_module():
    """zero_engine/testing/models.py as a standalone module (it needs only torch), so every Python runs the same
    model source whether or not zero_engine is importable there."""
    spec = importlib.util.spec_from_file_location("bench_gpt_models", MODELS_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def zero_engine_config(size: BenchSize, system: System, world: int, dtype: str = "fp32") -> dict:
    """A DeepSpeed-style config dict for zero_engine; the same knobs DeepSpeed gets (see deepspeed_config)."""
    k = size.knobs
    zero = {"stage": system.stage, "overlap_comm": True, "reduce_bucket_size": k.reduce_bucket_size,
            "allgather_bucket_size": k.allgather_bucket_size}
    if system.stage == 3:
        zero.update({
            "stage3_prefetch_bucket_size": k.prefetch_bucket_size,
            "stage3_param_persistence_threshold": k.param_persistence_threshold,
            "stage3_max_live_parameters": k.max_live_parameters,
            "stage3_max_reuse_distance": k.max_reuse_distance,
            "stage3_allgather_sequential": system.sequential,
        })
        # zero3-seq stays per module: a leaf would gather its whole block, where sequential keeps one parameter.
        if k.leaf_classes and system.leaf_units:
            zero["leaf_module"] = {"classes": list(k.leaf_classes)}
        if system.mics:
            zero["mics_shard_size"] = system.mics
        if system.hpz:
            zero["zero_hpz_partition_size"] = system.hpz
        if system.quantized:
            zero.update(zero_quantized_weights=True, zero_quantized_gradients=True)
    return {
        "train_micro_batch_size_per_gpu": size.micro_batch(system.data_parallel(world)),
        "gradient_accumulation_steps": 1,
        "gradient_clipping": GRADIENT_CLIPPING,
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
        "zero_optimization": zero,
        "steps_per_print": 1_000_000,  # no progress logging inside timed steps
        "bf16": {"enabled": dtype == "bf16"},
        **({"compile": {"enabled": True, "backend": "inductor", "traced": system.traced}}  # engine.compile()
           if system.compiled else {}),
    }


def deepspeed_config(size: BenchSize, world: int, dtype: str = "fp32") -> dict:
    """DeepSpeed ZeRO-3 in fp32 with the same knobs; the optimizer is passed in (torch AdamW), hence the flag."""
    k = size.knobs
    return {
        "train_micro_batch_size_per_gpu": size.micro_batch(world),
        "gradient_accumulation_steps": 1,
        "gradient_clipping": GRADIENT_CLIPPING,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": dtype == "bf16"},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": k.reduce_bucket_size,
            "stage3_prefetch_bucket_size": k.prefetch_bucket_size,
            "stage3_param_persistence_threshold": k.param_persistence_threshold,
            "stage3_max_live_parameters": k.max_live_parameters,
            "stage3_max_reuse_distance": k.max_reuse_distance,
            **({"leaf_module": {"classes": list(k.leaf_classes)}} if k.leaf_classes else {}),
        },
    }
