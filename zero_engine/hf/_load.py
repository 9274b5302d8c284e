"""from_pretrained: a Hugging Face model whose weights go from the checkpoint files straight into each rank's shards.

    model = zero_engine.hf.from_pretrained(AutoModelForCausalLM, "path/to/model", config="ds_config.json")
    engine, *_ = zero_engine.initialize(model=model, config="ds_config.json")

How, so that no rank ever holds the whole model (nor one whole layer beyond a moment):
1. The model is built on the meta device, as transformers itself does: parameters and buffers have shapes and no
   storage. ``post_init`` ties the tied weights there (one parameter object under two names).
2. Every parameter becomes a released ``ShardedParam`` with a zero shard of ``ceil(numel / world)`` elements
   (``ShardedParam.from_meta``): the full tensor is never allocated.
3. Each checkpoint tensor is read once per rank, only the byte range of that rank's shard (see
   [Note: reading only this rank's bytes] in _files.py), straight into the shard; buffers (small) are read whole.
   A parameter transformers stacks from a tensor per expert (MoE) reads the ranges of those it overlaps (_merged.py).
   A 16-bit model's fp32 master (``ShardedParam.master_init``) is filled from the file's own values, so a 16-bit
   model loaded from an fp32 checkpoint trains from the exact fp32 weights.
4. Missing weights are initialised by transformers' own ``initialize_weights()`` (``_init_weights`` of each module;
   loaded tensors carry transformers' ``_is_hf_initialized`` flag so they are skipped), with the missing parameters
   gathered: every rank runs the same initialisation and rank 0's values are kept (GatheredParameters with
   ``modifier_rank=0``), so the result is what transformers gives with the same seed, identical on every rank.
   Non-persistent buffers (rotary ``inv_freq``...) are recomputed the same way, as transformers does.
5. Missing / unexpected / mismatched keys are computed with transformers' key renaming (``base_model_prefix`` added
   or stripped, legacy renames) and ignore patterns (``_keys_to_ignore_on_load_missing`` / ``_unexpected``), and
   reported with transformers' own load report.

[Note: one rank's failure while loading]
Loading is collective: a rank whose part fails (its copy of a file truncated or corrupt, a full disk, a bug) must not
leave the others waiting in, or failing with a bare backend error from, the next collective. So everything up to
the first collective (configuration, building on meta, reading this rank's bytes) runs through ``agree`` (the
checkpoint loader's rule, see [Note: why every phase is agreed] in checkpoint/_collective.py): one exchange of
outcomes, then the failing rank raises its own error and every other rank a ``CheckpointError`` naming that rank
and its error. The collectives of loading (that exchange, the gathers that initialise missing weights, the buffer
broadcasts) run on a Communicator with the training watchdog (``zero_engine.stall_timeout_s`` and
``collective_timeout_s`` from the config): a rank that dies outright (killed, out of memory) is reported as
``RankLostError`` naming it, as in training.

Peak memory per rank: the shards (``4 * numel / world`` bytes in fp32) plus a 16 MiB staging buffer when the file's
dtype differs from the model's, plus the missing parameters while they are initialised (gathered together).
"""

from __future__ import annotations

import logging
import os
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn

from ..checkpoint._collective import agree
from ..comm import Communicator, init_distributed
from ..config.models import ZeroEngineSection
from ..device import local_device
from ..zero.gathered import GatheredParameters
from ..zero.partition import ShardedParam
from ._files import find_checkpoint, open_tensor_file
from ._merged import Run, merged_runs, read_runs
from ._resize import install_resize_token_embeddings
from ._transformers import require_transformers

log = logging.getLogger("zero_engine.hf")

__all__ = ["from_pretrained"]

