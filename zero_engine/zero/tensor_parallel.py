"""What a ``tp`` mesh dim means to ZeRO: parameters that are DTensors split over it keep being DTensors for the
model's forward; ZeRO shards each one's *local* tensor over the data-parallel ranks, as it shards a plain tensor.

    mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(block, mesh["tp"], {"mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})
    engine, *_ = zero_engine.initialize(model=model, config=cfg, mesh=mesh)

[Note: the local tensor is the parameter's data]
A DTensor parameter is a wrapper around ``_local_tensor`` (this rank's TP piece, e.g. rows 64..127 of a
ColwiseParallel weight); every op on it runs on that local tensor. So ZeRO treats the local tensor as "the
parameter's data": its shape and numel are the local ones, ``ShardedParam.full`` is the local tensor's storage
(released and re-gathered over dp exactly like a plain parameter's), and the DTensor wrapper -- its identity, its
placements, its global shape -- never changes. DTensor placements belong to torch: nothing here redistributes a
weight. The one redistribution is torch's own, of a gradient whose placement differs from its parameter's
(a Partial gradient of a Replicate bias, as FSDP2 does in ``_get_grad_inner_tensor``). A DTensor parameter keeps
its class (ZeroParameter's read check is for plain parameters): while released its local tensor holds no elements,
so read it outside the model's forward inside GatheredParameters, as any partitioned parameter.

[Note: the global gradient norm with tp]
After the dp reduce-scatter each dp rank holds the averaged gradient shards of its tp rank's local tensors. A
parameter split over tp (a Shard placement) holds different values on each tp rank: every one counts. A parameter
replicated over tp (a plain tensor, or a DTensor with a Replicate placement) holds the same values on every tp rank:
only tp rank 0 counts it. Replicas of a hierarchical mesh (dp_replicate) hold the same shards: only replica 0
counts. Then one all-reduce of the summed squares over the world is the norm of the whole model, each value once.

[Note: compiled blocks with DTensor parameters]
torch.compile of a tp block works at every stage with nothing tp-specific (tests/test_tensor_parallel.py, the
compiled cases): Dynamo guards a DTensor parameter by its type, its ``_spec`` (mesh, placements, global shape) and
its ``_local_tensor``'s dtype, size, stride and requires_grad (seen with TORCH_LOGS=guards). ZeRO changes none of
them inside a compiled call: the wrapper and its spec never change (above), the local tensor keeps its identity
(gather and release swap its ``.data``), and the compiled block is one unit (compile.py), gathered before its
compiled call, so the local tensor always has its whole local shape there. parallelize_module's input/output hooks
and DTensor's collectives over tp trace into the block's graph (torchtitan's FSDP2 + TP + compile, with FSDP2's
all-gathers outside the graph as ours are).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["is_dtensor", "local_of", "local_grad", "match_local_dtype", "grad_from_local", "splits_over_tp",
           "check_tp_params", "norm_counted"]


def is_dtensor(tensor) -> bool:
    return isinstance(tensor, DTensor)


def local_of(param: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage ZeRO manages: a DTensor's local piece, a plain parameter itself (see [Note: the local
    tensor is the parameter's data])."""
    return param._local_tensor if isinstance(param, DTensor) else param


