"""Issue collectives on whatever the process group's backend supports, emulating the gaps.

The communicator speaks in four logical collectives (all-gather into one tensor, reduce-scatter from one tensor,
all-reduce, broadcast) with ops sum/avg/max/min. Backends differ in what they implement natively:

* torch 2.13's gloo supports all of them (checked: ``all_gather_single``, ``reduce_scatter_single`` and
  ``ReduceOp.AVG`` all work, sync and async, for float32/bfloat16/float16).
* older gloo builds lack the single-tensor all-gather / reduce-scatter and ``ReduceOp.AVG``.

[Note: decided per backend, never by an error]
What runs natively is decided from the backend's name and torch's version alone (``decide_support``), before the
first collective, so every rank of a job (same torch, same backend) decides the same and issues the same
collectives. Nothing is inferred from an error at run time: an earlier version tried each op and switched to the
emulation when an error message contained "support", on one rank and process-wide, which let one rank's unrelated
error (or a different message) make ranks issue different collectives. Now an error from a native op is always
re-raised. A backend not in the table gets the emulations, which use only the list all-gather and SUM all-reduce
every backend has. The decision is logged once per backend.

Emulations keep async work async: the emulated collective is issued with ``async_op`` and whatever has to happen
after it (copying this rank's slice out, dividing by the world size for "avg") is returned as a ``finalize``
callable that ``Pending.wait()`` runs once the work has completed.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

Finalize = Optional[Callable[[], None]]
Issued = tuple[Optional[object], Finalize]  # (work, finalize): what every CollectiveIssuer call returns

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}

# The single-tensor collectives were renamed in torch 2.13 (the old names still work but warn). Resolve once.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_op(op: str) -> dist.ReduceOp:
    """Map our op name to torch's ReduceOp; a name we do not know is a caller mistake."""
    try:
        return _REDUCE_OPS[op]
    except KeyError:
        raise ValueError(f"op={op!r} is not a reduce op; use one of {sorted(_REDUCE_OPS)}") from None


