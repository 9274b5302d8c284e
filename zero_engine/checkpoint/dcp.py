"""Offline conversion between our checkpoints and torch.distributed.checkpoint (DCP) directories, no ranks needed.

    from zero_engine.checkpoint import from_dcp, to_dcp
    from_dcp("fsdp2_ckpt/step-100", "ckpt", config="ds_config.json")   # DCP -> ckpt/step-100 (+ latest)
    to_dcp("ckpt", "fsdp2_ckpt/step-100")                              # ours (the latest) -> DCP

    $ zero-engine convert fsdp2_ckpt/step-100 ckpt --config ds_config.json
    $ zero-engine convert ckpt fsdp2_ckpt/step-100

A DCP directory holds whole (global) tensors under their fully qualified names, however many ranks wrote them, so
both directions run in one process with DCP's no-dist mode and any world size can load the result: FSDP2 reshards
DCP on load, and load_checkpoint reshards ours.

Layouts read and written (``layout=``):
- "fsdp2": what ``dcp.save({"model": model_sd, "optim": optim_sd})`` writes with ``model_sd, optim_sd =
  get_state_dict(model, optimizer)`` (torch.distributed.checkpoint.state_dict): ``model.<fqn>``, and the optimizer
  as ``optim.state.<fqn>.<key>`` plus ``optim.param_groups`` whose ``params`` are fqns. The recipe of PyTorch's
  DCP tutorial and of most FSDP2 training loops.
- "torchtitan": torchtitan's CheckpointManager: model fqns at the top level (or under ``model.``), the optimizer
  under ``optimizer.`` flattened (``flatten_optimizer_state_dict``: ``state.<fqn>.<key>`` and
  ``param_groups.<fqn>.<name>``), ``train_state.step``. Its ``lr_scheduler`` and ``dataloader`` are not converted;
  load our output in torchtitan with ``exclude_from_loading = ["lr_scheduler", "dataloader", "train_state"]``.
Reading detects the layout. Optimizer state converts for Adam and AdamW (torch's, or our CPUAdam/FusedAdam: the
same ``step``, ``exp_avg``, ``exp_avg_sq``); other optimizers' tensors are carried under their own keys.

What a DCP directory does not hold is taken from ``config`` (stage, dtype, gradient accumulation: the run that will
load it) and from ``model`` (which tensors are buffers, which names are tied); the LR scheduler, loss scaler, RNG
states and data position are not converted (the loading engine keeps its own scheduler and RNG).

Memory: from_dcp reads one parameter (its value and optimizer states) at a time; to_dcp builds the whole fp32 state
dict (parameters and optimizer states) in host memory, as DCP's own dcp_to_torch_save does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import shutil
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ._atomic import check_tag, create_staging, publish, remove_stale_staging, write_latest
from ._consolidate import locate_checkpoint
from ._errors import CheckpointError
from ._load import ADAM_STATE_ALIKE, load_engine_state
from ._metadata import (ENGINE_STATE_FILE, FORMAT, GRADS_NONE, BufferInfo, CheckpointMeta, ParamInfo, rank_file_name,
                        read_metadata, state_dict_layout, write_metadata)
from ._reader import CheckpointReader, verify_files
from ._tensorfile import TensorFileWriter
from ._views import dtype_name

log = logging.getLogger("zero_engine.checkpoint")

__all__ = ["from_dcp", "to_dcp", "LAYOUTS"]

LAYOUTS = ("fsdp2", "torchtitan")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# torch.optim.Adam/AdamW param-group keys that ours lack; the values are torch's defaults.
_TORCH_ADAM_GROUP_DEFAULTS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                              "differentiable": False, "fused": None}


# ---- reading a DCP directory ---------------------------------------------------------------------------------------
@dataclass
class _DcpSource:
    """Where each piece of a DCP checkpoint is, by our names; tensors are read on demand."""

    directory: str
    layout: str
    tensors: dict[str, tuple[torch.Size, torch.dtype]]  # every DCP tensor key -> size, dtype
    model: dict[str, str]  # fqn -> DCP key of its value
    optim_state: dict[str, dict[str, str]] = field(default_factory=dict)  # fqn -> state key -> DCP tensor key
    optim_values: dict[str, dict] = field(default_factory=dict)  # fqn -> state key -> non-tensor value
    param_groups: list[dict] = field(default_factory=list)  # torch's form, "params" as fqns
    step: int | None = None  # train_state.step (torchtitan)

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        return _load_keys(self.directory, {k: torch.empty(self.tensors[k][0], dtype=self.tensors[k][1])
                                           for k in keys})


@contextlib.contextmanager
def _single_process():
    """DCP warns that it assumes a single process when none is initialized: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _load_keys(directory: str, state: dict) -> dict:
    """Fill ``state`` (DCP's own flat keys: tensors to read into, None for pickled values) from the directory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    values = {}

    class KeepValues(DefaultLoadPlanner):
        """Collects the non-tensor values (the default planner stores them into a copy of the state dict)."""

        def load_bytes(self, read_item, value) -> None:
            # Plain Python values (numbers, tuples, lists of names): nothing a DCP directory holds may run code here.
            values[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    # No process group: one process reads whole tensors (in place), whatever world size wrote them.
    with _single_process():
        dcp.load(state, storage_reader=FileSystemReader(directory), planner=KeepValues(flatten_state_dict=False),
                 no_dist=True)
    state.update(values)
    return state


def _open_dcp(directory: str) -> _DcpSource:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isfile(os.path.join(directory, ".metadata")):
        raise CheckpointError(f"{directory} is not a torch.distributed.checkpoint directory (no .metadata file)")
    metadata = FileSystemReader(directory).read_metadata()
    paths = metadata.planner_data or {}  # DCP key -> path in the saved (nested) state dict
    tensors, values = {}, []
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            tensors[key] = (item.size, item.properties.dtype)
        else:
            values.append(key)
    path_of = {key: tuple(paths.get(key, (key,))) for key in metadata.state_dict_metadata}
    top = {path[0] for path in path_of.values()}
    optim_root = next((name for name in ("optim", "optimizer") if name in top), None)
    model_keys = {key: path for key, path in path_of.items() if key in tensors and (
        path[0] == "model" if "model" in top else len(path) == 1)}
    if not model_keys:
        raise CheckpointError(f"{directory}: no model tensors found (neither under 'model' nor at the top level; "
                              f"top-level entries: {sorted(top)})")
    model = {path[1] if len(path) > 1 else key: key for key, path in model_keys.items()}
    flattened = optim_root is not None and any(
        len(path) == 2 and path[0] == optim_root and str(path[1]).startswith(("state.", "param_groups."))
        for path in path_of.values())
    source = _DcpSource(directory, "torchtitan" if flattened or "model" not in top else "fsdp2", tensors, model)
    wanted = [key for key in values if path_of[key][0] == optim_root or path_of[key] == ("train_state", "step")]
    byte_values = _load_keys(directory, {key: None for key in wanted}) if wanted else {}
    if optim_root is not None:
        if flattened:
            _read_flat_optimizer(source, optim_root, path_of, byte_values)
        else:
            _read_nested_optimizer(source, optim_root, path_of, byte_values)
    step_key = next((key for key, path in path_of.items() if path == ("train_state", "step")), None)
    if step_key is not None:
        source.step = int(source.read([step_key])[step_key]) if step_key in tensors else int(byte_values[step_key])
    return source


def _read_nested_optimizer(source: _DcpSource, root: str, path_of: dict, byte_values: dict) -> None:
    """get_state_dict's form: state/<fqn>/<key>, and param_groups/<i>/<name> (each a pickled value)."""
    groups: dict[int, dict] = {}
    for key, path in path_of.items():
        if path[0] != root or len(path) < 3:
            continue
        if path[1] == "state" and len(path) == 4:
            _state_entry(source, path[2], path[3], key, byte_values)
        elif path[1] == "param_groups" and len(path) == 4:
            groups.setdefault(int(path[2]), {})[path[3]] = byte_values[key]
        elif path[1] == "param_groups" and len(path) == 3:  # a group saved whole
            groups[int(path[2])] = dict(byte_values[key])
    source.param_groups = [groups[index] for index in sorted(groups)]


