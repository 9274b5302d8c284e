"""The step fingerprint: ranks that ran different collectives in a step, paired up by shape, raise before the update.

[Note: step fingerprint]
At the accumulation boundary, before the optimizer touches anything, each rank's CRC of this step's records
(kind, dtype, size, name, phase, step of each) is compared with one 2-element all-reduce (max of [crc, -crc]). Equal
everywhere -> go on. Otherwise the ranks exchange the records (error path only) and raise RankDivergenceError
naming the first difference, with parameters, masters and optimizer states untouched. This catches what the stall
watchdog cannot see: same-shaped collectives that paired up across different modules (mixed data in the gathered
weights and gradients, never applied). The comparison stays on the device until the optimizer reads it on the host
together with the gradient norm, in the step's one synchronisation, before any update (StepFingerprint; see
[Note: host syncs per step] in zero/optimizer.py).
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
    The engine splits this in two (``StepFingerprint.start``, then ``check`` with the value read in the step's one
    host synchronisation: see [Note: host syncs per step] in zero/optimizer.py)."""
    fingerprint = StepFingerprint.start(comm, device)
    fingerprint.check(fingerprint.agree is None or bool(fingerprint.agree))


class StepFingerprint:
    """This step's fingerprint all-reduce, issued; whether the ranks agree is a device tensor until ``check``."""

    def __init__(self, comm, agree: Optional[torch.Tensor], records: list):
        self.comm = comm
        self.agree = agree  # 0-dim bool on the collectives' device; None: nothing to compare (one rank, meta)
        self.records = records

    @classmethod
    def start(cls, comm, device: Optional[torch.device] = None) -> "StepFingerprint":
        """Issue the all-reduce (max of [crc, -crc]: equal everywhere iff max(crc) == -max(-crc)); no host sync."""
        crc, records = comm.progress.take_step_fingerprint()
        if comm.world_size == 1:
            return cls(comm, None, records)
        device = device if device is not None else comm.exchange_device(None)
        # Made on the host and copied without blocking: torch.tensor(..., device=cuda) waits for its own copy, a
        # second host sync per step (seen on an H100 with set_sync_debug_mode). Pinned, so the copy is a real DMA
        # and the caching host allocator keeps the block until the copy is done.
        host = torch.tensor([crc, -crc], dtype=torch.int64, pin_memory=torch.device(device).type == "cuda")
        both = host.to(device, non_blocking=True)
        comm.all_reduce(both, op="max", name="step fingerprint")
        comm.progress.take_step_fingerprint()  # the fingerprint's own all-reduce belongs to no step
        return cls(comm, None if both.device.type == "meta" else both[0] == -both[1], records)

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
