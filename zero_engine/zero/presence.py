"""Which parameters get a gradient in a backward pass on some ranks but not on others (stage 3).

[Note: a gradient on some ranks only]
A branch taken on one rank only (``out + h @ extra if use_extra else out``) leaves ``extra`` without a gradient on
the other ranks. The reducer launches a bucket when all its parameters have reported; at stage 3 the all-gathers of
backward are interleaved with those launches, so a rank still waiting for ``extra`` would issue its next all-gather
while the rank that has it issues the bucket's reduce-scatter: the ranks would disagree on a collective.

Each rank walks its autograd graph from the loss to the parameters it will reach (one Python pass over the graph's
nodes), and one all-reduce of a presence count per parameter makes the result common knowledge. A parameter
reached on some ranks only is *irregular*: every rank leaves it out of its bucket's readiness (it contributes zeros
there) and reduces it on its own at the end of backward, where every rank is again in step. A parameter reached on
no rank needs nothing: its bucket already contributes zeros everywhere.

[Note: when the presence walk runs]
The walk and its all-reduce cost a pass over the graph and a host synchronisation (``.tolist()`` of the counts: on
CUDA the CPU waits there for the whole forward). They run only in a backward whose forward *records* the module
trace: the first step, a step whose forward left the recorded trace, and the first backward after the trace was
re-recorded at the end of a step (a backward-only change of order). Every rank takes the same decision, because the
trace is the same on every rank (the coordinator checks it). The other backwards reuse the recorded irregular set.

What this guarantees, and what it does not:
- A branch that is data-dependent *in the recorded pass* (a parameter reached on some ranks there) stays handled in
  every later pass, whichever ranks reach it then (irregular parameters are always reduced on their own).
- A branch that changes the module order (a module skipped or added on some rank) is a trace deviation: the walk
  runs again in that pass (and a different order across ranks is RankDivergenceError, see coordinator.py).
- Not detected before backward: a parameter that was reached on *every* rank (or on none) when the trace was
  recorded, and later is reached on some ranks only, inside a module that still runs everywhere (``extra`` above,
  where ``use_extra`` was the same on every rank in the first step). Finding that out before backward needs the walk
  and a host synchronisation in every pass, which is what this note avoids. In such a pass a rank missing the
  gradient holds its bucket back to the end of backward while the others reduce it at once. Where no collective
  comes between (the usual case with prefetching) the orders still match and the gradients are right (the missing
  one contributes zeros). Otherwise it is an error on every rank, never silently mixed gradients: same-sized
  collectives that paired up are RankDivergenceError at the step fingerprint (``zero_engine.step_fingerprint``, on
  by default); a stalled pair is RankDivergenceError
  from the watchdog after ``stall_timeout_s``; on gloo a pair of different sizes aborts one rank ("collective
  mismatch") and the others raise RankLostError waiting in that bucket's reduction
  (test_reliability.py::test_a_branch_on_some_ranks_only_that_starts_after_recording_fails_on_every_rank). Make
  such a branch visible in the first step (take it on some rank there), or use a separate module for it.
"""

from __future__ import annotations

import torch

from .partition import ShardedParam

__all__ = ["params_reached", "irregular_params", "GradientPresence"]


def params_reached(root: torch.Tensor) -> set[int]:
    """ids of the leaf tensors whose gradient a backward from ``root`` will accumulate."""
    reached: set[int] = set()
    if root.grad_fn is None:
        return reached
    seen = {root.grad_fn}
    stack = [root.grad_fn]
    while stack:
        node = stack.pop()
        variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf it accumulates into
        if variable is not None:
            reached.add(id(variable))
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return reached


def irregular_params(root: torch.Tensor, params: list[ShardedParam], comm, device: torch.device) -> set[int]:
    """ids of the ``params`` that a backward from ``root`` reaches on some ranks but not on all (one all-reduce)."""
    reached = params_reached(root)
    counts = torch.tensor([id(sp.param) in reached for sp in params], dtype=torch.int32, device=device)
    comm.all_reduce(counts, op="sum", name="gradient presence")
    if counts.device.type == "meta":
        return set()  # shape-only run (fake process group): there are no values
    world = comm.world_size
    return {id(sp) for sp, n in zip(params, counts.tolist()) if 0 < n < world}


class GradientPresence:
    """The irregular set of the last walked pass, walked again only when the trace is (re)recorded; see
    [Note: when the presence walk runs]."""

    def __init__(self, params: list[ShardedParam], comm, device: torch.device, coordinator):
        self.params = params
        self.comm = comm
        self.device = device
        self.coordinator = coordinator
        self.irregular: frozenset[int] = frozenset()
        self.walks = 0  # how many passes walked the graph (tests read it)
        self._walked_trace = None  # the trace the irregular set belongs to
        self._recorded_after = None  # walked while recording: the set belongs to the first trace recorded after this

    def irregular_for(self, root: torch.Tensor) -> frozenset[int]:
        """The irregular set for a backward from ``root``: walked (one all-reduce, one host sync) or reused."""
        trace, following = self.coordinator.trace, self.coordinator.follows_trace
        if self._recorded_after is not None and following and trace is not self._recorded_after[0]:
            self._walked_trace, self._recorded_after = trace, None  # recorded at the end of the walked pass
        if not following or trace is not self._walked_trace:
            if self.walks:  # the ranks' decision rests on the trace: agree before the collective
                self.comm.agree_before_next_collective()
            self.irregular = frozenset(irregular_params(root, self.params, self.comm, self.device))
            self.walks += 1
            # boxed: the trace before the first recording is None, which must differ from "nothing pending"
            self._walked_trace, self._recorded_after = (trace, None) if following else (None, (trace,))
        return self.irregular
