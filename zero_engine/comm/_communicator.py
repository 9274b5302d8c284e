"""Communicator: the one place zero_engine issues collectives, with counters, profiler ranges and a debug check.

[Note: byte counting convention]
``stats()`` counts one call per logical collective issued and these bytes (numel * element size):

* ``all_gather``: the OUTPUT, i.e. the full gathered tensor (world_size x the shard);
* ``gather``: the same on every rank, though only the destination receives it (a save's whole tensors on rank 0);
* ``reduce_scatter``: the INPUT, i.e. the full unreduced tensor (world_size x the shard);
* ``all_to_all``: the INPUT, i.e. every chunk this rank sends (ZeRO++ qgZ's quantized gradients, zero/quantize.py);
* ``all_reduce`` and ``broadcast``: the tensor;
* ``object``: ``all_gather_object`` calls, with the pickled size of this rank's object.

With this convention one ZeRO-3 step reads as 2x the parameter bytes under all_gather (forward and backward) plus
1x the gradient bytes under reduce_scatter, the numbers the ZeRO paper quotes. The counts are of the logical
collective even when the backend emulates it (see ``_backend``), and debug-mode consistency checks are not counted,
so the counters are the same with ``debug`` on or off.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from zero_engine._profiling import profile_range as record_function  # no-op without a profiler
from zero_engine.comm._backend import _REDUCE_OPS, CollectiveIssuer, reduce_op
from zero_engine.comm._init import group_timeout_s
from zero_engine.comm._records import CollectiveRecord, ProgressLog
from zero_engine.comm.watchdog import StallWatchdog, default_store
from zero_engine.errors import DistributedError
from zero_engine.comm._consistency import (
    CollectiveDescriptor,
    CollectiveMismatchError,
    caller_outside_comm,
    hashes_disagree,
    mismatch_message,
)

_COUNTED_KINDS = ("all_gather", "gather", "reduce_scatter", "all_to_all", "all_reduce", "broadcast", "object")
_REDUCE_SCATTER_OPS = ("sum", "avg")


class Pending(NamedTuple):
    """A collective that was issued. ``tensor`` holds the result once ``wait()`` has returned.

    ``work`` is the backend's handle, or None when the collective already completed synchronously. ``finalize`` is
    what still has to run after the work completes (e.g. dividing by the world size for "avg" on a backend without
    AVG); it runs at most once. Always call ``wait()`` before reading ``tensor`` of an async collective.
    ``record`` is its progress record; with a ``watchdog`` the wait goes in slices and a stall is diagnosed (see
    [Note: how a stall is diagnosed] in watchdog.py).
    """

    work: Optional[Any]
    tensor: torch.Tensor
    finalize: Optional[Callable[[], None]] = None
    record: Optional[CollectiveRecord] = None
    watchdog: Optional[StallWatchdog] = None
    held: bool = False  # ``work`` is the check of ``record``, not issued yet (``StallWatchdog.wait``)

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            if self.watchdog is not None and self.watchdog.watches_waits and not self.watchdog.stopped:
                self.watchdog.wait(self.work, self.record, self.held)
            else:
                self.work.wait()
        if self.finalize is not None:
            self.finalize()
        return self.tensor


# Built once, not per collective: a collective's profiler range (joined with its name only while a profiler
# collects) and its dtype as the progress records spell it ("bfloat16").
_RANGE_NAMES = {kind: f"zero3::{kind}" for kind in _COUNTED_KINDS}
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


class Communicator:
    """Collectives on one process group (default: the whole world), counted per kind.

    Args:
        group: the ``torch.distributed`` process group; None means the default (world) group.
        debug: before each collective, check that every rank is issuing the same one (kind, dtype, size, op, name)
            and raise ``CollectiveMismatchError`` on every rank otherwise, instead of hanging. Costs one small
            synchronous all-gather per collective (and serialises async collectives), so use it to find a bug, not
            in production runs.

        stall_timeout_s: with a positive value (and the world group, more than one rank), waits go through a
            ``StallWatchdog``: a collective not done after this many seconds makes the ranks compare their progress
            records and raise ``RankDivergenceError`` / ``RankLostError`` instead of hanging. 0 or None: plain waits.
        step_fingerprint: keep each step's collective records for ``check_step_fingerprint`` (fingerprint.py), which
            must then be called once a step to drain them; False (the default): no step records are kept.
        share_records_with: the world communicator of a device mesh; this one (on a sub-group of it) then records
            its collectives in that one's progress log and waits through its watchdog, so the step fingerprint and
            stall diagnosis cover sub-group collectives too (they must be issued symmetrically by every sub-group:
            zero_engine/mesh.py). ``close()`` of this one never waits: the world communicator's does.
        collective_timeout_s: with the watchdog, a wait longer than this raises ``DistributedError`` whoever created
            the process group (the group's own timeout still applies too). None: the group's own timeout
            (``group_timeout_s``), so a group made with ``timeout=1h`` waits an hour. Resolved in
            ``self.collective_timeout_s``.

    Every collective runs inside ``torch.profiler.record_function("zero3::<kind> <name>")``; ``name`` is free text for
    profiles and error messages (a module or bucket name). Every collective also gets a progress record in
    ``self.progress`` (see [Note: progress records]). See [Note: byte counting convention] for ``stats()``.
    """

    def __init__(self, group=None, debug: bool = False, stall_timeout_s: Optional[float] = None,
                 collective_timeout_s: Optional[float] = None, step_fingerprint: bool = False,
                 share_records_with: Optional["Communicator"] = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "Communicator needs an initialized torch.distributed process group; call "
                "zero_engine.init_distributed() first (or use zero_engine.testing.run_ranks / fake_world in tests)"
            )
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.debug = bool(debug)
        self.backend = str(dist.get_backend(self.group))
        self.collective_timeout_s = (float(collective_timeout_s) if collective_timeout_s is not None
                                     else group_timeout_s(self.group))
        self._issuer = CollectiveIssuer(self.group, self.backend, self.world_size)
        self._sequence = 0
        self._stats: dict[str, dict[str, int]] = {}
        self.reset_stats()
        self.progress = ProgressLog(step_fingerprint=step_fingerprint)
        self.watchdog: Optional[StallWatchdog] = None
        if share_records_with is not None:  # a sub-group of a mesh: see [Note: what runs on which group] in mesh.py
            self.progress = share_records_with.progress
            self.watchdog = share_records_with.watchdog
            stall_timeout_s = None
        # whether the next collective, on this group or on any sub-group sharing these records, is held back:
        # one flag shared by them (a mesh's gathers run on a sub-group; agree_before_next_collective is asked of the
        # world communicator)
        self._agree_next = share_records_with._agree_next if share_records_with is not None else [False]
        # whether each collective is checked across ranks before it is issued (_check_consistency): always with
        # ``debug``, and while check_every_collective asks; shared with the sub-groups as _agree_next is
        self._checking = share_records_with._checking if share_records_with is not None else [self.debug]
        self._closed = False
        self._shares_records = share_records_with is not None
        store = default_store() if self.group is dist.group.WORLD and self.world_size > 1 else None
        if stall_timeout_s and store is not None and self.backend in ("gloo", "nccl"):
            self.watchdog = StallWatchdog(store, self.rank, self.world_size, self.progress, stall_timeout_s,
                                          self.collective_timeout_s, self.backend)

    def agree_before_next_collective(self) -> None:
        """Make the next collective wait until every rank is about to issue the same one (store only, nothing
        exchanged on the group); see [Note: holding back a collective that may not match] in watchdog.py. For the
        rare points where ranks may legitimately or mistakenly take different paths."""
        self._agree_next[0] = self.watchdog is not None

    def check_every_collective(self, on: bool) -> None:
        """Check each collective across ranks before it is issued, as ``debug`` does, from now until this is called
        with False (``debug`` keeps the check on), on this group and the sub-groups sharing its records. For the
        stretches where ranks may take different paths and nothing says where: every rank must turn it on and off
        at the same point of its collectives. See [Note: the recording step is checked] in zero/coordinator.py."""
        # fake: one process stands for every rank (shapes only), nothing to compare
        self._checking[0] = self.debug or (on and self.world_size > 1 and self.backend != "fake")

    def close(self, wait: bool = True) -> None:
        """This rank is done with the group: wait until every rank is (store only with the watchdog, which then
        stops; a barrier without it), so no rank destroys the group while a peer still talks to it. Raises
        RankDivergenceError when a peer waits in a collective this rank never issued. Safe to call twice.

        ``wait=False`` (a failed initialize): stop at once and tell the other ranks nothing; they may not be
        closing, and the ones that failed the same way go on too (a "left" key or a failure note would be stale)."""
        if self._closed:
            return
        if self._shares_records:  # the world communicator waits for every rank; this one only lets go
            self._closed = True
            self.group = self._issuer = None
            return
        try:
            if self.watchdog is not None:
                if self.watchdog.failed or not wait:  # not "left": the others would read a clean finish
                    self.watchdog.stop(mark=None, silently=True)
                else:
                    self.watchdog.leave()
            elif wait and self.world_size > 1 and self.backend != "fake":
                self.barrier()
        finally:
            self._closed = True
            # Hold the process group no longer, so that destroy_process_group() really destroys it (its threads
            # joined then) instead of leaving that to garbage collection at interpreter exit.
            self.group = self._issuer = None

    def _closed_error(self, kind: str, name: str) -> RuntimeError:
        return RuntimeError(f"{kind} {name!r} on rank {self.rank}: this communicator was closed "
                            "(engine.destroy()); build a new engine to train again")

    def _record(self, kind: str, tensor: Optional[torch.Tensor], numel: int, name: str) -> CollectiveRecord:
        """The progress record of a collective about to be issued (and its agreement, when one was asked for)."""
        if self._closed:
            raise self._closed_error(kind, name)
        dtype = "" if tensor is None else (_DTYPE_NAMES.get(tensor.dtype) or _dtype_name(tensor.dtype))
        record = self.progress.record(kind, dtype, numel, name)
        if self._agree_next[0]:
            self._agree_next[0] = False
            self.watchdog.agree(record)
        return record

    def _issue(self, kind: str, record_kind: str, name: str, dtype: torch.dtype, numel: int, nbytes: int, issue,
               args: tuple, result: torch.Tensor, async_op: bool) -> Pending:
        """Issue one tensor collective whose arguments were checked: its progress record (and agreement, when one
        was asked for), ``issue(*args)`` (a CollectiveIssuer method: always asynchronous) inside its profiler range,
        ``nbytes`` counted under ``kind``, and its handle. A synchronous call is waited here, so that synchronous
        collectives are watched too. ``record_kind`` is what runs: a reduce-scatter run as an all-reduce is
        recorded as one."""
        # _record's steps written out, not called: this runs for every collective of every step.
        if self._closed:
            raise self._closed_error(record_kind, name)
        record = self.progress.record(record_kind, _DTYPE_NAMES.get(dtype) or _dtype_name(dtype), numel, name)
        if self._agree_next[0]:
            self._agree_next[0] = False
            self.watchdog.agree(record)
        with record_function(_RANGE_NAMES[kind], name):
            work, finalize = issue(*args)
        counts = self._stats[kind]
        counts["calls"] += 1
        counts["bytes"] += nbytes
        pending = Pending(work, result, finalize, record, self.watchdog)
        if async_op:
            return pending
        pending.wait()
        return Pending(None, result)

    def __repr__(self) -> str:
        return (f"Communicator(rank={self.rank}, world_size={self.world_size}, backend={self.backend}, "
                f"debug={self.debug})")

    # -- counters ----------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, dict[str, int]]:
        """{"all_gather": {"calls": n, "bytes": b}, "reduce_scatter": ..., "all_reduce": ..., "broadcast": ...,
        "object": ...} on this rank, since construction or the last ``reset_stats()``. A copy: safe to keep."""
        return {kind: dict(counts) for kind, counts in self._stats.items()}

    def reset_stats(self) -> None:
        self._stats = {kind: {"calls": 0, "bytes": 0} for kind in _COUNTED_KINDS}

    def _count(self, kind: str, nbytes: int) -> None:
        self._stats[kind]["calls"] += 1
        self._stats[kind]["bytes"] += nbytes

    # -- argument checks ---------------------------------------------------------------------------------------

    def _require(self, condition: bool, kind: str, name: str, problem: str) -> None:
        if not condition:
            raise ValueError(f"{kind} {name!r} on rank {self.rank} (world {self.world_size}): {problem}")

    def _check_pair(self, kind: str, name: str, output: torch.Tensor, input: torch.Tensor) -> None:
        """Raise the ValueError that says how ``output`` and ``input`` do not match; called only when the
        collective's own one-line test failed (that test also covers the sizes, whose message is the caller's)."""
        self._require(output.dtype == input.dtype, kind, name,
                      f"output dtype {output.dtype} differs from input dtype {input.dtype}")
        self._require(output.device == input.device, kind, name,
                      f"output is on {output.device} but input is on {input.device}")
        self._require(output.is_contiguous() and input.is_contiguous(), kind, name,
                      "output and input must be contiguous (use a flat buffer or .contiguous())")

    # -- debug check -------------------------------------------------------------------------------------------

    def exchange_device(self, tensor: Optional[torch.Tensor]) -> torch.device:
        if tensor is not None:
            return tensor.device
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _check_consistency(self, kind: str, tensor: Optional[torch.Tensor], input_numel: int,
                           output_numel: int, op: str = "", src: int = -1, name: str = "",
                           record_kind: str = "") -> None:
        """The debug check, before each collective while it is on (``debug``, or ``check_every_collective``); the
        sequence it numbers is of the collectives checked. ``record_kind``: the kind the collective's progress
        record will have, where it differs from ``kind`` (what runs: see ``_issue``). See [Note: why check before
        every collective] in _consistency.py."""
        self._sequence += 1
        descriptor = CollectiveDescriptor(
            kind=kind, dtype=str(tensor.dtype).replace("torch.", "") if tensor is not None else "",
            input_numel=input_numel, output_numel=output_numel, op=op, src=src, name=name,
            call_site=caller_outside_comm(), sequence=self._sequence,
        )
        device = self.exchange_device(tensor)
        mine = torch.tensor([descriptor.signature_hash()], dtype=torch.int64, device=device)
        hashes = torch.empty(self.world_size, dtype=torch.int64, device=device)
        with record_function("zero3::debug_check"):
            work, _ = self._issuer.all_gather(hashes, mine)  # no finalize: the list form writes into `hashes`
            # A check that never completes (ranks checking on different groups) is a stall diagnosed with the
            # record of the collective held back, as the next one will be numbered: not a wait without end.
            held = CollectiveRecord(self.progress.seq + 1, record_kind or kind, descriptor.dtype, input_numel, name,
                                    self.progress.phase, self.progress.step)
            Pending(work, hashes, None, held, self.watchdog, held=True).wait()
        if not hashes_disagree(hashes):
            return
        descriptors: list = [None] * self.world_size
        dist.all_gather_object(descriptors, descriptor, group=self.group)
        raise CollectiveMismatchError(mismatch_message(descriptors, self.world_size))

    # -- collectives -------------------------------------------------------------------------------------------

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                               name: str = "") -> Pending:
        """Gather every rank's ``input`` into ``output`` (rank r's data at ``output.view(-1)[r*n:(r+1)*n]``).

        ``output`` must hold world_size x input.numel() elements. Counts the output bytes. On gloo with CPU tensors
        it runs as an all-to-all (see [Note: gloo's all-gather as an all-to-all] in _backend.py; recorded for the
        watchdog as the all-to-all it is).
        """
        kind = "all_gather"
        # The checks: the common case in one test (this runs before every collective), the message only on failure.
        if not (output.dtype == input.dtype and output.device == input.device and output.is_contiguous()
                and input.is_contiguous() and output.numel() == input.numel() * self.world_size):
            self._check_pair(kind, name, output, input)
            self._require(False, kind, name,
                          f"output has {output.numel()} elements; expected world_size x input = "
                          f"{self.world_size} x {input.numel()} = {self.world_size * input.numel()}")
        plan = self._issuer.all_gather_plan(input)
        if self._checking[0]:
            self._check_consistency(kind, input, input.numel(), output.numel(), name=name, record_kind=plan)
        return self._issue(kind, plan, name, input.dtype, input.numel(), output.numel() * output.element_size(),
                           self._issuer.all_gather, (output, input, plan), output, async_op)

    def gathers_peers_only(self, input: torch.Tensor) -> bool:
        """Whether ``all_gather_peers`` can gather ``input`` here: where the all-gather runs as an all-to-all or as
        sends and receives (gloo, CPU tensors: [Note: gloo's all-gather as an all-to-all] and [Note: gloo's gathers
        as sends and receives] in _backend.py). The same answer on every rank."""
        return self._issuer.all_gather_plan(input) != "all_gather"

    def all_gather_peers(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                         name: str = "") -> Pending:
        """``all_gather_into_tensor`` for a caller that reads this rank's row from ``input`` itself: ``output`` holds
        the other ranks' rows only, ``(world_size - 1) x input.numel()`` elements in rank order. Only where
        ``gathers_peers_only(input)``. Counted and checked as the all-gather it stands for; recorded for the watchdog as
        what runs (``CollectiveIssuer.all_gather_plan``: an all-to-all, or sends and receives above world 2)."""
        kind = "all_gather"
        world_size = self.world_size
        # all_gather_into_tensor's check with another row count, written out as there: one call less a collective
        if not (output.dtype == input.dtype and output.device == input.device and output.is_contiguous()
                and input.is_contiguous() and output.numel() == input.numel() * (world_size - 1)):
            self._check_pair(kind, name, output, input)
            self._require(False, kind, name,
                          f"output has {output.numel()} elements; expected (world_size - 1) x input = "
                          f"{world_size - 1} x {input.numel()} = {(world_size - 1) * input.numel()}")
        plan = self._issuer.all_gather_plan(input)
        if plan == "all_gather":
            self._require(False, kind, name, "all_gather_peers runs only where gathers_peers_only(input) (here the "
                          "backend's own all-gather runs); use all_gather_into_tensor")
        if self._checking[0]:
            self._check_consistency(kind, input, input.numel(), input.numel() * world_size, name=name,
                                    record_kind=plan)
        return self._issue(kind, plan, name, input.dtype, input.numel(),
                           input.numel() * world_size * input.element_size(), self._issuer.all_gather_peers,
                           (output, input, plan), output, async_op)

    @property
    def groups_all_gathers(self) -> bool:
        """Whether ``all_gather_grouped`` saves something here: on NCCL a group of all-gathers is one launch; gloo
        runs the group as its collectives one by one (and slower than separate ones, bench/gather_probe.py)."""
        return "nccl" in self.backend.lower()  # as CollectiveIssuer reads it (a "cpu:gloo,cuda:nccl" group too)

    def all_gather_grouped(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], async_op: bool = False,
                           name: str = "") -> Pending:
        """``all_gather_into_tensor`` of each pair, issued as one call of the backend (one group on NCCL): one
        collective as the counters, the progress records and the debug check see it, of all the pairs' elements.
        ``tensor`` of the result is ``outputs[0]``; wait before reading any of them."""
        kind = "all_gather"
        if len(outputs) != len(inputs) or not outputs:
            raise ValueError(f"all_gather {name!r} on rank {self.rank}: {len(outputs)} outputs for {len(inputs)} "
                             "inputs; expected as many of each, at least one")
        numel = nbytes = 0
        for output, input in zip(outputs, inputs):
            if not (output.dtype == input.dtype and output.device == input.device and output.is_contiguous()
                    and input.is_contiguous() and output.numel() == input.numel() * self.world_size):
                self._check_pair(kind, name, output, input)
                self._require(False, kind, name,
                              f"an output has {output.numel()} elements; expected world_size x input = "
                              f"{self.world_size} x {input.numel()} = {self.world_size * input.numel()}")
            numel += input.numel()
            nbytes += output.numel() * output.element_size()
        if self._checking[0]:
            self._check_consistency(kind, inputs[0], numel, numel * self.world_size, name=name)
        return self._issue(kind, kind, name, inputs[0].dtype, numel, nbytes, self._issuer.all_gather_grouped,
                           (outputs, inputs), outputs[0], async_op)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: str = "avg",
                              async_op: bool = False, name: str = "", input_is_scratch: bool = False) -> Pending:
        """Reduce ``input`` across ranks with ``op`` ("sum" or "avg") and keep this rank's slice in ``output``.

        ``input`` must hold world_size x output.numel() elements; rank r receives the reduced
        ``input.view(-1)[r*n:(r+1)*n]``. Counts the input bytes. On gloo with CPU tensors it runs as an all-to-all and
        a sum (see [Note: gloo's reduce-scatter as an all-to-all] in _backend.py; recorded for the watchdog as the
        all-to-all it is; ``reduce_scatter_workspace`` says what it holds). ``input_is_scratch``: the caller does not
        read ``input`` afterwards, so where gloo's own reduce-scatter would copy it (CUDA tensors), it is all-reduced
        in place ([Note: gloo's reduce-scatter is an all-reduce of a copy]; recorded as that all-reduce).
        """
        kind = "reduce_scatter"
        if op not in _REDUCE_SCATTER_OPS:
            raise ValueError(f"reduce_scatter {name!r}: op={op!r} is not supported; use one of {_REDUCE_SCATTER_OPS}")
        if not (output.dtype == input.dtype and output.device == input.device and output.is_contiguous()
                and input.is_contiguous() and input.numel() == output.numel() * self.world_size):
            self._check_pair(kind, name, output, input)  # the message only on failure, as in all_gather
            self._require(False, kind, name,
                          f"input has {input.numel()} elements; expected world_size x output = "
                          f"{self.world_size} x {output.numel()} = {self.world_size * output.numel()}")
        if op == "avg" and not input.is_floating_point():
            self._require_float_for_avg(kind, name, op, input)
        plan = self._issuer.reduce_scatter_plan(input, input_is_scratch)
        if self._checking[0]:
            self._check_consistency(kind, input, input.numel(), output.numel(), op=op, name=name, record_kind=plan)
        return self._issue(kind, plan, name, input.dtype, input.numel(), input.numel() * input.element_size(),
                           self._issuer.reduce_scatter, (output, input, op, plan), output, async_op)

    def reduce_scatter_workspace(self, input: torch.Tensor) -> int:
        """Bytes a ``reduce_scatter_tensor`` of ``input`` holds beside its buffers until it completes (the received
        rows of [Note: gloo's reduce-scatter as an all-to-all]; at world 2 only the peer's: [Note: gloo's
        reduce-scatter at world 2]), for the caller's memory accounting."""
        if self._issuer.reduce_scatter_plan(input, True) == "all_to_all":
            received = input.numel() // 2 if self.world_size == 2 else input.numel()
            return received * input.element_size()
        return 0

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                          name: str = "") -> Pending:
        """Rank r sends chunk j of ``input`` (``world_size`` equal chunks) to rank j, which stores it as chunk r of
        ``output``. Equal sizes only. Counts the input bytes."""
        kind = "all_to_all"
        if not (output.dtype == input.dtype and output.device == input.device and output.is_contiguous()
                and input.is_contiguous() and output.numel() == input.numel()
                and input.numel() % self.world_size == 0):
            self._check_pair(kind, name, output, input)  # the message only on failure, as in all_gather
            self._require(False, kind, name,
                          f"input ({input.numel()}) and output ({output.numel()}) must have the same number of "
                          f"elements, a multiple of world_size {self.world_size}")
        if self._checking[0]:
            self._check_consistency(kind, input, input.numel(), output.numel(), name=name)
        return self._issue(kind, kind, name, input.dtype, input.numel(), input.numel() * input.element_size(),
                           self._issuer.all_to_all, (output, input), output, async_op)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False, name: str = "") -> Pending:
        """Reduce ``tensor`` in place across ranks with ``op`` ("sum", "avg", "max" or "min"). Counts its bytes."""
        kind = "all_reduce"
        if op not in _REDUCE_OPS:
            reduce_op(op)  # raises the ValueError that names the ops, before anything is exchanged
        if not tensor.is_contiguous():  # the message only on failure, as in all_gather
            self._require(False, kind, name, "tensor must be contiguous")
        if op == "avg" and not tensor.is_floating_point():
            self._require_float_for_avg(kind, name, op, tensor)
        if self._checking[0]:
            self._check_consistency(kind, tensor, tensor.numel(), tensor.numel(), op=op, name=name)
        return self._issue(kind, kind, name, tensor.dtype, tensor.numel(), tensor.numel() * tensor.element_size(),
                           self._issuer.all_reduce, (tensor, op), tensor, async_op)

    def gather(self, output: Optional[torch.Tensor], input: torch.Tensor, dst: int = 0, async_op: bool = False,
               name: str = "") -> Pending:
        """Gather every rank's ``input`` into ``output`` on rank ``dst`` (rank r's data at
        ``output.view(-1)[r*n:(r+1)*n]``); ``output`` is None on the other ranks. For what only one rank writes (a
        save's whole tensors): an all-gather would hold the whole tensor on every rank. Counts world_size x input
        bytes on every rank. Watched as every collective here, so a rank that never calls it is named, not waited
        for without end."""
        kind = "gather"
        if not (0 <= dst < self.world_size and input.is_contiguous() and (output is None) == (self.rank != dst)):
            self._require(0 <= dst < self.world_size, kind, name, f"dst={dst} is not a rank of this group "
                          f"(0..{self.world_size - 1})")
            self._require(input.is_contiguous(), kind, name, "input must be contiguous")
            self._require(False, kind, name, f"output must be given on rank dst={dst} and only there")
        total = input.numel() * self.world_size
        if output is not None and not (output.dtype == input.dtype and output.device == input.device
                                       and output.is_contiguous() and output.numel() == total):
            self._check_pair(kind, name, output, input)
            self._require(False, kind, name,
                          f"output has {output.numel()} elements; expected world_size x input = "
                          f"{self.world_size} x {input.numel()} = {total}")
        if self._checking[0]:
            self._check_consistency(kind, input, input.numel(), total, src=dst, name=name)
        return self._issue(kind, kind, name, input.dtype, input.numel(), total * input.element_size(),
                           self._issuer.gather, (output, input, dst), output, async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False, name: str = "") -> Pending:
        """Copy ``tensor`` from rank ``src`` (a rank of this communicator's group) to every rank. Counts its bytes."""
        kind = "broadcast"
        if not (0 <= src < self.world_size and tensor.is_contiguous()):  # the message only on failure
            self._require(0 <= src < self.world_size, kind, name, f"src={src} is not a rank of this group "
                          f"(0..{self.world_size - 1})")
            self._require(False, kind, name, "tensor must be contiguous")
        if self._checking[0]:
            self._check_consistency(kind, tensor, tensor.numel(), tensor.numel(), src=src, name=name)
        return self._issue(kind, kind, name, tensor.dtype, tensor.numel(), tensor.numel() * tensor.element_size(),
                           self._issuer.broadcast, (tensor, src), tensor, async_op)

    def all_gather_object(self, obj: Any) -> list:
        """Every rank's picklable ``obj``, indexed by rank. For small metadata (e.g. order checks), not tensors."""
        if self._checking[0]:
            self._check_consistency("object", None, 0, 0)
        record = self._record("object", None, 0, "")
        gathered: list = [None] * self.world_size
        with record_function("zero3::object"):
            try:
                dist.all_gather_object(gathered, obj, group=self.group)  # synchronous: not a sliced wait
            except RuntimeError as error:  # the backend's own error (a peer's connection closed...)
                if self.watchdog is None or isinstance(error, DistributedError):
                    raise
                self.watchdog.fail(record, error)  # raises the DistributedError naming the rank at fault
        self._count("object", len(pickle.dumps(obj)))
        return gathered

    def barrier(self) -> None:
        """Wait until every rank of the group reaches this point. Not counted."""
        if self._checking[0]:
            self._check_consistency("barrier", None, 0, 0)
        record = self._record("barrier", None, 0, "")
        with record_function("zero3::barrier"):
            work = dist.barrier(group=self.group, async_op=True)
        Pending(work, torch.empty(0), None, record, self.watchdog).wait()

    def _require_float_for_avg(self, kind: str, name: str, op: str, tensor: torch.Tensor) -> None:
        if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):  # the message only on failure
            self._require(False, kind, name,
                          f"op='avg' needs a floating-point tensor, got {tensor.dtype}; use op='sum' and divide "
                          "yourself")
