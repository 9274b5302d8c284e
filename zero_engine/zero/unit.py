"""The gather unit: one module (or a leaf module's subtree) and the parameters its hooks gather, with their lifecycle.

A ``ParamUnit`` is what the rest of the engine talks to about a group of parameters that are gathered together
(FSDP2's ``FSDPParamGroup`` is the model): which module it is and its qualified name, its parameters (its own, and
the external ones that joined it, with O(1) membership), and three steps:

- ``unshard(name)``: issue the gather of those of its parameters that are not gathered yet (asynchronous);
- ``wait_for_unshard()``: wait for that gather and for prefetches in flight that cover its parameters, count them
  in the live budget, and count this unit as one more user of each;
- ``reshard(...)``: this unit stops using its parameters; each one that ``may_release`` allows is released.

Which units run when is the coordinator's business (coordinator.py: the trace, prefetching, the live budget); the
units of an engine share one ``LiveParams`` (the gathers in flight and the gathered elements counted), because a
prefetch covers the parameters of several units in one collective and a parameter (a tied weight) can be in
several units. ``coordinator.units`` lists them in module order: later work (regional compilation, device meshes)
attaches to a unit.

[Note: the release rule]
Whether a gathered parameter may be freed now is decided by ``may_release`` and nowhere else. Every place that
frees a parameter during training asks it first: through ``release_if_unused`` at the coordinator's end of step,
making room under ``stage3_max_live_parameters``, the end of what a forward held, and a ``GatheredParameters``
block's exit; a unit's reshard after its module ran asks it directly (once per parameter, as it also needs to know
whether a refusal came from the trace alone) and releases through the same ``_release``. A parameter stays gathered while any of these holds:

* it is not whole: in flight (a gather is writing it) or already released;
* it is persistent (small parameters at stage 3, all of them at stages 1-2);
* a running module uses it (``active_users``: nested calls, a weight shared by several modules);
* a user holds it (``held_by_user``): a ``GatheredParameters`` block, or the engine holding it to the end of the
  step (``hold_for_step``: read by the model's forward outside every unit, or returned by a module);
* it is frozen and activation recomputation is running (``keep_frozen``; see [Note: frozen parameters in
  recomputation] in hooks.py);
* the step follows the recorded trace and the trace says it is used again soon (``next_use``): within
  ``max_reuse_distance`` gathered elements, or, for a parameter shared by several modules, later in the same pass
  (see [Note: shared parameters stay within a pass] in coordinator.py). Such a parameter is *kept*: the live budget
  gives it up first when a fetch needs room (the budget asks the rule again, without the trace part).
"""

from __future__ import annotations

from typing import NamedTuple

import torch.nn as nn

from .gather import GatherWork
from .partition import ParamStatus, ShardedParam

__all__ = ["LiveParams", "NextUse", "ParamUnit", "may_release", "release_if_unused", "releases"]


class NextUse(NamedTuple):
    """When the recorded trace uses a parameter next, seen from the event that just ended."""

    distance: int | None  # gathered elements fetched before that use (None: not used again this step)
    again_in_pass: bool  # shared by several modules and used again in the same pass (forward or backward)


def may_release(p: ShardedParam, next_use: NextUse | None = None, max_reuse_distance: int = 0,
                keep_frozen: bool = False) -> bool:
    """The release rule: see [Note: the release rule]."""
    if p.status is not ParamStatus.AVAILABLE or p.is_persistent or p.active_users or p.held_by_user:
        return False
    if keep_frozen and not p.param.requires_grad:
        return False
    if next_use is None:
        return True
    reused_soon = next_use.distance is not None and next_use.distance < max_reuse_distance
    return not (reused_soon or next_use.again_in_pass)


_releases = 0  # parameters released through release_if_unused so far (this process): see releases()


def release_if_unused(p: ShardedParam, **rule) -> bool:
    """Release ``p`` if ``may_release(p, **rule)`` allows it, keeping its engine's live count right. True if
    released."""
    if not may_release(p, **rule):
        return False
    _release(p)
    return True


def _release(p: ShardedParam) -> None:
    """Release ``p``, which ``may_release`` just allowed (its callers: ``release_if_unused`` and a unit's
    ``reshard``, which asks the rule once per parameter)."""
    global _releases
    p.release()
    _releases += 1
    if p.live_owner is not None:
        p.live_owner.forget(p)


def releases() -> int:
    """How many parameters ``release_if_unused`` has released so far. While it does not change, no parameter went
    from gathered (or in flight) back to its shard during a step: the coordinator's prefetch skips the events ahead
    it found gathered (see [Note: the prefetch frontier] in coordinator.py)."""
    return _releases


