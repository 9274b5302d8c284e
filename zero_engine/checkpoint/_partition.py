"""Which saved shards hold a range of a parameter: the arithmetic of resharding.

A parameter of ``numel`` elements saved over ``world`` ranks was flattened, padded to ``shard_numel * world``
(``shard_numel = ceil(numel / world)``) and cut into equal slices: saved rank ``k`` holds elements
``[k * shard_numel, (k + 1) * shard_numel)`` of the padded flat tensor. Only the first ``numel`` are data; the
padding is zeros and is never read back.

Loading at another world size, a rank needs the elements its new shard covers. Those lie in at most
``ceil(new shard / old shard) + 1`` old shards, each contributing one contiguous run: ``pieces`` lists them. The
same function serves consolidation (the range is the whole parameter) and same-size loads (one piece).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Piece", "owned_range", "pieces"]


class Piece(NamedTuple):
    rank: int  # the saved rank whose shard holds these elements
    src_start: int  # offset inside that rank's shard
    dst_start: int  # offset inside the requested range
    length: int


def owned_range(numel: int, shard_numel: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of the real (unpadded) elements a rank holds; empty for a rank holding only padding."""
    start = min(rank * shard_numel, numel)
    return start, min(start + shard_numel, numel)


def pieces(numel: int, shard_numel: int, start: int, stop: int) -> list[Piece]:
    """The runs of saved shards that make up elements ``[start, stop)`` of a parameter, in order."""
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"range [{start}, {stop}) is not inside a parameter of {numel} elements")
    if shard_numel < 1:
        raise ValueError(f"shard_numel={shard_numel} must be positive")
    out = []
    position = start
    while position < stop:
        rank = position // shard_numel
        run_end = min(stop, (rank + 1) * shard_numel)
        out.append(Piece(rank, position - rank * shard_numel, position - start, run_end - position))
        position = run_end
    return out