def _read_flat_optimizer(source: _DcpSource, root: str, path_of: dict, byte_values: dict) -> None:
    """flatten_optimizer_state_dict's form: "state.<fqn>.<key>" and "param_groups.<fqn>.<name>", one per param."""
    names = sorted(source.model, key=len, reverse=True)  # longest first: "a.b" before "a" when both are names
    per_param: dict[str, dict] = {}
    for key, path in path_of.items():
        if path[0] != root or len(path) != 2:
            continue
        section, _, rest = str(path[1]).partition(".")
        fqn = next((name for name in names if rest.startswith(name + ".")), None)
        if fqn is None or section not in ("state", "param_groups"):
            raise CheckpointError(f"{source.directory}: optimizer entry {key!r} names no parameter of the model")
        entry = rest[len(fqn) + 1:]
        if section == "state":
            _state_entry(source, fqn, entry, key, byte_values)
        else:
            per_param.setdefault(fqn, {})[entry] = byte_values[key]
    # Parameters with equal hyperparameters formed one group (torch unflattens them the same way).
    groups: list[dict] = []
    for fqn in source.model:  # model order
        if fqn not in per_param:
            continue
        hyper = per_param[fqn]
        group = next((g for g in groups if {k: v for k, v in g.items() if k != "params"} == hyper), None)
        if group is None:
            groups.append(group := dict(hyper, params=[]))
        group["params"].append(fqn)
    source.param_groups = groups


