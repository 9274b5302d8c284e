"""Gradient buckets: full gradients in, this rank's gradient shards out.

Buckets are composed once, from the fixed parameter order (reverse registration order, which is roughly the order
backward produces gradients), never from the order gradients happen to arrive. A bucket is reduce-scattered when
all its parameters have reported, and strictly in bucket order; a parameter that gets no gradient in a backward
(an unused branch) contributes zeros when the pass ends. So every rank issues the same collectives in the same
order whatever its data did.

[Note: gradient buffers]
A bucket's send buffer is allocated with ``empty()`` when its first gradients are copied in and is laid out
``[world, elements per rank]``: row ``r`` holds every parameter's slice owned by rank ``r``, back to back. Each
gradient is copied once into its column of that buffer (``world`` contiguous runs of ``shard_numel``, its padding
zeroed; a unit's gradients together, see [Note: one copy per unit]), and the whole bucket is one reduce-scatter,
which hands each rank its row: its gradient shards back to back, in the order the optimizer reads them. One
collective per bucket whatever its parameters' sizes: a collective costs a fixed ~0.3 ms on gloo
(bench/profile_step.py), and unlike the gather (see [Note: flat shard storage] in partition.py) the column layout
costs no extra copy, as the gradient is copied in either way. A parameter that got no gradient has its column
zeroed when the bucket is launched. A parameter alone in its bucket without padding needs no layout at all: its
gradient is reduced from where autograd put it (``_adopt``).

[Note: gradient buckets are not runs of units]
Shard buckets and optimizer sub-groups are runs of whole gather units (partition.runs); gradient buckets stay
filled to ``reduce_bucket_size`` across unit boundaries. Measured on the demo (examples/configs/zero3.json, world
2): cutting them at unit boundaries made 13 reduce-scatters a step instead of 9 (a bucket that cannot take the next
whole unit launches part-empty), each a fixed ~0.3 ms on gloo, and changed the global gradient norm in its last
bits (the norm is summed per bucket), so the clipped trajectory was no longer bitwise the one before. Both are
costs with nothing bought: a bucket is launched when its last gradient arrives whichever unit that belongs to.

[Note: one copy per unit]
A bucket's parameters are cut into *copy groups*, each the run of its parameters that belong to one gather unit
(``copy_groups``: the units at stage 3; whole buckets at stage 1, where every gradient is there at once; each
parameter alone at stage 2, where nothing bounds a group's gradients but the bucket). A gradient that arrives is
held (``param.grad`` is dropped all the same) until the last gradient of its group arrives; then the group's
gradients go into their columns of the send buffer by one ``torch._chunk_cat`` (each gradient flat, cut into
``world`` rows of ``shard_numel`` and zero-padded: the column layout above), as FSDP2's post-backward copies a
group's gradients into its reduce-scatter input. One op per unit instead of three to five per parameter (views,
copies, padding): the Python and dispatch cost of a backward no longer grows with the number of parameters, and on
CUDA it is one kernel. The price is the memory of the group's gradients held until its last one arrives: at most one
unit's (FSDP2 holds as much), which the same unit's gathered parameters already bound, as they are live together in
its backward. The copy moves values unchanged (a cast to the reduction dtype where it differs, as ``copy_`` does),
buckets and their order are as before, so every reduction and norm is bitwise what the per-parameter copy gave. The
rare cases copy one parameter at a time as before: a group that is not complete when its bucket is launched (a
parameter without gradient this pass, or reduced on its own: [Note: a gradient on some ranks only]) and a second
gradient for a parameter whose group was already copied.

[Note: a gradient after its bucket]
A block applied several times under reentrant checkpointing (each application's backward its own, so autograd
cannot sum them first) gives its parameters gradients after their bucket was reduced. Each is held, as an irregular
one, and reduced on its own at the end of the pass: every rank runs the same graph and issues it.

[Note: buckets of one group]
Each bucket's parameters share one shard group: the reducer's (``comm``: the world when flat), or an MoE expert's
expert-data-parallel group (``ShardedParam.group``, zero/expert.py), whose reduce-scatter runs on that group and is
then scaled (see [Note: gradients of expert weights] in moe.py). A bucket is cut where the group changes, so a
model without experts is bucketed exactly as before.

[Note: gradient shard lifetime]
Reduced gradient shards exist only inside an accumulation window: allocated (``empty``) by the first reduce-scatter
of the window, which writes every element; accumulated into by later micro-steps; consumed by the optimizer step;
freed by ``zero_grad()``. Between a step and the next backward they hold no memory, so the next forward's
activations can use it. ``grad_bytes`` is what exists now; the engine reports the window's peak as ``grads_peak``.

Gradient shards are kept in ``grad_dtype``: fp32 in fp32 training, the 16-bit compute dtype in mixed precision (as
DeepSpeed does: 2 bytes per parameter instead of 4, which is what keeps model states at 16Psi/N); the optimizer
converts them to fp32 one sub-group at a time.

[Note: gradient shards on the host]
Under ``offload_optimizer`` (cpu or nvme) the step runs on the host, so the reducer is given ``grad_device`` (the
CPU; pinned when ``pin_memory``): each bucket's reduce-scatter still runs on the compute device into a transient
receive buffer, and as the bucket completes its shards are copied to the host (asynchronously from pinned memory;
the step synchronises once before it reads them, and ``shard_grads``, through which the helpers and checkpoints read
them, waits for such a copy: ``wait_for_host_copies``) and accumulated there across micro-steps. The device then
holds no gradient shard between buckets. The host shards keep ``grad_dtype``, as the device's would: the values (and
the rounding of the accumulation) are the same with and without offload, which is what makes offload bitwise exact;
CPUAdam converts 16-bit gradients inside its kernel. On a CPU-only machine ``grad_device`` is where the shards
already are and nothing changes (see [Note: host and device on a CPU-only machine] in offload/placement.py).
"""

