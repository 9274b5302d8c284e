"""The one exception type for a checkpoint that cannot be used as asked."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not fit the model/engine loading it.

    The message names the file or parameter and what differs. Every rank of a collective load raises it together
    (a rank that found no problem itself names the rank that did), so no rank is left waiting in a collective.
    """