def _state_entry(source: _DcpSource, fqn: str, state_key: str, dcp_key: str, byte_values: dict) -> None:
    if fqn not in source.model:
        raise CheckpointError(f"{source.directory}: optimizer state {dcp_key!r} is for {fqn!r}, which is not among "
                              "the model's tensors")
    if dcp_key in source.tensors:
        source.optim_state.setdefault(fqn, {})[state_key] = dcp_key
    else:  # e.g. a step saved as a Python number
        source.optim_values.setdefault(fqn, {})[state_key] = byte_values[dcp_key]


# ---- DCP -> ours ---------------------------------------------------------------------------------------------------
def from_dcp(dcp_dir, save_dir, config, tag: str | None = None, model: nn.Module | None = None,
             world_size: int = 1, save_latest: bool = True) -> str:
    """Write a DCP checkpoint (FSDP2, torchtitan) as one of ours in ``save_dir/<tag>``; returns its directory.

    Args:
        dcp_dir: the directory dcp.save wrote (holding ``.metadata``).
        save_dir: the directory to give load_checkpoint; ``latest`` is pointed at the new tag unless
            ``save_latest=False``.
        config: the ds_config (path or dict) of the run that will load it: its ZeRO stage, dtype and gradient
            accumulation are recorded as that run's (load_checkpoint requires the same dtype;
            another stage resumes too).
        tag: default ``global_step<N>`` with N the training step (torchtitan's ``train_state.step``, else Adam's
            ``step``, else 0).
        model: the model (on the meta device is enough): tells buffers from parameters and tied names. Without it
            every model tensor is taken as a parameter, trainable when the optimizer holds state or a group for it.
        world_size: ranks the files are written for; any world size loads them (load_checkpoint reshards), so this
            only chooses how the data is split across files.

    The LR scheduler, loss scaler and RNG states are not in DCP's model/optimizer state: the loading engine keeps
    its own (a scheduler from the config starts at its first step; the param groups' saved ``lr`` holds until the
    scheduler's first step sets it).
    """
    from ..config import load_config

    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"from_dcp: world_size={world_size!r} must be a positive int")
    cfg = load_config(config, world_size=world_size)
    source = _open_dcp(dcp_dir)
    entries = _entries(source, model)
    step = source.step if source.step is not None else _adam_step(source)
    tag = check_tag(str(tag) if tag is not None else f"global_step{step}")
    save_dir = os.path.abspath(os.fspath(save_dir))
    os.makedirs(save_dir, exist_ok=True)
    remove_stale_staging(save_dir)
    staging = create_staging(save_dir, tag)
    try:
        meta = _write_converted(source, entries, cfg, world_size, staging, tag, step)
        final = publish(save_dir, staging, tag, {name: entry["bytes"] for name, entry in meta.files.items()})
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if save_latest:
        write_latest(save_dir, tag)
    if not source.param_groups:
        log.warning("%s holds no optimizer state (a weights-only checkpoint): load %s with "
                    "load_checkpoint(..., load_module_only=True)", source.directory, final)
    log.info("converted %s (%s layout) to %s: %d parameters, stage %d, %s, %d rank files", source.directory,
             source.layout, final, len(meta.params), meta.stage, meta.compute_dtype, world_size)
    return final


def _adam_step(source: _DcpSource) -> int:
    keys = [state["step"] for state in source.optim_state.values() if "step" in state]
    steps = [int(value) for value in source.read(keys).values()] if keys else []
    steps += [int(values["step"]) for values in source.optim_values.values() if "step" in values]
    return max(steps, default=0)


@dataclass(frozen=True)
class _Entry:
    key: str  # the state-dict key
    kind: str  # "param" or "buffer"
    name: str  # the key it aliases (tied), or itself