# from_pretrained arguments that place or transform weights in ways that cannot stream into ZeRO-3 shards.
_REFUSED = {
    "device_map": "ZeRO-3 decides where each shard lives; drop device_map",
    "max_memory": "ZeRO-3 decides where each shard lives; drop max_memory",
    "offload_folder": "use zero_optimization.offload_param in the ds_config instead",
    "quantization_config": "quantized loading is not supported under zero_engine",
    "load_in_8bit": "quantized loading is not supported under zero_engine",
    "load_in_4bit": "quantized loading is not supported under zero_engine",
    "gguf_file": "GGUF files are not supported; convert to safetensors",
    "state_dict": "pass a directory; an in-memory state dict is already whole on every rank",
    "tp_plan": "tensor parallelism is not combined with ZeRO-3 here",
    "tp_size": "tensor parallelism is not combined with ZeRO-3 here",
    "distributed_config": "tensor parallelism is not combined with ZeRO-3 here",
    "device_mesh": "tensor parallelism is not combined with ZeRO-3 here",
    "adapter_kwargs": "load the base model, then the adapter with PEFT",
    "trust_remote_code": "only models of the installed transformers are supported (pass the model class itself)",
}
# Accepted and without effect here, as in transformers (download options: the path is a local directory).
_IGNORED = {"cache_dir", "force_download", "local_files_only", "token", "revision", "proxies", "subfolder",
            "low_cpu_mem_usage", "_fast_init", "mirror", "weights_only", "disable_mmap"}


def from_pretrained(model_class, path, config=None, **hf_kwargs):
    """Build ``model_class`` (a transformers model class or an ``AutoModel*`` class) with its parameters
    partitioned across the ranks, and load the checkpoint in the local directory ``path`` into the shards.

    ``config`` is the DeepSpeed/zero_engine config (dict, path or JSON text) that ``initialize`` will get;
    partitioning needs only the world size, so only its ZeRO stage is read here: stage 0 (whole parameters on every
    rank, DeepSpeed's default) is refused before any weight is read. Every rank must call this (collective).
    ``hf_kwargs`` are transformers' from_pretrained arguments: ``dtype`` (or ``torch_dtype``; default ``"auto"``:
    the config's dtype, else the checkpoint's), ``use_safetensors``, ``ignore_mismatched_sizes``,
    ``output_loading_info``, ``key_mapping``, ``attn_implementation``, and config overrides
    (``num_hidden_layers=2``...). Arguments that place or transform weights (``device_map``, quantization, tensor
    parallelism...) are refused with the reason. Returns the model in eval mode, as transformers does.
    """
    transformers = require_transformers("zero_engine.hf.from_pretrained")
    for key in _REFUSED:
        if hf_kwargs.get(key) not in (None, False, {}):
            raise NotImplementedError(f"zero_engine.hf.from_pretrained: {key}= is not supported: {_REFUSED[key]}")
        hf_kwargs.pop(key, None)
    for key in _IGNORED:
        hf_kwargs.pop(key, None)
    dtype = hf_kwargs.pop("dtype", None)
    torch_dtype = hf_kwargs.pop("torch_dtype", None)
    dtype = dtype if dtype is not None else (torch_dtype if torch_dtype is not None else "auto")
    use_safetensors = hf_kwargs.pop("use_safetensors", None)
    ignore_mismatched = hf_kwargs.pop("ignore_mismatched_sizes", False)
    output_loading_info = hf_kwargs.pop("output_loading_info", False)
    key_mapping = hf_kwargs.pop("key_mapping", None)
    attn_implementation = hf_kwargs.pop("attn_implementation", None)

    zero_engine_section = _check_engine_config(config)
    path = os.fspath(path)
    files = find_checkpoint(path, use_safetensors)
    if not dist.is_initialized():
        init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    requested_class, requested_dtype = model_class, dtype

    def read_this_ranks_part():
        hf_config, model_kwargs = transformers.AutoConfig.from_pretrained(path, return_unused_kwargs=True,
                                                                          **hf_kwargs)
        if attn_implementation is not None:
            hf_config._attn_implementation = attn_implementation
        cls = _concrete_class(requested_class, hf_config)
        if not isinstance(hf_config, cls.config_class):
            hf_config, model_kwargs = cls.config_class.from_pretrained(path, return_unused_kwargs=True, **hf_kwargs)
        readers = []
        try:
            for f in files.files:
                readers.append(open_tensor_file(f, files.fmt))
            resolved = _resolve_dtype(requested_dtype, hf_config, readers)
            hf_config.dtype = resolved
            model = _build_on_meta(cls, hf_config, resolved, model_kwargs)
            plan = _plan(model, readers, key_mapping, transformers)
            _check_renamings(plan)
            sharded = _partition(model, rank, world)
            loaded = _stream(model, sharded, plan, readers)
        finally:
            for reader in readers:
                reader.close()
        return cls, resolved, model, plan, sharded, loaded

    # [Note: one rank's failure while loading] in the module docstring
    comm = Communicator(stall_timeout_s=zero_engine_section.stall_timeout_s,
                        collective_timeout_s=zero_engine_section.collective_timeout_s)
    try:
        model_class, dtype, model, plan, sharded, loaded = agree(
            comm, f"zero_engine.hf.from_pretrained: reading {path}", read_this_ranks_part)
        _initialize_missing(model, sharded, loaded, comm)
    finally:
        comm.close()
    model._adjust_missing_and_unexpected_keys(plan.info)
    report_logger = logging.getLogger("transformers.modeling_utils") if rank == 0 else _SILENT
    from transformers.utils.loading_report import log_state_dict_report

    log_state_dict_report(model, path, ignore_mismatched, plan.info, logger=report_logger)
    model.eval()
    install_resize_token_embeddings(model)  # transformers' own cannot read partitioned embeddings (_resize.py)
    _load_generation_config(model, path, transformers)
    if rank == 0:
        log.info("loaded %s from %s into shards over %d ranks (%s, %d tensors, dtype %s)",
                 model_class.__name__, path, world, files.fmt, len(plan.sources), str(dtype).removeprefix("torch."))
    if output_loading_info:
        return model, plan.info.to_dict()
    return model