@dataclass
class BackendSupport:
    """What one backend runs natively (see [Note: decided per backend, never by an error])."""

    all_gather_single: bool = False
    reduce_scatter_single: bool = False
    avg: bool = False
    # [Note: gloo's reduce-scatter is an all-reduce of a copy] gloo (torch 2.13) runs reduce_scatter_tensor as an
    # all-reduce of the whole input followed by taking this rank's slice, and first copies the input on the calling
    # thread (2 ms per 1M fp32 elements, before the call returns; its work also ignores wait(timeout)). When the
    # caller's input is scratch (a gradient send buffer), all-reducing it in place does the same reduction with the
    # same bytes on the wire, without that copy and with a work that honours timeouts (bench/profile_step.py: the
    # demo model's 9 reduce-scatters cost 7.4 ms a step to issue).
    reduce_scatter_copies_input: bool = False
    # [Note: gloo's reduce-scatter as an all-to-all] Either way above, gloo reduces the whole input on every rank:
    # its ring all-reduce moves each byte twice (reduce, then gather the result back), and a reduce-scatter needs
    # only the first half. An all-to-all of the input (rank j receives every rank's chunk j) and a sum of the
    # received rows on this rank is that half: it took 0.46-0.72 of the in-place all-reduce's time for 1-16 MiB at
    # worlds 2 and 4 (bench/reduce_scatter_probe.py, docs/benchmarks.md), so the reduce-scatters of a training step
    # run this way on gloo (CPU tensors: gloo's all-to-all takes no CUDA ones). Its cost is the received rows: one
    # more buffer of the input's size until the work completes (``Communicator.reduce_scatter_workspace``, which
    # the gradient reducer counts as a comm buffer). So only inputs up to ``ALL_TO_ALL_REDUCE_MAX_BYTES`` take it:
    # there the time is a fixed cost that the step waits for (make demo's 2 MiB buckets: the step 4-5% faster, 2 MiB
    # more peak RSS); bench/compare.py's 100m model, whose 19.5 MB buckets reduce behind the backward's compute,
    # gained no step time from it and held 35 MiB more peak RSS per rank (docs/benchmarks.md, "Fourth pass"), so
    # larger inputs keep the in-place all-reduce. The input is only read, so it needs no copy either. At world 2
    # the sum is the all-reduce's one addition, bitwise; above, a fixed order (torch.sum over the rows), which may
    # round differently from the ring's (itself different per chunk).
    # [Note: gloo's reduce-scatter at world 2] There the all-to-all sends nothing to this rank itself (split sizes
    # [0, n] or [n, 0], as in [Note: gloo's all-gather as an all-to-all]): only the peer's chunk
    # arrives, into a buffer half the input's size, and is added to this rank's own chunk, read where it lies in
    # the input, in rank order (a + b, as gloo's all-reduce adds; torch.sum over two rows gave -0.0 + -0.0 as
    # +0.0, equal values). On 250k-1M fp32 elements (bench/all_to_all_probe.py, docs/benchmarks.md) the call's wall
    # time was 0.72-0.89 x, its CPU over every thread 0.57-0.80 x.
    reduce_scatter_by_all_to_all: bool = False
    # [Note: gloo's all-gather as an all-to-all] gloo's all_gather_into_tensor (torch 2.13) gathers into a flat
    # buffer of its own, the output's size, and then copies that into the output, on its worker thread; per byte it
    # cost 1.5-2 x the CPU of an all-to-all moving the same bytes. So on gloo (CPU tensors) an all-gather runs as an
    # all-to-all in which every rank sends its shard to every rank:
    # - at world 2 it sends nothing to itself (split sizes [0, n] or [n, 0]): gloo receives the peer's shard
    #   straight into its row of the output, and this rank copies its own shard into its row while that runs. No
    #   buffer beside the output;
    # - above, each peer's chunk of the input must be the shard, so the input is the shard repeated (``repeat``: a
    #   buffer the output's size, as gloo's own flat buffer, held until the work completes instead of while it
    #   runs, and one copy of it on this thread). That copy grows with the size, and at world 4 the all-to-all
    #   stopped paying between 3 and 6 MiB; so there only outputs up to ``ALL_TO_ALL_GATHER_MAX_BYTES`` take it.
    #   Since [Note: gloo's gathers as sends and receives], only those under ``SEND_RECV_GATHER_MIN_BYTES`` do.
    # The same bytes on the wire; the same result, bitwise (a gather adds nothing). Per call (bench/all_to_all_probe.py,
    # docs/benchmarks.md, "gloo's all-gathers, and world 2's reduce-scatters, as all-to-alls"): 150k-1.6M fp32
    # elements at world 2, wall time 0.54-0.61 x, CPU over every thread 0.54-0.59 x; at world 4 0.57 x / 0.45 x
    # at 150k, 0.91 x / 0.95 x at 800k, 1.00 x / 1.05 x at 1.6M. Its wait honours timeouts as the all-to-all's does
    # (watchdog.py), and it is recorded as the all-to-all it is, as the reduce-scatter above.
    all_gather_by_all_to_all: bool = False
    # [Note: gloo's gathers as sends and receives] Above world 2 a gather needs no repeated shard: each peer's shard
    # is received straight into its row and this rank's shard is sent to each peer from where it lies, a send and a
    # receive per peer (gloo's point-to-point, under a tag of their own per gather, so that two gathers in flight
    # never pair up with each other); a whole all-gather also copies this rank's shard into its own row meanwhile,
    # and a peer gather ([Note: a gather that leaves this rank's row out] in zero/gather.py) has no such row. Per
    # call (bench/all_to_all_probe.py, docs/benchmarks.md):
    # - ``--peers``, 0.8-1.6M fp32 elements at worlds 3 and 4: 0.58-0.76 x the CPU over every thread and 0.55-0.80
    #   x the wall time of the all-to-all of the repeated shard, whose repeat alone is a copy of (world - 1) shards
    #   on the calling thread ("A peer gather as sends and receives above world 2");
    # - ``--large``, 2-8M elements, beyond ``ALL_TO_ALL_GATHER_MAX_BYTES``, where gloo's own all-gather ran: 0.41-0.57
    #   x its CPU and 0.39-0.51 x its wall time at worlds 3 and 4 (gloo's gathers into a flat buffer of its own and
    #   copies that out; "Large gathers as sends and receives above world 2").
    # Below 1 MiB of output (``SEND_RECV_GATHER_MIN_BYTES``) the 2 (world - 1) calls' fixed cost took more CPU than
    # the repeat saves (1.07-1.41 x at world 4): there the all-to-all stays, and at world 2, where nothing is
    # repeated, the two were even: there the one all-to-all stays too. The same bytes, the same result bitwise.
    # gloo's point-to-point works cannot be waited with a timeout (a timed-out wait closes the connection) and
    # report completion only once waited, so the watchdog waits them on its helper thread
    # (_blocking_waiter.py): they are recorded as "send_recv", whose waits do not honour timeouts.
    all_gather_by_send_recv: bool = False
    logged: set = field(default_factory=set)


