"""Debug mode: check that every rank is about to issue the same collective, and fail loudly instead of hanging.

[Note: why check before every collective]
Collectives match up by order alone. If rank 1 gathers a 10-element shard while rank 0 gathers 11 elements, or
rank 1 all-reduces while rank 0 all-gathers, the job either hangs until the backend's timeout or, worse, completes
with garbage. In debug mode each rank first describes the collective it is about to issue (kind, dtype, sizes, op,
source rank, name) and the ranks compare descriptions. The comparison must itself be cheap and must never hang on
a mismatch, so it is one fixed-size all-gather of a 64-bit hash per rank; only when the hashes differ do the ranks
exchange the full descriptions (with the caller's file:line) to build the message. Every rank sees the same hashes,
so every rank takes the same branch and every rank raises the same error.

The call site is not part of the hash: two ranks may legitimately reach the same collective through different code
paths. The name is part of it: gathering "blocks.0" on one rank while another gathers "blocks.1" is exactly the
ordering bug this mode exists to catch.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections import Counter
from typing import NamedTuple, Sequence

import torch

from zero_engine.errors import RankDivergenceError

_COMM_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


class CollectiveMismatchError(RankDivergenceError):
    """Ranks were about to issue different collectives. Raised on every rank of the group, with the same message,
    before any of them was issued (the group can still be used)."""


class CollectiveDescriptor(NamedTuple):
    """What one rank is about to issue; everything except ``call_site`` and ``sequence`` must agree across ranks."""

    kind: str
    dtype: str
    input_numel: int
    output_numel: int
    op: str
    src: int
    name: str
    call_site: str
    sequence: int

    def signature(self) -> tuple:
        return (self.kind, self.dtype, self.input_numel, self.output_numel, self.op, self.src, self.name)

    def signature_hash(self) -> int:
        # hashlib, not hash(): Python's str hash is salted per process, and every rank is its own process.
        digest = hashlib.blake2b(repr(self.signature()).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little", signed=True)

    def describe(self) -> str:
        parts = [f"dtype={self.dtype}", f"numel={self.input_numel}"]
        if self.output_numel != self.input_numel:
            parts.append(f"output_numel={self.output_numel}")
        if self.op:
            parts.append(f"op={self.op}")
        if self.src >= 0:
            parts.append(f"src={self.src}")
        parts.append(f"name={self.name!r}")
        return f"{self.kind}({', '.join(parts)}) at {self.call_site}"


def caller_outside_comm() -> str:
    """file:line (function) of the innermost frame that is not inside zero_engine/comm: who asked for the collective."""
    frame = sys._getframe(1)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _COMM_PACKAGE_DIR:
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    filename = frame.f_code.co_filename
    try:
        relative = os.path.relpath(filename)
        if not relative.startswith(".."):
            filename = relative
    except ValueError:  # a different drive on Windows
        pass
    return f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def hashes_disagree(hashes: torch.Tensor) -> bool:
    return bool((hashes != hashes[0]).any())


def mismatch_message(descriptors: Sequence[CollectiveDescriptor], group_size: int) -> str:
    """Group ranks by what they issued; the largest group (ties: the lowest rank) is taken as the intended one."""
    signature_counts = Counter(d.signature() for d in descriptors)
    intended = max(signature_counts, key=lambda sig: (signature_counts[sig], -_first_rank(descriptors, sig)))
    agreeing = [rank for rank, d in enumerate(descriptors) if d.signature() == intended]
    disagreeing = [rank for rank, d in enumerate(descriptors) if d.signature() != intended]

    by_description: dict[str, list[int]] = {}
    for rank, descriptor in enumerate(descriptors):
        by_description.setdefault(descriptor.describe(), []).append(rank)
    lines = [f"  ranks {ranks}: {description}" for description, ranks in by_description.items()]
    sequences = sorted({d.sequence for d in descriptors})
    return (
        f"ranks {disagreeing} issued a different collective than ranks {agreeing} "
        f"(collective #{'/'.join(map(str, sequences))} of this communicator, group of {group_size} ranks):\n"
        + "\n".join(lines)
        + "\nEvery rank must issue the same collectives in the same order with the same kind, dtype, size, op and "
        "name; look for a rank-dependent branch or a different module/parameter order at the call sites above."
    )


def _first_rank(descriptors: Sequence[CollectiveDescriptor], signature: tuple) -> int:
    return next(rank for rank, d in enumerate(descriptors) if d.signature() == signature)
