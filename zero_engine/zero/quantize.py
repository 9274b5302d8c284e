"""ZeRO++ qwZ and qgZ: parameter all-gathers in int8, gradient reduction in int4, both blockwise with fp32 scales.

``zero_optimization.zero_quantized_weights`` (qwZ, stage 3): each forward/backward gather quantizes this rank's
shard, all-gathers the int8 values and their scales in one collective, and dequantizes every rank's piece into the
parameter's own ``full`` storage (the same storage the exact strategies write: see partition.py's notes). The
shards, the fp32 masters and the optimizer never see a quantized value, so quantization error does not accumulate in
the weights: each step's forward and backward read weights within one quantization step of the exact ones. A
gather's bytes are 1 + 4 / 256 per element instead of 2 (bf16): 0.508 x.

``zero_optimization.zero_quantized_gradients`` (qgZ, stage 3): each gradient bucket, laid out ``[world, per rank]``
as for the reduce-scatter (see [Note: gradient buffers] in grads.py), is quantized row by row to int4 (two values
a byte) and exchanged with one all-to-all: rank r receives every rank's row r, dequantizes the pieces and sums them
in fp32. Bytes per bucket: 0.5 + 4 / 256 per element, against 4 for the fp32 reduce-scatter (0.129 x) or 2 for a
bf16 one (0.258 x). See [Note: qgZ is one all-to-all].

[Note: the quantization format]
A tensor (a row of one) is cut into blocks of ``BLOCK`` elements (the last zero-padded); each block keeps
``scale = max |x| / qmax`` in fp32 and ``q = round(x / scale)`` in [-qmax, qmax] (qmax 127 for int8, 7 for int4:
symmetric, so zero stays exactly zero); the padding is not sent. Dequantized, every element is within
``scale / 2`` of its value: a relative error of at most 1/254 (int8) or 1/14 (int4) of its block's largest
magnitude. A row's payload is one uint8 tensor, the values then the scales' bytes, so a run of parameters or a
whole bucket is one collective. A block holding inf or nan gets a non-finite scale and dequantizes to non-finite
values, so an overflowing gradient is still seen by the engine's non-finite check (the step is skipped).

[Note: a shard's blocks are its own]
A gather of several parameters quantizes their shards in one payload, but each shard starts a block of its own, so
no scale spans two parameters (the blocks' padding is not sent: the bytes are those of quantizing each shard alone).
A block's scale is its largest magnitude, so a block shared with a neighbour rounded a parameter's values by that
neighbour's, and which neighbour a parameter has depends on which parameters one gather takes: the prefetch's
choice, which differs between the step that records the trace and the steps that follow it. A run resumed from a
checkpoint (whose first step records again) then read other weights than the uninterrupted run and trained to other
losses (bench/combinations.py found it: 0.004 in an fp16 loss, 0.0015 in fp32). Now the values a forward reads
depend on the weights alone.

[Note: what stays exact]
Persistent parameters (small, kept whole: biases, norms) are re-gathered after each step by the exact strategy, as
is every ``GatheredParameters`` and checkpoint gather: user-visible values are the real ones (but for a block
inside a forward on a weight the engine has gathered: it sees what the forward reads; gathered.py's [Note: edits
are compared with what the block found] keeps that rounding out of the shards). With hpZ
(zero/hpz.py) the forward's quantized gather fills the 16-bit secondary shards from the dequantized values, so
backward's gathers within the hpZ group move 16-bit copies of exactly the weights forward used (backward and
forward agree bit for bit; only the cross-group primary gather is quantized, where the bandwidth is scarce).
DeepSpeed differs here: its ``all_gather_coalesced`` (partition_parameters.py) quantizes the secondary-tensor
gathers too, from a secondary partition refreshed from the 16-bit shards after the step, so its backward reads a
second int8 rounding of the weights over the intra-node links. Ours spends 16-bit bytes within the hpZ group (a
node: the fast links) to keep one rounding and forward/backward consistency.
Gradients of a parameter that got one on some ranks only (presence.py) are reduced on their own, exactly.

[Note: qgZ is one all-to-all]
DeepSpeed's qgZ exchanges int4 pieces within the node, reduces, re-quantizes and exchanges again across nodes, so
each gradient is quantized twice and the inter-node hop carries 1/8 of the intra-node volume. Here the shard
group's ranks exchange once: each gradient is quantized once (one rounding per value instead of two) and each rank
sends (world - 1) / world of its quantized bucket, all of it across nodes for a flat group. The two-hop scheme
moves fewer inter-node bytes at large worlds; the one-hop scheme is exact to one rounding, needs no node topology,
and runs on any group the mesh gives (under MiCS, the shard group; the replicas' all-reduce stays exact).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .gather import _runs
from .partition import DIRECT_GATHER_NUMEL, ShardedParam

__all__ = ["BLOCK", "QuantizedGather", "QuantizedReduceScatter", "dequantize", "dequantize_shards", "payload_bytes",
           "quantize", "quantize_shards"]

BLOCK = 256  # elements per scale: 4 / 256 bytes of scale per element (1.6% of an int8 value, 3% of an int4 one)
WEIGHT_BITS = 8
GRADIENT_BITS = 4
_DEQUANTIZE_CHUNK = 1 << 22  # elements dequantized at once (bounds the fp32 temporary of a large parameter)


def _value_bytes(numel: int, bits: int) -> int:
    return math.ceil(numel * bits / 8)  # the last block's padding is not sent


def payload_bytes(numel: int, bits: int, block: int = BLOCK) -> int:
    """Bytes of one quantized row of ``numel`` elements: the values, then one fp32 scale per block."""
    return _value_bytes(numel, bits) + 4 * math.ceil(numel / block)


def quantize(rows: torch.Tensor, bits: int, block: int = BLOCK) -> torch.Tensor:
    """``rows`` [r, n] (any float dtype) -> uint8 [r, payload_bytes(n)], each row quantized on its own (see
    [Note: the quantization format])."""
    if bits not in (4, 8):
        raise ValueError(f"quantize: bits={bits}; use 8 or 4")
    r, n = rows.shape
    blocks = math.ceil(n / block)
    x = rows.float()
    if blocks * block != n:
        x = F.pad(x, (0, blocks * block - n))
    x = x.view(r, blocks, block)
    qmax = 2 ** (bits - 1) - 1
    scale = x.abs().amax(dim=2, keepdim=True) / qmax  # inf / nan where the block is: see the note
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.nan_to_num(x * inverse, nan=0.0, posinf=0.0, neginf=0.0).round_().clamp_(-qmax, qmax)
    out = torch.empty(r, payload_bytes(n, bits, block), dtype=torch.uint8, device=rows.device)
    values = _value_bytes(n, bits)
    q = q.view(r, -1)[:, : values * 8 // bits]  # whole bytes of values; the rest of the last block is padding
    if bits == 8:
        out[:, :values] = q.to(torch.int8).view(torch.uint8)
    else:  # two values a byte, offset to [1, 15]: low nibble first
        u = (q + 8).to(torch.uint8).view(r, -1, 2)
        out[:, :values] = u[..., 0] | (u[..., 1] << 4)
    out[:, values:] = scale.view(r, blocks).view(torch.uint8)
    return out


def dequantize(payload: torch.Tensor, numel: int, bits: int, block: int = BLOCK) -> torch.Tensor:
    """uint8 [r, payload_bytes(numel)] -> fp32 [r, numel]: the inverse of ``quantize`` (within half a step)."""
    r = payload.shape[0]
    blocks = math.ceil(numel / block)
    values = _value_bytes(numel, bits)
    # a copy of its own, 4-byte aligned: a single row's slice is already contiguous, at an odd offset
    scale = payload[:, values:].clone(memory_format=torch.contiguous_format).view(torch.float32).view(r, blocks, 1)
    raw = payload[:, :values]
    x = torch.zeros(r, blocks * block, dtype=torch.float32, device=payload.device)
    if bits == 8:
        x[:, :values] = raw.view(torch.int8)
    else:
        x[:, : 2 * values] = torch.stack(((raw & 15), (raw >> 4)), dim=-1).view(r, -1).to(torch.int8) - 8
    x = x.view(r, blocks, block).mul_(scale)
    return x.view(r, blocks * block)[:, :numel]


def quantize_shards(shards: list[torch.Tensor], bits: int = 8, block: int = BLOCK) -> torch.Tensor:
    """Several shards (1-D, any float dtype) -> uint8 [1, payload]: the shards' values back to back, then every
    block's fp32 scale, each shard cut into blocks of its own (see [Note: a shard's blocks are its own]). One shard is
    ``quantize``'s row. int8 only (qwZ: a value a byte, so the blocks' padding can be cut out of the values)."""
    if bits != 8:
        raise ValueError(f"quantize_shards: bits={bits}; qwZ's shards are int8")
    numels = [t.numel() for t in shards]
    widths, padded_numel = _whole_blocks(numels, block)
    x = torch.zeros(padded_numel, dtype=torch.float32, device=shards[0].device)
    torch._foreach_copy_([piece[:n] for piece, n in zip(x.split(widths), numels)], shards)
    padded = quantize(x.view(1, -1), bits, block)[0]  # whole blocks' values (the padding too), then the scales
    values, scales = padded[:padded_numel], padded[padded_numel:]
    return torch.cat([piece[:n] for piece, n in zip(values.split(widths), numels)] + [scales]).view(1, -1)


def dequantize_shards(payload: torch.Tensor, numels: list[int], bits: int = 8,
                      block: int = BLOCK) -> list[torch.Tensor]:
    """uint8 [r, payload] of ``quantize_shards`` -> one fp32 [r, n] per shard: the inverse (within half a step)."""
    r, total = payload.shape[0], sum(numels)
    widths, padded_numel = _whole_blocks(numels, block)
    padded = payload.new_zeros(r, padded_numel + payload.shape[1] - total)  # ``quantize``'s rows: padding put back
    torch._foreach_copy_([piece[:, :n] for piece, n in zip(padded[:, :padded_numel].split(widths, dim=1), numels)],
                         list(payload[:, :total].split(numels, dim=1)))
    padded[:, padded_numel:] = payload[:, total:]
    x = dequantize(padded, padded_numel, bits, block)
    return [piece[:, :n] for piece, n in zip(x.split(widths, dim=1), numels)]


def _whole_blocks(numels: list[int], block: int) -> tuple[list[int], int]:
    """Each shard's elements rounded up to whole blocks, and their sum."""
    widths = [-(-n // block) * block for n in numels]
    return widths, sum(widths)


# ---- qwZ: quantized all-gathers ---------------------------------------------------------------------------------------
@dataclass
class _QuantizedGatherWork:
    """A quantized gather in flight: ``runs`` are (received payload [world, bytes], its parameters); ``wait()``
    dequantizes each into its parameters' storage (the GatherWork interface)."""

    params: list[ShardedParam]
    numel: int
    accounting: object = None
    pending: list = field(default_factory=list)
    runs: list = field(default_factory=list)
    keep_alive: list = field(default_factory=list)  # the collectives' inputs, until wait() (streams.py's rule)
    done: bool = False

    @property
    def buffer_bytes(self) -> int:
        return sum(t.numel() for t in self.keep_alive) + sum(recv.numel() for recv, _ in self.runs)

    def wait(self) -> None:
        if self.done:
            return
        for handle in self.pending:
            handle.wait()
        for recv, run in self.runs:
            world, numels = recv.shape[0], [p.shard_numel for p in run]
            outs = [p.alloc_full().view(world, p.shard_numel) for p in run]
            rows = max(1, _DEQUANTIZE_CHUNK // max(1, sum(numels)))
            for start in range(0, world, rows):
                values = dequantize_shards(recv[start: start + rows], numels, WEIGHT_BITS)
                torch._foreach_copy_([o[start: start + rows] for o in outs], values)
        if self.accounting is not None:
            self.accounting.add("comm_buffers", -self.buffer_bytes)
        self.runs.clear()
        self.keep_alive.clear()
        for p in self.params:
            p.to_available()
        self.done = True


class QuantizedGather:
    """qwZ: stage-3 gathers in int8 + scales; ``exact`` (the configured strategy) does the refresh gathers of
    persistent parameters after a step (see [Note: what stays exact]).

    A parameter of at least ``DIRECT_GATHER_NUMEL`` elements is one collective, the smaller ones of a request one per
    ``bucket_numel`` elements, as the coalesced strategy; every collective's output is a staging payload (int8 cannot
    land in a 16-bit storage), dequantized into the parameters' storage by ``wait()``.
    """

    def __init__(self, exact, comm, bucket_numel: int, accounting=None, streams=None):
        self.exact = exact
        self.comm = comm
        self.bucket_numel = max(1, int(bucket_numel))
        self.accounting = accounting
        self.streams = streams
        self.name = f"{exact.name}, int8 (qwZ)"

    def issue(self, params: list[ShardedParam], name: str = "", refresh: bool = False):
        if refresh:
            return self.exact.issue(params, name=name, refresh=True)
        work = _QuantizedGatherWork(params=list(params), numel=sum(p.padded_numel for p in params),
                                    accounting=self.accounting)
        small = []
        for p in params:
            p.to_inflight()
            if p.padded_numel >= DIRECT_GATHER_NUMEL or getattr(p, "gather_sequential", False):
                self._gather(work, [p], name)
            else:
                small.append(p)
        for run in _runs(small, self.bucket_numel):
            self._gather(work, run, name)
        if self.accounting is not None:
            self.accounting.add("comm_buffers", work.buffer_bytes)
        return work

    def _gather(self, work: _QuantizedGatherWork, run: list[ShardedParam], name: str) -> None:
        # Quantized and allocated on the current stream, held by ``work`` until wait() (streams.py's rule for a
        # collective's buffers); only the collective runs on the all-gather stream.
        send = quantize_shards([p.shard for p in run], WEIGHT_BITS)
        recv = torch.empty(self.comm.world_size, send.numel(), dtype=torch.uint8, device=send.device)
        work.keep_alive.append(send)
        work.runs.append((recv, run))

        def issue():
            return self.comm.all_gather_into_tensor(recv, send, async_op=True, name=f"{name or run[0].fqn} (int8)")

        work.pending.append(issue() if self.streams is None else
                            self.streams.collective_on(self.streams.all_gather, issue))


# ---- qgZ: quantized gradient reduction --------------------------------------------------------------------------------
class _QuantizedReduce:
    """An issued qgZ exchange; ``wait()`` sums the dequantized pieces into ``out`` (fp32 sum, then the average)."""

    def __init__(self, pending, send: torch.Tensor, recv: torch.Tensor, out: torch.Tensor, accounting):
        self.pending, self.send, self.recv, self.out, self.accounting = pending, send, recv, out, accounting
        self.work = getattr(pending, "work", None)

    def wait(self) -> torch.Tensor:
        if self.recv is None:
            return self.out
        self.pending.wait()
        world = self.recv.shape[0]
        pieces = dequantize(self.recv, self.out.numel(), GRADIENT_BITS)  # [world, per rank]: every rank's piece
        self.out.copy_(pieces.sum(dim=0).div_(world))
        if self.recv.is_cuda:  # allocated on the reduce-scatter stream, read above on this one: free after it
            self.recv.record_stream(torch.cuda.current_stream(self.recv.device))
        if self.accounting is not None:
            self.accounting.add("comm_buffers", -2 * self.recv.numel())
        self.send = self.recv = None
        return self.out


class QuantizedReduceScatter:
    """qgZ: a reduce-scatter (op "avg") of a ``[world, per rank]`` gradient bucket as one int4 all-to-all; see
    [Note: qgZ is one all-to-all]. The gradient reducer calls it in place of ``comm.reduce_scatter_tensor``."""

    def __init__(self, accounting=None):
        self.accounting = accounting

    def reduce_scatter(self, comm, out: torch.Tensor, inp: torch.Tensor, name: str = "",
                       async_op: bool = True) -> _QuantizedReduce:
        world = comm.world_size
        send = quantize(inp.view(world, out.numel()), GRADIENT_BITS)
        recv = torch.empty_like(send)
        if self.accounting is not None:
            self.accounting.add("comm_buffers", 2 * send.numel())
        pending = comm.all_to_all_single(recv, send, async_op=True, name=f"{name} (int4)")
        result = _QuantizedReduce(pending, send, recv, out, self.accounting)
        if not async_op:
            result.wait()
            result.work = None  # done here: on CUDA, streams.collective_on then orders the compute stream after it
        return result
