"""Which saved shards hold a range of a parameter: the arithmetic of resharding.

A parameter of ``numel`` elements saved over ``world`` ranks was flattened, padded to ``shard_numel * world``
(``shard_numel = ceil(numel / world)``) and cut into equal slices: saved rank ``k`` holds elements
``[k * shard_numel, (k + 1) * shard_numel)`` of the padded flat tensor. Only the first ``numel`` are data; the
padding is zeros and is never read back.

Loading at another world size, a rank needs the elements its new shard covers. Those lie in at most
``ceil(new shard / old shard) + 1`` old shards, each contributing one contiguous run: ``pieces`` lists them. The
same function serves consolidation (the range is the whole parameter) and same-size loads (one piece).

An expert parameter (``ep_size`` > 1, see [Note: checkpoints of expert parameters] in _metadata.py) is saved as
``ep_size`` pieces, its ep ranks' local tensors back to back; piece ``e`` is split as above over the expert-data-
parallel ranks, and its shard ``d`` is in the file of world rank ``d * ep_size + e``. A run then never crosses a
piece, and ``Piece.rank`` names that file.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Piece", "owned_range", "pieces"]


class Piece(NamedTuple):
    rank: int  # the saved rank whose shard holds these elements (its file's index)
    src_start: int  # offset inside that rank's shard
    dst_start: int  # offset inside the requested range
    length: int


def owned_range(numel: int, shard_numel: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of the real (unpadded) elements a rank holds; empty for a rank holding only padding."""
    start = min(rank * shard_numel, numel)
    return start, min(start + shard_numel, numel)


def pieces(numel: int, shard_numel: int, start: int, stop: int, ep_size: int = 1) -> list[Piece]:
    """The runs of saved shards that make up elements ``[start, stop)`` of a parameter, in order. ``ep_size``: the
    ep pieces an expert parameter was saved as (``shard_numel`` is then a piece's shard)."""
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"range [{start}, {stop}) is not inside a parameter of {numel} elements")
    if shard_numel < 1:
        raise ValueError(f"shard_numel={shard_numel} must be positive")
    if ep_size < 1 or numel % ep_size:
        raise ValueError(f"ep_size={ep_size} does not divide a parameter of {numel} elements into pieces")
    piece_numel = numel // ep_size
    out = []
    position = start
    while position < stop:
        piece, offset = divmod(position, piece_numel)
        shard = offset // shard_numel
        run_end = min(stop, piece * piece_numel + min((shard + 1) * shard_numel, piece_numel))
        out.append(Piece(shard * ep_size + piece, offset - shard * shard_numel, position - start,
                         run_end - position))
        position = run_end
    return out