# The largest reduce-scatter input (bytes) run as an all-to-all on gloo: [Note: gloo's reduce-scatter as an
# all-to-all].
ALL_TO_ALL_REDUCE_MAX_BYTES = 4 << 20
# The largest all-gather output (bytes) run as an all-to-all of the repeated shard on gloo above world 2, where
# sends and receives do not run it: [Note: gloo's all-gather as an all-to-all]. At world 2 there is no such limit
# (nothing is repeated).
ALL_TO_ALL_GATHER_MAX_BYTES = 4 << 20
# The smallest gather output (bytes) run as sends and receives above world 2: [Note: gloo's gathers as sends and
# receives]. Below it, each point-to-point call's fixed cost outweighs the repeated shard's copy.
SEND_RECV_GATHER_MIN_BYTES = 1 << 20


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


# Backends known to run all three natively, from the torch version on which that was checked.
_NATIVE_SINCE = {"gloo": (2, 13), "nccl": (2, 0), "fake": (2, 0)}


def decide_support(backend: str, torch_version: tuple[int, int] | None = None) -> BackendSupport:
    """The capabilities of ``backend``, a pure function of its name and the torch version.

    A composite backend ("cpu:gloo,cuda:nccl") runs natively only what every part runs natively."""
    version = torch_version or _torch_version()
    parts = [part.split(":")[-1].strip().lower() for part in str(backend).split(",")]
    native = all(name in _NATIVE_SINCE and version >= _NATIVE_SINCE[name] for name in parts)
    gloo = all(name == "gloo" for name in parts)
    return BackendSupport(all_gather_single=native, reduce_scatter_single=native, avg=native,
                          reduce_scatter_copies_input=gloo, reduce_scatter_by_all_to_all=gloo,
                          all_gather_by_all_to_all=gloo, all_gather_by_send_recv=gloo)


_support_by_backend: dict[str, BackendSupport] = {}


def support_for(backend: str) -> BackendSupport:
    """The (shared) capability record for a backend name; tests may set fields to force the emulations."""
    backend = str(backend)
    if backend not in _support_by_backend:
        support = _support_by_backend[backend] = decide_support(backend)
        emulated = [name for name in ("all_gather_single", "reduce_scatter_single", "avg")
                    if not getattr(support, name)]
        if emulated:
            logger.info("backend %s (torch %s): emulating %s with list all-gather / SUM all-reduce", backend,
                        torch.__version__, ", ".join(emulated))
    return _support_by_backend[backend]


def _divide_once(tensor: torch.Tensor, world_size: int) -> Callable[[], None]:
    """"avg" on a backend without AVG: SUM, then this. At most once: a second ``Pending.wait()`` must not divide
    again."""
    once = [tensor]

    def divide() -> None:
        if once:
            once.pop().div_(world_size)

    return divide