_SILENT = logging.getLogger("zero_engine.hf.silent")
_SILENT.setLevel(logging.CRITICAL + 1)
_SILENT.propagate = False


# ---- building ------------------------------------------------------------------------------------------------------
def _check_engine_config(config) -> ZeroEngineSection:
    """Only the ZeRO stage and the collective timeouts matter here ("auto" values need the model, so the config is
    not resolved here); returns the config's ``zero_engine`` section (the defaults without a config)."""
    if config is None:
        return ZeroEngineSection()
    from ..config.loader import read_config_source, validate_section

    source = read_config_source(config)
    stage = (source.get("zero_optimization") or {}).get("stage", 0)
    section = validate_section(ZeroEngineSection, source.get("zero_engine") or {})
    if stage == 0:
        raise ValueError("zero_engine.hf.from_pretrained: zero_optimization.stage is 0 in the config: stage 0 keeps "
                         "every parameter whole on every rank, so there is nothing to partition; load with "
                         "transformers' own from_pretrained, or use stage 1, 2 or 3")
    return section


def _concrete_class(model_class, hf_config):
    mapping = getattr(model_class, "_model_mapping", None)
    if mapping is None:
        return model_class
    try:
        return mapping[type(hf_config)]
    except KeyError:
        raise ValueError(f"zero_engine.hf: {model_class.__name__} has no model for config "
                         f"{type(hf_config).__name__} (model_type {hf_config.model_type!r})") from None