def _entries(source: _DcpSource, model: nn.Module | None) -> list[_Entry]:
    if model is None:
        return [_Entry(fqn, "param", fqn) for fqn in source.model]
    layout = [_Entry(*item) for item in state_dict_layout(model)]
    missing = [e.name for e in layout if e.key == e.name and e.name not in source.model]
    unexpected = [fqn for fqn in source.model if fqn not in {e.key for e in layout}]
    if missing or unexpected:
        raise CheckpointError(f"{source.directory} does not fit the model: missing {missing[:6]}"
                              f"{' ...' if len(missing) > 6 else ''}, not in the model {unexpected[:6]}"
                              f"{' ...' if len(unexpected) > 6 else ''}")
    shapes = {name: tuple(t.shape) for name, t in [*model.named_parameters(), *model.named_buffers()]}
    wrong = [f"{e.name}: {list(source.tensors[source.model[e.name]][0])} in the checkpoint, {list(shapes[e.name])} "
             "in the model" for e in layout if e.key == e.name and
             tuple(source.tensors[source.model[e.name]][0]) != shapes[e.name]]
    if wrong:
        raise CheckpointError(f"{source.directory} does not fit the model: " + "; ".join(wrong[:6]))
    return layout


def _write_converted(source: _DcpSource, entries: list[_Entry], cfg, world: int, staging: str, tag: str,
                     step: int) -> CheckpointMeta:
    stage, dtype_key = cfg.zero_optimization.stage, cfg.compute_dtype_name
    compute = _COMPUTE_DTYPES[dtype_key]
    partition_world = 1 if stage == 0 else world
    in_groups = {fqn for group in source.param_groups for fqn in group.get("params", ())}
    trainable = {fqn for fqn in source.model if fqn in in_groups or fqn in source.optim_state}
    params, buffers = [], []
    for e in entries:
        if e.key != e.name:
            continue
        size, saved_dtype = source.tensors[source.model[e.name]]
        if e.kind == "buffer":
            buffers.append(BufferInfo(e.name, tuple(size), dtype_name(saved_dtype)))
            continue
        numel = math.prod(size)
        shard = max(1, numel) if stage == 0 else max(1, math.ceil(numel / partition_world))
        dtype = compute if saved_dtype in _FLOATS else saved_dtype
        params.append(ParamInfo(e.name, tuple(size), numel, shard, dtype_name(dtype), e.name in trainable))
    masters = compute != torch.float32
    layouts = [_rank_layout(rank, partition_world, params, buffers, masters, source) for rank in range(world)]
    # A fixed seed: DCP holds no RNG state of the run, and a converted checkpoint should load the same every time.
    file_meta = {"format": FORMAT, "rng_python": json.dumps(random.Random(0).getstate())}
    writers = [TensorFileWriter(os.path.join(staging, rank_file_name(rank)), layouts[rank],
                                dict(file_meta, rank=str(rank), **({"optim_values": json.dumps(
                                    source.optim_values)} if rank == 0 else {})))
               for rank in range(world)]
    try:
        for info in params:
            _write_param(source, info, writers, partition_world, masters)
        for info in buffers:
            writers[0].add(f"buffer/{info.name}", source.read([source.model[info.name]])[source.model[info.name]])
        rng = torch.Generator().manual_seed(0).get_state()
        for writer in writers:
            writer.add("rng/torch", rng)
        digests = [writer.close() for writer in writers]
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    digests.append(_save_engine_state(staging, source, trainable))
    files = {d.name: {"bytes": d.nbytes, "sha256": d.sha256} for d in digests}
    from .. import __version__

    gas = cfg.gradient_accumulation_steps
    meta = CheckpointMeta(
        tag=tag, world_size=world, partition_world_size=partition_world, stage=stage, compute_dtype=dtype_key,
        params=tuple(params), buffers=tuple(buffers),
        state_dict_keys=tuple((e.key, e.kind, e.name) for e in entries), masters=masters, gradients=GRADS_NONE,
        optimizer=_optimizer_name(source.param_groups, source.directory), files=files,
        counters={"global_steps": step, "micro_steps": step * gas, "skipped_steps": 0,
                  "global_samples": step * cfg.train_batch_size},
        config=cfg.model_dump(mode="json"),
        versions={"zero_engine": __version__, "torch": torch.__version__, "converted_from": source.layout})
    write_metadata(staging, meta)
    return meta