class PeerWorks:
    """The sends and receives of one gather as one work ([Note: gloo's gathers as sends and receives]).
    ``wait()`` takes no timeout on purpose: a timed wait on gloo's point-to-point works breaks the connection."""

    __slots__ = ("works", "error")

    def __init__(self, works: list) -> None:
        self.works = works
        self.error: BaseException | None = None

    def wait(self) -> bool:
        # Failed once, failed for good, as a work of the backend: the works after the failing one are never waited
        # again (gloo's, whose peer is gone, would block), and the watchdog reads the error back to explain it.
        if self.error is not None:
            raise self.error
        try:
            for work in self.works:
                work.wait()
        except BaseException as error:
            self.error = error
            raise
        return True

    def is_completed(self) -> bool:
        return self.error is not None or all(work.is_completed() for work in self.works)


class CollectiveIssuer:
    """Issues the four logical collectives on one process group, natively where possible.

    Every call issues asynchronously and returns ``(work, finalize)``: the work handle and what has to run once it
    completed, or None (see the module docstring). The communicator waits, through its watchdog, for a synchronous
    call. The capabilities are read per call, from the shared ``support`` record (tests force the emulations by
    setting its fields)."""

    def __init__(self, group, backend: str, world_size: int) -> None:
        self.group = group
        self.backend = str(backend)
        self.world_size = world_size
        self.support = support_for(self.backend)
        self._peer_tag = 0  # the last gather's tag of sends and receives (_next_peer_tag)
        if "nccl" in self.backend.lower():
            # NCCL runs all_gather_into_tensor, reduce_scatter_tensor and AVG natively: never emulate on that path
            # (an emulation would add a full-size copy per reduce-scatter and hide a real NCCL error).
            self.support = BackendSupport(all_gather_single=True, reduce_scatter_single=True, avg=True)

    @functools.cached_property
    def rank(self) -> int:
        """This rank in the group, read once, at the first use (an issuer is built before any collective runs, and
        without a process group by tests); an attribute after that."""
        return dist.get_rank(self.group)

    def all_gather_plan(self, input: torch.Tensor) -> str:
        """The collective an all-gather of ``input`` runs, which the communicator records for the watchdog. On gloo
        for CPU tensors: at world 2 "all_to_all" ([Note: gloo's all-gather as an all-to-all]); above it
        "send_recv" for outputs from ``SEND_RECV_GATHER_MIN_BYTES`` ([Note: gloo's gathers as sends and receives]),
        "all_to_all" for smaller ones. Else "all_gather" (also at world 1, where gloo's is a copy, and where neither
        applies: an output above ``ALL_TO_ALL_GATHER_MAX_BYTES`` with the sends and receives turned off)."""
        world_size = self.world_size
        if not (self.support.all_gather_by_all_to_all and world_size > 1 and input.device.type == "cpu"):
            return "all_gather"
        if world_size == 2:
            return "all_to_all"
        nbytes = input.numel() * input.element_size() * world_size
        if self.support.all_gather_by_send_recv and nbytes >= SEND_RECV_GATHER_MIN_BYTES:
            return "send_recv"
        return "all_to_all" if nbytes <= ALL_TO_ALL_GATHER_MAX_BYTES else "all_gather"

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, plan: str = "all_gather") -> Issued:
        """``plan`` from ``all_gather_plan``."""
        if plan == "all_to_all" and self.world_size == 2:  # the peer's shard into its row, ours into our own
            shard, rows = input.view(-1), output.view(2, -1)
            n, rank = shard.numel(), self.rank
            sizes = [0, n] if rank == 0 else [n, 0]
            work = dist.all_to_all_single(rows[1 - rank], shard, sizes, sizes, group=self.group, async_op=True)
            rows[rank].copy_(shard)
            return work, None
        if plan == "send_recv":  # each peer's shard into its row, ours into our own meanwhile
            shard, rows = input.view(-1), output.view(self.world_size, -1)
            work = self._send_and_receive(shard, [rows[peer] for peer in self.peers])
            rows[self.rank].copy_(shard)
            return work, None
        if plan == "all_to_all":  # every rank sends its shard to every rank: the input is the shard repeated
            repeated = input.view(-1).repeat(self.world_size)
            return dist.all_to_all_single(output.view(-1), repeated, group=self.group, async_op=True), None
        if self.support.all_gather_single:
            return _all_gather_single(output, input, group=self.group, async_op=True), None
        # The per-rank chunks are views of `output`, so the list form writes straight into it: no extra copy.
        chunks = list(output.view(-1).chunk(self.world_size))
        return dist.all_gather(chunks, input.reshape(-1), group=self.group, async_op=True), None

    def all_gather_peers(self, output: torch.Tensor, input: torch.Tensor, plan: str = "all_to_all") -> Issued:
        """Every other rank's ``input`` into the ``world_size - 1`` rows of ``output``, in rank order, this rank's row
        left out (see [Note: a gather that leaves this rank's row out] in gather.py); ``plan`` from
        ``all_gather_plan``: "send_recv", a send and a receive per peer, or "all_to_all", at world 2 the
        all-to-all without the part this rank sends itself, above it that of the shard repeated once a peer."""
        shard, world_size, rank = input.view(-1), self.world_size, self.rank
        if plan == "send_recv":
            return self._send_and_receive(shard, list(output.view(world_size - 1, -1))), None
        sizes = [shard.numel()] * world_size
        sizes[rank] = 0
        send = shard if world_size == 2 else shard.repeat(world_size - 1)
        return dist.all_to_all_single(output.view(-1), send, sizes, sizes, group=self.group, async_op=True), None

    def _send_and_receive(self, shard: torch.Tensor, rows: list[torch.Tensor]) -> PeerWorks:
        """Each peer's shard received into ``rows`` (one per peer, in rank order) and ``shard`` sent to each peer:
        [Note: gloo's gathers as sends and receives]."""
        tag, world_size, rank = self._next_peer_tag(), self.world_size, self.rank
        works = [dist.irecv(row, group=self.group, group_src=peer, tag=tag) for row, peer in zip(rows, self.peers)]
        # to the next ranks first, so that the ranks do not all send to rank 0 at once
        works += [dist.isend(shard, group=self.group, group_dst=(rank + step) % world_size, tag=tag)
                  for step in range(1, world_size)]
        return PeerWorks(works)

    @functools.cached_property
    def peers(self) -> list[int]:
        """The other ranks of the group, in rank order."""
        return [peer for peer in range(self.world_size) if peer != self.rank]

    def _next_peer_tag(self) -> int:
        """A tag for the next gather's sends and receives: every rank issues the same gathers in the same order, so
        the n-th gather has the same tag on every rank, and no two gathers in flight share one."""
        self._peer_tag = (self._peer_tag + 1) % (1 << 30)
        return self._peer_tag

    def all_gather_grouped(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> Issued:
        """Each ``inputs[i]`` gathered into ``outputs[i]``, issued as one call of the backend (torch's coalescing
        manager: on NCCL one group, one launch); see [Note: large parameters gathered as one group] in gather.py."""
        with dist.distributed_c10d._coalescing_manager(group=self.group, async_ops=True) as grouped:
            for output, input in zip(outputs, inputs):
                _all_gather_single(output, input, group=self.group)
        work, = grouped.works  # the backend's one work for the group
        return work, None

    def reduce_scatter_plan(self, input: torch.Tensor, input_is_scratch: bool) -> str:
        """The collective a ``reduce_scatter`` of ``input`` runs, which the communicator records for the watchdog:
        "all_to_all" on gloo for CPU tensors up to ``ALL_TO_ALL_REDUCE_MAX_BYTES`` ([Note: gloo's reduce-scatter as
        an all-to-all]), "all_reduce" of a scratch input in place where the native one would copy it ([Note: gloo's
        reduce-scatter is an all-reduce of a copy]), or the native "reduce_scatter"."""
        support = self.support
        if (support.reduce_scatter_by_all_to_all and input.device.type == "cpu"
                and input.numel() * input.element_size() <= ALL_TO_ALL_REDUCE_MAX_BYTES):
            return "all_to_all"
        if input_is_scratch and (support.reduce_scatter_copies_input or not support.reduce_scatter_single):
            return "all_reduce"
        return "reduce_scatter"

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str,
                       plan: str = "reduce_scatter") -> Issued:
        """``plan`` from ``reduce_scatter_plan``; with "all_reduce" the caller will not read ``input`` again, and it
        is all-reduced in place."""
        if plan == "all_to_all" and self.world_size == 2:  # [Note: gloo's reduce-scatter at world 2]
            flat, rank = input.detach().reshape(-1), self.rank
            n = flat.numel() // 2
            received = torch.empty(n, dtype=flat.dtype, device=flat.device)
            sizes = [0, n] if rank == 0 else [n, 0]
            work = dist.all_to_all_single(received, flat[n:] if rank == 0 else flat[:n], sizes, sizes,
                                          group=self.group, async_op=True)
            rows = (flat[:n], received) if rank == 0 else (received, flat[n:])  # in rank order
            slice_out = [output.view(-1)]

            def add_rows() -> None:  # at most once, as sum_rows below
                if slice_out:
                    out = slice_out.pop()
                    torch.add(*rows, out=out)
                    if op == "avg":
                        out.div_(2)

            return work, add_rows
        if plan == "all_to_all":  # every rank's chunk r arrives here as a row: their sum is this rank's slice
            flat = input.detach().reshape(-1)
            received = torch.empty_like(flat)
            work = dist.all_to_all_single(received, flat, group=self.group, async_op=True)
            world_size, slice_out = self.world_size, [output.view(-1)]

            def sum_rows() -> None:  # at most once: a second Pending.wait() must not sum again
                if slice_out:
                    out = slice_out.pop()
                    torch.sum(received.view(world_size, -1), 0, out=out)
                    if op == "avg":
                        out.div_(world_size)

            return work, sum_rows
        in_place = plan == "all_reduce"
        support = self.support
        divide = op == "avg" and not support.avg
        torch_op = dist.ReduceOp.SUM if divide else _REDUCE_OPS[op]  # op checked by the communicator
        if support.reduce_scatter_single and not in_place:
            work = _reduce_scatter_single(output, input, op=torch_op, group=self.group, async_op=True)
            return work, (_divide_once(output, self.world_size) if divide else None)
        # All-reduce, then keep this rank's slice. Emulated, it costs a temporary copy of the full input (the
        # caller's input must stay untouched), unless the caller says it is scratch.
        reduced = input.detach().reshape(-1) if in_place else input.detach().reshape(-1).clone()
        my_slice = reduced.chunk(self.world_size)[self.rank]
        work = dist.all_reduce(reduced, op=torch_op, group=self.group, async_op=True)
        world_size, once = self.world_size, [output.view(-1)]

        def complete() -> None:  # at most once: a second Pending.wait() must not divide again
            if once:
                if divide:
                    reduced.div_(world_size)
                once.pop().copy_(my_slice)

        return work, complete

    def all_reduce(self, tensor: torch.Tensor, op: str) -> Issued:
        divide = op == "avg" and not self.support.avg
        torch_op = dist.ReduceOp.SUM if divide else _REDUCE_OPS[op]  # op checked by the communicator
        work = dist.all_reduce(tensor, op=torch_op, group=self.group, async_op=True)
        return work, (_divide_once(tensor, self.world_size) if divide else None)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Issued:
        """Native on NCCL and on gloo (CPU tensors; checked with torch 2.13's gloo, sync and async)."""
        return dist.all_to_all_single(output, input, group=self.group, async_op=True), None

    def gather(self, output: Optional[torch.Tensor], input: torch.Tensor, dst: int) -> Issued:
        """Every rank's ``input`` into ``output`` on rank ``dst`` (rank r's at row r; None on the other ranks)."""
        global_dst = dist.get_global_rank(self.group, dst) if self.group is not None else dst
        rows = list(output.view(self.world_size, *input.shape).unbind(0)) if output is not None else None
        return dist.gather(input, rows, dst=global_dst, group=self.group, async_op=True), None

    def broadcast(self, tensor: torch.Tensor, src: int) -> Issued:
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        return dist.broadcast(tensor, src=global_src, group=self.group, async_op=True), None
