"""engine.save_checkpoint: every rank writes its shards; the checkpoint appears at once when all are durable.

Phases (each agreed across ranks, see [Note: why every phase is agreed]):
1. ranks agree on the tag (see [Note: tags that differ across ranks]), the directory and a staging name; rank 0
   creates the staging directory;
2. every rank writes ``rank_<r>.safetensors`` (rank 0 also ``engine_state.pt`` and ``client_state.pt``), fsyncs
   it and reports its size and SHA-256;
3. rank 0 writes ``metadata.json``, renames the staging directory into place and updates ``latest``
   (see [Note: crash consistency] in _atomic.py).

[Note: tags that differ across ranks]
A checkpoint is one directory written by all ranks together, so it has one tag. DeepSpeed's
``checkpoint.tag_validation`` says what happens when ranks pass different tags: "Fail" raises (DeepSpeed asserts;
we raise ArgumentError, an AssertionError too) on every rank before anything is written. Under "Warn" (the default)
and "Ignore", DeepSpeed goes on and each rank writes its own files under its own tag, so no tag holds a complete
checkpoint and ``latest`` (rank 0's tag) names one that cannot be loaded. We save one complete checkpoint under rank
0's tag instead, the one ``latest`` names in DeepSpeed too; "Warn" logs the differing tags on every rank, "Ignore"
says nothing. Each rank's return value is that checkpoint's directory. A different save_dir is always an error: it
would be a different checkpoint, not a different name for the same one.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import sys
import time
import uuid

import torch

from ..errors import ArgumentError
from ._atomic import check_dir_argument, check_tag, create_staging, publish, remove_stale_staging, write_latest
from ._collective import agree
from ._metadata import (CLIENT_STATE_FILE, ENGINE_STATE_FILE, FORMAT, GRADS_LOCAL, GRADS_NONE, GRADS_SHARDED,
                        CheckpointMeta, rank_file_name, state_dict_layout, write_metadata)
from ._tensorfile import FileDigest, sha256_of_file, write_tensor_file
from ._views import ParamView, buffer_items, param_views, states_in_memory
from ..zero.tensor_parallel import local_grad

log = logging.getLogger("zero_engine.checkpoint")

__all__ = ["save_checkpoint"]


def save_checkpoint(engine, save_dir, tag=None, client_state=None, save_latest: bool = True) -> str:
    """Collective: save everything needed to resume bit-identically; returns the checkpoint directory.

    Args:
        save_dir: the directory holding checkpoints (one subdirectory per tag, and ``latest``); every rank must see
            the same directory (a shared filesystem across nodes).
        tag: the subdirectory name; default ``global_step<N>``. Saving an existing tag replaces it atomically.
            The same on every rank; see [Note: tags that differ across ranks] for checkpoint.tag_validation.
        client_state: a dict of your own (data-loader position, epoch...), returned by load_checkpoint. Saved by
            rank 0 with torch.save (pickle), so it may hold any picklable object.
        save_latest: point ``latest`` at this checkpoint once it is complete.

    Cost: each rank writes its own states once (no gather, no copy): 2 bytes per parameter / world for bf16/fp16
    shards, plus 4 for the fp32 master (not separate in fp32 training) and the optimizer's state (8 for Adam).
    """
    comm = engine.comm
    started = time.perf_counter()
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    try:
        save_dir, problem = os.path.abspath(check_dir_argument("save_checkpoint", "save_dir", save_dir)), None
    except ValueError as error:  # raised below on every rank, so none is left waiting for the others
        problem = str(error)
    proposals = comm.all_gather_object((problem, tag, save_dir, uuid.uuid4().hex[:16]))
    tag = _agree_on_target(comm.rank, proposals, engine.config.checkpoint.tag_validation)
    check_tag(tag)  # after the agreement: every rank raises or none does
    staging = agree(comm, "creating the checkpoint directory",
                    lambda: _prepare(save_dir, tag, proposals[0][3]) if comm.rank == 0 else None, share=True)[0]
    try:
        with states_in_memory(engine):  # NVMe offload: masters and moments read in for the save (views see them)
            views = param_views(engine)
            reports = agree(comm, f"writing checkpoint {tag}",
                            lambda: _write_rank(engine, views, staging, client_state), share=True)
            final = agree(comm, f"publishing checkpoint {tag}",
                          lambda: _finish(engine, views, reports, save_dir, staging, tag, save_latest)
                          if comm.rank == 0 else None, share=True)[0]
    except BaseException:
        if comm.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if comm.rank == 0:
        written = sum(d.nbytes for digests, _ in reports for d in digests)
        log.info("saved checkpoint %s: %.1f MiB in %d files, %.2fs", final, written / 2**20,
                 sum(len(d) for d, _ in reports) + 1, time.perf_counter() - started)
    return final


def _agree_on_target(rank: int, proposals: list[tuple], tag_validation: str) -> str:
    """The tag every rank saves under (rank 0's), or the same error on every rank; see [Note: tags that differ across
    ranks]. ``proposals``: (problem with save_dir, tag, save_dir, nonce) of each rank."""
    for other, (problem, _, _, _) in enumerate(proposals):
        if problem is not None:
            raise ValueError(problem if other == rank else f"rank {other}: {problem}")
    dirs = {other: d for other, (_, _, d, _) in enumerate(proposals)}
    if len(set(dirs.values())) > 1:
        raise ValueError(f"save_checkpoint: ranks pass different save_dirs ({_by_rank(dirs)}); every rank must pass "
                         "the same save_dir (it is one checkpoint written by all ranks together)")
    tags = {other: t for other, (_, t, _, _) in enumerate(proposals)}
    if len(set(tags.values())) > 1:
        if tag_validation == "FAIL":
            raise ArgumentError(f"save_checkpoint on rank {rank}: ranks pass different tags ({_by_rank(tags)}) and "
                                'checkpoint.tag_validation is "Fail"; pass the same tag on every rank (one '
                                "checkpoint is written by all ranks together)")
        if tag_validation == "WARN":
            log.warning("save_checkpoint on rank %d: ranks pass different tags (%s); saving one checkpoint under rank "
                        "0's tag %r (checkpoint.tag_validation \"Warn\"; \"Ignore\" silences this, \"Fail\" "
                        "raises). Pass the same tag on every rank", rank, _by_rank(tags), tags[0])
    return tags[0]


def _by_rank(values: dict[int, str], shown: int = 4) -> str:
    """``'a' on ranks 0, 2, 'b' on rank 1``: the first ``shown`` distinct values, each with its ranks."""
    ranks: dict[str, list[int]] = {}
    for rank, value in values.items():
        ranks.setdefault(value, []).append(rank)
    parts = [f"{value!r} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r[:8]))}{'...' if len(r) > 8 else ''}"
             for value, r in list(ranks.items())[:shown]]
    return "; ".join(parts) + (f"; and {len(ranks) - shown} more" if len(ranks) > shown else "")


def _prepare(save_dir: str, tag: str, nonce: str) -> str:
    os.makedirs(save_dir, exist_ok=True)
    remove_stale_staging(save_dir)
    return create_staging(save_dir, tag, nonce)


def _gradient_mode(engine, views: list[ParamView]) -> str:
    if engine.stage >= 2:
        return GRADS_SHARDED if any(b.has_grads for b in engine.reducer.buckets) else GRADS_NONE
    return GRADS_LOCAL if any(v.param.grad is not None for v in views) else GRADS_NONE


def _write_rank(engine, views: list[ParamView], staging: str, client_state) -> tuple[list[FileDigest], str]:
    rank = engine.comm.rank
    tensors: dict[str, torch.Tensor] = {}
    file_meta = {"format": FORMAT, "rank": str(rank)}
    optimizer = engine.optimizer.optimizer
    values: dict[str, dict] = {}
    # [Note: checkpoints of a hierarchical mesh] Under MiCS / HSDP every replica holds the same model states, so only
    # replica 0 writes them: its shard rank r is world rank r (see [Note: rank layout of a hierarchical mesh] in
    # mesh.py), so rank files 0..k-1 hold the k shards exactly as a flat run over k ranks would, and the metadata says
    # partition_world_size k. Every rank still writes its own file (RNG states, stage 0-1 local gradients), so the
    # checkpoint loads at any world and any mesh by the usual ranges (_partition.py).
    saves_shards = engine.mesh.saves_shards
    # [Note: checkpoints of a tensor-parallel model] in _metadata.py: what rank 0 alone writes without tp, dp rank 0
    # of every tp rank writes (the first file of that tp rank's flat checkpoint); the same as rank 0 without tp.
    first = engine.mesh.data_parallel_rank == 0
    for v in views:
        if v.shard is None or not saves_shards:  # stage 0: only rank 0 saves the (replicated) parameters and optimizer state
            continue
        name = v.info.name
        tensors[f"param/{name}"] = v.shard
        if v.master is not None:
            tensors[f"master/{name}"] = v.master
        for key, value in optimizer.state.get(v.opt_param, {}).items() if v.opt_param is not None else ():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == v.opt_param.numel():
                tensors[f"optim/{key}/{name}"] = value.reshape(-1)  # shaped like the shard: resharded like it
            elif first and isinstance(value, torch.Tensor):
                tensors[f"optim_scalar/{key}/{name}"] = value
            elif first:
                _require_json(value, f"optimizer state {key!r} of {name}")
                values.setdefault(name, {})[key] = value
    mode = _gradient_mode(engine, views)
    if mode == GRADS_SHARDED:  # the replicas' sums averaged, as any hierarchy reads them (on every rank: collective)
        engine.reducer.average_across_replicas()
    if mode == GRADS_SHARDED and saves_shards:
        for bucket in engine.reducer.buckets:
            if bucket.has_grads:
                for sp in bucket.params:
                    tensors[f"grad/{sp.fqn}"] = engine.reducer.shard_grad(sp)
    elif mode == GRADS_LOCAL:
        for v in views:
            if v.param.grad is not None:  # a DTensor's: its local piece, in the parameter's placements
                tensors[f"local_grad/{v.info.name}"] = local_grad(v.param, v.param.grad)
    if first:
        for info, buffer in buffer_items(engine.module):
            tensors[f"buffer/{info.name}"] = buffer
        file_meta["optim_values"] = json.dumps(values)
    _add_rng_states(tensors, file_meta)
    digests = [write_tensor_file(os.path.join(staging, rank_file_name(rank)), tensors, file_meta)]
    if rank == 0:
        digests.append(torch_save(os.path.join(staging, ENGINE_STATE_FILE), _engine_state(engine, views)))
        if client_state is not None:
            digests.append(torch_save(os.path.join(staging, CLIENT_STATE_FILE), client_state))
    return digests, mode


def _require_json(value, what: str) -> None:
    try:
        json.dumps(value)
    except TypeError:
        raise NotImplementedError(f"cannot checkpoint {what}: a {type(value).__name__} is neither a tensor nor a "
                                  "JSON value") from None


def _add_rng_states(tensors: dict, file_meta: dict) -> None:
    tensors["rng/torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # this rank's device only: see _load_rng_states
        tensors["rng/cuda"] = torch.cuda.get_rng_state()
    file_meta["rng_python"] = json.dumps(random.getstate())
    if "numpy" in sys.modules:  # only when the program uses numpy; never imported for this
        kind, keys, position, has_gauss, cached = sys.modules["numpy"].random.get_state()
        tensors["rng/numpy"] = torch.from_numpy(keys.astype("int64"))
        file_meta["rng_numpy"] = json.dumps([kind, int(position), int(has_gauss), float(cached)])


def _engine_state(engine, views: list[ParamView]) -> dict:
    name_of = {id(v.opt_param): v.info.name for v in views if v.opt_param is not None}
    groups = [dict({k: val for k, val in g.items() if k != "params"}, params=[name_of[id(p)] for p in g["params"]])
              for g in engine.optimizer.optimizer.param_groups]
    return {
        "param_groups": groups,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
    }


def torch_save(path: str, obj) -> FileDigest:
    with open(path, "xb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    nbytes, digest = sha256_of_file(path)
    return FileDigest(os.path.basename(path), nbytes, digest)


def _finish(engine, views, reports, save_dir: str, staging: str, tag: str, save_latest: bool) -> str:
    """Rank 0, once every rank's files are durable: metadata, then the rename, then ``latest``."""
    from .. import __version__

    files = {d.name: {"bytes": d.nbytes, "sha256": d.sha256} for digests, _ in reports for d in digests}
    world = engine.comm.world_size
    meta = CheckpointMeta(
        tag=tag, world_size=world, partition_world_size=1 if engine.stage == 0 else engine.shard_comm.world_size,
        stage=engine.stage,
        compute_dtype=engine.config.compute_dtype_name, params=tuple(v.info for v in views),
        buffers=tuple(info for info, _ in buffer_items(engine.module)),
        state_dict_keys=tuple(state_dict_layout(engine.module)),
        masters=any(v.master is not None for v in views), gradients=reports[0][1],
        optimizer=type(engine.optimizer.optimizer).__name__,
        counters=engine.counters(),
        files=files, config=engine.config.model_dump(mode="json"),
        versions={"zero_engine": __version__, "torch": torch.__version__}, tp_size=engine.mesh.tp_size)
    write_metadata(staging, meta)
    final = publish(save_dir, staging, tag, expected_files={
        name: entry["bytes"] for name, entry in files.items()})
    if save_latest:
        write_latest(save_dir, tag)
    return final
