"""The gather unit: one module (or a leaf module's subtree) and the parameters its hooks gather, with their lifecycle.

A ``ParamUnit`` is what the rest of the engine talks to about a group of parameters that are gathered together
(FSDP2's ``FSDPParamGroup`` is the model): which module it is and its qualified name, its parameters (its own, and
the external ones that joined it, with O(1) membership), and three steps:

- ``unshard(name)``: issue the gather of those of its parameters that are not gathered yet (asynchronous);
- ``wait_for_unshard()``: wait for that gather and for prefetches in flight that cover its parameters, count them
  in the live budget, and count this unit as one more user of each;
- ``reshard(...)``: this unit stops using its parameters; those the release rule allows are released.

Which units run when is the coordinator's business (coordinator.py: the trace, prefetching, the live budget); the
units of an engine share one ``LiveParams`` (the gathers in flight and the gathered elements counted), because a
prefetch covers the parameters of several units in one collective and a parameter (a tied weight) can be in
several units. ``coordinator.units`` lists them in module order: later work (regional compilation, device meshes)
attaches to a unit.

[Note: the release rule]
Whether a gathered parameter may be freed now is decided by ``releasable`` (over a list of parameters) and nowhere
else. Every place that frees a parameter during training asks it first: through ``release_if_unused`` when making
room under ``stage3_max_live_parameters``, at the end of what a forward held and at a ``GatheredParameters`` block's
exit; through ``release_unused`` at the coordinator's end of step and when traced regions take their parameters
(traced.py); and a unit's reshard after its module ran asks it directly, once for all of the unit's parameters (it
returns which ones it refused only because of the trace, too). All release through ``_release``: the parameters the rule
let go, in one call (``foreach_release``, ``LiveParams.forget_each``). A parameter stays gathered while any of these
holds:

* it is not whole: in flight (a gather is writing it) or already released;
* it is persistent (small parameters at stage 3, all of them at stages 1-2);
* a running module uses it (``active_users``: nested calls, a weight shared by several modules);
* a user holds it (``held_by_user``): a ``GatheredParameters`` block, or the engine holding it to the end of the
  step (``hold_for_step``: read by the model's forward outside every unit, or returned by a module);
* it is frozen and activation recomputation is running (``keep_frozen``; see [Note: frozen parameters in
  recomputation] in hooks.py);
* the step follows the recorded trace and the trace says it is used again soon (its ``NextUse``): within
  ``max_reuse_distance`` gathered elements, or, for a parameter shared by several modules, later in the same pass
  (see [Note: shared parameters stay within a pass] in coordinator.py). Such a parameter is *kept*: the live budget
  gives it up first when a fetch needs room (the budget asks the rule again, without the trace part).
"""

from __future__ import annotations

from typing import NamedTuple

import torch.nn as nn

from .gather import GatherWork
from .partition import ParamStatus, ShardedParam, foreach_release

__all__ = ["LiveParams", "NextUse", "ParamUnit", "releasable", "release_if_unused", "release_unused",
           "releases", "reused_soon"]


class NextUse(NamedTuple):
    """When the recorded trace uses a parameter next, seen from the event that just ended."""

    distance: int | None  # gathered elements fetched before that use (None: not used again this step)
    again_in_pass: bool  # shared by several modules and used again in the same pass (forward or backward)


def releasable(params, next_uses: list[NextUse] | None = None, max_reuse_distance: int = 0,
               keep_frozen: bool = False) -> tuple[list[ShardedParam], list[ShardedParam]]:
    """The release rule (see [Note: the release rule]) over ``params``: (free, kept), those that may be released
    now, and those refused only because the trace reuses them soon. ``next_uses``: the trace's ``NextUse`` of each
    of ``params``, in order (None when the step does not follow a trace)."""
    free, kept = [], []
    for i, p in enumerate(params):
        if p.status is not ParamStatus.AVAILABLE or p.is_persistent or p.active_users or p.held_by_user:
            continue
        if keep_frozen and not p.param.requires_grad:
            continue
        if next_uses is not None and reused_soon(next_uses[i], max_reuse_distance):
            kept.append(p)
            continue
        free.append(p)
    return free, kept


def reused_soon(use: NextUse, max_reuse_distance: int) -> bool:
    """The trace's part of the release rule: a parameter whose next use is ``use`` is kept gathered (the
    coordinator's look-ahead asks it too: [Note: a released parameter is prefetched in order])."""
    distance, again_in_pass = use
    return again_in_pass or (distance is not None and distance < max_reuse_distance)


_releases = 0  # parameters released through the release rule so far (this process): see releases()


