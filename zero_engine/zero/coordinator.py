"""The parameter coordinator: which parameters are gathered when, and when they are released.

On the first training step it records the order in which modules fetch their parameters (forward, activation
recomputation and backward alike): the *trace*. All ranks must record the same trace; that is checked once with
one small exchange and a difference is an error naming the first differing module, not a hang later. Before that
exchange, each collective of the recording step is checked across ranks as it is issued: see [Note: the recording
step is checked].

From the next step on, every fetch looks ahead in the trace and issues asynchronous gathers for the parameters the
next modules will need (up to ``prefetch_bucket_size`` elements, a whole unit at a time; about one parameter ahead
with the sequential strategy), never holding more than ``max_live_parameters`` gathered elements. A module's
parameters are released after it ran unless they are persistent (small), still used by another active module
(shared weights, nested calls), used again before ``max_reuse_distance`` more elements are gathered (0: never
kept), or shared by several modules and used again later in the same pass (see [Note: shared parameters stay
within a pass]).

If a step runs a different order than the trace (data-dependent control flow, the same on every rank), the
coordinator notices at the first differing fetch, stops prefetching for the rest of that step (on-demand gathers
are always correct), logs it once, and uses the newly recorded order from then on.

A parameter a forward reads without owning it joins the reader's unit, and one held for the rest of the step has
one more user until the step ends: see external.py.

[Note: the recording step is checked]
A step that leaves the recorded order holds its next gather back until every rank agrees on it (watchdog.py,
[Note: holding back a collective that may not match]). The step that records the order has none to leave, so a
rank-dependent branch there (a module only some ranks run) went unnoticed until the trace exchange at the end of
backward, if the gathers on the way paired up; where they did not (different sizes), gloo aborted a process
("Received data size doesn't match expected size") and the others could only report it lost. So while recording,
each collective is first checked across ranks (``Communicator.check_every_collective``: the ``debug_collectives``
check, one all-gather of an 8-byte hash), and ranks about to issue different ones raise
``CollectiveMismatchError`` (a ``RankDivergenceError``) on every rank, naming what each was about to issue, before
any of it is exchanged. Only the recording step pays for it (one small collective per collective, once); from the
next step on, a deviation is agreed on where it happens, as before. Evaluation forwards outside a training step
are not checked: a model used for inference only would otherwise pay it on every gather.
"""

from __future__ import annotations

import bisect
import logging
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..errors import RankDivergenceError
from . import external
from .._profiling import profile_range
from .partition import ParamStatus, ShardedParam
from .unit import LiveParams, NextUse, ParamUnit, release_if_unused, release_unused, releases, reused_soon

log = logging.getLogger("zero_engine.coordinator")

__all__ = ["ParamCoordinator", "TraceEvent"]


@dataclass(frozen=True)
class TraceEvent:
    module: str  # fully qualified module name
    phase: str  # "forward" or "backward"


