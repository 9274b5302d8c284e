"""Side streams and events for collectives on CUDA; on any other device every call is a no-op (today's behaviour).

    streams = CommStreams(device)
    with streams.issue_on(streams.all_gather):      # waits for the work queued so far on the compute stream
        pending = comm.all_gather_into_tensor(out, inp, async_op=True)
    ...
    pending.wait()                                  # NCCL: the current (compute) stream waits; the host does not
    done = streams.record()                         # an event after the consumer, for whoever reuses the buffer

[Note: streams, events and buffer lifetime]
This follows FSDP2 (``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``, ``_fsdp_collectives.py``):

* Two side streams of high priority, one for all-gathers and one for reduce-scatters, so that the next layer's
  gather and the previous layer's gradient reduction overlap the current layer's kernels. A side stream first
  waits for the compute stream (``issue_on``): the shard a gather reads and the gradient a reduce-scatter reads
  were written there.
* The consumer orders itself after the collective without blocking the host: ``Pending.wait()`` on an NCCL work
  makes the *current* stream wait for NCCL's stream (``work.wait()`` is a stream dependency, not a host sync), and
  an event recorded on a side stream is waited with ``current_stream().wait_event`` when the consumer needs the
  side stream's own kernels (a copy-out, an accumulation) as well.
* Buffers are allocated on the compute stream (the caller allocates before entering ``issue_on``), never on a side
  stream. The caching allocator hands a freed block back only to allocations on the stream that allocated it, so
  a block of the compute stream is reused only by later compute-stream work; and every side-stream use starts by
  waiting for the compute stream, which by then has waited for the collective that read or wrote the block. So a
  released parameter's storage (``resize_(0)``) or a dropped send buffer is never reused while a collective or
  kernel still reads it, with no ``record_stream`` (which would delay the reuse of every such block to an
  unknown later point). The one requirement on callers: keep a reference to a buffer a side stream reads until
  the compute stream has waited for that side stream's work (``Pending.wait()`` or ``wait(event)``).
* No host synchronisation: nothing here calls ``synchronize()`` or ``.item()``. The step's documented host syncs
  are the global grad norm / overflow check (one scalar, zero_engine/zero/optimizer.py) and checkpoint I/O.
* Host<->device copies (``to_device`` / ``to_host``) are ``non_blocking`` only where that is safe: from pinned
  memory into the device, and into pinned host memory whose reader first waits on the returned event.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch

__all__ = ["CommStreams", "to_device", "to_host"]


class CommStreams:
    """The all-gather and reduce-scatter side streams of one device (None off CUDA) and event helpers."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.all_gather: Optional[torch.cuda.Stream] = None
        self.reduce_scatter: Optional[torch.cuda.Stream] = None
        if self.is_cuda:
            # -1: higher than the compute stream's 0 (lower numbers run first; CUDA clamps to its range), as FSDP2
            self.all_gather = torch.cuda.Stream(self.device, priority=-1)
            self.reduce_scatter = torch.cuda.Stream(self.device, priority=-1)

    def current(self) -> Optional[torch.cuda.Stream]:
        return torch.cuda.current_stream(self.device) if self.is_cuda else None

    @contextlib.contextmanager
    def issue_on(self, stream: Optional[torch.cuda.Stream]) -> Iterator[None]:
        """Run the enclosed code on ``stream`` after everything queued so far on the current stream."""
        if stream is None:
            yield
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield

    def collective_on(self, stream: Optional[torch.cuda.Stream], issue: Callable[[], object]):
        """Issue a collective (``issue()`` returns a comm ``Pending``) from ``stream``; see the note above.

        Allocate its buffers before calling this (on the current stream). An asynchronous collective is ordered
        before its consumer by ``Pending.wait()``; a synchronous one (no work handle left) completed on ``stream``,
        so the current stream waits for it here, without the host waiting."""
        if stream is None:
            return issue()
        with self.issue_on(stream):
            pending = issue()
            if getattr(pending, "work", None) is not None:
                return pending
            done = stream.record_event()
        torch.cuda.current_stream(self.device).wait_event(done)
        return pending

    def record(self, stream: Optional[torch.cuda.Stream] = None) -> Optional[torch.cuda.Event]:
        """An event after the work queued so far on ``stream`` (the current stream by default); None off CUDA."""
        if not self.is_cuda:
            return None
        return (stream or torch.cuda.current_stream(self.device)).record_event()

    def wait(self, event: Optional[torch.cuda.Event]) -> None:
        """Make the current stream wait for ``event`` (the host does not wait); no-op for None."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def __repr__(self) -> str:
        return f"CommStreams({self.device}, side streams: {'yes' if self.is_cuda else 'no (not CUDA)'})"


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy ``host`` to ``device``; asynchronous (ordered on the current stream) when ``host`` is pinned.

    From pageable memory the copy is synchronous: a non_blocking copy from pageable memory is staged through a
    pinned bounce buffer by the driver anyway and gains nothing."""
    device = torch.device(device)
    if host.device == device:
        return host
    return host.to(device, non_blocking=device.type == "cuda" and host.is_pinned())


def to_host(tensor: torch.Tensor, out: Optional[torch.Tensor] = None) -> Optional[torch.cuda.Event]:
    """Copy a device tensor into host tensor ``out`` (pinned for an asynchronous copy); returns the event to wait
    on (``event.synchronize()`` before the host reads ``out``), or None when the copy has already completed."""
    if out is None:
        raise ValueError("to_host: pass out= (a host tensor of the same shape; pinned for an asynchronous copy)")
    asynchronous = tensor.device.type == "cuda" and out.is_pinned()
    out.copy_(tensor, non_blocking=asynchronous)
    return torch.cuda.current_stream(tensor.device).record_event() if asynchronous else None
