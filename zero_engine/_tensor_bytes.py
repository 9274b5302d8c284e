"""The bytes of a host tensor as a writable memoryview, without a copy and without numpy.

[Note: numpy pins a storage's size]
``tensor.numpy()`` marks the tensor's storage non-resizable for good (numpy may hold the pointer), so a later
``untyped_storage().resize_(...)`` raises "Trying to resize storage that is not resizable". zero_engine resizes
storages to free memory without invalidating the tensors that alias them: ``ShardedParam.release`` frees gathered
parameters, and NVMe parameter offload frees whole shard buckets between uses (offload/param_swap.py). File I/O on
shards (checkpoints, Hugging Face loading and saving) therefore goes through :func:`tensor_bytes`, a ctypes view of
the memory that keeps the tensor alive as long as the view and leaves the storage as it was.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["tensor_bytes"]


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory; see [Note: numpy pins a storage's size]."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"tensor_bytes needs a contiguous CPU tensor, got {tensor.device} "
                         f"contiguous={tensor.is_contiguous()}")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    array_type = type("_TensorBytes", (ctypes.c_char * nbytes,), {})  # a subclass can carry the owner below
    array = array_type.from_address(tensor.data_ptr())
    array.owner = tensor  # the view keeps the array, the array keeps the tensor (and its memory) alive
    return memoryview(array).cast("B")
