"""Issue collectives on whatever the process group's backend supports, emulating the gaps.

The communicator speaks in four logical collectives (all-gather into one tensor, reduce-scatter from one tensor,
all-reduce, broadcast) with ops sum/avg/max/min. Backends differ in what they implement natively:

* torch 2.13's gloo supports all of them (checked: ``all_gather_single``, ``reduce_scatter_single`` and
  ``ReduceOp.AVG`` all work, sync and async, for float32/bfloat16/float16).
* older gloo builds lack the single-tensor all-gather / reduce-scatter and ``ReduceOp.AVG``.

[Note: native first, then emulate]
Rather than keep a table of versions, each capability is tried natively on first use. A backend that lacks an op
refuses it synchronously, at dispatch and before any byte is exchanged, with the same error on every rank (same
build, same backend), so every rank switches to the emulation together and no collective is left half-issued. The
decision is cached per backend name and logged once. An error that does not read like "unsupported" is re-raised
untouched, so a real bug is never hidden behind an emulation.

Emulations keep async work async: the emulated collective is issued with ``async_op`` and whatever has to happen
after it (copying this rank's slice out, dividing by the world size for "avg") is returned as a ``finalize``
callable that ``Pending.wait()`` runs once the work has completed.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

Finalize = Optional[Callable[[], None]]

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}

# Phrases backends use when they refuse an op they do not implement ("no support for _reduce_scatter_base in Gloo
# process group", "Cannot use ReduceOp.AVG with Gloo", "... is not supported", "not implemented").
_UNSUPPORTED_PATTERN = re.compile(r"support|cannot use|not implemented|unimplemented", re.IGNORECASE)

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
    """What one backend runs natively. ``None`` means not tried yet (see [Note: native first, then emulate])."""

    all_gather_single: Optional[bool] = None
    reduce_scatter_single: Optional[bool] = None
    avg: Optional[bool] = None
    logged: set = field(default_factory=set)


_support_by_backend: dict[str, BackendSupport] = {}


def support_for(backend: str) -> BackendSupport:
    """The (mutable, shared) capability record for a backend name; tests may pre-set fields to force emulation."""
    return _support_by_backend.setdefault(str(backend), BackendSupport())


def _is_unsupported_error(error: BaseException) -> bool:
    return isinstance(error, (RuntimeError, NotImplementedError, ValueError)) and bool(
        _UNSUPPORTED_PATTERN.search(str(error))
    )


def _note_emulation(support: BackendSupport, backend: str, capability: str, how: str, error: BaseException) -> None:
    if capability not in support.logged:
        support.logged.add(capability)
        logger.info("rank %d: backend %s lacks %s (%s); emulating it with %s", dist.get_rank(), backend, capability,
                    error, how)


class _RunOnce:
    """Wrap a finalize step so that calling Pending.wait() twice does not, e.g., divide by the world size twice."""

    def __init__(self, step: Callable[[], None]) -> None:
        self._step: Optional[Callable[[], None]] = step

    def __call__(self) -> None:
        step, self._step = self._step, None
        if step is not None:
            step()


def _finish(work, finalize: Finalize, async_op: bool):
    """Return (work, finalize) for async calls; for sync calls complete everything now and return (None, None)."""
    if async_op:
        return work, (_RunOnce(finalize) if finalize is not None else None)
    if work is not None:
        work.wait()
    if finalize is not None:
        finalize()
    return None, None


class CollectiveIssuer:
    """Issues the four logical collectives on one process group, natively where possible."""

    def __init__(self, group, backend: str, world_size: int) -> None:
        self.group = group
        self.backend = str(backend)
        self.world_size = world_size
        self.support = support_for(self.backend)
        if "nccl" in self.backend.lower():
            # NCCL runs all_gather_into_tensor, reduce_scatter_tensor and AVG natively: never emulate on that path
            # (an emulation would add a full-size copy per reduce-scatter and hide a real NCCL error).
            self.support = BackendSupport(all_gather_single=True, reduce_scatter_single=True, avg=True)

    # -- avg ---------------------------------------------------------------------------------------------------

    def _reduce_with_avg_fallback(self, issue: Callable[[dist.ReduceOp], object], result: torch.Tensor, op: str,
                                  async_op: bool, capability_name: str):
        """Run ``issue(reduce_op)``; for "avg" on a backend without AVG, issue SUM and divide when it completes."""
        if op != "avg" or self.support.avg is not False:
            try:
                work = issue(reduce_op(op))
                if op == "avg":
                    self.support.avg = True
                return _finish(work, None, async_op)
            except Exception as error:  # noqa: BLE001 -- only "unsupported" errors are swallowed, see below
                if op != "avg" or not _is_unsupported_error(error) or self.support.avg:
                    raise
                self.support.avg = False
                _note_emulation(self.support, self.backend, f"ReduceOp.AVG in {capability_name}",
                                "SUM followed by a division by the world size", error)
        work = issue(dist.ReduceOp.SUM)
        world_size = self.world_size
        return _finish(work, lambda: result.div_(world_size), async_op)

    # -- the four collectives ------------------------------------------------------------------------------------

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool):
        if self.support.all_gather_single is not False:
            try:
                work = _all_gather_single(output, input, group=self.group, async_op=async_op)
                self.support.all_gather_single = True
                return _finish(work, None, async_op)
            except Exception as error:  # noqa: BLE001
                if not _is_unsupported_error(error) or self.support.all_gather_single:
                    raise
                self.support.all_gather_single = False
                _note_emulation(self.support, self.backend, "all_gather_into_tensor",
                                "all_gather into per-rank views of the output", error)
        # The per-rank chunks are views of `output`, so the list form writes straight into it: no extra copy.
        chunks = list(output.view(-1).chunk(self.world_size))
        work = dist.all_gather(chunks, input.reshape(-1), group=self.group, async_op=async_op)
        return _finish(work, None, async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str, async_op: bool):
        if self.support.reduce_scatter_single is not False:
            try:
                issued = self._reduce_with_avg_fallback(
                    lambda torch_op: _reduce_scatter_single(output, input, op=torch_op, group=self.group,
                                                            async_op=async_op),
                    output, op, async_op, "reduce_scatter_tensor")
                self.support.reduce_scatter_single = True
                return issued
            except Exception as error:  # noqa: BLE001
                # Once it has worked natively, a later failure is a real error, never a reason to emulate.
                if not _is_unsupported_error(error) or self.support.reduce_scatter_single:
                    raise
                self.support.reduce_scatter_single = False
                _note_emulation(self.support, self.backend, "reduce_scatter_tensor",
                                "all_reduce of a copy of the input, then a copy of this rank's slice", error)
        # Emulation costs one temporary copy of the full input (the caller's input must stay untouched).
        reduced = input.detach().reshape(-1).clone()
        rank = dist.get_rank(self.group)
        my_slice = reduced.chunk(self.world_size)[rank]

        def copy_my_slice() -> None:
            output.view(-1).copy_(my_slice)

        def issue(torch_op):
            return dist.all_reduce(reduced, op=torch_op, group=self.group, async_op=True)

        if op == "avg" and self.support.avg is False:
            work = issue(dist.ReduceOp.SUM)
            world_size = self.world_size
            return _finish(work, lambda: (copy_my_slice(), output.div_(world_size)), async_op)
        # Issue async internally so the slice copy can be deferred to wait(); avg support is probed on the way.
        work, finalize = self._reduce_with_avg_fallback(issue, reduced, op, async_op=True,
                                                        capability_name="all_reduce")

        def complete() -> None:
            if finalize is not None:
                finalize()
            copy_my_slice()

        return _finish(work, complete, async_op)

    def all_reduce(self, tensor: torch.Tensor, op: str, async_op: bool):
        return self._reduce_with_avg_fallback(
            lambda torch_op: dist.all_reduce(tensor, op=torch_op, group=self.group, async_op=async_op),
            tensor, op, async_op, "all_reduce")

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool):
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        work = dist.broadcast(tensor, src=global_src, group=self.group, async_op=async_op)
        return _finish(work, None, async_op)
