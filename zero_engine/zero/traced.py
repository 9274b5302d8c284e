"""A traced region: a compiled block whose parameter all-gather and gradient reduce-scatter are functional collectives
inside its own graph (the traced mode of ``engine.compile(traced=True)`` / ``compile: {traced: true}``).

[Note: the traced mode]
Regional compilation (compile.py) gathers a region's parameters in its hooks, eagerly, before the compiled call: the
graph sees whole parameters and no communication, so the compiler cannot move a gather next to the compute it could
hide behind. In the traced mode (torchtitan's SimpleFSDP idea, with our partitioning) the region is not a gather unit
at all: its hooks and the coordinator never touch its parameters. What the compiled graph takes is the region's
*flat shard*: this rank's shards of its parameters, adjacent in one shard bucket (partition.py, [Note: flat shard
storage]; shard buckets are runs of whole units in module order, so a block's shards are one run, or one per shard
bucket it spans when it is larger than ``stage3_prefetch_bucket_size / world``). Inside the graph:

* **Forward**: ``_c10d_functional.all_gather_into_tensor`` of the flat shard, one per region (coalesced), or one per
  parameter with ``stage3_allgather_sequential: true``; then each parameter is its column of the gathered
  ``[world, shard elements]`` rows, unpadded and reshaped (the layout of partition.py: each parameter padded to
  ``world * ceil(numel / world)`` and split evenly). The module runs on those tensors, put in place of its
  parameters for the call (``torch.nn.utils.stateless._reparametrize_module``, which Dynamo traces).
* **Backward**: the autograd leaf is the flat shard itself (a tensor aliasing the shards' storage, so optimizer
  steps, checkpoint loads and ``GatheredParameters`` edits, which all write the shards in place, are what the next
  forward gathers). The gather's backward is its reduce-scatter, averaged over the shard group in the reduction dtype
  (``communication_data_type``: fp32 unless set), as the eager reducer averages (grads.py; gloo runs the
  reduce-scatter as an all-reduce of the whole gradient and keeps this rank's slice: twice the bytes of NCCL's, as
  in eager mode, [Note: gloo's reduce-scatter is an all-reduce of a copy] in comm/_backend.py). The leaf's gradient
  is this rank's reduced gradient shard; a hook hands it to the reducer's bucket of this region
  (``GradReducer.add_reduced``), where the optimizer, the gradient norm, clipping and checkpoints find it as they
  find every other gradient shard. Under MiCS / HSDP (zero_engine/mesh.py) the graph's collectives run over the
  shard group, and the reducer averages the accumulated shard across replicas in the window's last pass, as it does
  an eager bucket's ([Note: gradients across replicas] in grads.py).
* **Memory**: the gathered parameters must not live from forward to backward (that would keep every block's whole
  parameters: ZeRO-3 undone). The gather is wrapped in selective activation checkpointing whose policy is
  ``MUST_RECOMPUTE``: AOTAutograd's partitioner never saves the gathered tensors, and the backward graph gathers
  again what it reads (per flat shard and step: 2 all-gathers and 1 reduce-scatter, as eager ZeRO-3; sequential
  gathering skips the backward gather of a parameter backward does not read, a Linear's bias). The compiler decides
  the buffers:
  the transient cost is one region's parameters (coalesced) or less (sequential), plus what Inductor's reordering
  keeps alive to overlap.

What it buys: Inductor may bucket and reorder those collectives around the region's compute (e.g.
``torch._inductor.config.reorder_for_compute_comm_overlap``) on a backend with asynchronous collectives (NCCL).
What it costs: the region's communication is no longer the engine's (no prefetch across regions by the
coordinator, not counted in ``comm_stats()`` or in ``params_gathered``), and every rank must run every region in
the same order (a collective inside a graph cannot be skipped on one rank). Measured on 2 CPU cores with gloo it
was slower than the regional compile (docs/benchmarks.md, "The traced mode (issue 23)").

Dynamo sees the same things on every call: the flat shards (one shape per block shape; they keep their storage), the
layout constants and the module's class, so blocks of one shape share one graph and nothing recompiles after the
first step. torch logs once that a ``context_fn`` was passed to ``torch.utils.checkpoint`` under compile and asks
for no in-place op in the region: the checkpointed part is the gather alone, which has none.

The flat shards are marked static (``torch._dynamo.mark_static``): their sizes are constants of the graph, as the
layout already is. Dynamo would otherwise make them symbolic once it recompiled the region for another size (seen
with a second model traced in the same process), and the partitioner then gathered a flat shard again in backward
only to read the gathered tensor's size: a collective more per region and backward, never waited for, so torch's
registry of unwaited work kept one a step with its buffers, for the life of the process
(test_a_second_model_traced_in_one_process_gathers_once_and_leaves_no_collective_unwaited). Activations keep
Dynamo's automatic dynamic shapes (a sequence length that changes does not recompile every step).

[Note: a traced region without gradients runs eagerly]
A forward without gradients (an evaluation, ``generate``) runs the region eagerly: the same functional all-gather of
its flat shards, outside any graph (an eager functional collective is waited where its result is first read), then
the module on the whole parameters, which are dropped as the call returns. It used to compile a second graph, the
region's inference graph, and with Inductor on gloo a rank then died of a heap corruption (glibc: "malloc():
unaligned tcache chunk detected", SIGABRT) in the first forward after it: 3 of 9 runs of a bench/combinations.py
draw at world 4 (bf16, an evaluation forward after step 1), and the crashes that had `generate()` on a traced model
refused (2 of 12, then 1 of 12 runs). Run eagerly, the same draw ran 8 times of 8 without it, and a traced Llama
that generates between steps 6 of 6 (docs/benchmarks.md, "The traced mode without gradients"). Which part of the
compiled inference graph corrupts the heap is not found; an evaluation and a generation are the cheap part of
training, so they give up compilation (and its compile time, and generate's recompilations per cache length) rather
than risk a rank.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .._profiling import profile_range
from .partition import ShardedParam
from .unit import release_unused

__all__ = ["TracedRegion", "is_traced", "traced_modules"]


def is_traced(module: nn.Module) -> bool:
    """``module`` is the root of a traced region (units.py leaves its subtree out of every gather unit)."""
    return isinstance(getattr(module, "_compiled_call_impl", None), TracedRegion)


def traced_modules(root: nn.Module) -> set[int]:
    """ids of every module inside a traced region of ``root`` (their parameter reads are not watched: external.py)."""
    return {id(m) for r in root.modules() if is_traced(r) for m in r.modules()}


# torch 2.13 renamed the functional collectives' *_tensor to *_single; the old names warn when called eagerly (a region
# without gradients: see the Note above), so the new ones where torch has them
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


class _GatherShard(torch.autograd.Function):
    """All-gather of a flat shard; backward: the reduce-scatter of its gradient, averaged (see [Note: the traced
    mode])."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, group_name: str, reduce_dtype: torch.dtype) -> torch.Tensor:
        ctx.group_name, ctx.reduce_dtype = group_name, reduce_dtype
        return _all_gather(shard, 0, group_name)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        reduced = _reduce_scatter(grad.to(ctx.reduce_dtype).contiguous(), "avg", 0, ctx.group_name)
        return reduced, None, None  # autograd casts it to the shard's dtype


