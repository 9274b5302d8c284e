"""The step fingerprint: ranks that ran different collectives in a step, paired up by shape, raise before the update.

[Note: step fingerprint]
At the accumulation boundary, before the optimizer touches anything, each rank takes the CRC of this step's records
(kind, dtype, size, name, phase, step of each); the ranks then compare it in a collective they run anyway, before
any update. With ZeRO over a flat world the gradient norm's all-reduce (a sum, over every rank) carries it: the 32
bits of the CRC as 32 more float64 elements, each summed to 0 or to the world size exactly when every rank has the
same bit there (exact at any world size), so the comparison costs no collective of its own. Otherwise (stage 0,
whose norm needs no all-reduce, or a mesh, whose norm is summed over the shard group only) it is one 2-element
all-reduce of its own (max of [crc, -crc]) when the verdict is read. Equal everywhere -> go on. Otherwise the ranks
exchange the records (error path only) and raise RankDivergenceError naming the first difference, with parameters,
masters and optimizer states untouched. This catches what the stall watchdog cannot see: same-shaped collectives
that paired up across different modules (mixed data in the gathered weights and gradients, never applied). The
verdict stays on the device until the optimizer reads it on the host together with the gradient norm, in the step's
one synchronisation (StepFingerprint; see [Note: host syncs per step] in zero/optimizer.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from zero_engine.comm._records import CollectiveRecord, describe_pair
from zero_engine.comm.watchdog import BRANCH_ADVICE
from zero_engine.errors import RankDivergenceError

__all__ = ["StepFingerprint", "check_step_fingerprint"]


def check_step_fingerprint(comm, device: Optional[torch.device] = None) -> None:
    """See [Note: step fingerprint]. Collective; call at the accumulation boundary before any update. ``device``:
    the parameters' device (where the engine's collectives run); the communicator's default when not given.
    The engine splits this in three (``StepFingerprint.start``; ``carry`` by the gradient norm's all-reduce or its
    own in ``agreement``; ``check`` with the value read in the step's one host synchronisation: see [Note: host
    syncs per step] in zero/optimizer.py)."""
    fingerprint = StepFingerprint.start(comm, device)
    agree = fingerprint.agreement()
    fingerprint.check(agree is None or bool(agree))


class StepFingerprint:
    """This step's CRC, taken; whether the ranks agree is a device tensor once compared (``carry`` or
    ``agreement``), read on the host by ``check``."""

    def __init__(self, comm, crc: int, records: list, device: Optional[torch.device]):
        self.comm = comm
        self.crc = crc
        self.records = records
        self.device = device
        self.agree: Optional[torch.Tensor] = None  # 0-dim bool on the collectives' device once compared
        # one rank, or a fake group (one process standing for every rank: its collectives combine no values):
        # nothing to compare
        self.compared = comm.world_size == 1 or comm.backend == "fake"

    @classmethod
    def start(cls, comm, device: Optional[torch.device] = None) -> "StepFingerprint":
        """Take this step's CRC (the records since the last one); no collective, no host sync."""
        crc, records = comm.progress.take_step_fingerprint()
        return cls(comm, crc, records, device)

    def carry(self, values: torch.Tensor, comm) -> Optional[torch.Tensor]:
        """Sum-all-reduce the 1-D float64 ``values`` over ``comm`` with this fingerprint's comparison in the same
        collective, and return them summed; None (nothing issued) when it cannot ride on it: compared already, or
        ``comm`` is not the fingerprint's (every rank's) communicator."""
        if self.compared or comm is not self.comm:
            return None
        self.compared = True
        bits = self._on_device([(self.crc >> i) & 1 for i in range(32)], torch.float64)
        both = torch.cat([values, bits])
        comm.all_reduce(both, op="sum", name="grad norm and step fingerprint")
        if both.device.type != "meta":
            sums = both[values.numel():]
            self.agree = ((sums == 0) | (sums == comm.world_size)).all()
        return both[:values.numel()]

    def agreement(self) -> Optional[torch.Tensor]:
        """Whether the ranks agree (0-dim bool on the device; None: nothing to compare). Compares now, with an
        all-reduce of its own (max of [crc, -crc]: equal everywhere iff max(crc) == -max(-crc)), if no collective
        carried the comparison."""
        if not self.compared:
            self.compared = True
            both = self._on_device([self.crc, -self.crc], torch.int64)
            self.comm.all_reduce(both, op="max", name="step fingerprint")
            self.comm.progress.forget_step_record("step fingerprint")  # compares steps: belongs to none
            if both.device.type != "meta":
                self.agree = both[0] == -both[1]
        return self.agree

    def _on_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """``values`` on the collectives' device without a host sync: torch.tensor(..., device=cuda) waits for its
        own copy, a second host sync per step (seen on an H100 with set_sync_debug_mode). Made pinned, so the copy
        is a real DMA and the caching host allocator keeps the block until the copy is done."""
        device = torch.device(self.device if self.device is not None else self.comm.exchange_device(None))
        host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
        return host if device.type == "cpu" else host.to(device, non_blocking=True)

    def check(self, agree: bool) -> None:
        """``agree``: ``self.agree`` as read on the host (the same on every rank). Collective when they disagree."""
        if agree:
            return
        comm = self.comm
        described = comm.all_gather_object([r.as_list() for r in self.records])
        comm.progress.take_step_fingerprint()
        per_rank = [[CollectiveRecord.from_list(v) for v in rank_records] for rank_records in described]
        length = max(len(rs) for rs in per_rank)
        for i in range(length):
            here = [rs[i] if i < len(rs) else None for rs in per_rank]
            reference = next(r for r in here if r is not None)
            if all(r is not None and r.same_collective(reference) for r in here):
                continue
            parts = []
            for rank, rec in enumerate(here):
                other = reference if rec is None or not rec.same_collective(reference) else next(
                    (r for r in here if r is not None and not r.same_collective(rec)), rec)
                text = describe_pair(rec, other)[0] if rec is not None else "no more collectives in this step"
                parts.append(f"rank {rank}: {text}")
            raise RankDivergenceError(
                f"ranks ran different collectives in step {comm.progress.step} (step fingerprints differ; the "
                f"collectives paired up, so their data is mixed); first difference at this step's collective #{i + 1}: "
                f"{'; '.join(parts)}. The optimizer step was not taken: parameters, master weights and optimizer "
                f"states are as before this step. {BRANCH_ADVICE}.")
        raise RankDivergenceError(f"step {comm.progress.step}: step fingerprints differ across ranks but the records "
                                  f"agree (hash collision?): {BRANCH_ADVICE}.")
