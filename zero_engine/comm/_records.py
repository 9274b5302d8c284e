"""Collective progress records: what this rank issued, in order, kept cheaply for when ranks disagree.

[Note: progress records]
Every collective the Communicator issues gets the next sequence number and a small record: kind, dtype, element
count, name (module or bucket), and where the engine is -- phase (forward/backward/step/...) and global step, which
the engine sets on ``ProgressLog.phase`` / ``ProgressLog.step`` as it goes (two attribute writes per phase, nothing
more). The last ``capacity`` records stay in a ring buffer for the stall watchdog; with ``step_fingerprint`` (the
engine's ``zero_engine.step_fingerprint``) the records of the current step are also kept until the step's
fingerprint is taken, and folded into a CRC then (once a step, not per collective: no string is formatted on the
collective's path). Without it nothing takes them, so none are kept (a
list nobody drains would grow by every collective of every step). All of it is
local: the normal path exchanges nothing. Collectives pair up across ranks by order, so in a healthy job rank r's
record number n describes the same collective on every rank; the first number at which records differ is where
the ranks diverged.
"""

from __future__ import annotations

import collections
import zlib
from typing import NamedTuple, Optional

__all__ = ["CollectiveRecord", "ProgressLog"]


class CollectiveRecord(NamedTuple):
    seq: int
    kind: str  # all_gather, gather, reduce_scatter, all_reduce, broadcast, object, barrier
    dtype: str
    numel: int  # elements this rank contributes (the input)
    name: str  # module, bucket or purpose
    phase: str  # forward, backward, step, ... (see ProgressLog.phase)
    step: int  # the engine's global step when it was issued

    def describe(self) -> str:
        """'all_gather of blocks.3.attn (forward, step 2)'; size and dtype only when the names agree (see
        ``differs_only_in_size``)."""
        return f"{self.kind} of {self.name or '<unnamed>'} ({self.phase}, step {self.step})"

    def describe_full(self) -> str:
        return f"{self.describe()[:-1]}, {self.numel} {self.dtype} elements)"

    def same_collective(self, other: "CollectiveRecord") -> bool:
        return self[1:] == other[1:]

    def as_list(self) -> list:
        return list(self)

    @classmethod
    def from_list(cls, values: list) -> "CollectiveRecord":
        return cls(*values)


def describe_pair(a: CollectiveRecord, b: CollectiveRecord) -> tuple[str, str]:
    """How to tell two differing records apart in a message: with sizes when that is all that differs."""
    if a.describe() == b.describe():
        return a.describe_full(), b.describe_full()
    return a.describe(), b.describe()


class ProgressLog:
    """This rank's collective records (see [Note: progress records]).

    ``phase`` and ``step`` are plain attributes the engine writes; ``record`` is called by the Communicator once per
    collective.
    """

    def __init__(self, capacity: int = 64, step_fingerprint: bool = False) -> None:
        self.phase = "setup"
        self.step = 0
        self.module = ""  # the module whose parameters were fetched last (ZeRO-3), for messages
        self.seq = 0  # records issued so far; the next one gets seq + 1
        self.recent: collections.deque[CollectiveRecord] = collections.deque(maxlen=capacity)
        self.step_fingerprint = step_fingerprint  # keep this step's records and CRC for take_step_fingerprint
        self.step_records: list[CollectiveRecord] = []

    def record(self, kind: str, dtype: str, numel: int, name: str) -> CollectiveRecord:
        self.seq += 1
        rec = CollectiveRecord(self.seq, kind, dtype, numel, name, self.phase, self.step)
        self.recent.append(rec)
        if self.step_fingerprint:
            self.step_records.append(rec)  # folded into the CRC when the fingerprint is taken, not per collective
        return rec

    @property
    def last(self) -> Optional[CollectiveRecord]:
        return self.recent[-1] if self.recent else None

    def take_step_fingerprint(self) -> tuple[int, list[CollectiveRecord]]:
        """The CRC of the records since the last call and those records; starts the next step's fingerprint."""
        if not self.step_fingerprint:
            raise RuntimeError("take_step_fingerprint: this rank's progress log keeps no step records; create the "
                               "Communicator with step_fingerprint=True (the engine does when "
                               "zero_engine.step_fingerprint is true)")
        records, self.step_records = self.step_records, []
        crc = 0
        for r in records:
            crc = zlib.crc32(f"{r.kind}|{r.dtype}|{r.numel}|{r.name}|{r.phase}|{r.step};".encode(), crc)
        return crc, records

    def forget_step_record(self, name: str) -> None:
        """Drop the last record of this step's fingerprint if it is the collective ``name`` (one that compares
        steps, like the fingerprint's own all-reduce, and belongs to none)."""
        if self.step_records and self.step_records[-1].name == name:
            self.step_records.pop()

    def position(self) -> str:
        """Where this rank is, in words, for heartbeats and lost-rank messages."""
        last = self.last
        where = f"{self.phase}, step {self.step}" + (f", module {self.module}" if self.module else "")
        if last is None:
            return f"no collective issued yet ({where})"
        return f"collective #{last.seq} {last.describe()}; now in {where}"