def release_if_unused(p: ShardedParam, next_use: NextUse | None = None, max_reuse_distance: int = 0,
                      keep_frozen: bool = False) -> bool:
    """Release ``p`` if the release rule allows it, keeping its engine's live count right. True if released."""
    free, _ = releasable((p,), None if next_use is None else (next_use,), max_reuse_distance, keep_frozen)
    if free:
        _release(free)
    return bool(free)


def release_unused(params: list[ShardedParam], keep_frozen: bool = False) -> list[ShardedParam]:
    """Release each of ``params`` (no duplicates) that the release rule without the trace allows, in one call (the
    coordinator's end of step); the ones released."""
    free, _ = releasable(params, keep_frozen=keep_frozen)
    if free:
        _release(free)
    return free


def _release(params: list[ShardedParam]) -> None:
    """Release ``params``, which the release rule just allowed, in one call (its callers: ``release_if_unused``,
    ``release_unused`` and a unit's ``reshard``)."""
    global _releases
    foreach_release(params)
    _releases += len(params)
    LiveParams.forget_each(params)


def releases() -> int:
    """How many parameters the release rule has let go so far. While it does not change, no parameter went from
    gathered (or in flight) back to its shard during a step: the coordinator's prefetch skips the events ahead it
    found gathered (see [Note: the prefetch frontier] in coordinator.py)."""
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
        inflight = self.inflight
        for p in params:
            inflight[id(p)] = work
            if p.live_owner is not self:  # count(p), inline: this runs for every gathered parameter
                p.live_owner = self
                self.numel += p.padded_numel
        self.peak_numel = max(self.peak_numel, self.numel)
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

    @staticmethod
    def forget_each(params: list[ShardedParam]) -> None:
        """Each of ``params`` was released (the release rule's ``_release``): no longer kept nor counted by the
        engine counting it."""
        for p in params:
            live = p.live_owner
            if live is not None:
                if live.kept:
                    live.kept.pop(id(p), None)
                p.live_owner = None
                live.numel -= p.padded_numel

    def unkeep(self, params: list[ShardedParam]) -> None:
        if self.kept:  # usually empty (max_reuse_distance 0, no shared weight): no walk
            for p in params:
                self.kept.pop(id(p), None)

    def issue_missing(self, params: list[ShardedParam], name: str) -> GatherWork | None:
        """Issue the gather of those of ``params`` that hold only their shard (None if there are none)."""
        missing = []
        for p in params:  # a loop, not a comprehension (one frame less per fetch)
            if p.status is ParamStatus.NOT_AVAILABLE:
                missing.append(p)
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
        self.param_ids = {id(p) for p in params}  # O(1) membership (``p in unit``, or id(p) in it on a hot path)
        # the same, by their nn.Parameters: what a forward reads (external.py checks a read against it)
        self.read_ids = {id(p.param) for p in params}
        self.externals: set[int] = set()  # ids of parameters it gathers without owning them (external.py)
        self._work: GatherWork | None = None  # its gather issued by unshard, until wait_for_unshard

    def __contains__(self, p: ShardedParam) -> bool:
        return id(p) in self.param_ids

    def __repr__(self) -> str:
        return f"ParamUnit({self.name}, {len(self.params)} params)"

    # ---- membership (external.py) --------------------------------------------------------------------------------
    def add_external(self, p: ShardedParam) -> bool:
        """``p`` is gathered with this unit from now on; False if it already was."""
        if id(p) in self.param_ids:
            return False
        self.params.append(p)
        self.param_ids.add(id(p))
        self.read_ids.add(id(p.param))
        self.externals.add(id(p))
        return True

    def remove_external(self, p: ShardedParam) -> None:
        if id(p) in self.externals:
            self.externals.discard(id(p))
            self.param_ids.discard(id(p))
            self.read_ids.discard(id(p.param))
            self.params.remove(p)

    # ---- lifecycle -----------------------------------------------------------------------------------------------
    def missing_numel(self) -> int:
        """Elements a gather of this unit would make live (its parameters holding only their shard)."""
        numel = 0
        for p in self.params:
            if p.status is ParamStatus.NOT_AVAILABLE:
                numel += p.padded_numel
        return numel

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

    def reshard(self, next_uses: list[NextUse] | None = None, max_reuse_distance: int = 0,
                keep_frozen: bool = False) -> tuple[list[ShardedParam], list[ShardedParam]]:
        """This unit no longer uses its parameters: release those the release rule allows, in one call.
        ``next_uses``: the trace's ``NextUse`` of each of ``self.params``, in order (None when the step does not
        follow a trace). Returns (kept, released): kept, the parameters kept only because the trace reuses them soon
        (the caller keeps them in ``LiveParams.kept``)."""
        for p in self.params:
            if p.active_users:
                p.active_users -= 1
        released, kept = releasable(self.params, next_uses, max_reuse_distance, keep_frozen)
        if released:
            _release(released)
        return kept, released