def _recompute(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


def _recompute_gathers():
    """Selective checkpointing of the gather: nothing of it is saved for backward (see [Note: the traced mode])."""
    return create_selective_checkpoint_contexts(_recompute)


_PIECE = "_zero_engine_piece"  # a piece's leaf holds its piece under this name (TracedRegion.hook_gradients)


def _hand_gradient_to_piece(leaf: torch.Tensor) -> None:
    piece = leaf.__dict__[_PIECE]
    piece.on_grad(piece)


class _Piece:
    """A run of a region's parameters whose shards are adjacent in one shard bucket: one flat shard, one collective
    when coalesced."""

    def __init__(self, params: list[ShardedParam]):
        self.params = params
        base = params[0].bucket_offset
        self.starts = [p.bucket_offset - base for p in params]  # each shard's offset in the flat shard
        self.numel = sum(p.shard_numel for p in params)
        flat = params[0].bucket.flat[base: base + self.numel]
        # the autograd leaf: a detached alias of the shards (same storage; in-place writes to them are seen here)
        self.leaf = flat.detach().requires_grad_(any(p.param.requires_grad for p in params))
        self.bucket = None  # the reducer's bucket of its trainable parameters (GradReducer.reduce_in_graph)
        self.hook = None
        self.on_grad = None  # what its leaf's gradient hook calls (TracedRegion.hook_gradients)


def _pieces(params: list[ShardedParam]) -> list[_Piece]:
    ordered = sorted(params, key=lambda p: (p.bucket.index, p.bucket_offset))
    runs: list[list[ShardedParam]] = []
    for p in ordered:
        last = runs[-1][-1] if runs else None
        if last is not None and last.bucket is p.bucket and last.bucket_offset + last.shard_numel == p.bucket_offset:
            runs[-1].append(p)
        else:
            runs.append([p])
    return [_Piece(run) for run in runs]


class TracedRegion:
    """One traced region: its module's call is the compiled graph over its flat shards (see [Note: the traced
    mode]). Installed as the module's compiled call (what ``Module.compile()`` sets), so the module stays where it
    is in the model, with its parameters, names and state dict."""

    def __init__(self, name: str, module: nn.Module, params: list[ShardedParam], names: dict[int, list[str]],
                 group_name: str, sequential: bool, reduce_dtype: torch.dtype, compile_kwargs: dict):
        """``names``: id(param) -> every name it has in ``module`` (a weight tied inside the region has two)."""
        self.name = name
        self.module = module
        self.params = params
        self.group_name = group_name
        self.sequential = sequential
        self.reduce_dtype = reduce_dtype
        self.world = params[0].world_size
        self.pieces = _pieces(params)
        # what the graph reads, as constants: per piece and parameter, (its names, numel, shape, start in the flat
        # shard, shard numel)
        self.layout = [[(tuple(names[id(p.param)]), p.numel, tuple(p.shape), start, p.shard_numel)
                        for p, start in zip(piece.params, piece.starts)] for piece in self.pieces]
        self.leaves = [piece.leaf for piece in self.pieces]
        for leaf in self.leaves:  # sizes fixed in the graph (see [Note: the traced mode], last paragraph)
            torch._dynamo.mark_static(leaf)
        self._compiled = torch.compile(self._run, **compile_kwargs)
        module._compiled_call_impl = self  # see Module._wrapped_call_impl

    def __repr__(self) -> str:
        return f"TracedRegion({self.name}, {len(self.params)} params, {len(self.pieces)} flat shard(s))"

    def __call__(self, *args, **kwargs):
        with profile_range("zero3::traced", self.name):  # its gathers and compute, named in a profiler trace
            if not torch.is_grad_enabled():  # see [Note: a traced region without gradients runs eagerly]
                return self._call_with(self._unshard(*self.leaves), args, kwargs)
            return self._compiled(self.leaves, args, kwargs)

    # ---- what the graph runs -----------------------------------------------------------------------------------
    def _run(self, leaves: list[torch.Tensor], args, kwargs):
        whole = checkpoint(self._unshard, *leaves, use_reentrant=False, context_fn=_recompute_gathers)
        return self._call_with(whole, args, kwargs)

    def _call_with(self, whole: list[list[torch.Tensor]], args, kwargs):
        """The module's forward on the whole parameters ``_unshard`` made."""
        tensors = {}
        for piece_layout, piece_whole in zip(self.layout, whole):
            for (names, *_), tensor in zip(piece_layout, piece_whole):
                for name in names:
                    tensors[name] = tensor
        with _reparametrize_module(self.module, tensors):
            return self.module._call_impl(*args, **kwargs)

    def _unshard(self, *leaves: torch.Tensor) -> list[list[torch.Tensor]]:
        """Every parameter whole, from the flat shards: one all-gather per flat shard, or per parameter when
        sequential."""
        out = []
        for leaf, piece_layout in zip(leaves, self.layout):
            tensors = []
            if self.sequential or len(piece_layout) == 1:
                for _, numel, shape, start, shard_numel in piece_layout:
                    full = _GatherShard.apply(leaf[start: start + shard_numel], self.group_name, self.reduce_dtype)
                    tensors.append(full[:numel].view(shape))
            else:
                rows = _GatherShard.apply(leaf, self.group_name, self.reduce_dtype).view(self.world, -1)
                for _, numel, shape, start, shard_numel in piece_layout:  # a column of the rows (partition.py)
                    tensors.append(rows[:, start: start + shard_numel].reshape(-1)[:numel].view(shape))
            out.append(tensors)
        return out

    # ---- gradients ----------------------------------------------------------------------------------------------
    def hook_gradients(self, on_grad) -> None:
        """``on_grad(piece)`` once the leaf of a piece has its gradient (this rank's reduced shard) in a backward. The
        hook finds its piece in the leaf's ``__dict__``, as the parameters' gradient hook finds its reducer ([Note: one
        call per gradient] in grads.py): a hook holding the piece would be a cycle the collector never frees."""
        for piece in self.pieces:
            if piece.leaf.requires_grad:
                piece.on_grad = on_grad
                piece.leaf.__dict__[_PIECE] = piece
                piece.hook = piece.leaf.register_post_accumulate_grad_hook(_hand_gradient_to_piece)

    def remove(self) -> None:
        """Back to a plain module (``engine.destroy()``): no compiled call, no gradient hooks."""
        for piece in self.pieces:
            if piece.hook is not None:
                piece.hook.remove()
        if self.module._compiled_call_impl is self:
            self.module._compiled_call_impl = None


def trace_regions(engine, regions: list[tuple[str, nn.Module]], compile_kwargs: dict) -> list[TracedRegion]:
    """Make each region a traced region of ``engine`` (see ``ZeroEngine.compile(traced=True)``)."""
    by_param = {id(sp.param): sp for sp in engine.sharded}
    traced = []
    sequential = engine.config.zero_optimization.allgather_sequential is True
    for name, module in regions:
        names: dict[int, list[str]] = {}
        for pname, p in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(pname)
        params = [by_param[pid] for pid in names]
        if not params:
            continue
        for sp in params:
            sp.is_persistent = False  # gathered inside the graph only: never kept whole, never refreshed
        traced.append(TracedRegion(name, module, params, names, engine.shard_comm.group.group_name, sequential,
                                   engine.communication_data_type, compile_kwargs))
    return traced


def connect(engine, traced: list[TracedRegion]) -> None:
    """The reducer's buckets for the regions' gradients, the gradient hooks, and the regions' parameters released
    (made units again without them: compile.py calls build_gathering after this)."""
    pieces = [piece for region in traced for piece in region.pieces if piece.leaf.requires_grad]
    buckets = engine.reducer.reduce_in_graph([[p for p in piece.params if p.param.requires_grad]
                                              for piece in pieces])
    for piece, bucket in zip(pieces, buckets):
        piece.bucket = bucket
    for region in traced:
        region.hook_gradients(partial(_on_grad, engine))
        release_unused(region.params)  # the release rule (unit.py): whole, unused and not held by a user


def _on_grad(engine, piece: _Piece) -> None:
    engine.backward_end.queue_if_needed()
    starts = [start for p, start in zip(piece.params, piece.starts) if p.param.requires_grad]
    engine.reducer.add_reduced(piece.bucket, piece.leaf.grad, starts)
    piece.leaf.grad = None


def refuse_unsupported(engine, regions) -> None:
    """What the traced mode does not support yet, each named (the config's part is config/models.py's
    ``traced_conflict``)."""
    from ..config.models import traced_conflict

    conflict = traced_conflict(engine.config)
    if conflict is not None:
        raise NotImplementedError(f"compile.traced (engine.compile(traced=True)): {conflict}")
    what = None
    if engine.mesh.tp_size > 1:
        what = f"tensor parallelism ({engine.mesh.describe()})"
    elif engine.shard_groups:
        what = "MoE expert parallelism (parameters marked allreduce=False)"
    if what is not None:
        raise NotImplementedError(f"{what} is not supported yet with compile.traced (engine.compile(traced=True)); "
                                  "drop one of the two (engine.compile() without traced compiles the same regions "
                                  "with eager gathers)")
    from .external import registered_external_parameters

    region_of = {}
    for name, module in regions:
        for sub_name, sub in module.named_modules(prefix=name):
            if registered_external_parameters(sub):
                raise NotImplementedError(
                    f"compile.traced: {sub_name} has external parameters registered (register_external_parameter): "
                    "reads of parameters outside a region are not supported yet with compile.traced; compile a "
                    "module that contains the parameter's owner too, or drop traced")
        for p in module.parameters():
            region_of[id(p)] = name
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        owner = region_of.get(id(p))
        if owner is not None and not (name == owner or name.startswith(owner + ".")):
            raise NotImplementedError(
                f"compile.traced: the region {owner} shares a parameter with {name}, outside it (a tied weight): a "
                "traced region must own its parameters, and this is not supported yet with compile.traced; untie "
                "them, or compile without traced")
