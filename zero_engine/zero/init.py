"""zero.Init: build a model that does not fit one rank, partitioning parameters as modules are constructed.

    with zero_engine.zero.Init():
        model = BigModel()                  # each submodule is partitioned once its constructor has finished
    engine, *_ = zero_engine.initialize(model=model, config=cfg)   # adopts the partitioning as it is

How "finished" is known: a submodule is registered into its parent (``self.fc = nn.Linear(...)``) only after its
own ``__init__`` returned. A global module-registration hook, installed for the ``with`` block only and removed on
exit (also on error), partitions every parameter of the registered submodule that is not partitioned yet. What is
left (parameters registered directly on the root) is partitioned on exit. So at any moment at most one module's
parameters are whole: peak memory ~ the sharded total plus the largest module.

Identical initial weights. Values are broadcast from rank 0 before a parameter is sharded, so every rank holds a
slice of the same tensor even when ranks were seeded differently. A parent that re-initialises its children after
building them (nanoGPT's ``self.apply(self._init_weights)``, Hugging Face's post_init) would touch 0-element
tensors; during the block a TorchFunctionMode catches any ``torch.nn.init`` function or in-place tensor method
called on a partitioned parameter, gathers it, runs the call on the full tensor (drawing the same random numbers
as without Init), broadcasts rank 0's result and re-partitions. Writes through ``param.data`` cannot be seen this
way: use ``torch.nn.init`` functions or GatheredParameters(modifier_rank=0) in such code. A transformers model's
``_init_weights`` reads more than that (an embedding's padding row, a shape): for the block, its
``initialize_weights`` gathers each module's parameters around that module's init (hf/_init_weights.py).

[Note: experts under zero.Init]
An MoE expert parameter (DeepSpeed's marks, ep size above 1: zero/expert.py) is a different tensor on each ep rank,
so it is not rank 0's value that every rank takes: it is sharded over its expert-data-parallel group, as the engine
shards it, and broadcast from that group's first rank (the ranks of one edp group hold the same experts). The
marks must be set when the parameter's module is registered (zero_engine.moe's layer sets them in its
constructor). A re-initialisation of a partitioned expert parameter inside the block is refused (GatheredParameters
cannot broadcast edits of experts yet).
"""

from __future__ import annotations

import contextlib
import logging
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..comm import Communicator, init_distributed
from ..device import local_device
from .expert import init_shard_group
from .gathered import GatheredParameters
from .partition import ParamStatus, ShardedParam, sharded_param_of

log = logging.getLogger("zero_engine.init")

__all__ = ["Init"]


class _GatherOnInitCall(TorchFunctionMode):
    """Runs ``torch.nn.init.*`` and in-place methods on partitioned parameters against their full data."""

    def __init__(self):
        super().__init__()
        self.active = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.active and _is_init_call(func):
            params = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
                      and (sp := sharded_param_of(t)) is not None and sp.status is ParamStatus.NOT_AVAILABLE]
            experts = [sharded_param_of(t) for t in params if sharded_param_of(t).group is not None]
            if experts:  # [Note: experts under zero.Init]
                raise NotImplementedError(
                    f"zero.Init: {getattr(func, '__name__', func)} on {experts[0].fqn}, an MoE expert parameter "
                    f"({experts[0].group.name}) partitioned over its expert-data-parallel group: re-initialising it "
                    "inside zero.Init is not supported yet. Initialise expert weights in their module's constructor, "
                    "or build the MoE layers outside zero.Init")
            if params:
                self.active = False
                try:
                    with GatheredParameters(params, modifier_rank=0):
                        return func(*args, **kwargs)
                finally:
                    self.active = True
        return func(*args, **kwargs)


def _is_init_call(func) -> bool:
    name = getattr(func, "__name__", "")
    module = getattr(func, "__module__", "") or ""
    return module == "torch.nn.init" or (name.endswith("_") and not name.startswith("_"))