def _optimizer_name(groups: list[dict], directory: str) -> str:
    """The torch optimizer class the param groups belong to (DCP does not record it); for Adam, load_checkpoint
    accepts the name for any Adam implementation (torch's, CPUAdam, FusedAdam)."""
    if not groups or all("betas" in g for g in groups):
        decoupled = any(g.get("decoupled_weight_decay", g.get("adamw_mode", True)) for g in groups)
        return "AdamW" if decoupled or not groups else "Adam"
    if all("momentum" in g and "nesterov" in g for g in groups):
        return "SGD"
    raise NotImplementedError(f"{directory}: an optimizer with param group keys {sorted(groups[0])} is not supported "
                              "yet (Adam, AdamW and SGD are)")


def _split_state(source: _DcpSource, info: ParamInfo) -> tuple[dict[str, str], dict[str, str]]:
    """A parameter's optimizer tensors: (shaped like it, so sharded like it; the rest, such as Adam's step)."""
    sharded, scalars = {}, {}
    for key, dcp_key in source.optim_state.get(info.name, {}).items():
        size = source.tensors[dcp_key][0]
        (sharded if len(size) > 0 and size.numel() == info.numel else scalars)[key] = dcp_key
    return sharded, scalars


def _rank_layout(rank: int, partition_world: int, params, buffers, masters: bool, source: _DcpSource):
    """Names, dtypes and shapes of one rank file, in the order _write_param and from_dcp add them."""
    layout = []
    for info in params:
        if partition_world == 1 and rank > 0:
            continue  # stage 0: rank 0 alone saves the replicated values
        sharded, scalars = _split_state(source, info)
        layout.append((f"param/{info.name}", _dtype(info.dtype), (info.shard_numel,)))
        if masters and info.requires_grad:
            layout.append((f"master/{info.name}", torch.float32, (info.shard_numel,)))
        for key, dcp_key in sharded.items():
            layout.append((f"optim/{key}/{info.name}", source.tensors[dcp_key][1], (info.shard_numel,)))
        if rank == 0:
            layout += [(f"optim_scalar/{key}/{info.name}", source.tensors[dcp_key][1],
                        tuple(source.tensors[dcp_key][0])) for key, dcp_key in scalars.items()]
    if rank == 0:
        layout += [(f"buffer/{b.name}", _dtype(b.dtype), b.shape) for b in buffers]
    layout.append(("rng/torch", torch.uint8, tuple(torch.get_rng_state().shape)))
    return layout


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _write_param(source: _DcpSource, info: ParamInfo, writers, partition_world: int, masters: bool) -> None:
    """Read one parameter's value and optimizer state, and add each rank's shards (zero-padded) to its file."""
    sharded, scalars = _split_state(source, info)
    values = source.read([source.model[info.name], *sharded.values(), *scalars.values()])
    padded = info.shard_numel * partition_world

    def shards(tensor: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
        flat = torch.zeros(padded, dtype=dtype)
        flat[: info.numel] = tensor.reshape(-1)
        return list(flat.chunk(partition_world))

    value = values[source.model[info.name]]
    pieces = {"param": shards(value, _dtype(info.dtype))}
    if masters and info.requires_grad:
        pieces["master"] = shards(value, torch.float32)
    for key, dcp_key in sharded.items():
        pieces[f"optim/{key}"] = shards(values[dcp_key], values[dcp_key].dtype)
    for rank in range(partition_world):
        for kind, parts in pieces.items():
            writers[rank].add(f"{kind}/{info.name}", parts[rank])
        if rank == 0:
            for key, dcp_key in scalars.items():
                writers[0].add(f"optim_scalar/{key}/{info.name}", values[dcp_key])


def _save_engine_state(staging: str, source: _DcpSource, trainable: set[str]):
    from ._save import torch_save

    groups = [dict(g, params=[fqn for fqn in g["params"] if fqn in trainable]) for g in source.param_groups]
    if not groups and trainable:
        raise CheckpointError(f"{source.directory} holds no optimizer param_groups; convert a checkpoint saved with "
                              "its optimizer (get_state_dict(model, optimizer))")
    return torch_save(os.path.join(staging, ENGINE_STATE_FILE),
                       {"param_groups": groups, "lr_scheduler": None, "loss_scaler": None})


# ---- ours -> DCP ---------------------------------------------------------------------------------------------------
def to_dcp(checkpoint_dir, dcp_dir, tag: str | None = None, layout: str = "fsdp2", verify: bool = True) -> str:
    """Write one of our checkpoints as a DCP directory that FSDP2 (or torchtitan, ``layout="torchtitan"``) loads.

    Parameters are written in fp32 (the master where one was saved), with their Adam states and param groups in
    torch.optim.AdamW's form, under the model's fully qualified names; load it with
    ``model_sd, optim_sd = get_state_dict(model, optimizer); state = {"model": model_sd, "optim": optim_sd};
    dcp.load(state, checkpoint_id=dcp_dir); set_state_dict(model, optimizer, model_state_dict=state["model"],
    optim_state_dict=state["optim"])``. ``dcp_dir`` must not exist yet (DCP writes in place). Returns dcp_dir.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    if layout not in LAYOUTS:
        raise ValueError(f"to_dcp: layout={layout!r}; use one of {LAYOUTS}")
    dcp_dir = os.path.abspath(os.fspath(dcp_dir))
    if os.path.exists(dcp_dir) and os.listdir(dcp_dir):
        raise FileExistsError(f"to_dcp: {dcp_dir} exists and is not empty; give a new directory")
    path = locate_checkpoint(checkpoint_dir, tag)
    meta = read_metadata(path)
    if verify:
        verify_files(path, meta)
    if meta.gradients != GRADS_NONE:
        log.warning("to_dcp: %s was saved in the middle of gradient accumulation; the accumulated gradients are not "
                    "converted (DCP state dicts hold none)", path)
    engine_state = load_engine_state(path, meta)
    with CheckpointReader(path, meta) as reader:
        model_sd, optim_state = _read_ours(reader)
    groups = engine_state["param_groups"]
    if meta.optimizer in ADAM_STATE_ALIKE:
        groups = [_torch_adam_group(group, path) for group in groups]
    step = meta.counters.get("global_steps", 0)
    if layout == "fsdp2":
        state = {"model": model_sd, "optim": {"state": optim_state, "param_groups": groups}}
    else:
        flat = {f"state.{fqn}.{key}": value for fqn, entry in optim_state.items() for key, value in entry.items()}
        flat.update({f"param_groups.{fqn}.{key}": value for group in groups for fqn in group["params"]
                     for key, value in group.items() if key != "params"})
        # torchtitan (since 0.3) keeps the model's fqns at the top level; train_state.step as its TrainState has it
        state = {**model_sd, "optimizer": flat, "train_state": {"step": torch.tensor(step, dtype=torch.int32)}}
    os.makedirs(dcp_dir, exist_ok=True)
    with _single_process():
        dcp.save(state, storage_writer=FileSystemWriter(dcp_dir), no_dist=True)  # one process writes whole tensors
    log.info("wrote %s (%s layout) from %s: %d model tensors in fp32, step %d", dcp_dir, layout, path,
             len(model_sd), step)
    return dcp_dir


def _read_ours(reader: CheckpointReader) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    meta = reader.meta
    tensors: dict[str, torch.Tensor] = {}
    optim_state: dict[str, dict] = {}
    values = reader.optimizer_values()
    for info in meta.params:
        name = info.name
        source = "master" if reader.has("master", name) else "param"
        saved = reader.file(0).entry(f"{source}/{name}").dtype
        tensors[name] = reader.read_whole(source, name, torch.float32 if saved in _FLOATS else saved)
        keys = reader.state_keys(name)
        entry = dict(values.get(name, {}))
        for key in keys["optim"]:
            entry[key] = reader.read_whole(f"optim/{key}", name)
        for key in keys["optim_scalar"]:
            entry[key] = reader.file(0).read(f"optim_scalar/{key}/{name}")
        if entry:
            optim_state[name] = entry
    for info in meta.buffers:
        tensors[info.name] = reader.file(0).read(f"buffer/{info.name}")
    return {key: tensors[name] for key, _, name in meta.state_dict_keys}, optim_state


def _torch_adam_group(group: dict, path: str) -> dict:
    """Our Adam's param group as torch.optim.AdamW's (``adamw_mode`` is torch's ``decoupled_weight_decay``)."""
    group = dict(group)
    if not group.pop("bias_correction", True):
        raise NotImplementedError(f"{path}: bias_correction=False has no torch.optim.Adam equivalent; such a "
                                  "checkpoint cannot be converted for FSDP2")
    if "adamw_mode" in group:
        group["decoupled_weight_decay"] = bool(group.pop("adamw_mode"))
    for key, default in _TORCH_ADAM_GROUP_DEFAULTS.items():
        group.setdefault(key, default)
    if isinstance(group.get("betas"), list):
        group["betas"] = tuple(group["betas"])
    return group
