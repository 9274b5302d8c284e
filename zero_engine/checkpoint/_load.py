"""engine.load_checkpoint: check everything, then read each rank's new shards from whichever saved shards hold them.

Order (every check is agreed across ranks before anything in the engine changes, so a refused checkpoint leaves
the engine as it was):
1. find the directory (``latest`` or the tag) and read ``metadata.json``; check dtype, parameter and buffer
   names and shapes, optimizer type and param groups against this engine;
2. verify every file's size and SHA-256 (the files are split across ranks, each hashed once);
3. read this rank's range of every parameter, master and optimizer-state tensor (see _partition.py): at the same
   world size one piece per tensor, at another world size the overlapping pieces of the saved shards;
4. refresh whole parameters (stages 1-2, persistent ones at stage 3) from the new shards, then restore param
   groups, LR scheduler, loss scaler, gradient-accumulation state, step counters and RNG states.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import pickle
import random

import torch

from ._atomic import check_dir_argument, resolve_checkpoint
from ._collective import agree
from ._errors import CheckpointError
from ._metadata import (CLIENT_STATE_FILE, ENGINE_STATE_FILE, GRADS_LOCAL, GRADS_NONE, GRADS_SHARDED,
                        CheckpointMeta, check_buffers_match, check_params_match, read_metadata)
from ._reader import CheckpointReader, verify_files
from ._views import ParamView, buffer_items, param_views, states_in_memory
from ..zero.gathered import refresh_whole_params
from ..zero.tensor_parallel import grad_from_local

log = logging.getLogger("zero_engine.checkpoint")

__all__ = ["load_checkpoint"]

# Optimizers whose state is the same (step, exp_avg, exp_avg_sq) and whose param groups carry the Adam/AdamW mode:
# a checkpoint of one resumes in another (our kernel where it builds, torch's where it does not, or one converted
# from an FSDP2 run's torch.optim.AdamW).
ADAM_STATE_ALIKE = {"Adam", "AdamW", "CPUAdam", "FusedAdam"}


def load_checkpoint(engine, load_dir, tag=None, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False, missing_ok: bool = False):
    """Collective: restore a checkpoint saved by save_checkpoint, at this or another world size or ZeRO stage (see
    [Note: resuming at another stage]).

    Returns ``(path, client_state)``, or ``(None, None)`` when ``tag`` is None and ``load_dir`` has no ``latest``
    (nothing saved yet, as DeepSpeed does). A ``load_dir`` that does not exist raises CheckpointError (a typo in a
    resume path must not silently train from scratch) unless ``missing_ok=True``: then it is ``(None, None)`` too,
    DeepSpeed's behaviour for a first run whose save_dir was not created yet. ``load_module_only``: weights (fp32 masters when saved) and buffers only,
    for fine-tuning: optimizer, scheduler, counters and RNG keep this engine's values, and the dtype may differ
    from the saved one. ``load_optimizer_states=False``: weights, scheduler and counters, fresh optimizer.
    Raises CheckpointError on every rank, naming the file or parameter, when the checkpoint is missing, corrupt or
    does not fit this engine, or when ranks would load different checkpoints (different tags, or a ``latest`` that
    differs between nodes); the engine is then unchanged. ``load_dir`` None or empty is a ValueError.
    """
    comm = engine.comm
    located = agree(comm, "finding the checkpoint", lambda: resolve_checkpoint(
        check_dir_argument("load_checkpoint", "load_dir", load_dir), tag, missing_ok), share=True)
    tags = {rank: found[1] if found is not None else None for rank, found in enumerate(located)}
    if len(set(tags.values())) > 1:  # mixing shards of different checkpoints would load garbage
        found = ", ".join(f"rank {rank}: {t!r}" for rank, t in list(tags.items())[:8])
        raise CheckpointError(f"load_checkpoint on rank {comm.rank}: ranks would load different checkpoints ({found}"
                              f"{', ...' if len(tags) > 8 else ''}; None: nothing to load); pass the same load_dir and "
                              "tag on every rank, on a filesystem every rank sees")
    located = located[comm.rank]
    if located is None:
        if comm.rank == 0:
            log.warning("load_checkpoint: no 'latest' file in %s: nothing loaded (pass tag= to name a checkpoint)",
                        os.path.abspath(os.fspath(load_dir)))
        return None, None
    path, tag = located
    with states_in_memory(engine):  # NVMe offload: read in, loaded into, written back after
        views = param_views(engine)
        full_resume = not load_module_only
        with_optimizer = full_resume and load_optimizer_states
        meta, engine_state = agree(comm, f"reading {path}", lambda: _read_and_check(
            engine, views, path, with_optimizer, load_module_only))
        agree(comm, f"verifying {path}",
              lambda: verify_files(path, meta, sorted(meta.files)[comm.rank::comm.world_size]))
        reader = CheckpointReader(path, meta, tp_rank=engine.mesh.tp_rank)
        try:
            optimizer_state = agree(comm, f"reading optimizer states of {path}", lambda: _optimizer_state_dict(
                engine, views, reader, engine_state)) if with_optimizer else None
            # From here the engine changes. Reads of verified files should not fail, but if one does (an I/O error),
            # every rank still raises together instead of leaving the others in the refresh gather.
            agree(comm, f"reading {path}", lambda: (_load_weights(engine, views, reader, meta),
                                                    _load_buffers(engine, reader)))
            _refresh_whole_params(engine)
            client_state = agree(comm, f"restoring the training state of {path}", lambda: _restore_training_state(
                engine, views, reader, meta, engine_state, optimizer_state, full_resume, load_lr_scheduler_states))
        finally:
            reader.close()
    if comm.rank == 0:
        log.info("loaded checkpoint %s (saved at stage %d on %d ranks, %s) on %d ranks", path, meta.stage,
                 meta.world_size, meta.compute_dtype, comm.world_size)
    return path, client_state


def _restore_training_state(engine, views, reader, meta, engine_state, optimizer_state, full_resume: bool,
                            load_lr_scheduler_states: bool):
    """Everything but the weights (local to this rank); returns the client_state."""
    _reset_gradients(engine, views)
    if optimizer_state is not None:
        engine.optimizer.optimizer.load_state_dict(optimizer_state)
        if engine.loss_scaler is not None and engine_state["loss_scaler"] is not None:
            engine.loss_scaler.load_state_dict(engine_state["loss_scaler"])
        _load_gradients(engine, views, reader, meta)
    elif full_resume and meta.gradients != GRADS_NONE and engine.comm.rank == 0:
        log.warning("load_checkpoint: %s was saved mid-accumulation; with load_optimizer_states=False the "
                    "accumulated gradients are dropped", reader.directory)
    if full_resume:
        if load_lr_scheduler_states and engine.lr_scheduler is not None and engine_state["lr_scheduler"] is not None:
            engine.lr_scheduler.load_state_dict(engine_state["lr_scheduler"])
        engine.load_counters(meta.counters, with_gradients=optimizer_state is not None)
        _load_rng_states(engine, reader, meta)
    return _client_state(reader.directory)


# ---- checks ----------------------------------------------------------------------------------------------------------
def _read_and_check(engine, views: list[ParamView], path: str, with_optimizer: bool,
                    module_only: bool) -> tuple[CheckpointMeta, dict]:
    meta = read_metadata(path)
    if meta.tp_size != engine.mesh.tp_size:
        raise NotImplementedError(
            f"checkpoint {path} was saved at tp size {meta.tp_size}; this engine's tp size is {engine.mesh.tp_size} "
            f"({engine.mesh.describe()}). Loading at another tp size is not supported yet (the files hold each tp "
            f"rank's pieces); load it at tp size {meta.tp_size} (the data-parallel size may differ)")
    ours = engine.config.compute_dtype_name
    if not module_only and meta.compute_dtype != ours:
        raise CheckpointError(f"checkpoint {path} was saved with dtype {meta.compute_dtype} (this engine: {ours}); "
                              "resuming needs the same dtype. Pass load_module_only=True to take the weights only "
                              "(optimizer states, scheduler and counters are then not restored)")
    check_params_match(meta, [(v.info.name, v.info.shape) for v in views], path)
    check_buffers_match(meta, [(info.name, info.shape) for info, _ in buffer_items(engine.module)], path)
    engine_state = load_engine_state(path, meta)
    if with_optimizer:
        ours_opt = type(engine.optimizer.optimizer).__name__
        if meta.optimizer != ours_opt and not {meta.optimizer, ours_opt} <= ADAM_STATE_ALIKE:
            raise CheckpointError(f"checkpoint {path} holds {meta.optimizer} state; this engine's optimizer is "
                                  f"{ours_opt}. Use the same optimizer, or load_optimizer_states=False")
        _check_gradients_fit(engine, meta, path)
        if meta.gradients == GRADS_LOCAL and meta.world_size != engine.comm.world_size:
            raise CheckpointError(
                f"checkpoint {path} was saved in the middle of gradient accumulation at stage {meta.stage} on "
                f"{meta.world_size} ranks: each rank's unreduced gradients cannot be split over "
                f"{engine.comm.world_size}. Save at an accumulation boundary, or load with "
                "load_optimizer_states=False (the partial accumulation is then dropped)")
        if engine.loss_scaler is not None and engine_state["loss_scaler"] is not None:
            copy.copy(engine.loss_scaler).load_state_dict(engine_state["loss_scaler"])  # raises if incompatible
    return meta, engine_state


def _check_gradients_fit(engine, meta: CheckpointMeta, path: str) -> None:
    """[Note: resuming at another stage] The files are one format at every stage: each parameter, master and
    optimizer state is saved by name, split over ``partition_world_size`` ranks (1 at stage 0), and a load reads
    this rank's range of each, as at another world size. So a checkpoint resumes at another stage (with its optimizer
    states, scheduler, counters and loss scale), except in the middle of gradient accumulation when the two stages
    keep the window's gradients in another form: reduced shards at stages 2-3, each rank's own unreduced gradients at
    stages 0-1."""
    if meta.gradients == GRADS_NONE or meta.stage == engine.stage:
        return
    sharded_here = engine.stage >= 2
    if (meta.gradients == GRADS_SHARDED) != sharded_here:
        saved = "reduced gradient shards" if meta.gradients == GRADS_SHARDED else "each rank's unreduced gradients"
        kept = "reduced gradient shards" if sharded_here else "each rank's unreduced gradients"
        raise CheckpointError(
            f"checkpoint {path} was saved in the middle of gradient accumulation at stage {meta.stage}, with "
            f"{saved}; stage {engine.stage} keeps {kept}. Save at an accumulation boundary, or load with "
            "load_optimizer_states=False (the partial accumulation is then dropped)")


def load_engine_state(path: str, meta: CheckpointMeta) -> dict:
    file = os.path.join(path, ENGINE_STATE_FILE)
    if ENGINE_STATE_FILE not in meta.files:
        raise CheckpointError(f"{os.path.join(path, 'metadata.json')} does not list {ENGINE_STATE_FILE}")
    verify_files(path, meta, [ENGINE_STATE_FILE])  # small; checked before it is unpickled
    try:
        return torch.load(file, weights_only=True)
    except pickle.UnpicklingError:  # a user's LR scheduler whose state holds other types; our own file, verified
        return torch.load(file, weights_only=False)


def _optimizer_state_dict(engine, views: list[ParamView], reader: CheckpointReader, engine_state: dict) -> dict:
    """The torch optimizer's state_dict for this rank's shards, read from the checkpoint, indexed as it expects."""
    optimizer = engine.optimizer.optimizer
    saved_groups = engine_state["param_groups"]
    name_of = {id(v.opt_param): v.info.name for v in views if v.opt_param is not None}
    current = [[name_of[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    if len(saved_groups) != len(current):
        raise CheckpointError(f"checkpoint {reader.directory}: the optimizer had {len(saved_groups)} param groups; "
                              f"this one has {len(current)}")
    for index, (saved, names) in enumerate(zip(saved_groups, current)):
        if set(saved["params"]) != set(names):
            moved = sorted(set(saved["params"]) ^ set(names))
            raise CheckpointError(f"checkpoint {reader.directory}: param group {index} differs from this "
                                  f"optimizer's in {len(moved)} parameter(s): {', '.join(moved[:6])}")
    by_name = {v.info.name: v for v in views}
    values = reader.optimizer_values()
    state, groups, position = {}, [], 0
    for saved, names in zip(saved_groups, current):
        groups.append(dict({k: val for k, val in saved.items() if k != "params"},
                           params=list(range(position, position + len(names)))))
        for name in names:
            entry = _param_optimizer_state(reader, by_name[name], values.get(name, {}))
            if entry:
                state[position] = entry
            position += 1
    return {"state": state, "param_groups": groups}


def _param_optimizer_state(reader: CheckpointReader, v: ParamView, values: dict) -> dict:
    name, keys = v.info.name, reader.state_keys(v.info.name)
    entry = dict(values)
    for key in keys["optim"]:
        dtype = reader.file(0).entry(f"optim/{key}/{name}").dtype
        flat = torch.zeros(v.opt_param.numel(), dtype=dtype)  # padding stays zero, as it was when saved
        reader.read_range(f"optim/{key}", name, v.start, v.stop, flat[: v.stop - v.start])
        entry[key] = flat.view(v.opt_param.shape)
    for key in keys["optim_scalar"]:
        entry[key] = reader.file(0).read(f"optim_scalar/{key}/{name}")
    return entry


# ---- applying ------------------------------------------------------------------------------------------------------
def _load_weights(engine, views: list[ParamView], reader: CheckpointReader, meta: CheckpointMeta) -> None:
    """Shards (and masters) from the saved values: exact when dtypes match, else cast from the fp32 master."""
    for v in views:
        name, n = v.info.name, v.stop - v.start
        same_dtype = meta.param(name).dtype == v.info.dtype
        precise = "master" if reader.has("master", name) else "param"  # the most precise saved value
        if engine.stage == 0:  # the whole parameter (an expert's: its ep rank's range of the saved tensor)
            data = v.param.data
            target = data.view(-1) if data.is_contiguous() else torch.empty(data.numel(), dtype=data.dtype)
            reader.read_range("param" if same_dtype else precise, name, v.start, v.stop, target)
            if target.data_ptr() != data.data_ptr():
                data.copy_(target.view(data.shape))
            if v.master is not None:  # fp16/bf16: the whole fp32 master, a view of its data
                reader.read_range(precise, name, v.start, v.stop, v.master)
            continue
        if v.master is not None:
            v.master.zero_()
            reader.read_range(precise, name, v.start, v.stop, v.master[:n])
        if same_dtype or v.master is None:
            v.shard.zero_()
            reader.read_range("param" if same_dtype else precise, name, v.start, v.stop, v.shard[:n])
        else:
            v.shard.copy_(v.master)


def _load_buffers(engine, reader: CheckpointReader) -> None:
    for info, buffer in buffer_items(engine.module):
        buffer.data.copy_(reader.file(0).read(f"buffer/{info.name}").view(buffer.shape))


def _refresh_whole_params(engine) -> None:
    """Parameters kept whole re-gathered from the new shards (stages 1-3: see refresh_whole_params)."""
    if engine.stage == 0:
        return
    refresh_whole_params(engine.sharded, engine.refresh_gatherer, "refresh after load_checkpoint")


def _reset_gradients(engine, views: list[ParamView]) -> None:
    """Gradients of whatever ran before the load must not leak into the restored accumulation window."""
    engine.zero_grad()
    for v in views:
        v.param.grad = None


def _load_gradients(engine, views: list[ParamView], reader: CheckpointReader, meta: CheckpointMeta) -> None:
    if meta.gradients == GRADS_SHARDED:
        if engine.stage < 2:  # _check_gradients_fit refused it
            raise AssertionError(f"sharded gradients in a stage-{meta.stage} checkpoint loaded at stage {engine.stage}")
        by_name = {v.info.name: v for v in views}
        for bucket in engine.reducer.buckets:
            engine.reducer.alloc_shard_grads(bucket).zero_()
            for sp in bucket.params:
                if reader.has("grad", sp.fqn):
                    v = by_name[sp.fqn]
                    target = engine.reducer.shard_grad(sp)[: v.stop - v.start]
                    reader.read_range("grad", sp.fqn, v.start, v.stop, target)
            bucket.has_grads = True
    elif meta.gradients == GRADS_LOCAL:
        own = reader.file(engine.mesh.data_parallel_rank)  # this world rank's file (same world and tp size)
        for v in views:
            if f"local_grad/{v.info.name}" in own:
                local = own.read(f"local_grad/{v.info.name}").to(v.param.device, v.param.dtype)
                # info: the tp-local shape; an expert's is the whole tensor's (this rank's own is the parameter's)
                shape = v.info.shape if v.info.ep_size == 1 else v.param.shape
                v.param.grad = grad_from_local(v.param, local.view(shape))


def _load_rng_states(engine, reader: CheckpointReader, meta: CheckpointMeta) -> None:
    comm = engine.comm
    if meta.world_size != comm.world_size:
        if comm.rank == 0:
            log.info("load_checkpoint: RNG states not restored (saved on %d ranks, loading on %d)", meta.world_size,
                     comm.world_size)
        return
    own = reader.file(engine.mesh.data_parallel_rank)  # this world rank's file (same world and tp size)
    torch.set_rng_state(own.read("rng/torch"))
    # The state of the rank's own device (the current one). Earlier checkpoints kept every visible device's, as
    # rng/cuda/<index>; restoring them all failed where a rank sees fewer devices than when it saved (a per-rank
    # CUDA_VISIBLE_DEVICES), and a rank draws from its own device only.
    if torch.cuda.is_available():
        own_device = "rng/cuda" if "rng/cuda" in own.entries else f"rng/cuda/{torch.cuda.current_device()}"
        if own_device in own.entries:
            torch.cuda.set_rng_state(own.read(own_device))
    version, state, gauss = json.loads(own.metadata["rng_python"])
    random.setstate((version, tuple(state), gauss))
    if "rng_numpy" in own.metadata:
        import numpy

        kind, position, has_gauss, cached = json.loads(own.metadata["rng_numpy"])
        numpy.random.set_state((kind, own.read("rng/numpy").numpy().astype(numpy.uint32), position, has_gauss,
                                cached))


def _client_state(path: str):
    file = os.path.join(path, CLIENT_STATE_FILE)
    if not os.path.isfile(file):
        return {}
    # The user's own objects (checksum verified above); unpickling them needs the full pickle.
    return torch.load(file, weights_only=False)
