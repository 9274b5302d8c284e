"""Per-rank memory of model states under ZeRO stages 0-3, from a model (meta device is fine) or two counts.

    with torch.device("meta"):
        model = Big()                                         # no real memory
    est = estimate_zero3_model_states_mem_needs_all_live(model, num_ranks_per_node=8, num_nodes=4)
    est.get(stage=3, precision="bf16").peak                   # bytes on one rank
    estimate_from_counts(7e9, 131e6, num_ranks_per_node=8)   # without a model

The numbers follow the engine's own layout, category by category, with the names ``engine.memory_stats()`` uses,
so an estimate can be checked against a run key by key:

  params_sharded     this rank's shard of every parameter in the compute dtype (ceil(numel / N) elements each:
                     the last rank's shard is zero-padded, see zero/partition.py). Stages 1-3.
  master_params      a separate fp32 copy of the trainable shards: 16-bit training only (in fp32 training the
                     shard IS the master).
  grads              reduced gradient shards of the trainable parameters (fp32 in every precision).
  optimizer_states   Adam's two fp32 moments per trainable shard element.
  params_gathered_peak  full parameters alive at once: all of them at stages 0-2 (kept whole); at stage 3 the
                     persistent (small) ones plus the largest layer's working set, plus what the gather policy
                     may add (prefetch, parameters kept for reuse), capped by max_live_parameters (see
                     [Note: the stage-3 gathered peak]).
  unsharded_grads_peak  full-size gradients alive at once before they are reduced: all of them at stages 0 and 1
                     (accumulated whole until the boundary), the largest layer's at stages 2 and 3.

``model_states`` is what ``ZeroEngine.model_state_bytes`` sums (the quantity the ZeRO formula 16Ψ/N predicts);
``peak`` adds the gathered parameters and the unsharded gradients. Activations, communication buffers
(reduce_bucket_size, allgather buckets) and allocator overhead are not model states and are not estimated.

[Note: bytes per element are derived from dtypes]
Each precision is a ``StateDtypes`` (the dtype of every state); bytes follow from ``dtype.itemsize``. fp32: 4 + 4 +
8 = 16 bytes per parameter over N. fp16/bf16: 2 (compute shard) + 4 (fp32 master) + 2 (16-bit gradient shard) + 8 =
16Ψ/N, DeepSpeed's layout (the engine converts gradients to fp32 one sub-group at a time during the step).

Differences from DeepSpeed's estimator of the same name: counts tied parameters once by identity (DeepSpeed keys
them by ``data_ptr()``, which is 0 for every tensor on the meta device); applies the real per-parameter padding;
reports every stage and precision; returns a typed result instead of only printing.

[Note: offload in the estimate]
``offload_optimizer`` / ``offload_param`` ("none", "cpu", "nvme"; DeepSpeed's ``cpu_offload=True`` /
``cpu_offload_params=True`` mean "cpu"; a ``zero_config`` supplies both) move categories as the engine's
``Placement`` does (zero_engine/offload/placement.py): optimizer offload puts the fp32 masters, the optimizer
states and the gradient shards on the host ("cpu") or the masters and states in files ("nvme", gradient shards on
the host); parameter offload (stage 3) puts the compute shards there. ``RankMemory.by_location()`` has the shape of
``engine.memory_stats()["by_location"]``; ``device_bytes`` adds the gathered parameters and unsharded gradients
(they are always on the device), ``host_bytes`` the host-only buffers offload needs: with an accelerator
(``accelerator=True``, the default) the masters are separate host copies even in fp32 training and a 16-bit host
copy of the shards carries the update back (``host_staging``); under NVMe the step streams the states through
``buffer_count`` buffers of one sub-group each (``swap_buffers``). On a CPU-only machine (``accelerator=False``)
fp32 masters stay the compute shards and nothing is staged, as in the engine.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.nn as nn

from zero_engine.offload.placement import Placement
from zero_engine.zero.partition import shard_numel_for
from zero_engine.memory.model_counts import ModelCounts, count_model_params
from zero_engine.zero.tensor_parallel import is_dtensor

__all__ = [
    "StateDtypes",
    "PRECISIONS",
    "GatherPolicy",
    "ModelCounts",
    "RankMemory",
    "MemoryEstimate",
    "count_model_params",
    "estimate_rank_memory",
    "estimate_zero3_model_states_mem_needs_all_live",
    "estimate_from_counts",
    "format_bytes",
]

STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class StateDtypes:
    """The dtype of each model state in one precision mode (see [Note: bytes per element are derived from dtypes]).

    ``master`` is None when the compute shard itself is what the optimizer updates (fp32 training).
    """

    name: str
    compute: torch.dtype  # parameter shards and gathered parameters; autograd's gradients have this dtype too
    master: torch.dtype | None  # separate master copy of the trainable shards
    grad: torch.dtype  # reduced gradient shards
    optimizer: torch.dtype  # each optimizer state (Adam: exp_avg, exp_avg_sq)

    @property
    def compute_bytes(self) -> int:
        return self.compute.itemsize

    @property
    def master_bytes(self) -> int:
        return 0 if self.master is None else self.master.itemsize


PRECISIONS: dict[str, StateDtypes] = {
    "fp32": StateDtypes("fp32", torch.float32, None, torch.float32, torch.float32),
    "fp16": StateDtypes("fp16", torch.float16, torch.float32, torch.float16, torch.float32),
    "bf16": StateDtypes("bf16", torch.bfloat16, torch.float32, torch.bfloat16, torch.float32),
}


@dataclass(frozen=True)
class GatherPolicy:
    """The stage-3 settings that decide how many full parameters are alive at once (all in elements).

    ``GatherPolicy()`` is the minimum any ZeRO-3 run needs (nothing persistent, no prefetch, no reuse: only the
    largest layer gathered -- what DeepSpeed's estimator assumes); ``from_zero_config`` reads a config section.
    """

    persistence_threshold: int = 0  # parameters with numel <= this stay gathered all the time
    prefetch_numel: int = 0  # gathered ahead of use (coalesced strategy)
    max_live_numel: int = 2**62  # the coordinator gives up kept parameters and stops prefetching above this
    reuse_numel: int = 0  # max_reuse_distance: parameters used again within this many elements stay gathered
    sequential: bool = False  # stage3_allgather_sequential: prefetch one parameter ahead, not a bucket
    keep_shared: bool = False  # the engine keeps a shared (tied) parameter gathered between its uses in a pass

    @classmethod
    def from_zero_config(cls, zero_config) -> "GatherPolicy":
        """From a ``ZeroConfig`` (``EngineConfig.zero_optimization``), the engine's own settings."""
        return cls(persistence_threshold=int(zero_config.param_persistence_threshold),
                   prefetch_numel=int(zero_config.prefetch_bucket_size),
                   max_live_numel=int(zero_config.max_live_parameters),
                   reuse_numel=int(zero_config.max_reuse_distance),
                   sequential=zero_config.allgather_sequential is True, keep_shared=True)


@dataclass(frozen=True)
class RankMemory:
    """Bytes on one rank for one stage and precision (category names as in ``engine.memory_stats()``)."""

    stage: int
    precision: str
    world_size: int
    params_sharded: int
    master_params: int
    grads: int
    optimizer_states: int
    params_gathered_min: int  # stage 3: persistent + the largest layer's working set, no prefetch or reuse
    params_gathered_peak: int
    unsharded_grads_peak: int
    full_numel: int  # parameter elements of the model (unpadded, tied counted once)
    padding_numel: int  # zero elements the padding adds over all ranks: sum(ceil(numel / N) * N - numel)
    offload_optimizer: str = "none"  # see [Note: offload in the estimate]
    offload_param: str = "none"
    host_staging: int = 0  # 16-bit host copy of the shards the offloaded step writes (accelerator only)
    swap_buffers: int = 0  # NVMe: host buffers the optimizer step streams sub-groups through
    params_secondary: int = 0  # ZeRO++ hpZ: the secondary partition within its group (zero/hpz.py)

    def placement(self) -> Placement:
        return Placement.of(self.stage, self.offload_optimizer, self.offload_param)

    def by_location(self) -> dict:
        """Model states split by where they live, as ``engine.memory_stats()["by_location"]``."""
        stats = {"params_sharded": self.params_sharded, "master_params": self.master_params, "grads": self.grads,
                 "optimizer_states": self.optimizer_states}
        out = self.placement().by_location(stats, nvme_bytes=self.master_params + self.optimizer_states
                                           if self.offload_optimizer == "nvme" else 0,
                                           swap_buffer_bytes=self.swap_buffers)
        out["host"]["host_staging"] = self.host_staging
        out["host"]["total"] += self.host_staging
        if self.params_secondary:  # hpZ: beside the gathered parameters, as engine.memory_stats() reports it
            out["device"]["params_secondary"] = self.params_secondary
            out["device"]["total"] += self.params_secondary
        return out

    @property
    def device_bytes(self) -> int:
        """Peak on the accelerator: its model states plus gathered parameters and unsharded gradients."""
        return self.by_location()["device"]["total"] + self.params_gathered_peak + self.unsharded_grads_peak

    @property
    def host_bytes(self) -> int:
        """Host memory of the offloaded states and the buffers offload needs (0 without offload)."""
        return self.by_location()["host"]["total"]

    @property
    def nvme_bytes(self) -> int:
        """Bytes in this rank's NVMe files."""
        return self.by_location()["nvme"]["total"]

    @property
    def padding_fraction(self) -> float:
        """Padding relative to the unpadded parameters: how much larger every sharded category is than X/N."""
        return self.padding_numel / self.full_numel if self.full_numel else 0.0

    @property
    def model_states(self) -> int:
        """As ``ZeroEngine.model_state_bytes``: sharded params + masters + gradient shards + optimizer states, and
        hpZ's secondary partition when there is one (16 Psi / N + 2 Psi / k in bf16)."""
        return self.params_sharded + self.master_params + self.grads + self.optimizer_states + self.params_secondary

    @property
    def model_states_and_gathered(self) -> int:
        """Model states plus the gathered-parameter peak (what ``memory_stats()`` can check directly)."""
        return self.model_states + self.params_gathered_peak

    @property
    def peak(self) -> int:
        """Model states, gathered parameters and unsharded gradients at their peaks (activations excluded)."""
        return self.model_states_and_gathered + self.unsharded_grads_peak

    def as_dict(self) -> dict[str, int]:
        return {"params_sharded": self.params_sharded, "master_params": self.master_params, "grads": self.grads,
                "optimizer_states": self.optimizer_states, "params_secondary": self.params_secondary,
                "model_states": self.model_states,
                "params_gathered_min": self.params_gathered_min, "params_gathered_peak": self.params_gathered_peak,
                "unsharded_grads_peak": self.unsharded_grads_peak, "peak": self.peak,
                "padding_numel": self.padding_numel, "device_bytes": self.device_bytes,
                "host_bytes": self.host_bytes, "nvme_bytes": self.nvme_bytes}


def _padded(numel: int, world: int) -> int:
    return shard_numel_for(numel, world) * world


def _stage3_gathered(counts: ModelCounts, world: int, policy: GatherPolicy) -> tuple[int, int]:
    """(minimum, peak) gathered elements at stage 3 under ``policy``, padded as the engine's full buffers are.

    [Note: the stage-3 gathered peak]
    Alive at once: the persistent parameters; the module running and its ancestors' own parameters (the
    *working set*; its largest value over all modules is the unavoidable minimum); what was prefetched. The
    coordinator keeps at most ``prefetch`` elements in flight, and the previous prefetch, now complete, may still
    hold up to ``prefetch`` elements not used yet (the module running among them): ``max(working, prefetch) +
    prefetch``. The sequential strategy has one parameter in flight: ``working + largest parameter``. Parameters
    kept for a reuse within ``max_reuse_distance`` add up to that distance (an upper bound: in a transformer
    about half of it is kept at the turn from forward to backward). A parameter shared by several modules stays
    gathered between its uses within a pass (coordinator.py, [Note: shared parameters stay within a pass]): it
    adds its size whatever the reuse distance. Prefetch and reuse stop at
    ``max_live_parameters`` (persistent parameters included); the module being fetched is never refused.
    """
    def persistent(n: int) -> bool:
        return n <= policy.persistence_threshold

    persistent_numel = sum(_padded(n, world) for n in counts.numels if persistent(n))
    others = [_padded(n, world) for n in counts.numels if not persistent(n)]
    working = max((sum(_padded(n, world) for n in layer if not persistent(n)) for layer in counts.layers),
                  default=0)
    minimum = persistent_numel + working
    if policy.sequential:
        ahead = working + max(others, default=0)
    elif policy.prefetch_numel > 0:
        ahead = max(working, policy.prefetch_numel) + policy.prefetch_numel
    else:
        ahead = working
    kept_shared = sum(_padded(n, world) for n in counts.shared_numels if not persistent(n)) \
        if policy.keep_shared else 0
    allowed = min(policy.max_live_numel, persistent_numel + ahead + policy.reuse_numel + kept_shared)
    peak = min(max(minimum, allowed), persistent_numel + sum(others))
    return minimum, peak


def estimate_rank_memory(counts: ModelCounts, world_size: int, stage: int, dtypes: StateDtypes,
                         policy: GatherPolicy = GatherPolicy(), optimizer_states_per_param: int = 2, *,
                         offload_optimizer: str = "none", offload_param: str = "none", accelerator: bool = True,
                         sub_group_size: int = 1_000_000_000, buffer_count: int = 4) -> RankMemory:
    """Bytes of each category on one rank of ``world_size`` at ``stage`` (0-3) in precision ``dtypes``; for the
    offload arguments see [Note: offload in the estimate] (``sub_group_size`` and ``buffer_count`` size the NVMe
    swap buffers)."""
    for what, value in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if value not in ("none", "cpu", "nvme"):
            raise ValueError(f'{what} must be "none", "cpu" or "nvme", got {value!r}')
    if stage == 0 and offload_optimizer != "none":
        raise ValueError("offload_optimizer needs stage >= 1 (the engine refuses it at stage 0)")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage}")
    if optimizer_states_per_param < 0:
        raise ValueError(f"optimizer_states_per_param must be >= 0 (Adam: 2, SGD with momentum: 1), got "
                         f"{optimizer_states_per_param}")
    c = dtypes.compute_bytes
    full = sum(counts.numels)
    full_trainable = counts.trainable_params
    padded = sum(_padded(n, world_size) for n in counts.numels)
    shard = sum(shard_numel_for(n, world_size) for n in counts.numels)
    shard_trainable = sum(shard_numel_for(n, world_size) for n, t in zip(counts.numels, counts.trainable) if t)
    largest_layer = counts.largest_layer_params
    opt_bytes = optimizer_states_per_param * dtypes.optimizer.itemsize

    if stage == 0:  # plain data parallel: everything whole on every rank
        return RankMemory(stage, dtypes.name, world_size, params_sharded=0,
                          master_params=full_trainable * dtypes.master_bytes,
                          grads=full_trainable * c, optimizer_states=full_trainable * opt_bytes,
                          params_gathered_min=full * c, params_gathered_peak=full * c,
                          unsharded_grads_peak=0, full_numel=full, padding_numel=0)
    if stage < 3:  # parameters stay whole (padded buffers) beside their shards
        gathered_min = gathered_peak = padded * c
        # Stage 1 accumulates whole gradients until the boundary; stage 2 buckets each one as it is produced.
        unsharded = full_trainable * c if stage == 1 else largest_layer * c
    else:
        minimum, peak = _stage3_gathered(counts, world_size, policy)
        gathered_min, gathered_peak = minimum * c, peak * c
        unsharded = largest_layer * c
    master_bytes = dtypes.master_bytes
    staging = swap = 0
    if offload_optimizer != "none" and accelerator:  # host masters, and the shards' way back (zero/optimizer.py)
        master_bytes = 4
        staging = shard_trainable * c if dtypes.master is not None else 0
    if offload_optimizer == "nvme":
        # a sub-group is at most sub_group_size elements, or one shard larger than that (zero/optimizer.py)
        largest_shard = max((shard_numel_for(n, world_size) for n, t in zip(counts.numels, counts.trainable) if t),
                            default=0)
        group = min(shard_trainable, max(sub_group_size, largest_shard))
        slots = (1 if master_bytes else 0) + optimizer_states_per_param
        stride = -(-group // 1024) * 1024  # each slot padded to 4 KiB (offload/optimizer_swap.py)
        swap = min(buffer_count, -(-shard_trainable // max(1, group))) * stride * slots * 4
    return RankMemory(stage, dtypes.name, world_size, params_sharded=shard * c,
                      master_params=shard_trainable * master_bytes, grads=shard_trainable * dtypes.grad.itemsize,
                      optimizer_states=shard_trainable * opt_bytes, params_gathered_min=gathered_min,
                      params_gathered_peak=gathered_peak, unsharded_grads_peak=unsharded,
                      full_numel=full, padding_numel=padded - full, offload_optimizer=offload_optimizer,
                      offload_param=offload_param if stage == 3 else "none", host_staging=staging, swap_buffers=swap)


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank estimates for every requested stage and precision; ``table()`` renders them."""

    counts: ModelCounts
    num_ranks_per_node: int
    num_nodes: int
    policy: GatherPolicy
    rows: tuple[RankMemory, ...] = field(repr=False)
    shard_size: int | None = None  # MiCS / HSDP (zero_optimization.mics_shard_size): states sharded over this many
    tp_size: int = 1  # tensor parallelism: the world is dp x tp; each rank shards its tp piece over dp

    @property
    def partition_size(self) -> int:
        """Ranks each model state is sharded over: the data-parallel world (world / tp), or the MiCS shard group
        (16 Psi / k per rank)."""
        return self.shard_size or self.world_size // self.tp_size

    @property
    def world_size(self) -> int:
        return self.num_ranks_per_node * self.num_nodes

    def get(self, stage: int, precision: str) -> RankMemory:
        for row in self.rows:
            if row.stage == stage and row.precision == precision:
                return row
        have = sorted({(r.stage, r.precision) for r in self.rows})
        raise KeyError(f"no estimate for stage {stage}, precision {precision!r}; estimated: {have}")

    def table(self) -> str:
        """A text table (one line per stage and precision) in the spirit of DeepSpeed's estimator printout."""
        c = self.counts
        head = [f"Estimated memory per rank for params, gradients and optimizer states (Adam) of a model with "
                f"{c.total_params / 1e6:.1f}M total params ({c.trainable_params / 1e6:.1f}M trainable), "
                f"largest layer {c.largest_layer_params / 1e6:.1f}M params"
                + (f" ({c.largest_layer_name})" if c.largest_layer_name else "") + ".",
                f"Setup: {self.num_nodes} node(s) x {self.num_ranks_per_node} rank(s) per node = "
                f"{self.world_size} rank(s)"
                + (f", model states sharded within groups of {self.shard_size} (MiCS / HSDP) and replicated "
                   f"{self.world_size // self.tp_size // self.shard_size} times" if self.shard_size else "")
                + (f", tensor parallel {self.tp_size} x data parallel {self.world_size // self.tp_size} (counts: one "
                   "tp rank's pieces)" if self.tp_size > 1 else "")
                + f". Stage 3 gather policy: persistence_threshold="
                f"{self.policy.persistence_threshold}, prefetch={self.policy.prefetch_numel}, "
                f"max_live={self.policy.max_live_numel}, reuse_distance={self.policy.reuse_numel}.",
                "model states = params (sharded) + master + grads + optimizer; peak = model states + gathered "
                "params + unsharded grads (activations and comm buffers not included)."]
        columns = ("stage", "precision", "params", "master", "grads", "optimizer", "model states",
                   "gathered (min)", "gathered (peak)", "unsharded grads", "peak")
        body = [(str(r.stage), r.precision, format_bytes(r.params_sharded), format_bytes(r.master_params),
                 format_bytes(r.grads), format_bytes(r.optimizer_states), format_bytes(r.model_states),
                 format_bytes(r.params_gathered_min), format_bytes(r.params_gathered_peak),
                 format_bytes(r.unsharded_grads_peak), format_bytes(r.peak)) for r in self.rows]
        if any(r.offload_optimizer != "none" or r.offload_param != "none" for r in self.rows):
            r0 = self.rows[-1]
            head.append(f"Offload: optimizer {r0.offload_optimizer}, params {r0.offload_param}; device = its model "
                        "states + gathered + unsharded grads, host = offloaded states + offload buffers.")
            columns += ("device", "host", "nvme")
            body = [row + (format_bytes(r.device_bytes), format_bytes(r.host_bytes), format_bytes(r.nvme_bytes))
                    for row, r in zip(body, self.rows)]
        widths = [max(len(col), *(len(row[i]) for row in body)) for i, col in enumerate(columns)]
        lines = ["  ".join(col.rjust(w) for col, w in zip(columns, widths)),
                 "  ".join("-" * w for w in widths)]
        lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in body]
        return "\n".join(head + [""] + lines)


def format_bytes(n: int) -> str:
    """Bytes in binary units with 2 decimals: '1.50 GiB'."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    value, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB", "TiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.2f} {unit}"


def _estimate(counts: ModelCounts, num_ranks_per_node: int, num_nodes: int, stages: Iterable[int],
              precisions: Iterable[str], zero_config, policy: GatherPolicy | None,
              optimizer_states_per_param: int, print_table: bool, offload_optimizer: str | None = None,
              offload_param: str | None = None, accelerator: bool = True, tp_size: int = 1) -> MemoryEstimate:
    for arg, value in (("num_ranks_per_node", num_ranks_per_node), ("num_nodes", num_nodes), ("tp_size", tp_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{arg} must be a positive integer, got {value!r}")
    if policy is not None and zero_config is not None:
        raise ValueError("give either zero_config or policy, not both (policy is derived from zero_config)")
    swap_knobs = {}
    if policy is None:
        if zero_config is None:
            from zero_engine.config import ZeroConfig

            zero_config = ZeroConfig()  # DeepSpeed's defaults, as a run without a zero_optimization section
        policy = GatherPolicy.from_zero_config(zero_config)
        opt, par = zero_config.offload_optimizer, zero_config.offload_param
        offload_optimizer = offload_optimizer or (opt.device if opt is not None else "none")
        offload_param = offload_param or (par.device if par is not None else "none")
        swap_knobs = {"sub_group_size": int(zero_config.sub_group_size),
                      "buffer_count": int(opt.buffer_count) if opt is not None else 4}
    stages, precisions = tuple(stages), tuple(precisions)
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown:
        raise ValueError(f"precisions: unknown {unknown}; choose from {sorted(PRECISIONS)}")
    world = num_ranks_per_node * num_nodes
    if world % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide the {world} ranks (num_nodes x num_ranks_per_node); the "
                         "world is data parallel x tensor parallel")
    world //= tp_size  # the data-parallel ranks each tp piece is sharded over (counts: one tp rank's pieces)
    shard_size = _mics_shard_size(zero_config, world)
    hpz = getattr(zero_config, "zero_hpz_partition_size", 1) if zero_config is not None else 1
    if hpz > 1 and world % hpz:
        raise ValueError(f"zero_config.zero_hpz_partition_size={hpz} does not divide the {world} ranks; use a divisor "
                         "of the world, or 1")
    rows = tuple(_with_secondary(estimate_rank_memory(
        counts, shard_size or world, stage, PRECISIONS[p], policy, optimizer_states_per_param,
        offload_optimizer=(offload_optimizer or "none") if stage else "none", offload_param=offload_param or "none",
        accelerator=accelerator, **swap_knobs), counts, policy, hpz if hpz not in (1, world) else 1)
        for stage in stages for p in precisions)
    result = MemoryEstimate(counts, num_ranks_per_node, num_nodes, policy, rows, shard_size, tp_size)
    if print_table:
        print(result.table())  # the documented output of this function, as DeepSpeed's, not debugging
    return result


def _ranks_per_node(num_ranks_per_node: int, num_gpus_per_node: int | None) -> int:
    if num_gpus_per_node is None:
        return num_ranks_per_node
    if num_ranks_per_node not in (1, num_gpus_per_node):
        raise ValueError(f"num_gpus_per_node={num_gpus_per_node} (DeepSpeed's name) and num_ranks_per_node="
                         f"{num_ranks_per_node} disagree; give only num_ranks_per_node")
    return num_gpus_per_node


def _with_secondary(row: RankMemory, counts: ModelCounts, policy: GatherPolicy, hpz: int) -> RankMemory:
    """ZeRO++ hpZ at stage 3: each partitioned (not persistent) parameter's padded data over ``hpz`` ranks, in the
    compute dtype (zero/hpz.py)."""
    if hpz == 1 or row.stage != 3:
        return row
    per_element = PRECISIONS[row.precision].compute_bytes
    secondary = sum(_padded(n, row.world_size) // hpz for n in counts.numels if n > policy.persistence_threshold)
    return dataclasses.replace(row, params_secondary=secondary * per_element)


def _mics_shard_size(zero_config, world: int) -> int | None:
    """The MiCS shard group size a zero_config asks for (None: flat). Each rank then holds 1/k of every state, as on
    a flat world of k ranks: the rows are those of k ranks ([Note: what runs on which group] in mesh.py)."""
    k = getattr(zero_config, "mics_shard_size", -1) if zero_config is not None else -1
    if k in (-1, world):
        return None
    if k < 1 or world % k:
        raise ValueError(f"zero_config.mics_shard_size={k} does not divide the {world} ranks (num_nodes x "
                         "num_ranks_per_node); use a divisor of the world, or -1")
    return k


def estimate_zero3_model_states_mem_needs_all_live(
        model: nn.Module, num_ranks_per_node: int = 1, num_nodes: int = 1, *, stages: Iterable[int] = STAGES,
        precisions: Iterable[str] = tuple(PRECISIONS), zero_config=None, policy: GatherPolicy | None = None,
        optimizer_states_per_param: int = 2, print_table: bool = True,
        num_gpus_per_node: int | None = None, cpu_offload: bool = False, cpu_offload_params: bool = False,
        offload_optimizer: str | None = None, offload_param: str | None = None,
        accelerator: bool = True, tp_size: int = 1) -> MemoryEstimate:
    """Estimate per-rank memory for training ``model`` with ZeRO on ``num_nodes x num_ranks_per_node`` ranks.

    ``model`` may be built on the meta device (``with torch.device("meta"): model = Big()``): only shapes are
    read. Tied parameters count once; each parameter is padded to a multiple of the world size as the engine
    pads it. ``zero_config`` (a ``ZeroConfig``, e.g. ``load_config(path).zero_optimization``) sets the stage-3
    gather policy -- persistence threshold, prefetch bucket, max live parameters, reuse distance -- and defaults
    to DeepSpeed's defaults; pass ``policy=GatherPolicy()`` for the bare minimum (largest layer only, as
    DeepSpeed's estimator). ``optimizer_states_per_param``: 2 for Adam/AdamW, 1 for SGD with momentum. A
    zero_config with ``mics_shard_size: k`` (MiCS / HSDP) estimates a rank of a shard group of k: 16 Psi / k.

    Offload: ``offload_optimizer`` / ``offload_param`` ("none", "cpu", "nvme"; default: the zero_config's, else
    none), or DeepSpeed's ``cpu_offload=True`` / ``cpu_offload_params=True``; each row then splits its bytes into
    device, host and NVMe (``row.by_location()``, ``row.device_bytes``...; see [Note: offload in the estimate]).

    Prints the table (as DeepSpeed's function does) unless ``print_table=False``; returns a ``MemoryEstimate``.
    ``num_gpus_per_node`` is DeepSpeed's name for ``num_ranks_per_node``, accepted so that existing calls work.

    Tensor parallelism (``tp_size`` > 1): the world is data parallel x ``tp_size``; ``model`` is one already split
    by ``parallelize_module`` (on the meta device, over a mesh's tp dim), whose DTensor parameters count their
    tp-local pieces: a parameter split over tp costs 16 Psi / (tp x dp) per rank, one replicated over tp 16 Psi / dp.
    """
    num_ranks_per_node = _ranks_per_node(num_ranks_per_node, num_gpus_per_node)
    if tp_size > 1 and not any(is_dtensor(p) for p in model.parameters()):
        raise ValueError(f"tp_size={tp_size}: the model has no parameter split by tensor parallelism (DTensor); "
                         "parallelize it (parallelize_module over a mesh's tp dim, on the meta device) first, or use "
                         "estimate_from_counts(..., tp_size=...)")
    return _estimate(count_model_params(model), num_ranks_per_node, num_nodes, stages, precisions, zero_config,
                     policy, optimizer_states_per_param, print_table,
                     offload_optimizer or ("cpu" if cpu_offload else None),
                     offload_param or ("cpu" if cpu_offload_params else None), accelerator, tp_size)


def estimate_from_counts(total_params: int, largest_layer_params: int, num_ranks_per_node: int = 1,
                         num_nodes: int = 1, *, stages: Iterable[int] = STAGES,
                         precisions: Iterable[str] = tuple(PRECISIONS), zero_config=None,
                         policy: GatherPolicy | None = None, optimizer_states_per_param: int = 2,
                         print_table: bool = True, num_gpus_per_node: int | None = None,
                         cpu_offload: bool = False, cpu_offload_params: bool = False,
                         offload_optimizer: str | None = None, offload_param: str | None = None,
                         accelerator: bool = True, tp_size: int = 1) -> MemoryEstimate:
    """As ``estimate_zero3_model_states_mem_needs_all_live`` from two counts instead of a model.

    Without the individual parameter sizes, the parameters are treated as one flat tensor: padding is at most
    N - 1 elements instead of up to N - 1 per parameter, and no parameter counts as persistent, so a model's own
    estimate is slightly higher (see ``padding_numel``). All parameters are taken as trainable. ``tp_size`` > 1:
    every parameter is taken as split evenly over the tp ranks (16 Psi / (tp x dp) per rank).
    """
    num_ranks_per_node = _ranks_per_node(num_ranks_per_node, num_gpus_per_node)
    total, largest = int(total_params), int(largest_layer_params)
    if total < 1 or largest < 0 or largest > total:
        raise ValueError(f"need total_params >= 1 and 0 <= largest_layer_params <= total_params; got "
                         f"total_params={total_params}, largest_layer_params={largest_layer_params}")
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive integer, got {tp_size!r}")
    total, largest = -(-total // tp_size), -(-largest // tp_size)  # one tp rank's pieces
    counts = ModelCounts(numels=(total,), trainable=(True,), layers=((largest,),) if largest else (),
                         largest_layer_params=largest)
    return _estimate(counts, num_ranks_per_node, num_nodes, stages, precisions, zero_config, policy,
                     optimizer_states_per_param, print_table, offload_optimizer or ("cpu" if cpu_offload else None),
                     offload_param or ("cpu" if cpu_offload_params else None), accelerator, tp_size)
