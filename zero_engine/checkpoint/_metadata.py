"""The checkpoint's metadata file and directory layout: what was saved, how it is partitioned, how to verify it.

    <save_dir>/latest                   the tag of the newest complete checkpoint (written last, atomically)
    <save_dir>/<tag>/metadata.json      this file: format version, world size, stage, dtypes, every parameter's name,
                                        shape, numel and partitioning, config, step counters, each file's size and
                                        SHA-256, and a checksum of the metadata itself
    <save_dir>/<tag>/rank_00000.safetensors ...   one per rank: parameter shards (compute dtype), fp32 master shards,
                                        optimizer-state shards, gradient-accumulation state, RNG states
    <save_dir>/<tag>/engine_state.pt    rank 0: optimizer hyper-parameters, LR scheduler, loss scaler (no user code)
    <save_dir>/<tag>/client_state.pt    rank 0: the user's client_state, when one was given

Tensor names inside a rank file: ``param/<fqn>``, ``master/<fqn>``, ``optim/<key>/<fqn>`` (sharded like the
master), ``optim_scalar/<key>/<fqn>`` (rank 0; e.g. Adam's step), ``grad/<fqn>`` (stages 2-3, reduced shards),
``local_grad/<fqn>`` (stages 0-1, this rank's unreduced gradient), ``buffer/<name>`` (rank 0), ``rng/torch``,
``rng/cuda`` (the rank's own device's state, with CUDA), ``rng/numpy``.

[Note: checkpoints of a tensor-parallel model]
With a ``tp`` mesh dim (tp_size > 1 in the metadata), the tp ranks hold different local pieces of the parameters
split by parallelize_module, and ZeRO shards each piece over the data-parallel ranks. Every rank still writes
``rank_<world rank>``; with tp innermost (world rank = dp rank x tp_size + tp rank), the files of tp rank ``t`` --
``rank_<d * tp_size + t>`` for data-parallel rank ``d`` -- are a flat checkpoint of their own over the dp ranks:
the shards of ``t``'s local pieces (written by replica 0), and in dp rank 0's file the per-parameter scalars, the
non-tensor optimizer values and the buffers, as rank 0 writes them without tp. Parameter shapes in the metadata are
the local ones (the same on every tp rank: uneven splits are refused). So loading reads, per tp rank, exactly as a
flat checkpoint is read (CheckpointReader with ``tp_rank``), at any dp size; the tp size must be the same. A
checkpoint without tp has no ``tp_size`` entry (files unchanged from before tp existed).

[Note: checkpoints of expert parameters]
An MoE expert parameter (zero/expert.py) is a different tensor on each of its ep ranks (their experts) and is sharded
over its expert-data-parallel (edp) group. The checkpoint holds it as one tensor: its ep ranks' local tensors
concatenated along dim 0 in ep-rank order, which for zero_engine.moe's stacked ``[local experts, ...]`` weights is
the ``[num_experts, ...]`` weight of the model with every expert on every rank. ``ParamInfo`` gives that global shape
and ``ep_size``; ``shard_numel`` is the shard of one ep rank's piece over its edp ranks, and world rank ``r`` (ep rank
``r % ep_size``, edp rank ``r // ep_size``: [Note: expert-parallel rank layout] in moe.py) writes its own shard, so
every rank's file holds its expert shards and no rank writes another's. Readers go through _partition.pieces, which
maps any range of the global tensor to those files: the offline tools (to-fp32, to_dcp) see whole
``[num_experts, ...]`` tensors, and a load reads the range of the global tensor its rank holds, at another world size
or another ep size alike (an engine at ep size 1 holds every expert: a dense parameter). A parameter without
``ep_size`` in the file is plain (checkpoints without experts are unchanged).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field

import torch.nn as nn

from ._errors import CheckpointError

__all__ = ["FORMAT", "VERSION", "METADATA_FILE", "LATEST_FILE", "ENGINE_STATE_FILE", "CLIENT_STATE_FILE",
           "rank_file_name", "ParamInfo", "BufferInfo", "CheckpointMeta", "read_metadata", "write_metadata",
           "state_dict_layout", "check_params_match", "check_buffers_match"]

FORMAT = "zero_engine.checkpoint"
VERSION = 1
METADATA_FILE = "metadata.json"
LATEST_FILE = "latest"
ENGINE_STATE_FILE = "engine_state.pt"
CLIENT_STATE_FILE = "client_state.pt"

# How every parameter is partitioned; stated in the file so that it is self-describing.
LAYOUT = ("flat: each parameter is flattened, zero-padded to shard_numel * partition_world_size elements and cut "
          "into equal shards; rank r holds elements [r * shard_numel, (r + 1) * shard_numel)")

GRADS_NONE = "none"  # saved at an accumulation boundary
GRADS_SHARDED = "sharded"  # stages 2-3 mid-accumulation: reduced gradient shards, resharded like parameters
GRADS_LOCAL = "local"  # stages 0-1 mid-accumulation: each rank's own unreduced gradients (same world size only)


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


@dataclass(frozen=True)
class ParamInfo:
    name: str  # fully qualified name (the first one, for a tied parameter)
    shape: tuple[int, ...]
    numel: int
    shard_numel: int  # elements per saved shard, padding included: ceil(numel / partition_world_size)
    dtype: str  # the saved shard's dtype (the compute dtype for floating-point parameters)
    requires_grad: bool
    ep_size: int = 1  # the ep pieces of an expert parameter: see [Note: checkpoints of expert parameters]


@dataclass(frozen=True)
class BufferInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class CheckpointMeta:
    tag: str
    world_size: int  # ranks that saved (one rank file each)
    partition_world_size: int  # ranks the parameters are split over: world_size, or 1 at stage 0 (replicated)
    stage: int
    compute_dtype: str  # "fp32", "bf16" or "fp16"
    params: tuple[ParamInfo, ...]
    buffers: tuple[BufferInfo, ...]
    state_dict_keys: tuple[tuple[str, str, str], ...]  # (key, "param" | "buffer", name it aliases) in module order
    masters: bool  # separate fp32 master shards were saved (16-bit training)
    gradients: str  # GRADS_NONE, GRADS_SHARDED or GRADS_LOCAL
    optimizer: str  # class name of the torch optimizer
    counters: dict  # ZeroEngine.counters(): the step counters and the accumulation window's place
    files: dict  # file name -> {"bytes": n, "sha256": hex}
    config: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    layout: str = LAYOUT
    format: str = FORMAT
    version: int = VERSION
    tp_size: int = 1  # tensor-parallel ranks; see [Note: checkpoints of a tensor-parallel model]

    def param(self, name: str) -> ParamInfo:
        return self._by_name()[name]

    def _by_name(self) -> dict[str, ParamInfo]:
        cache = self.__dict__.get("_param_index")
        if cache is None:
            cache = {p.name: p for p in self.params}
            object.__setattr__(self, "_param_index", cache)
        return cache

    def to_json(self) -> str:
        body = dataclasses.asdict(self)
        body.pop("_param_index", None)
        if body["tp_size"] == 1:  # a checkpoint without tp reads exactly as before tp existed
            del body["tp_size"]
        for param in body["params"]:  # and a parameter that is no expert's as before experts were saved
            if param["ep_size"] == 1:
                del param["ep_size"]
        body["checksum"] = _checksum(body)
        return _one_entry_per_line(body)

    @classmethod
    def from_json(cls, text: str, path: str) -> "CheckpointMeta":
        try:
            body = json.loads(text)
        except json.JSONDecodeError as error:
            raise CheckpointError(f"{path} is corrupt or truncated (not JSON: {error})") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not zero_engine checkpoint metadata (format "
                                  f"{body.get('format') if isinstance(body, dict) else type(body).__name__!r})")
        if body.get("version") != VERSION:
            raise CheckpointError(f"{path}: checkpoint format version {body.get('version')}; this zero_engine reads "
                                  f"version {VERSION}")
        recorded = body.pop("checksum", None)
        if recorded != _checksum(body):
            raise CheckpointError(f"{path} is corrupt: its checksum does not match its content (edited or damaged)")
        try:
            body["params"] = tuple(ParamInfo(**dict(p, shape=tuple(p["shape"]))) for p in body["params"])
            body["buffers"] = tuple(BufferInfo(**dict(b, shape=tuple(b["shape"]))) for b in body["buffers"])
            body["state_dict_keys"] = tuple(tuple(k) for k in body["state_dict_keys"])
            return cls(**body)
        except (KeyError, TypeError) as error:
            raise CheckpointError(f"{path}: metadata is missing or has unexpected fields ({error})") from None


def _one_entry_per_line(body: dict) -> str:
    """JSON a person can read: one top-level key, parameter or file per line."""
    lines = []
    for key, value in body.items():
        if isinstance(value, (list, tuple, dict)) and len(value) > 1 and key != "config":
            items = [json.dumps(v) for v in value] if not isinstance(value, dict) else \
                [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in value.items()]
            opening, closing = ("{", "}") if isinstance(value, dict) else ("[", "]")
            lines.append(f"  {json.dumps(key)}: {opening}\n    " + ",\n    ".join(items) + f"\n  {closing}")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def _checksum(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_metadata(directory: str, meta: CheckpointMeta) -> None:
    path = os.path.join(directory, METADATA_FILE)
    with open(path, "x") as f:
        f.write(meta.to_json())
        f.flush()
        os.fsync(f.fileno())


def read_metadata(directory: str) -> CheckpointMeta:
    path = os.path.join(directory, METADATA_FILE)
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {directory} is not a complete zero_engine checkpoint") from None
    return CheckpointMeta.from_json(text, path)


# ---- the model's names ---------------------------------------------------------------------------------------------
def state_dict_layout(module: nn.Module) -> list[tuple[str, str, str]]:
    """``(key, kind, name)`` for every entry ``module.state_dict()`` would have, without touching any data.

    ``kind`` is "param" or "buffer"; ``name`` is the key the value is stored under: the key itself, or for a tied
    parameter (``lm_head.weight`` is ``wte.weight``) the first name ``named_parameters()`` gives it. Partitioned
    parameters hold no data at stage 3, so this walks the module tree by identity instead of calling state_dict().
    """
    first_name: dict[int, str] = {}
    for name, p in module.named_parameters():
        first_name.setdefault(id(p), name)
    for name, b in module.named_buffers():
        first_name.setdefault(id(b), name)
    out: list[tuple[str, str, str]] = []

    def walk(m: nn.Module, prefix: str) -> None:
        for name, p in m._parameters.items():
            if p is not None:
                out.append((prefix + name, "param", first_name[id(p)]))
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                out.append((prefix + name, "buffer", first_name[id(b)]))
        for name, child in m._modules.items():
            if child is not None:
                walk(child, prefix + name + ".")

    walk(module, "")
    return out


def _listing(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_params_match(meta: CheckpointMeta, current: list[tuple[str, tuple[int, ...]]], path: str,
                       what: str = "parameter") -> None:
    """Raise naming every parameter that is missing, unexpected, or of another shape."""
    saved = {p.name: tuple(p.shape) for p in meta.params} if what == "parameter" else \
        {b.name: tuple(b.shape) for b in meta.buffers}
    now = {name: tuple(shape) for name, shape in current}
    problems = []
    reshaped = [f"{n} is {list(saved[n])} in the checkpoint and {list(now[n])} in the model"
                for n in now if n in saved and saved[n] != now[n]]
    if reshaped:
        problems.append(f"{what} shapes differ: " + "; ".join(reshaped[:6]) +
                        (f" (and {len(reshaped) - 6} more)" if len(reshaped) > 6 else ""))
    missing = [n for n in now if n not in saved]
    if missing:
        problems.append(f"{len(missing)} {what}(s) of the model are not in the checkpoint: {_listing(missing)}")
    unexpected = [n for n in saved if n not in now]
    if unexpected:
        problems.append(f"{len(unexpected)} {what}(s) in the checkpoint are not in the model: "
                        f"{_listing(unexpected)}")
    if problems:
        raise CheckpointError(f"checkpoint {path} does not fit this model: " + ". ".join(problems))


def check_buffers_match(meta: CheckpointMeta, current: list[tuple[str, tuple[int, ...]]], path: str) -> None:
    check_params_match(meta, current, path, what="buffer")