def _resolve_dtype(dtype, hf_config, readers) -> torch.dtype:
    """transformers' rule: a torch.dtype or its name; "auto": the config's dtype, else the first floating tensor's."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if getattr(hf_config, "dtype", None) is not None:
            found = hf_config.dtype
            return getattr(torch, found) if isinstance(found, str) else found
        for reader in readers:
            for entry in reader.entries.values():
                if entry.dtype.is_floating_point:
                    return entry.dtype
        return torch.get_default_dtype()
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise ValueError(f"zero_engine.hf.from_pretrained: dtype={dtype!r}: expected a torch.dtype, its name "
                     "('bfloat16') or 'auto'")


def _build_on_meta(model_class, hf_config, dtype, model_kwargs):
    previous = torch.get_default_dtype()
    try:
        if dtype.is_floating_point:
            torch.set_default_dtype(dtype)
        with torch.device("meta"):
            return model_class(hf_config, **model_kwargs)
    finally:
        torch.set_default_dtype(previous)


# ---- which file tensor goes to which model tensor ------------------------------------------------------------------
class _Plan:
    def __init__(self, info):
        self.info = info  # transformers' LoadStateDictInfo
        self.sources: dict[str, tuple[int, str]] = {}  # model key -> (reader index, checkpoint key)
        self.merged: dict[str, list[Run]] = {}  # model key -> its runs of checkpoint tensors (_merged.py)
        self.converted: list[str] = []  # checkpoint keys of a conversion that _merged.py cannot do


def _plan(model, readers, key_mapping, transformers) -> _Plan:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, apply_renamings, rename_source_key
    from transformers.utils.loading_report import LoadStateDictInfo

    expected = model.state_dict(keep_vars=True)  # meta tensors; tied weights under each of their names
    info = LoadStateDictInfo(missing_keys=set(expected), unexpected_keys=set(), mismatched_keys=set(),
                             error_msgs=[], conversion_errors={}, skipped_pp_keys=set())
    plan = _Plan(info)
    transforms = get_model_conversion_mapping(model, key_mapping, None)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    prefix = model.base_model_prefix
    merging: dict[str, list[tuple[str, int, str, tuple]]] = {}  # model key -> its converter's sources
    original: dict[str, str] = {}  # their renamed keys (where each expert's index is found) -> the checkpoint's
    for index, reader in enumerate(readers):
        for ckpt_key, entry in reader.entries.items():
            key, pattern = rename_source_key(ckpt_key, renamings, converters, prefix, expected)
            if key not in expected and ckpt_key in expected:
                key, pattern = rename_source_key(ckpt_key, [], [], prefix, expected)
            if key not in expected:
                info.unexpected_keys.add(ckpt_key)
                continue
            if pattern is not None:
                renamed = apply_renamings(ckpt_key, renamings)
                original[renamed] = ckpt_key
                merging.setdefault(key, []).append((pattern, index, renamed, entry.shape))
                continue
            target = expected[key]
            if tuple(target.shape) != entry.shape:
                info.mismatched_keys.add((key, entry.shape, tuple(target.shape)))
                continue
            plan.sources[key] = (index, ckpt_key)
            info.missing_keys.discard(key)
    for key, sources in merging.items():
        converter = next(c for c in converters if sources[0][0] in c.source_patterns)
        runs = merged_runs(converter, sources, tuple(expected[key].shape))
        if runs is None:
            plan.converted.append(original[sources[0][2]])
            continue
        plan.merged[key] = [(index, original[name], first, count) for index, name, first, count in runs]
        info.missing_keys.discard(key)
    # Tied weights: a name whose tensor is loaded under another of its names is not missing (transformers'
    # tie_weights(missing_keys=...) discards it the same way).
    loaded_ids = {id(expected[k]) for k in [*plan.sources, *plan.merged]}
    info.missing_keys = {k for k in info.missing_keys if id(expected[k]) not in loaded_ids}
    return plan


def _check_renamings(plan: _Plan) -> None:
    if plan.converted:
        raise NotImplementedError(
            f"zero_engine.hf: this checkpoint needs a transformers weight conversion other than stacking and "
            f"concatenating whole tensors (e.g. for {plan.converted[0]}): not supported yet. Load the model with "
            "transformers' own from_pretrained (each rank then holds it whole once) and pass it to initialize()")


# ---- partitioning and streaming ------------------------------------------------------------------------------------
def _partition(model: nn.Module, rank: int, world: int) -> dict[int, ShardedParam]:
    """Every meta parameter -> a released ShardedParam (shard only); meta buffers -> empty tensors, on this rank's
    device.

    Returns {id(new param): ShardedParam}. Tied names share one parameter, hence one ShardedParam.
    """
    device = local_device()  # this rank's accelerator, as zero.Init builds on (see [Note: one device per rank])
    replaced: dict[int, nn.Parameter] = {}
    sharded: dict[int, ShardedParam] = {}
    for index, (name, param) in enumerate(model.named_parameters()):
        sp = ShardedParam.from_meta(param, name, index, rank, world, device=device)
        replaced[id(param)] = sp.param
        sharded[id(sp.param)] = sp
    buffers: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None and id(param) in replaced:
                module._parameters[key] = replaced[id(param)]
        for key, buffer in module._buffers.items():
            if buffer is not None and buffer.device.type == "meta":
                if id(buffer) not in buffers:
                    buffers[id(buffer)] = torch.empty_like(buffer, device=device)
                module._buffers[key] = buffers[id(buffer)]
    return sharded


def _stream(model, sharded: dict[int, ShardedParam], plan: _Plan, readers) -> set[int]:
    """Read every planned tensor into its shard (parameters) or whole (buffers); return ids of loaded tensors."""
    loaded: set[int] = set()
    for key, runs in plan.merged.items():  # first: their runs may be in any of the files
        param = model.get_parameter(key)
        loaded.add(id(param))
        file_dtype = readers[runs[0][0]].entries[runs[0][1]].dtype
        with torch.profiler.record_function(f"zero3::hf_load {key}"), torch.no_grad():
            _read_shard(lambda start, stop, out, runs=runs: read_runs(readers, runs, start, stop, out),
                        file_dtype, sharded[id(param)])
        param._is_hf_initialized = True
    by_reader: dict[int, list[tuple[str, str]]] = {}
    for key, (index, ckpt_key) in plan.sources.items():
        by_reader.setdefault(index, []).append((key, ckpt_key))
    for index, pairs in sorted(by_reader.items()):
        reader = readers[index]
        for key, ckpt_key in pairs:
            tensor = model.get_parameter(key) if _is_parameter(model, key) else model.get_buffer(key)
            if id(tensor) in loaded:
                continue  # a tied weight present under two names (.bin files keep both): read once
            loaded.add(id(tensor))
            sp = sharded.get(id(tensor))
            with torch.profiler.record_function(f"zero3::hf_load {key}"), torch.no_grad():
                if sp is None:
                    reader.read_into(ckpt_key, 0, tensor.numel(), tensor.view(-1))
                else:
                    _read_shard(partial(reader.read_into, ckpt_key), reader.entries[ckpt_key].dtype, sp)
            tensor._is_hf_initialized = True  # transformers' marker: its init functions skip this tensor
        reader.close()
    return loaded


def _read_shard(read, file_dtype: torch.dtype, sp: ShardedParam) -> None:
    """``read(start, stop, out)``: elements ``[start, stop)`` of the parameter's value, flattened, into ``out``."""
    local = sp.local_slice()
    n = local.stop - local.start
    if n == 0:
        return  # this rank holds only padding of a parameter smaller than the world
    if sp.master_init is not None and file_dtype != sp.dtype:
        read(local.start, local.stop, sp.master_init[:n])  # exact file values in fp32
        sp.shard[:n].copy_(sp.master_init[:n])
        return
    read(local.start, local.stop, sp.shard[:n])
    if sp.master_init is not None:
        sp.master_init[:n].copy_(sp.shard[:n])