@dataclass
class _Trace:
    events: list[TraceEvent]
    units: list[ParamUnit]
    params: list[list[ShardedParam]] = field(default_factory=list)  # each event's unit's parameter list
    start_numel: list[int] = field(default_factory=list)  # gathered elements fetched before each event
    # per event: id(p) -> the index of the next event that uses p (None: none), for each p of the event's unit
    next_index: list[dict[int, int | None]] = field(default_factory=list)
    uses: dict[int, list[int]] = field(default_factory=dict)  # id(ShardedParam) -> event indices using it
    shared: set[int] = field(default_factory=set)  # id(ShardedParam) of parameters used by several modules
    # (fetched_at, after) -> (the unit's parameters then, their NextUses, id(p) -> next event): see next_uses
    _next_uses: dict[tuple[int, int], tuple] = field(default_factory=dict)
    # per event: the latest earlier event after which the release rule frees one of its parameters (-1: none); see
    # released_before. None until the first following step needs it, and again when a unit's parameters change.
    release_before: list[int] | None = None

    def __post_init__(self):
        self.params = [unit.params for unit in self.units]
        total = 0
        users: dict[int, set[str]] = {}
        for i, params in enumerate(self.params):
            self.start_numel.append(total)
            total += sum(p.padded_numel for p in params)
            for p in params:
                self.uses.setdefault(id(p), []).append(i)
                users.setdefault(id(p), set()).add(self.events[i].module)
        self.shared = {key for key, modules in users.items() if len(modules) > 1}
        following: dict[int, int] = {}
        self.next_index = [{} for _ in self.params]
        for i in range(len(self.params) - 1, -1, -1):
            self.next_index[i] = {id(p): following.get(id(p)) for p in self.params[i]}
            following.update((id(p), i) for p in self.params[i])

    def next_event(self, p: ShardedParam, fetched_at: int, after: int) -> int | None:
        """The next event after event ``after`` that uses ``p``, which event ``fetched_at`` (<= ``after``) used."""
        key = id(p)
        table = self.next_index[fetched_at]
        if key in table and fetched_at <= after:
            nxt = table[key]
            while nxt is not None and nxt <= after:  # used between (a unit nested in the one ending): rare
                nxt = self.next_index[nxt][key]
            return nxt
        uses = self.uses.get(key, [])  # it joined the unit after the trace was recorded (external.py): search
        k = bisect.bisect_right(uses, after)
        return uses[k] if k < len(uses) else None

    def next_uses(self, params: list[ShardedParam], fetched_at: int,
                  after: int) -> tuple[list[NextUse], dict[int, int | None]]:
        """The ``NextUse`` of each of ``params`` (the parameters of the unit event ``fetched_at`` fetched, in order)
        after event ``after``, and the index of each one's next event by id. The trace does not change once
        recorded, so the answer for a (fetch, end) pair is computed once, at its first following step, and cached
        while the unit's parameters are the same (an external parameter joining it makes one more)."""
        key = (fetched_at, after)
        cached = self._next_uses.get(key)
        if cached is not None and cached[0] == params:  # compares identities: ShardedParam has no __eq__
            return cached[1], cached[2]
        uses, nexts = [], {}
        for p in params:
            nxt = nexts[id(p)] = self.next_event(p, fetched_at, after)
            uses.append(self.use_at(p, nxt, after))
        self._next_uses[key] = (list(params), uses, nexts)
        return uses, nexts

    def released_before(self, max_reuse_distance: int) -> list[int]:
        """For each event, the latest earlier event after which the release rule (with the trace) frees one of the
        event's parameters, to be gathered again for it; -1 if none is. See [Note: a released parameter is
        prefetched in order]."""
        if self.release_before is None:
            latest = []
            for i, params in enumerate(self.params):
                last = -1
                for p in params:
                    uses = self.uses.get(id(p), ())  # a parameter that joined its unit later is not in the table
                    k = bisect.bisect_left(uses, i) - 1
                    if k < 0 or p.is_persistent or uses[k] <= last:
                        continue
                    if not reused_soon(self.use_at(p, i, uses[k]), max_reuse_distance):
                        last = uses[k]
                latest.append(last)
            self.release_before = latest
        return self.release_before

    def next_use(self, p: ShardedParam, fetched_at: int, after: int) -> NextUse:
        """When ``p``, used by event ``fetched_at``, is used next after event ``after`` (>= ``fetched_at``)."""
        return self.use_at(p, self.next_event(p, fetched_at, after), after)

    def use_at(self, p: ShardedParam, nxt: int | None, after: int) -> NextUse:
        """``p``'s next use, at event ``nxt`` (None: none), seen from event ``after``."""
        if nxt is None:
            return NextUse(None, False)
        return NextUse(self.start_numel[nxt] - self.start_numel[after + 1],
                       id(p) in self.shared and self.events[nxt].phase == self.events[after].phase)