from __future__ import annotations

import torch

from .grad_buckets import CopyGroup, GradBucket
from .partition import ShardedParam, sharded_param_of
from .tensor_parallel import local_grad

__all__ = ["GradReducer", "hand_gradient_to_reducer"]

MAX_IN_FLIGHT = 2


def hand_gradient_to_reducer(param: torch.Tensor) -> None:
    """Every trainable parameter's post-accumulate-grad hook at stages 2-3: [Note: one call per gradient]."""
    sp = sharded_param_of(param)
    sp.grad_reducer.add(sp, param)


class GradReducer:
    """Reduce-scatters gradients bucket by bucket into this window's gradient shards.

    ``add(p, grad)`` during backward (stages 2 and 3) or for every parameter at the accumulation boundary
    (stage 1); ``finish()`` at the end of each backward pass; ``shard_grad(p)`` is what the optimizer reads;
    ``zero_grad()`` ends the window and frees the shards (see [Note: gradient shard lifetime]).
    """

    def __init__(self, params: list[ShardedParam], comm, bucket_numel: int, reduce_dtype: torch.dtype,
                 grad_dtype: torch.dtype = torch.float32, async_op: bool = True, accounting=None, streams=None,
                 grad_device: torch.device | None = None, pin_memory: bool = False, replicate_comm=None,
                 quantized=None, copy_groups: list[list[ShardedParam]] | None = None, backward_end=None):
        self.comm = comm  # the group the gradient shards are partitioned over (a mesh's dp_shard; the world if flat)
        # the replicas of those shards (a mesh's dp_replicate), or None: see [Note: gradients across replicas]
        self.replicate_comm = replicate_comm
        # Average across replicas once per window, at its last pass, on the accumulated shards: only where those stay
        # on the device the collective runs on (host shards under offload average each pass's device copy instead)
        self._average_once = replicate_comm is not None and (
            grad_device is None or not params or torch.device(grad_device) == params[0].compute_device)
        self.at_boundary = True  # this pass ends the accumulation window (the engine sets it before each backward)
        # None: gradient shards on the parameters' device; else see [Note: gradient shards on the host]
        self.grad_device = grad_device
        self.pin_memory = pin_memory
        self.streams = streams  # CommStreams on CUDA: reduce-scatters issued from its side stream
        # ZeRO++ qgZ (zero/quantize.py's QuantizedReduceScatter): each bucket's reduce-scatter becomes its int4
        # all-to-all; None: the exact reduce-scatter
        self.quantized = quantized
        self.reduce_dtype = reduce_dtype
        self.grad_dtype = grad_dtype
        self.async_op = async_op
        self.accounting = accounting
        self.bucket_numel = bucket_numel
        # every bucket (what the optimizer, the norm and checkpoints read), and those reduce-scattered here: all but
        # the buckets of traced regions, whose gradients come reduced (see reduce_in_graph)
        self.buckets = self._reduced_here = self._make_buckets(params)
        self._copy_groups = copy_groups
        self._index_buckets()
        self._irregular: set[int] = set()  # see [Note: a gradient on some ranks only] in presence.py
        self._held: dict[int, torch.Tensor] = {}  # their gradients on this rank, until the end of the pass
        self._next_launch = 0
        self._in_flight: list[GradBucket] = []
        self._copying_to_host: torch.device | None = None  # a non-blocking copy into host shards not waited for yet
        self.grad_bytes = 0  # gradient shards that exist now
        self.backward_end = backward_end  # the end-of-backward flush a pass's first gradient hook queues (hooks.py)

    def _index_buckets(self) -> None:
        """The lookups over ``self.buckets``: the parameters in bucket order and, for each, its bucket, its copy
        group and its position there (``_copy_slot``; [Note: one copy per unit]; copy_groups None: whole
        buckets)."""
        self.params = [p for b in self.buckets for p in b.params]
        copy_groups = self._copy_groups
        group_of = {id(p): i for i, group in enumerate(copy_groups or ()) for p in group}
        self._copy_slot: dict[int, tuple[GradBucket, CopyGroup, int]] = {}
        for bucket in self.buckets:
            bucket.groups = []
            run: list[ShardedParam] = []
            for p in bucket.params + [None]:
                if run and (p is None or group_of.get(id(p), -1) != group_of.get(id(run[0]), -1)
                            or (copy_groups is not None and id(p) not in group_of)):
                    bucket.groups.append(CopyGroup(bucket, run))
                    self._copy_slot.update((id(q), (bucket, bucket.groups[-1], i)) for i, q in enumerate(run))
                    run = []
                if p is not None:
                    run.append(p)

    def regroup(self, copy_groups: list[list[ShardedParam]]) -> None:
        """The gather units were made again (compile.py: a module compiled since initialize is one unit of its whole
        subtree): a unit's gradients go into the send buffer together again, one op per new unit and bucket
        ([Note: one copy per unit]). Buckets, their order and every value stay as they were. Between backward
        passes only, where no copy group holds a gradient."""
        if self._next_launch or self._in_flight or any(g.arrived or g.copied for b in self.buckets
                                                       for g in b.groups):
            raise RuntimeError("GradReducer.regroup inside a backward pass (gradients held): the units are made "
                               "again between steps only")
        self._copy_groups = copy_groups
        self._index_buckets()

    def _make_buckets(self, params: list[ShardedParam]) -> list[GradBucket]:
        buckets: list[GradBucket] = []
        current: list[ShardedParam] = []
        size = 0
        for p in params:  # [Note: buckets of one group]
            if current and (size + p.padded_numel > self.bucket_numel or p.group is not current[0].group):
                buckets.append(GradBucket(current, len(buckets), self.comm))
                current, size = [], 0
            current.append(p)
            size += p.padded_numel
        if current:
            buckets.append(GradBucket(current, len(buckets), self.comm))
        return buckets

    # ---- traced regions (traced.py) -----------------------------------------------------------------------------
    def reduce_in_graph(self, groups: list[list[ShardedParam]]) -> list[GradBucket]:
        """The parameters of ``groups`` get their gradients reduced inside compiled graphs (a traced region's flat
        shards: zero/traced.py): each group becomes a bucket of its own that ``add_reduced`` fills, and is no longer
        reduce-scattered here; the other parameters are bucketed again as before, without them. Call outside an
        accumulation window (no gradient shard held). Returns the new buckets, one per group."""
        if any(b.shard_grads is not None or b.send is not None for b in self.buckets):
            raise RuntimeError("compile.traced: the traced regions were set up inside a gradient accumulation window "
                               "(gradient shards are held); call engine.compile(traced=True) before the first "
                               "backward or right after a step")
        earlier = self.buckets[len(self._reduced_here):]  # of regions traced before
        taken = {id(p) for group in groups for p in group} | {id(p) for b in earlier for p in b.params}
        self._reduced_here = self._make_buckets([p for p in self.params if id(p) not in taken])
        groups = [g for g in groups if g]
        traced = [GradBucket(g, len(self._reduced_here) + len(earlier) + i, self.comm) for i, g in enumerate(groups)]
        for i, bucket in enumerate(earlier):
            bucket.index = len(self._reduced_here) + i
        self.buckets = self._reduced_here + earlier + traced
        self._index_buckets()
        return traced

    def add_reduced(self, bucket: GradBucket, grad: torch.Tensor, starts: list[int]) -> None:
        """A traced region's gradient shards, reduced over the shard group by its graph: ``grad`` is the gradient of
        its flat shard, where ``bucket.params[i]``'s shard starts at ``starts[i]``. Accumulated into the window's
        gradient shards as a reduce-scatter's result is (``_complete``), and averaged across replicas as there."""
        shards = self.alloc_shard_grads(bucket)
        grad = grad.detach()
        if self.replicate_comm is not None and not self._average_once:  # [Note: gradients across replicas]
            grad = grad.contiguous()
            self._average_across_replicas(grad, bucket.name)
        grad = grad.to(shards.device)  # host shards under offload_optimizer ([Note: gradient shards on the host]): a
        # blocking copy
        write = "add_" if bucket.has_grads else "copy_"
        if starts == [bucket.offsets[id(p)] + starts[0] for p in bucket.params]:  # adjacent: one kernel
            getattr(shards, write)(grad[starts[0]: starts[0] + bucket.per_rank])
        else:  # frozen parameters in between: their shards take no gradient
            for p, start in zip(bucket.params, starts):
                offset = bucket.offsets[id(p)]
                getattr(shards[offset: offset + p.shard_numel], write)(grad[start: start + p.shard_numel])
        bucket.has_grads = True
        if self._average_once:  # once per window, on the accumulated shards: the last pass averages them
            bucket.unaveraged = True
            if self.at_boundary:
                self._average_bucket(bucket)

    # ---- during backward ---------------------------------------------------------------------------------------
    def begin_pass(self, irregular: set[int]) -> None:
        """Before a backward pass: ``irregular`` (ids of params) get a gradient on some ranks only; they are left out
        of their buckets' readiness and reduced on their own by ``finish()``."""
        self._irregular = irregular
        for bucket in self.buckets:
            bucket.irregular = sum(id(p) in irregular for p in bucket.params) if irregular else 0

    def add(self, p: ShardedParam, grad: torch.Tensor) -> None:
        """``grad``, ``p``'s gradient of this pass, into its bucket (reduced when the bucket is complete).

        [Note: one call per gradient] At stages 2-3 ``p.param``'s post-accumulate-grad hook calls this at once
        (``hand_gradient_to_reducer``): ``grad`` is then the parameter, whose ``.grad`` is taken and dropped (freed
        once in its bucket), and a pass's first gradient queues the end-of-backward flush. The hook is a plain
        function that finds the reducer through the parameter's state (``ShardedParam.grad_reducer``), not a bound
        method or a partial holding the reducer: torch keeps a parameter's post-accumulate-grad hooks out of the
        garbage collector's sight, so a hook holding anything that leads back to its parameter (the reducer holds
        every parameter) is a cycle never freed, and a dropped model and its engine stayed in memory for good."""
        if grad is p.param:  # the gradient hook's call
            if not self.backward_end.queued:
                self.backward_end.queue_if_needed()
            grad = grad.grad
            if grad is None:
                return
            p.param.grad = None
        if type(grad) is not torch.Tensor:
            grad = local_grad(p.param, grad)  # a DTensor's: its local piece (tensor_parallel.py)
        if grad.is_sparse:  # nn.Embedding(sparse=True)'s: reduced dense, as partitioned reductions have no sparse form
            grad = grad.to_dense()
        if grad.numel() != p.numel:  # the last line of defence: see external.py for how reads are gathered
            raise RuntimeError(
                f"{p.fqn}: gradient of {grad.numel()} elements on rank {self.comm.rank}, expected {p.numel} "
                f"{tuple(p.shape)}: the forward computed with the parameter while it was partitioned (a read outside "
                "every module's forward that only looked at its shape, e.g. in a custom autograd Function). Read it "
                "inside the model's forward, or inside `with zero_engine.zero.GatheredParameters(param):`.")
        key = id(p)
        if key in self._irregular:
            held = self._held.get(key)
            self._held[key] = grad.detach() if held is None else held + grad.detach()
            return
        bucket, group, i = self._copy_slot[key]
        if bucket.pending is not None or bucket.index < self._next_launch:  # [Note: a gradient after its bucket]
            self._irregular = {*self._irregular, key}  # a new set: the coordinator's recorded one is not ours
            self._held[key] = grad.detach()
            return
        if bucket.send is None and len(bucket.params) == 1 and self._adopt(bucket, p, grad):
            self._launch_ready()
            return
        if grad.requires_grad:  # a gradient with a graph (backward(create_graph=True)): its values only, here
            grad = grad.detach()  # not on every call: 3 us of the hook's 25 inside a backward (docs/benchmarks.md)
        if group.copied:  # a second gradient in one pass, its group already in the send buffer: added there
            self._copy_one(bucket, p, grad, "add_")
        elif group.grads[i] is not None:  # a second gradient in one pass adds up, in the reduction dtype as there
            group.grads[i] = torch.add(group.grads[i].to(self.reduce_dtype), grad)
            group.summed = True
        else:
            group.grads[i] = grad
            group.arrived += 1
            bucket.arrived += 1
            if group.arrived == len(group.params) and group.chunks:
                self._copy_group(group)
            if bucket.arrived + bucket.irregular == len(bucket.params):  # complete: launched, if its turn
                self._launch_ready()

    def finish(self) -> None:
        """End of a backward pass: launch what is left (missing gradients are zeros), wait, accumulate."""
        while self._next_launch < len(self._reduced_here):
            self._launch(self._reduced_here[self._next_launch])
        for bucket in self._in_flight:
            self._complete(bucket)
        self._in_flight.clear()
        self._next_launch = 0
        if self._irregular:
            self._reduce_irregular()

    def _reduce_irregular(self) -> None:
        """Each irregular parameter on its own, in bucket order (the same on every rank), added to its shard (its
        bucket contributed zeros there)."""
        for bucket in self.buckets:
            for p in bucket.params:
                if id(p) not in self._irregular:
                    continue
                # on the compute device (NCCL), even when the shards are on the host (offload)
                send = torch.zeros(p.padded_numel, dtype=self.reduce_dtype, device=p.compute_device)
                held = self._held.pop(id(p), None)
                if held is not None:
                    send[: p.numel].copy_(held.reshape(-1))
                recv = torch.empty(p.shard_numel, dtype=self.reduce_dtype, device=send.device)
                bucket.comm.reduce_scatter_tensor(recv, send, op="avg", name=f"grads of {p.fqn} (some ranks only)",
                                                  input_is_scratch=True)
                if self._average_once:  # with the bucket's shards: see [Note: gradients across replicas]
                    bucket.unaveraged = True
                else:
                    self._average_across_replicas(recv, f"grads of {p.fqn} (some ranks only)")
                if bucket.scale != 1.0:
                    recv.mul_(bucket.scale)
                offset = bucket.offsets[id(p)]
                bucket.shard_grads[offset: offset + p.shard_numel].add_(recv.to(bucket.shard_grads.device))
            bucket.irregular = 0
        self._irregular = set()
        if self._average_once and self.at_boundary:
            self.average_across_replicas()

    def discard(self) -> None:
        """After a backward that raised: wait for reductions already issued (every rank issued them), then drop
        half-filled buckets and every accumulated gradient shard. The next backward starts a new window."""
        for bucket in self._in_flight:
            if bucket.pending is not None:
                bucket.pending.wait()
        for bucket in self.buckets:
            if bucket.send is not None:
                self._track("comm_buffers", -bucket.send.numel() * bucket.send.element_size())
            bucket.send = bucket.recv = bucket.pending = None
            bucket.arrived = 0
            for group in bucket.groups:
                group.reset()
        self._in_flight.clear()
        self._next_launch = 0
        self._irregular, self._held = set(), {}
        for bucket in self.buckets:
            bucket.irregular = 0
        self.zero_grad()

    # ---- the optimizer's side ----------------------------------------------------------------------------------
    def shard_grad(self, p: ShardedParam) -> torch.Tensor | None:
        """``p``'s gradient shard this window (a view of its bucket's), None if its bucket has none."""
        return self.shard_grads([p])[0]

    def shard_grads(self, params: list[ShardedParam]) -> list[torch.Tensor | None]:
        """``shard_grad`` of each of ``params``, in one call (the optimizer's, once per sub-group and step)."""
        self.wait_for_host_copies()
        views = []
        for p in params:
            bucket = self._copy_slot[id(p)][0]
            shards = bucket.shard_grads
            if shards is None:
                views.append(None)
            else:
                offset = bucket.offsets[id(p)]
                views.append(shards[offset: offset + p.shard_numel])
        return views

    def shard_grad_runs(self, params: list[ShardedParam]) -> list[tuple[torch.Tensor, list[int]]]:
        """The gradient shards of ``params`` as runs: (a view of one bucket's shards, the positions in ``params`` of
        the parameters it holds, back to back in that order); parameters of a bucket without shards are in none.
        What an update that converts gradients (the optimizer's fp32 copy) does once per run instead of once per
        parameter: a sub-group's parameters lie in few buckets, in reverse (buckets follow backward's order)."""
        self.wait_for_host_copies()
        slots = []
        for i, p in enumerate(params):
            bucket = self._copy_slot[id(p)][0]
            if bucket.shard_grads is not None:
                slots.append((bucket.index, bucket.offsets[id(p)], i, bucket))
        slots.sort(key=lambda slot: slot[:2])
        runs: list[tuple[torch.Tensor, list[int]]] = []
        bucket, start, end, members = None, 0, 0, []
        for _, offset, i, owner in slots:
            if owner is not bucket or offset != end:  # a gap, or another bucket: the run so far is done
                if members:
                    runs.append((bucket.shard_grads[start:end], members))
                bucket, start, end, members = owner, offset, offset, []
            members.append(i)
            end += params[i].shard_numel
        if members:
            runs.append((bucket.shard_grads[start:end], members))
        return runs

    def wait_for_host_copies(self) -> None:
        """Wait for the non-blocking copies into host gradient shards (see [Note: gradient shards on the host])
        before the host reads or writes one: one stream synchronisation after such a copy, none otherwise."""
        if self._copying_to_host is not None:
            torch.cuda.current_stream(self._copying_to_host).synchronize()
            self._copying_to_host = None

    def alloc_shard_grads(self, bucket: GradBucket) -> torch.Tensor:
        """This window's gradient shards of ``bucket`` (uninitialised: the first reduction overwrites them)."""
        if bucket.shard_grads is None:
            device = self.grad_device or bucket.params[0].compute_device
            bucket.shard_grads = torch.empty(bucket.per_rank, dtype=self.grad_dtype, device=device,
                                             pin_memory=self.pin_memory and device.type == "cpu")
            self._track("grads", bucket.per_rank * bucket.shard_grads.element_size())
        return bucket.shard_grads

    def zero_grad(self, params: set[int] | None = None) -> None:
        """End the accumulation window: the gradient shards are freed ([Note: gradient shard lifetime]). ``params``
        (ids; a module's zero_grad): only theirs dropped, their slices zeroed, a bucket freed once all of its are."""
        for bucket in self.buckets:
            dropped = bucket.params if params is None else [p for p in bucket.params if id(p) in params]
            if len(dropped) < len(bucket.params):
                for view in self.shard_grads(dropped) if dropped else ():
                    if view is not None:
                        view.zero_()
                continue
            if bucket.shard_grads is not None:
                self._track("grads", -bucket.per_rank * bucket.shard_grads.element_size())
                bucket.shard_grads = None
            bucket.has_grads = bucket.unaveraged = False

    # ---- internals ---------------------------------------------------------------------------------------------
    def _copy_group(self, group: CopyGroup) -> None:
        """All of the group's gradients into its columns of the send buffer, one op: [Note: one copy per unit]."""
        bucket = group.bucket
        if bucket.send is None:
            self._alloc_send(bucket)
        out = bucket.send.view(bucket.world, bucket.per_rank)[:, group.column: group.column + group.columns]
        # one dtype in (_chunk_cat's rule): a summed gradient is in the reduction dtype, so are the others then
        grads = [g.to(self.reduce_dtype) for g in group.grads] if group.summed else group.grads
        torch._chunk_cat([g.reshape(-1) for g in grads], 0, bucket.world, out=out)
        group.grads = [None] * len(group.params)  # the full gradients are freed here
        group.copied = True

    def _copy_one(self, bucket: GradBucket, p: ShardedParam, grad: torch.Tensor, write: str = "copy_") -> None:
        """One gradient into its column (``write``: "copy_", or "add_" for a second gradient); the rare path of
        [Note: one copy per unit]."""
        dst = bucket.slot(p)
        flat = grad.reshape(-1)
        full_rows, rem = divmod(p.numel, p.shard_numel)
        if full_rows:
            getattr(dst[:full_rows], write)(flat[: full_rows * p.shard_numel].view(full_rows, p.shard_numel))
        if rem:
            getattr(dst[full_rows, :rem], write)(flat[full_rows * p.shard_numel:])
        if write == "copy_" and p.numel != p.padded_numel:
            dst[full_rows, rem:].zero_()
            dst[full_rows + 1:].zero_()

    def _flush(self, bucket: GradBucket) -> None:
        """At launch: the groups not copied yet go in one parameter at a time; a parameter without a gradient this
        pass contributes zeros."""
        for group in bucket.groups:
            if group.copied:
                continue
            for p, grad in zip(group.params, group.grads):
                if grad is not None:
                    self._copy_one(bucket, p, grad)
                else:
                    bucket.slot(p).zero_()
            group.grads = [None] * len(group.params)
            group.copied = True

    def _adopt(self, bucket: GradBucket, p: ShardedParam, grad: torch.Tensor) -> bool:
        """A parameter alone in its bucket (one larger than reduce_bucket_size: a big embedding) with no padding:
        its gradient, as autograd made it, already is the send buffer. Reducing from it saves a copy and a buffer
        of its full size at the end of backward, where the peak is (see [Note: gradient buffers]). The engine drops
        ``param.grad`` right after, so the tensor is the reducer's alone."""
        if len(bucket.params) > 1 or p.numel != p.padded_numel or grad.dtype != self.reduce_dtype \
                or not grad.is_contiguous() or grad.device != p.compute_device:
            return False
        bucket.send = grad.detach().view(-1)
        self._track("comm_buffers", bucket.send.numel() * bucket.send.element_size())
        bucket.arrived = 1
        bucket.groups[0].copied = True
        return True

    def _alloc_send(self, bucket: GradBucket) -> None:
        bucket.send = torch.empty(bucket.per_rank * bucket.world, dtype=self.reduce_dtype,
                                  device=bucket.params[0].compute_device)
        self._track("comm_buffers", bucket.send.numel() * bucket.send.element_size())

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._reduced_here):
            bucket = self._reduced_here[self._next_launch]
            if bucket.arrived + bucket.irregular < len(bucket.params):
                return
            self._launch(bucket)

    def _launch(self, bucket: GradBucket) -> None:
        if bucket.send is None:  # no gradient at all in this bucket: it still takes part in the collective
            self._alloc_send(bucket)
        self._flush(bucket)  # the groups not copied as they completed
        if bucket.shard_grads is None:
            self.alloc_shard_grads(bucket)
        # Reduce straight into the shards when nothing is accumulated there and no cast is needed.
        direct = (not bucket.has_grads and self.reduce_dtype == self.grad_dtype
                  and bucket.shard_grads.device == bucket.send.device)
        bucket.recv = bucket.shard_grads if direct else torch.empty(bucket.per_rank, dtype=self.reduce_dtype,
                                                                     device=bucket.send.device)
        bucket.pending = self._reduce_scatter(bucket.recv, bucket.send, bucket)
        if self.quantized is None:  # gloo's received rows, say ([Note: gloo's reduce-scatter as an all-to-all])
            bucket.workspace = bucket.comm.reduce_scatter_workspace(bucket.send)
            self._track("comm_buffers", bucket.workspace)
        self._next_launch = bucket.index + 1
        # At most two buckets in flight (double buffering): overlap without holding every send buffer.
        self._in_flight.append(bucket)
        while len(self._in_flight) > MAX_IN_FLIGHT:
            self._complete(self._in_flight.pop(0))

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, bucket: GradBucket):
        """One reduce-scatter, from the reduce-scatter stream on CUDA. Both buffers were allocated and filled on the
        compute stream and stay referenced by the bucket until ``_complete`` has waited (see [Note: streams, events
        and buffer lifetime] in streams.py)."""
        # the send buffer is not read again: where gloo cannot all-to-all it (CUDA tensors), it is all-reduced in
        # place (see _backend.py)
        def issue():
            if self.quantized is not None:  # ZeRO++ qgZ (zero/quantize.py), on the bucket's group as exact ones
                return self.quantized.reduce_scatter(bucket.comm, out, inp, bucket.name, self.async_op)
            return bucket.comm.reduce_scatter_tensor(out, inp, op="avg", async_op=self.async_op,
                                                     name=bucket.name, input_is_scratch=True)
        return issue() if self.streams is None else self.streams.collective_on(self.streams.reduce_scatter, issue)

    def _complete(self, bucket: GradBucket) -> None:
        if bucket.pending is None:
            return
        bucket.pending.wait()
        if not self._average_once and self.replicate_comm is not None:  # [Note: gradients across replicas]
            self._average_across_replicas(bucket.recv, f"grads bucket {bucket.index}")
        if bucket.scale != 1.0:  # an expert group's bucket: [Note: gradients of expert weights] in moe.py
            bucket.recv.mul_(bucket.scale)
        if bucket.recv is not bucket.shard_grads:
            recv = bucket.recv
            if bucket.has_grads:
                if recv.device != bucket.shard_grads.device:  # accumulate on the host: the received values first
                    recv = recv.to(bucket.shard_grads.device)
                bucket.shard_grads.add_(recv)
            else:  # device -> (pinned) host is asynchronous; see [Note: gradient shards on the host]
                if recv.device != bucket.shard_grads.device:
                    self._copying_to_host = recv.device
                bucket.shard_grads.copy_(recv, non_blocking=recv.device != bucket.shard_grads.device)
        bucket.has_grads = True
        self._track("comm_buffers", -bucket.send.numel() * bucket.send.element_size() - bucket.workspace)
        bucket.workspace = 0
        bucket.send = bucket.recv = bucket.pending = None
        bucket.arrived = 0
        for group in bucket.groups:
            group.reset()
        if self._average_once:
            bucket.unaveraged = True
            if self.at_boundary and not bucket.irregular:  # irregular ones first: finish() averages after them
                self._average_bucket(bucket)

    def average_across_replicas(self) -> None:
        """Average every bucket's gradient shards not yet averaged across replicas. ``finish()`` does it in the
        window's last pass; the optimizer step calls it too, for a window that ended without one marked as last
        (``set_gradient_accumulation_boundary``, no_sync): a no-op when nothing is left."""
        for bucket in self.buckets:
            if bucket.unaveraged:
                self._average_bucket(bucket)

    def _average_bucket(self, bucket: GradBucket) -> None:
        shard = bucket.shard_grads
        if shard.dtype == self.reduce_dtype:
            self._average_across_replicas(shard, f"grads bucket {bucket.index}")
        else:  # in the reduction dtype, as every gradient reduction (fp32 for bf16 shards: 1/k of a bucket)
            wide = shard.to(self.reduce_dtype)
            self._average_across_replicas(wide, f"grads bucket {bucket.index}")
            shard.copy_(wide)
        bucket.unaveraged = False

    def _average_across_replicas(self, shard: torch.Tensor, name: str) -> None:
        """[Note: gradients across replicas] Under a hierarchical mesh (MiCS / HSDP, zero_engine/mesh.py) the
        reduce-scatter averaged a bucket over its shard group only; this rank's shard is then averaged with the same
        shard of every replica: one all-reduce per bucket on dp_replicate, of the bucket's shard (1/k of its bytes).
        avg over k then avg over N/k is the average over N (up to fp32 rounding: a different summation order than
        the flat reduce-scatter). It runs once per accumulation window, on the shards the window's passes summed
        (the average of a sum is the sum of the averages), in the window's last pass as each bucket completes, so
        it still overlaps the rest of that backward: the replica (cross-node) bytes of a step are one all-reduce of
        the gradient shards, whatever the accumulation (DeepSpeed's MiCS does the same at the boundary). Under
        gradient offload to the host the shards live where the collective cannot run: each pass's reduced shard is
        averaged on the device before it is accumulated there, as before."""
        if self.replicate_comm is not None:
            self.replicate_comm.all_reduce(shard, op="avg", name=name)

    def _track(self, category: str, nbytes: int) -> None:
        if category == "grads":
            self.grad_bytes += nbytes
        if self.accounting is not None:
            self.accounting.add(category, nbytes)