def _is_parameter(model: nn.Module, key: str) -> bool:
    module_name, _, leaf = key.rpartition(".")
    return leaf in model.get_submodule(module_name)._parameters


def _initialize_missing(model, sharded: dict[int, ShardedParam], loaded: set[int], comm: Communicator) -> None:
    """transformers' initialize_weights() over the not-loaded tensors, gathered; rank 0's values kept.

    A module whose every parameter and buffer (its submodules' too) was loaded is marked initialised first, as
    transformers marks a module it has initialised, so initialize_weights() passes it by: an ``_init_weights`` may
    read a loaded parameter's shape before its init function skips that parameter (Whisper's encoder builds its
    sinusoids from ``embed_positions.weight.shape``), and a loaded parameter is released here, with 0 elements."""
    for module in model.modules():
        tensors = [*module.parameters(), *module.buffers()]
        if tensors and all(id(t) in loaded for t in tensors):
            module._is_hf_initialized = True
    missing = [sp for key, sp in sharded.items() if key not in loaded]
    with GatheredParameters([sp.param for sp in missing], modifier_rank=0, _comm=comm):
        model.initialize_weights()
    for sp in missing:
        if sp.master_init is not None:
            sp.master_init.copy_(sp.shard)
    if dist.get_world_size() > 1:  # buffers were computed on every rank; keep rank 0's, as for the parameters
        for name, buffer in model.named_buffers():
            if id(buffer) not in loaded and buffer.numel():
                comm.broadcast(buffer, src=0, name=f"from_pretrained buffer {name}")


def _load_generation_config(model, path: str, transformers) -> None:
    if os.path.isfile(os.path.join(path, "generation_config.json")) and model.can_generate():
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
