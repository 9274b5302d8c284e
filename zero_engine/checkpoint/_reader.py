"""Reading a saved checkpoint: verification, and any element range of any parameter at any world size.

Shared by the collective load (each rank reads the range its new shard covers) and the offline tools (which read
whole parameters one at a time). Files are opened read-only: loading never modifies a checkpoint.
"""

from __future__ import annotations

import json
import os

import torch

from ._errors import CheckpointError
from ._metadata import CheckpointMeta, rank_file_name, read_metadata
from ._partition import pieces
from ._tensorfile import TensorFile, sha256_of_file

__all__ = ["CheckpointReader", "verify_files"]


def verify_files(directory: str, meta: CheckpointMeta, names: list[str] | None = None) -> None:
    """Check size and SHA-256 of ``names`` (default: every file the metadata lists); raise naming the first bad one."""
    expected_ranks = {rank_file_name(r) for r in range(meta.world_size)}
    unlisted = sorted(expected_ranks - set(meta.files))
    if unlisted:
        raise CheckpointError(f"{os.path.join(directory, 'metadata.json')} lists no entry for {', '.join(unlisted)}"
                              f" although the checkpoint was saved on {meta.world_size} ranks")
    for name in sorted(meta.files) if names is None else names:
        path = os.path.join(directory, name)
        expected = meta.files[name]
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing (metadata.json lists it with {expected['bytes']} bytes)") \
                from None
        if size != expected["bytes"]:
            raise CheckpointError(f"{path} is truncated or damaged: {size} bytes, metadata.json says "
                                  f"{expected['bytes']}")
        _, digest = sha256_of_file(path)
        if digest != expected["sha256"]:
            raise CheckpointError(f"{path} is corrupt: its SHA-256 is {digest[:16]}..., metadata.json says "
                                  f"{expected['sha256'][:16]}... (bit flip or partial overwrite)")


class CheckpointReader:
    """Lazily opened rank files of one checkpoint directory.

    ``tp_rank``: which tp rank's pieces to read from a checkpoint of a tensor-parallel model; its files read as a
    flat checkpoint over the data-parallel ranks ([Note: checkpoints of a tensor-parallel model] in _metadata.py).
    Required for such a checkpoint (whole parameters are not put together from tp pieces here); 0 or None without tp.
    """

    def __init__(self, directory: str, meta: CheckpointMeta | None = None, tp_rank: int | None = None):
        self.directory = directory
        self.meta = meta if meta is not None else read_metadata(directory)
        tp_size = self.meta.tp_size
        if tp_rank is None and tp_size > 1:
            raise NotImplementedError(
                f"{directory} is a checkpoint of a tensor-parallel model (tp size {tp_size}): its files hold each tp "
                "rank's pieces of the split parameters, and putting whole parameters together from them offline is "
                "not supported yet. Load it with engine.load_checkpoint at the same tp size, then write whole "
                "tensors with zero_engine.hf.save_pretrained or engine.save_16bit_model")
        if not 0 <= (tp_rank or 0) < tp_size:
            raise CheckpointError(f"{directory}: no tp rank {tp_rank} in a checkpoint of tp size {tp_size}")
        self.tp_rank = tp_rank or 0
        self._files: dict[int, TensorFile] = {}
        self._state_keys: dict[str, dict[str, list[str]]] | None = None

    def file(self, rank: int) -> TensorFile:
        """The file of data-parallel rank ``rank`` of this reader's tp rank (world rank ``rank`` without tp)."""
        if rank not in self._files:
            ranks = self.meta.world_size // self.meta.tp_size
            if not 0 <= rank < ranks:
                raise CheckpointError(f"{self.directory}: no rank {rank} in a checkpoint of {ranks}")
            path = os.path.join(self.directory, rank_file_name(rank * self.meta.tp_size + self.tp_rank))
            try:
                self._files[rank] = TensorFile(path)
            except FileNotFoundError:
                raise CheckpointError(f"{path} is missing") from None
        return self._files[rank]

    def has(self, kind: str, name: str) -> bool:
        return f"{kind}/{name}" in self.file(0)

    def read_range(self, kind: str, name: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Elements ``[start, stop)`` of the flattened ``kind`` tensor of parameter ``name`` into flat ``out``."""
        info = self.meta.param(name)
        if out.numel() != stop - start:
            raise AssertionError(f"{name}: {out.numel()} elements of room for range [{start}, {stop})")
        for piece in pieces(info.numel, info.shard_numel, start, stop, info.ep_size):
            self.file(piece.rank).read_range_into(f"{kind}/{name}", piece.src_start,
                                                  out[piece.dst_start: piece.dst_start + piece.length])

    def read_whole(self, kind: str, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole parameter, in its shape, as ``dtype`` (default: as saved)."""
        info = self.meta.param(name)
        saved = self.file(0).entry(f"{kind}/{name}").dtype
        out = torch.empty(info.numel, dtype=dtype or saved)
        self.read_range(kind, name, 0, info.numel, out)
        return out.view(info.shape)

    def state_keys(self, name: str) -> dict[str, list[str]]:
        """Saved optimizer state of a parameter: {"optim": sharded keys, "optim_scalar": per-parameter scalars}."""
        if self._state_keys is None:
            index: dict[str, dict[str, list[str]]] = {}
            for entry in self.file(0).entries:
                kind, _, rest = entry.partition("/")
                if kind in ("optim", "optim_scalar"):
                    key, _, param = rest.partition("/")
                    index.setdefault(param, {"optim": [], "optim_scalar": []})[kind].append(key)
            self._state_keys = index
        return self._state_keys.get(name, {"optim": [], "optim_scalar": []})

    def optimizer_values(self) -> dict[str, dict]:
        """Non-tensor optimizer state values (rare: most optimizers keep tensors), by parameter name."""
        return json.loads(self.file(0).metadata.get("optim_values", "{}"))

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