class Init:
    """Partition parameters as modules are built (see the module docstring).

    DeepSpeed's arguments, in DeepSpeed's order:

    * ``module``: a model built already (outside the block): its parameters are partitioned now.
    * ``config_dict_or_path`` (or ``config``, its older name): the ds_config dict, path or JSON text. It is
      validated, and its precision picks the dtype of the shards (fp16/bf16 when enabled) unless ``dtype`` is given.
    * ``dtype``: torch.float32, torch.float16 or torch.bfloat16 for the shards. The engine casts to the config's
      compute dtype in any case, so this matters only for memory between the block and initialize(). Inside the
      block the shards keep the dtype the constructors made: see [Note: cast as the block exits].
    * ``enabled=False``: the block does nothing (the model is built whole).
    * ``remote_device``: None, or the device the parameters are built on ("cpu" on a CPU-only machine): shards stay
      there. Another device ("cpu" while building on CUDA, "nvme") would be parameter offload, which is set in the
      config (``zero_optimization.offload_param``), not here: refused.
    * ``pin_memory``: False. True (pinned host shards) goes with remote_device offload: refused.
    * ``mem_efficient_linear``: accepted either way; zero_engine never replaces ``F.linear`` (its hooks gather and
      release around modules, so linear needs no special version).
    * ``data_parallel_group``: None or the world group; ``mpu``, ``zero_param_parallel_group``,
      ``sequence_data_parallel_group``, ``param_swapper`` and the ``zero_quantized_*`` flags (model, hierarchical
      and sequence parallelism, NVMe swapping, quantized weights: ZeRO++ qwZ is the engine config's
      ``zero_quantized_weights``) are refused when set.
    """

    def __init__(self, module: nn.Module | None = None, data_parallel_group=None, mem_efficient_linear: bool = True,
                 remote_device=None, pin_memory: bool = False, config_dict_or_path=None, config=None,
                 enabled: bool = True, dtype: torch.dtype | None = None, mpu=None, zero_param_parallel_group=None,
                 zero_quantized_weights: bool = False, zero_quantized_nontrainable_weights: bool = False,
                 sequence_data_parallel_group=None, param_swapper=None):
        if config_dict_or_path is not None and config is not None:
            raise ValueError("zero.Init: give config_dict_or_path or config (its older name), not both")
        self.config = config_dict_or_path if config_dict_or_path is not None else config
        self.enabled = enabled
        self._handles = []
        self._mode: _GatherOnInitCall | None = None
        self._roots: list[nn.Module] = []
        self._built: list[ShardedParam] = []  # partitioned in the block, cast to dtype as it exits
        self._expert_groups = {}  # group name -> ShardGroup: [Note: experts under zero.Init]
        self.dtype = None
        if not enabled:
            return
        _refuse_set(mpu=mpu, zero_param_parallel_group=zero_param_parallel_group,
                    zero_quantized_weights=zero_quantized_weights,
                    zero_quantized_nontrainable_weights=zero_quantized_nontrainable_weights,
                    sequence_data_parallel_group=sequence_data_parallel_group, param_swapper=param_swapper)
        if pin_memory:
            raise NotImplementedError("zero.Init(pin_memory=True): pinned host shards are parameter offload, which "
                                      "zero.Init does not do; set zero_optimization.offload_param in the config")
        building_on = "cuda" if torch.cuda.is_available() else "cpu"
        remote = getattr(remote_device, "value", remote_device)  # DeepSpeed's OffloadDeviceEnum or a string
        if remote not in (None, "none") and (remote == "nvme" or torch.device(remote).type != building_on):
            raise NotImplementedError(
                f"zero.Init(remote_device={remote_device!r}): shards stay on the device the model is built "
                f"on ({building_on}); offloading them is set in the config "
                "(zero_optimization.offload_param), not by zero.Init")
        if dtype not in (None, torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"zero.Init(dtype={dtype}): use torch.float32, torch.float16 or torch.bfloat16")
        if not dist.is_initialized():
            init_distributed()
        if data_parallel_group is not None and dist.get_world_size(data_parallel_group) != dist.get_world_size():
            raise NotImplementedError(f"zero.Init(data_parallel_group=...): a group of "
                                      f"{dist.get_world_size(data_parallel_group)} of the {dist.get_world_size()} "
                                      "ranks; zero_engine partitions over the whole world only")
        self.dtype = dtype
        self.device = local_device()  # each parameter is moved there before it is sharded (device.py)
        if self.config is not None:
            from ..config import load_config
            from ..precision import compute_dtype_of

            cfg = load_config(self.config, world_size=dist.get_world_size())
            self.dtype = self.dtype or compute_dtype_of(cfg)
        if module is not None:
            self.comm = Communicator()
            self._partition(module)

    def __enter__(self):
        if not self.enabled:
            return self
        if not dist.is_initialized():
            init_distributed()
        self.comm = Communicator()
        self._handles = [
            nn.modules.module.register_module_module_registration_hook(self._on_submodule),
            nn.modules.module.register_module_parameter_registration_hook(self._on_parameter),
        ]
        self._mode = _GatherOnInitCall()
        self._mode.__enter__()
        self._hf_init = contextlib.nullcontext()
        if "transformers.modeling_utils" in sys.modules:  # its models' _init_weights: hf/_init_weights.py
            from ..hf._init_weights import gathered_initialize_weights

            self._hf_init = gathered_initialize_weights()
        self._hf_init.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self.enabled:
            return False
        try:
            self._hf_init.__exit__(None, None, None)  # transformers' initialize_weights back
            self._mode.__exit__(exc_type, exc, tb)
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
        if exc_type is None:
            for module in self._roots:  # parameters registered on a module that never became anyone's child
                self._partition(module)
                if hasattr(module, "resize_token_embeddings"):  # a transformers model: its own cannot resize shards
                    from ..hf._resize import install_resize_token_embeddings

                    install_resize_token_embeddings(module)
            for sp in self._built:
                sp.cast_(self.dtype)
        self._roots.clear()
        self._built.clear()
        return False

    # ---- hooks ---------------------------------------------------------------------------------------------------
    def _on_submodule(self, parent: nn.Module, name: str, submodule: nn.Module | None):
        if submodule is not None:
            self._partition(submodule)
            self._roots = [m for m in self._roots if m is not submodule]
        if parent not in self._roots:
            self._roots.append(parent)
        return None

    def _on_parameter(self, module: nn.Module, name: str, param: nn.Parameter | None):
        if module not in self._roots:
            self._roots.append(module)
        return None

    # ---- partitioning ----------------------------------------------------------------------------------------------
    def _partition(self, module: nn.Module) -> None:
        if self._mode is not None:
            self._mode.active = False
        try:
            for name, param in module.named_parameters():
                if sharded_param_of(param) is not None or param.numel() == 0:
                    continue
                if param.device.type != "meta" and param.device != self.device:
                    param.data = param.data.to(self.device)  # see [Note: one device per rank] in device.py
                # one init, whatever the seeds; an MoE expert over its edp group: see [Note: experts under zero.Init]
                group = init_shard_group(param, self._expert_groups)
                comm = self.comm if group is None else group.comm
                comm.broadcast(param.data, src=0, name=f"zero.Init {name}")
                sp = ShardedParam(param, name, -1, comm.rank, comm.world_size)
                sp.group = group
                sp.release()
                if self.dtype is not None and param.is_floating_point():
                    # [Note: cast as the block exits] A parent re-initialises its children after they were
                    # partitioned (nanoGPT's self.apply(_init_weights), Hugging Face's post_init): that runs on a
                    # gather of the shard, in the shard's dtype. Cast at once, a 16-bit gather would round the new
                    # values before cast_ could keep them exact as the fp32 master, and training would start from
                    # other masters than a build without Init (bench/combinations.py found it). So the cast waits
                    # for the end of the block; the shards are fp32 until then: 4 bytes a parameter, against the
                    # 16-bit shard and its exact fp32 copy (6) that the cast leaves.
                    if self._mode is None:  # Init(module=...): built already, nothing re-initialises it
                        sp.cast_(self.dtype)
                    else:
                        self._built.append(sp)
        finally:
            if self._mode is not None:
                self._mode.active = True


def _refuse_set(**arguments) -> None:
    for name, value in arguments.items():
        if name == "zero_quantized_weights" and value:  # ZeRO++ qwZ is the engine's, from its config
            raise NotImplementedError("zero.Init(zero_quantized_weights=True): zero.Init builds exact shards; set "
                                      "zero_optimization.zero_quantized_weights in the engine's config, which "
                                      "quantizes the stage-3 gathers (zero_engine/zero/quantize.py)")
        if value is not None and value is not False:
            raise NotImplementedError(f"zero.Init({name}=...): not supported by zero_engine (data-parallel ZeRO "
                                      f"over the whole world, unquantized weights); leave {name} unset")