class LiveParams:
    """What one engine has gathered: the gathers in flight, the elements counted against ``max_live_parameters``,
    and the parameters kept after their module ran because the trace reuses them soon."""

    def __init__(self, gatherer):
        self.gatherer = gatherer
        self.inflight: dict[int, GatherWork] = {}  # id(ShardedParam) -> the work that gathers it
        self.kept: dict[int, ShardedParam] = {}  # released by their modules but kept for a near reuse, oldest first
        self.numel = self.peak_numel = 0

    def issue(self, params: list[ShardedParam], name: str) -> GatherWork:
        work = self.gatherer.issue(params, name=name)
        for p in params:
            self.inflight[id(p)] = work
            self.count(p)
        return work

    def wait(self, work: GatherWork) -> None:
        work.wait()
        for p in work.params:
            self.inflight.pop(id(p), None)

    def wait_all(self) -> None:
        for work in list(self.inflight.values()):
            self.wait(work)

    def acquire(self, params: list[ShardedParam], users: int = 0) -> None:
        """Wait for the gathers in flight that cover ``params``, count them (gathered and live) and ``users`` more
        users of each."""
        for p in params:
            if p.status is ParamStatus.INFLIGHT:
                self.wait(self.inflight[id(p)])
            if p.live_owner is None:  # gathered outside the coordinator (GatheredParameters): count it now
                self.count(p)
            p.active_users += users

    def count(self, p: ShardedParam) -> None:
        if p.live_owner is self:  # already counted (released behind our back and gathered again)
            return
        p.live_owner = self
        self.numel += p.padded_numel
        self.peak_numel = max(self.peak_numel, self.numel)

    def forget(self, p: ShardedParam) -> None:
        """``p`` was released (``release_if_unused``): no longer kept nor counted."""
        self.kept.pop(id(p), None)
        if p.live_owner is self:
            p.live_owner = None
            self.numel -= p.padded_numel

    def unkeep(self, params: list[ShardedParam]) -> None:
        if self.kept:  # usually empty (max_reuse_distance 0, no shared weight): no walk
            for p in params:
                self.kept.pop(id(p), None)

    def issue_missing(self, params: list[ShardedParam], name: str) -> GatherWork | None:
        """Issue the gather of those of ``params`` that hold only their shard (None if there are none)."""
        missing = [p for p in params if p.status is ParamStatus.NOT_AVAILABLE]
        return self.issue(missing, name) if missing else None


class ParamUnit:
    """One gather unit (units.py says which modules are units and which parameters each gathers)."""

    def __init__(self, module: nn.Module, name: str, params: list[ShardedParam], index: int, live: LiveParams):
        self.module = module
        self.name = name
        self.prefetch_name = f"prefetch after {name}"  # the name of the gathers issued after it ran (built once)
        self.index = index  # position in coordinator.units
        self.params = params  # own parameters first, then the external ones that joined (grows in place)
        self.live = live
        self._ids = {id(p) for p in params}
        self.param_ids = {id(p.param) for p in params}  # of their nn.Parameters: a forward's reads (external.py)
        self.externals: set[int] = set()  # ids of parameters it gathers without owning them (external.py)
        self._work: GatherWork | None = None  # its gather issued by unshard, until wait_for_unshard

    def __contains__(self, p: ShardedParam) -> bool:
        return id(p) in self._ids

    def __repr__(self) -> str:
        return f"ParamUnit({self.name}, {len(self.params)} params)"

    # ---- membership (external.py) --------------------------------------------------------------------------------
    def add_external(self, p: ShardedParam) -> bool:
        """``p`` is gathered with this unit from now on; False if it already was."""
        if id(p) in self._ids:
            return False
        self.params.append(p)
        self._ids.add(id(p))
        self.param_ids.add(id(p.param))
        self.externals.add(id(p))
        return True

    def remove_external(self, p: ShardedParam) -> None:
        if id(p) in self.externals:
            self.externals.discard(id(p))
            self._ids.discard(id(p))
            self.param_ids.discard(id(p.param))
            self.params.remove(p)

    # ---- lifecycle -----------------------------------------------------------------------------------------------
    def missing_numel(self) -> int:
        """Elements a gather of this unit would make live (its parameters holding only their shard)."""
        return sum(p.padded_numel for p in self.params if p.status is ParamStatus.NOT_AVAILABLE)

    def unshard(self, name: str | None = None) -> None:
        """Issue the gather of what is missing (asynchronous; ``wait_for_unshard`` waits). The caller made room
        under the live budget first (the coordinator's ``_make_room``)."""
        self._work = self.live.issue_missing(self.params, name or self.name)

    def wait_for_unshard(self) -> None:
        """Every parameter gathered (waits for this unit's gather, then for prefetches in flight that cover it),
        counted as live, and this unit one more user of each (until ``reshard``)."""
        if self._work is not None:
            self.live.wait(self._work)
            self._work = None
        self.live.acquire(self.params, users=1)

    def reshard(self, next_use=None, max_reuse_distance: int = 0,
                keep_frozen: bool = False) -> tuple[list[ShardedParam], list[ShardedParam]]:
        """This unit no longer uses its parameters: release each one the release rule allows. ``next_use(p)``: the
        trace's ``NextUse`` of ``p`` (None when the step does not follow a trace). Returns (kept, released): kept,
        the parameters kept only because the trace reuses them soon (the caller keeps them in
        ``LiveParams.kept``)."""
        kept, released = [], []
        for p in self.params:
            if p.active_users:
                p.active_users -= 1
            if p.is_persistent:  # never released (the rule's first test, here without a call)
                continue
            use = next_use(p) if next_use is not None else None
            if may_release(p, next_use=use, max_reuse_distance=max_reuse_distance, keep_frozen=keep_frozen):
                _release(p)
                released.append(p)
            elif use is not None and may_release(p, keep_frozen=keep_frozen):
                # refused only because the trace reuses it soon (the trace part only ever adds a refusal); in use,
                # held, not whole, or frozen (released at the end of the step): neither released nor kept
                kept.append(p)
        return kept, released