def local_grad(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient as a tensor of the parameter's local shape: a DTensor gradient is first brought to its
    parameter's placements (torch's redistribution: a Partial gradient is summed over tp)."""
    if not isinstance(grad, DTensor):
        return grad
    if grad.placements != param.placements:
        grad = grad.redistribute(param.device_mesh, param.placements)
    return grad._local_tensor


def match_local_dtype(param: torch.Tensor) -> None:
    """Make a DTensor parameter report its local tensor's dtype, once ZeRO has cast that tensor; the same Python
    object (what the module, the optimizer and the user hold), its attributes kept.

    [Note: a DTensor parameter's dtype] A DTensor is a wrapper whose dtype is fixed when it is made, and ZeRO's cast
    to bf16/fp16 changes the local tensor's ``.data`` only. Left so, the wrapper says fp32 around a 16-bit tensor:
    autograd casts each gradient to the dtype its parameter reports (fp32 DTensor gradients beside 16-bit plain
    ones: one unit's copy-in needs one dtype), and Dynamo's fake copy of the parameter fails its metadata check
    (``torch.float32 != torch.bfloat16``), so a compiled tp block did not run. A wrapper of the new dtype around
    the same local storage takes its place in the same object (``torch.utils.swap_tensors``, as
    ``nn.Module._apply`` changes a parameter's dtype in place); its local tensor is a new tensor object, which
    ``ShardedParam.local`` then points to."""
    if not isinstance(param, DTensor) or param.dtype == param._local_tensor.dtype:
        return
    retyped = DTensor.from_local(param._local_tensor, param.device_mesh, param.placements, run_check=False,
                                 shape=param.shape, stride=param.stride())
    retyped = nn.Parameter(retyped, requires_grad=param.requires_grad)
    retyped.__dict__.update(param.__dict__)
    try:
        torch.utils.swap_tensors(param, retyped)
    except RuntimeError as error:
        raise RuntimeError(f"a DTensor parameter of shape {tuple(param.shape)} could not take its new dtype "
                           f"{retyped.dtype} in place ({error}); hand initialize() the model before anything keeps "
                           "a weak reference to its parameters (torch.compile it after initialize)") from error


def grad_from_local(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The inverse of ``local_grad``: a gradient for ``param`` from a tensor of its local shape (a DTensor with the
    parameter's placements for a DTensor parameter; ``local`` itself otherwise)."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def splits_over_tp(param: torch.Tensor) -> bool:
    """Holds different values on each tp rank (a Shard placement); False: the same on all (replicated)."""
    return isinstance(param, DTensor) and any(not isinstance(p, Replicate) for p in param.placements)


def check_tp_params(named_params, tp_mesh) -> None:
    """Every DTensor parameter lives on the mesh's ``tp`` dim and is split evenly: clear errors naming it, not a
    wrong result later. ``tp_mesh``: the engine mesh's tp submesh, or None when the mesh has no tp dim."""
    for name, param in named_params:
        if not isinstance(param, DTensor):
            continue
        if tp_mesh is None:
            raise ValueError(
                f"{name} is a DTensor (placements {param.placements} on mesh {param.device_mesh}) but initialize got "
                "no mesh with a \"tp\" dim; pass mesh=init_device_mesh(device, (dp, tp), mesh_dim_names=(\"dp\", "
                "\"tp\")) and parallelize the model over mesh[\"tp\"]")
        if param.device_mesh != tp_mesh:
            raise ValueError(
                f"{name} is a DTensor on mesh {param.device_mesh} (dims {param.device_mesh.mesh_dim_names}), not on "
                f"the tp dim of the mesh given to initialize ({tp_mesh}); parallelize the model over mesh[\"tp\"] of "
                "that same mesh")
        for placement in param.placements:
            if placement.is_shard():
                dim, size = placement.dim, param.shape[placement.dim]
                if size % tp_mesh.size():
                    raise ValueError(
                        f"{name}: tp size {tp_mesh.size()} does not divide its dim {dim} of size {size} (shape "
                        f"{tuple(param.shape)}, placement {placement}); uneven tensor-parallel splits are not "
                        "supported yet: use a tp size that divides the features (or heads), or pad the layer")


def norm_counted(sharded, mesh) -> "set[int] | None":
    """Ids of the ShardedParams whose gradient shards this rank adds to the global norm's sum over the world; None
    without tp (every shard, summed over the shard group). See [Note: the global gradient norm with tp]."""
    if mesh.tp_size == 1:
        return None
    if mesh.replicate_rank != 0:
        return set()
    return {id(sp) for sp in sharded if mesh.tp_rank == 0 or splits_over_tp(sp.param)}