class ParamCoordinator:
    live: "weakref.WeakSet[ParamCoordinator]" = weakref.WeakSet()  # for register_external_parameter after initialize

    def __init__(self, module_params: dict[nn.Module, list[ShardedParam]], module_names: dict[nn.Module, str],
                 gatherer, comm, zero_config, on_event=None, shard_swapper=None):
        """``module_params``: each unit's module and the parameters it gathers (units.py's ``gather_units``),
        ``module_names``: their qualified names; ``shard_swapper``: offload_param nvme reads shard buckets ahead
        along the trace (offload/param_swap.py)."""
        self.gatherer = gatherer
        self.comm = comm
        self.prefetch_numel = int(zero_config.prefetch_bucket_size)
        self.max_live = int(zero_config.max_live_parameters)
        self.max_reuse_distance = int(zero_config.max_reuse_distance)
        self.on_event = on_event  # called with "fetch <module>" / "release <module>" (memory timeline)

        self.gathered = LiveParams(gatherer)  # shared by the units: gathers in flight, live count, kept parameters
        self.units = [ParamUnit(module, module_names[module], params, i, self.gathered)
                      for i, (module, params) in enumerate(module_params.items())]
        self._unit_of = {unit.module: unit for unit in self.units}
        # views by module, for callers that index by module: each unit's own parameter list (it grows in place)
        self.module_params = {unit.module: unit.params for unit in self.units}
        self.module_names = {unit.module: unit.name for unit in self.units}
        self.trace: _Trace | None = None
        self._recording: list[tuple[TraceEvent, ParamUnit]] = []
        self._in_step = False
        self._following = False  # this step matches the trace so far: prefetching is allowed
        self._pos = 0
        self._frontier = (-1, 0)  # (releases() then, event index): see [Note: the prefetch frontier]
        self._fetched_at = [0] * len(self.units)  # trace index of each unit's latest fetch while following
        self._warned_deviation = False
        unique = {id(p): p for unit in self.units for p in unit.params}
        self._params = list(unique.values())  # every unit's, once each (external ones join from among these)
        self._sharded_of = {id(p.param): p for p in self._params}  # nn.Parameter -> its state, this model only
        self._held: dict[int, ShardedParam] = {}  # held by the engine until the end of the step (external.py)
        self._held_for_forward: set[int] = set()  # of those, held by forwards without gradients alone (hold_for_step)
        # a backward that builds a graph ran in this step: nothing is released before its end (see [Note: a
        # gradient penalty's graph reads the parameters] in hooks.py)
        self.keep_until_step_ends = False
        ParamCoordinator.live.add(self)
        for p in unique.values():
            if p.status is not ParamStatus.NOT_AVAILABLE:
                self.gathered.count(p)
        self.fetch_count = 0
        self.prefetch_count = 0
        self.shard_swapper = shard_swapper

    # ---- views ---------------------------------------------------------------------------------------------------
    @property
    def live_numel(self) -> int:
        """Gathered elements counted against ``max_live_parameters`` now."""
        return self.gathered.numel

    @property
    def peak_live_numel(self) -> int:
        return self.gathered.peak_numel

    @peak_live_numel.setter
    def peak_live_numel(self, value: int) -> None:  # the engine resets the peak (memory_stats' reset)
        self.gathered.peak_numel = value

    def unit_of(self, module: nn.Module) -> ParamUnit | None:
        return self._unit_of.get(module)

    # ---- step boundaries -----------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """A training forward starts: record (first step) or follow the trace."""
        if self._in_step:  # a training forward without a backward: drop what it recorded
            self.end_step(adopt_trace=False)
            self.comm.agree_before_next_collective()  # another rank may be in its backward: no mismatched gather
        self._release_held()  # held by a forward that no backward followed
        self._in_step = True
        self._recording = []
        self._pos = 0
        self._frontier = (-1, 0)
        self._following = self.trace is not None
        if self.trace is None:  # see [Note: the recording step is checked]
            self.comm.check_every_collective(True)

    def end_step(self, adopt_trace: bool = True) -> None:
        """End of backward: wait for stray prefetches, release everything not persistent, settle the trace."""
        self.gathered.wait_all()
        self._drop_holds()
        for p in self._params:
            p.active_users = 0
        self.keep_until_step_ends = False
        release_unused(self._params)
        if self._in_step and adopt_trace and self._recording and (self.trace is None or not self._following
                                                                   or self._pos != len(self.trace.events)):
            events = [e for e, _ in self._recording]
            self._check_same_on_all_ranks(events)
            if self.trace is not None:
                self._log_deviation_once("the module order changed; prefetching re-recorded")
            self.trace = _Trace(events, [unit for _, unit in self._recording])
        self.comm.check_every_collective(False)  # on while recording: see [Note: the recording step is checked]
        self._in_step = False
        self._following = False
        if self.shard_swapper is not None:  # the next forward's first shard buckets, read ahead
            self.shard_swapper.after_fetch(self.trace.params if self.trace is not None else [])

    @property
    def in_step(self) -> bool:
        """A training forward started and its backward has not ended."""
        return self._in_step

    @property
    def follows_trace(self) -> bool:
        """This step has followed the recorded trace so far (False while recording or after a deviation)."""
        return self._following

    # ---- hooks call these ----------------------------------------------------------------------------------------
    def fetch(self, module: nn.Module, phase: str) -> None:
        unit = self._unit_of[module]
        event = TraceEvent(unit.name, phase)
        self.comm.progress.module = event.module
        if self._in_step:
            self._recording.append((event, unit))
            if self._following and (self._pos >= len(self.trace.events) or self.trace.events[self._pos] != event):
                self._following = False
                self.comm.agree_before_next_collective()  # other ranks may not take this turn: no mismatched gather
                self._log_deviation_once(
                    f"step deviates from the recorded module order at {event.module} ({phase}); "
                    "gathering on demand for the rest of this step")
        with profile_range("zero3::fetch", event.module):
            if self.gathered.kept:  # none kept (max_reuse_distance 0, no tied weight): no walk, no call
                self.gathered.unkeep(unit.params)  # in use again: not given up to make room below
                self._make_room(unit.missing_numel())
            unit.unshard(event.module)
            unit.wait_for_unshard()
            self.fetch_count += 1
            if self.shard_swapper is not None:
                trace = self.trace.params if self._following else []
                self.shard_swapper.after_fetch(trace[i] for i in range(self._pos + 1, len(trace)))
            if self._following:
                self._fetched_at[unit.index] = self._pos
                self._prefetch_after(self._pos)
                self._pos += 1
        if self.on_event is not None:
            self.on_event(f"fetch {event.module} ({phase})")

    def release(self, module: nn.Module, keep_frozen: bool = False) -> None:
        """The unit's module ran: reshard it. ``keep_frozen``: leave gathered the parameters that need no gradient
        (activation recomputation in backward saved them as they are; see [Note: frozen parameters in
        recomputation] in hooks.py).

        [Note: shared parameters stay within a pass] a tied weight (embedding / LM head) is kept between its uses
        inside one forward or one backward, so it is gathered once per pass; the live budget still rules: _make_room
        gives kept parameters up first when a fetch needs room."""
        if self.keep_until_step_ends:
            return
        unit = self._unit_of[module]
        next_uses = next_events = None
        if self._following:  # the trace says which parameters are used again soon
            next_uses, next_events = self.trace.next_uses(unit.params, self._fetched_at[unit.index], self._pos - 1)
        with profile_range("zero3::release", unit.name):
            releases_before = releases()
            kept, released = unit.reshard(next_uses, self.max_reuse_distance, keep_frozen)
            for p in kept:  # reused soon: _make_room gives it up first when a fetch needs room
                self.gathered.kept[id(p)] = p
            epoch, frontier = self._frontier
            if self._following and epoch == releases_before:
                for p in released:
                    nxt = next_events[id(p)]
                    if nxt is not None and nxt < frontier:
                        break
                else:  # none is used before the frontier: it holds (releases() counted exactly these since)
                    self._frontier = (releases_before + len(released), frontier)
        if self.on_event is not None:
            self.on_event(f"release {unit.name}")

    # ---- parameters used outside their own unit (external.py) ---------------------------------------------------
    def on_read(self, param: nn.Parameter, reader: nn.Module | None) -> None:
        """A forward read ``param`` (``module.weight``); ``reader``: the innermost unit in forward, None for the
        model's forward outside every unit."""
        p = self._sharded_of.get(id(param))
        if p is None or p.is_persistent:
            return
        if reader is not None and id(p) in self._unit_of[reader].param_ids:
            return  # the unit's own parameter: the common case
        if any(p in self._unit_of[m] for m in external.units_in_forward(self)):
            return  # an enclosing unit gathers it, and holds it longer than the reader runs
        if reader is None:
            self.hold_for_step(p)
        else:
            self.add_external(reader, param, gather_now=True)

    def add_external(self, module: nn.Module, param: nn.Parameter, gather_now: bool) -> None:
        """Make ``param`` part of ``module``'s unit from now on (gathered now too, if the module is running).

        The unit's list grows in place: a trace being recorded holds that list, so later steps prefetch it."""
        p = self._sharded_of.get(id(param))
        unit = self._unit_of.get(module)
        if p is None or unit is None or not unit.add_external(p):
            return  # not this model's, not a unit (reads inside it join its innermost unit), or already there
        log.info("rank %d: %s is used in the forward of %s, which does not own it: gathered with %s from now on",
                 self.comm.rank, p.fqn, unit.name, unit.name)
        self._frontier = (-1, 0)  # the trace's events of this unit have one more parameter to gather
        if self.trace is not None:
            self.trace.release_before = None
        if gather_now:
            self._gather_now(p, f"{unit.name} reads {p.fqn}")
            p.active_users += 1  # one more user of the running unit: its reshard ends it

    def remove_external(self, module: nn.Module, param: nn.Parameter) -> None:
        p = self._sharded_of.get(id(param))
        unit = self._unit_of.get(module)
        if p is not None and unit is not None:
            unit.remove_external(p)
            if self.trace is not None:
                self.trace.release_before = None

    def hold_for_step(self, p: ShardedParam) -> None:
        """Keep ``p`` gathered (gather it if needed) until the end of the step: held by one more user, until end_step.
        A hold taken without gradients ends with the model's forward (``end_model_forward``), unless a forward with
        gradients holds ``p`` too: a forward without gradients between a forward and its backward (DPO's reference
        pass through the policy with its adapters off) must not release what that backward reads."""
        key = id(p)
        if p.is_persistent:
            return
        if key in self._held:
            if torch.is_grad_enabled():
                self._held_for_forward.discard(key)
            return
        self._held[key] = p
        if not torch.is_grad_enabled():
            self._held_for_forward.add(key)
        self._gather_now(p, f"hold {p.fqn}")
        p.held_by_user += 1

    def hold_returned(self, param: nn.Parameter) -> None:
        """A module returned ``param``: its caller computes with it after the module ends (DeepSpeed keeps such
        parameters available until its end-of-step release)."""
        p = self._sharded_of.get(id(param))
        if p is not None and p.is_available:
            self.hold_for_step(p)

    def _drop_holds(self, keys=None) -> list[ShardedParam]:
        """End the holds of ``keys`` (default: all of them); returns their parameters."""
        keys = list(self._held) if keys is None else keys
        held = [self._held.pop(key) for key in keys]
        self._held_for_forward.difference_update(keys)
        for p in held:
            p.held_by_user -= 1
        return held

    def _release_held(self, keys=None) -> None:
        for p in self._drop_holds(keys):
            release_if_unused(p)

    def end_model_forward(self) -> None:
        """The model's forward returned: without gradients no backward will use what it held (what a forward with
        gradients held stays held for its backward)."""
        if not torch.is_grad_enabled():
            self._release_held(list(self._held_for_forward))

    def release_all(self) -> None:
        """Release every gathered non-persistent parameter (after an eval forward, before a checkpoint...)."""
        self.end_step(adopt_trace=False)

    # ---- internals -----------------------------------------------------------------------------------------------
    def _gather_now(self, p: ShardedParam, name: str) -> None:
        """Gather ``p`` (one parameter outside a unit's fetch: an external read, a hold) and count it as live."""
        self.gathered.unkeep([p])
        self._make_room(p.padded_numel if p.status is ParamStatus.NOT_AVAILABLE else 0)
        work = self.gathered.issue_missing([p], name)
        if work is not None:
            self.gathered.wait(work)
        self.gathered.acquire([p])

    def _make_room(self, numel: int) -> None:
        """Give up parameters kept for reuse (oldest first) until ``numel`` more fits under max_live_parameters."""
        for p in list(self.gathered.kept.values()):
            if self.gathered.numel + numel <= self.max_live:
                return
            release_if_unused(p)  # the release rule without the trace: kept only for reuse, never if used or held

    def _prefetch_after(self, index: int) -> None:
        """Issue gathers for the parameters of the events after ``index``, within the prefetch and live budgets.

        Gathers already in flight count against the prefetch budget. A parameter gathered sequentially
        (``stage3_allgather_sequential``, or its bucket under "auto") is prefetched alone and only when nothing else
        is in flight, as the point of that strategy is a small transient footprint.

        [Note: the prefetch frontier] The candidates are the parameters not gathered yet of the events after
        ``index``, in order of first use. Every parameter of the events before the one where the last look-ahead
        stopped (the frontier) was gathered, in flight or issued by it; only a release can undo that, so while no
        parameter was released since (``unit.releases()``) but those a unit released that the trace uses next at or
        after the frontier (``release``), the look-ahead starts at the frontier: the same candidates, without walking
        again over the gathered events ahead (with everything kept, the whole rest of the trace at every fetch).
        """
        works = {}
        for w in self.gathered.inflight.values():  # a loop, not a comprehension: this runs at every fetch
            works[id(w)] = w.numel
        in_flight = sum(works.values())
        budget = self.prefetch_numel - in_flight
        chosen: list[ShardedParam] = []
        start = index + 1
        epoch = releases()  # _choose_prefetch releases nothing
        if self._frontier[0] == epoch:
            start = max(start, self._frontier[1])
        stop = self._choose_prefetch(index, start, budget, bool(in_flight), chosen)
        self._frontier = (epoch, stop)
        if chosen:
            self.prefetch_count += len(chosen)
            self.gathered.issue(chosen, self.trace.units[index].prefetch_name)

    def _choose_prefetch(self, now: int, start: int, budget: int, in_flight: bool,
                         chosen: list[ShardedParam]) -> int:
        """Append to ``chosen`` the not-yet-gathered parameters of the trace events from ``start`` on, in order of
        first use, up to the first unit over the live or prefetch budget (see ``_prefetch_after``) or the first
        event whose parameters a release still to come frees (see below; ``now``: the event being fetched); return
        the index of the event where it stopped (the new frontier; the number of events if it did not stop). One
        loop, no generator or property per candidate: this runs at every fetch.

        [Note: a released parameter is prefetched in order] A parameter in use now (or in a gather ahead) may be
        released after that use and needed again later: then it is gathered at this look-ahead, but not for that
        later event. Walking past it as gathered would prefetch the units after it first and leave it to an
        on-demand gather when its event comes. At the turn from forward to backward that was the last block: its
        forward's look-ahead passed its backward (the block was gathered then) and gathered the block before it,
        then its release freed it, and the backward began with an on-demand gather of it, the prefetch budget
        taken by the block already gathered. So the look-ahead stops at the first event that uses a parameter the
        release rule frees after an earlier use that has not ended yet (``_Trace.released_before``); the first
        look-ahead after that release takes it, in order. (A parameter some other condition of the rule keeps, a
        user's hold, only ends the look-ahead early: the next one, with nothing released, passes it.)

        [Note: a unit is prefetched whole] The parameters a unit still needs are taken together or not at all: a
        unit that does not fit in what is left of the budgets waits for a later fetch, which takes it in one gather
        (one collective per unit, and no gather that spans two units and must stage its input). Only a unit larger
        than the whole prefetch bucket is taken in part, as many of its parameters as fit, in order (DeepSpeed's
        per-parameter rule), and a sequentially gathered parameter (``gather_sequential``) goes alone."""
        seen: set[int] = set()
        params_of = self.trace.params
        released_before = self.trace.released_before(self.max_reuse_distance)
        room = self.max_live - self.gathered.numel  # gathered elements that still fit under max_live_parameters
        size = 0
        for i in range(start, len(params_of)):
            if released_before[i] >= now:  # a release still to come frees one of its parameters: see the Note
                return i
            missing: list[ShardedParam] = []
            numel = 0
            sequential = False
            for p in params_of[i]:
                if p.status is ParamStatus.NOT_AVAILABLE and id(p) not in seen:
                    seen.add(id(p))
                    missing.append(p)
                    numel += p.padded_numel
                    sequential = sequential or p.gather_sequential
            if not missing:
                continue
            if not sequential:
                if size + numel <= budget and size + numel <= room:
                    chosen.extend(missing)
                    size += numel
                    continue
                if numel <= self.prefetch_numel:
                    return i  # it fits an empty bucket: a later fetch takes it whole
            for p in missing:  # larger than the bucket, or sequential: parameter by parameter
                numel = p.padded_numel
                if size + numel > room:
                    return i
                if p.gather_sequential:
                    if not chosen and not in_flight:
                        chosen.append(p)
                    return i
                if size + numel > budget:
                    return i
                chosen.append(p)
                size += numel
        return len(params_of)

    def _check_same_on_all_ranks(self, events: list[TraceEvent]) -> None:
        if self.comm.world_size == 1:
            return
        mine = [f"{e.module}:{e.phase}" for e in events]
        all_traces = self.comm.all_gather_object(mine)
        if all(t == all_traces[0] for t in all_traces):
            return
        for i in range(max(len(t) for t in all_traces)):
            seen = {r: (t[i] if i < len(t) else "<end of step>") for r, t in enumerate(all_traces)}
            if len(set(seen.values())) > 1:
                detail = ", ".join(f"rank {r}: {m}" for r, m in seen.items())
                raise RankDivergenceError(
                    f"ranks ran different module orders; first difference at fetch #{i}: {detail}. Every rank must "
                    "run the same modules in the same order in a step (ZeRO-3 gathers are collectives); make "
                    "data-dependent branches agree across ranks (e.g. decide on rank 0 and broadcast), or gather the "
                    "module that routes by data (a mixture of experts) as one unit: zero_optimization.leaf_module "
                    "{\"classes\": [\"<its class>\"]}.")

    def _log_deviation_once(self, message: str) -> None:
        if not self._warned_deviation:
            log.info("rank %d: %s", self.comm.rank, message)
            self._warned_deviation = True
