"""The parameter coordinator: which parameters are gathered when, and when they are released.

On the first training step it records the order in which modules fetch their parameters (forward, activation
recomputation and backward alike): the *trace*. All ranks must record the same trace; that is checked once with
one small exchange and a difference is an error naming the first differing module, not a hang later.

From the next step on, every fetch looks ahead in the trace and issues asynchronous gathers for the parameters the
next modules will need (up to ``prefetch_bucket_size`` elements; about one parameter ahead with the sequential
strategy), never holding more than ``max_live_parameters`` gathered elements. A module's parameters are released
after it ran unless they are persistent (small), still used by another active module (shared weights, nested
calls), used again before ``max_reuse_distance`` more elements are gathered (0: never kept), or shared by several
modules and used again later in the same pass (see [Note: shared parameters stay within a pass]).

If a step runs a different order than the trace (data-dependent control flow, the same on every rank), the
coordinator notices at the first differing fetch, stops prefetching for the rest of that step (on-demand gathers
are always correct), logs it once, and uses the newly recorded order from then on.

A parameter a forward reads without owning it joins the reader's unit, and one held for the rest of the step has
one more user until the step ends: see external.py.
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
from .gather import GatherWork
from .._profiling import profile_range
from .partition import ParamStatus, ShardedParam

log = logging.getLogger("zero_engine.coordinator")

__all__ = ["ParamCoordinator", "TraceEvent"]


@dataclass(frozen=True)
class TraceEvent:
    module: str  # fully qualified module name
    phase: str  # "forward" or "backward"


@dataclass
class _Trace:
    events: list[TraceEvent]
    params: list[list[ShardedParam]]
    start_numel: list[int] = field(default_factory=list)  # gathered elements fetched before each event
    uses: dict[int, list[int]] = field(default_factory=dict)  # id(ShardedParam) -> event indices using it
    shared: set[int] = field(default_factory=set)  # id(ShardedParam) of parameters used by several modules

    def __post_init__(self):
        total = 0
        users: dict[int, set[str]] = {}
        for i, params in enumerate(self.params):
            self.start_numel.append(total)
            total += sum(p.padded_numel for p in params)
            for p in params:
                self.uses.setdefault(id(p), []).append(i)
                users.setdefault(id(p), set()).add(self.events[i].module)
        self.shared = {key for key, modules in users.items() if len(modules) > 1}

    def used_again_in_pass(self, p: ShardedParam, after: int) -> bool:
        """A shared parameter used again by a later event of the same pass (forward or backward) as ``after``."""
        if id(p) not in self.shared:
            return False
        uses = self.uses[id(p)]
        k = bisect.bisect_right(uses, after)
        return k < len(uses) and self.events[uses[k]].phase == self.events[after].phase

    def reuse_distance(self, p: ShardedParam, after: int) -> int | None:
        """Elements fetched between event ``after`` and the next event that uses ``p`` (None: not used again)."""
        uses = self.uses.get(id(p), [])
        k = bisect.bisect_right(uses, after)
        if k == len(uses):
            return None
        nxt = uses[k]
        return self.start_numel[nxt] - self.start_numel[after + 1] if nxt > after else 0


class ParamCoordinator:
    live: "weakref.WeakSet[ParamCoordinator]" = weakref.WeakSet()  # for register_external_parameter after initialize

    def __init__(self, module_params: dict[nn.Module, list[ShardedParam]], module_names: dict[nn.Module, str],
                 gatherer, comm, zero_config, on_event=None):
        self.module_params = module_params
        self.module_names = module_names
        self.gatherer = gatherer
        self.comm = comm
        self.prefetch_numel = int(zero_config.prefetch_bucket_size)
        self.max_live = int(zero_config.max_live_parameters)
        self.max_reuse_distance = int(zero_config.max_reuse_distance)
        self.on_event = on_event  # called with "fetch <module>" / "release <module>" (memory timeline)

        self.trace: _Trace | None = None
        self._recording: list[tuple[TraceEvent, list[ShardedParam]]] = []
        self._in_step = False
        self._following = False  # this step matches the trace so far: prefetching is allowed
        self._pos = 0
        self._inflight: dict[int, GatherWork] = {}  # id(ShardedParam) -> the work that gathers it
        self._kept: dict[int, ShardedParam] = {}  # released by their modules but kept for a near reuse
        self._warned_deviation = False
        unique = {id(p): p for params in module_params.values() for p in params}
        self._sharded_of = {id(p.param): p for p in unique.values()}  # nn.Parameter -> its state, this model only
        self._unit_ids = {m: {id(p) for p in params} for m, params in module_params.items()}
        self._externals: dict[nn.Module, set[int]] = {}  # ids a unit gathers without owning them (external.py)
        self._held: dict[int, ShardedParam] = {}  # one more user until the end of the step (external.py)
        ParamCoordinator.live.add(self)
        self.live_numel = self.peak_live_numel = 0
        for p in unique.values():
            if p.status is not ParamStatus.NOT_AVAILABLE:
                self._count_live(p)
        self.fetch_count = 0
        self.prefetch_count = 0
        self.shard_swapper = None  # offload_param nvme: reads shard buckets ahead (offload/param_swap.py)

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
        self._following = self.trace is not None

    def end_step(self, adopt_trace: bool = True) -> None:
        """End of backward: wait for stray prefetches, release everything not persistent, settle the trace."""
        for work in list(self._inflight.values()):
            self._wait(work)
        self._held.clear()
        for params in self.module_params.values():
            for p in params:
                p.active_users = 0
                if self._releasable(p):
                    self._release(p)
        if self._in_step and adopt_trace and self._recording and (self.trace is None or not self._following
                                                                   or self._pos != len(self.trace.events)):
            events = [e for e, _ in self._recording]
            self._check_same_on_all_ranks(events)
            if self.trace is not None:
                self._log_deviation_once("the module order changed; prefetching re-recorded")
            self.trace = _Trace(events, [ps for _, ps in self._recording])
        self._in_step = False
        self._following = False
        if self.shard_swapper is not None:  # the next forward's first shard buckets, read ahead
            self.shard_swapper.after_fetch(self.trace.params if self.trace is not None else [])

    @property
    def follows_trace(self) -> bool:
        """This step has followed the recorded trace so far (False while recording or after a deviation)."""
        return self._following

    # ---- hooks call these ----------------------------------------------------------------------------------------
    def fetch(self, module: nn.Module, phase: str) -> None:
        params = self.module_params.get(module, [])
        event = TraceEvent(self.module_names[module], phase)
        self.comm.progress.module = event.module
        recording = self._in_step
        if recording:
            self._recording.append((event, params))
            if self._following and (self._pos >= len(self.trace.events) or self.trace.events[self._pos] != event):
                self._following = False
                self.comm.agree_before_next_collective()  # other ranks may not take this turn: no mismatched gather
                self._log_deviation_once(
                    f"step deviates from the recorded module order at {event.module} ({phase}); "
                    "gathering on demand for the rest of this step")
        with profile_range(f"zero3::fetch {event.module}"):
            self._acquire(params, event.module)
            self.fetch_count += 1
            if self.shard_swapper is not None:
                trace = self.trace.params if self._following else []
                self.shard_swapper.after_fetch(trace[i] for i in range(self._pos + 1, len(trace)))
            if self._following:
                self._prefetch_after(self._pos)
                self._pos += 1
        if self.on_event is not None:
            self.on_event(f"fetch {event.module} ({phase})")

    def release(self, module: nn.Module, keep_frozen: bool = False) -> None:
        """``keep_frozen``: leave gathered the parameters that need no gradient (activation recomputation in
        backward saved them as they are; see [Note: frozen parameters in recomputation] in hooks.py)."""
        params = self.module_params.get(module, [])
        event_index = self._pos - 1 if self._following else None
        with profile_range(f"zero3::release {self.module_names[module]}"):
            for p in params:
                p.active_users = max(0, p.active_users - 1)
                if not p.releasable:
                    continue
                if keep_frozen and not p.param.requires_grad:
                    continue  # released at the end of the step (see keep_frozen above)
                if self._releasable(p, after_event=event_index):
                    self._release(p)
                else:
                    self._kept[id(p)] = p  # reused soon: _make_room gives it up first when a fetch needs room
        if self.on_event is not None:
            self.on_event(f"release {self.module_names[module]}")

    # ---- parameters used outside their own unit (external.py) ---------------------------------------------------
    def on_read(self, param: nn.Parameter, reader: nn.Module | None) -> None:
        """A forward read ``param`` (``module.weight``); ``reader``: the innermost unit in forward, None for the
        model's forward outside every unit."""
        p = self._sharded_of.get(id(param))
        if p is None or p.is_persistent:
            return
        if reader is not None and id(p) in self._unit_ids[reader]:
            return  # the unit's own parameter: the common case
        if any(id(p) in self._unit_ids[m] for m in external.units_in_forward(self)):
            return  # an enclosing unit gathers it, and holds it longer than the reader runs
        if reader is None:
            self.hold_for_step(p)
        else:
            self.add_external(reader, param, gather_now=True)

    def add_external(self, module: nn.Module, param: nn.Parameter, gather_now: bool) -> None:
        """Make ``param`` part of ``module``'s unit from now on (gathered now too, if the module is running).

        The unit's list grows in place: a trace being recorded holds that list, so later steps prefetch it."""
        p = self._sharded_of.get(id(param))
        params = self.module_params.get(module)
        if p is None or params is None or id(p) in self._unit_ids[module]:
            return  # not this model's, not a unit (reads inside it join its innermost unit), or already there
        params.append(p)
        self._unit_ids[module].add(id(p))
        self._externals.setdefault(module, set()).add(id(p))
        log.info("rank %d: %s is used in the forward of %s, which does not own it: gathered with %s from now on",
                 self.comm.rank, p.fqn, self.module_names[module], self.module_names[module])
        if gather_now:
            self._acquire([p], f"{self.module_names[module]} reads {p.fqn}")

    def remove_external(self, module: nn.Module, param: nn.Parameter) -> None:
        p = self._sharded_of.get(id(param))
        if p is not None and id(p) in self._externals.get(module, ()):
            self._externals[module].discard(id(p))
            self._unit_ids[module].discard(id(p))
            self.module_params[module].remove(p)

    def hold_for_step(self, p: ShardedParam) -> None:
        """Keep ``p`` gathered (gather it if needed) until the end of the step: one more user, until end_step (or,
        without gradients, the end of the model's forward: ``release_held``)."""
        if p.is_persistent or id(p) in self._held:
            return
        self._held[id(p)] = p
        self._acquire([p], f"hold {p.fqn}")

    def hold_returned(self, param: nn.Parameter) -> None:
        """A module returned ``param``: its caller computes with it after the module ends (DeepSpeed keeps such
        parameters available until its end-of-step release)."""
        p = self._sharded_of.get(id(param))
        if p is not None and p.is_available:
            self.hold_for_step(p)

    def _release_held(self) -> None:
        held, self._held = list(self._held.values()), {}
        for p in held:
            p.active_users = max(0, p.active_users - 1)
            if self._releasable(p):
                self._release(p)

    def end_model_forward(self) -> None:
        """The model's forward returned: without gradients no backward will use what it held."""
        if not torch.is_grad_enabled():
            self._release_held()

    def release_all(self) -> None:
        """Release every gathered non-persistent parameter (after an eval forward, before a checkpoint...)."""
        self.end_step(adopt_trace=False)

    # ---- internals -----------------------------------------------------------------------------------------------
    def _acquire(self, params: list[ShardedParam], name: str) -> None:
        """Gather what is missing of ``params``, wait for what is in flight, and count one more user of each."""
        for p in params:
            self._kept.pop(id(p), None)
        missing = [p for p in params if p.status is ParamStatus.NOT_AVAILABLE]
        self._make_room(sum(p.padded_numel for p in missing))
        if missing:
            self._wait(self._issue(missing, name))
        for p in params:
            if p.status is ParamStatus.INFLIGHT:
                self._wait(self._inflight[id(p)])
            if p.live_owner is None:  # gathered outside the coordinator (GatheredParameters): count it now
                self._count_live(p)
            p.active_users += 1

    def _issue(self, params: list[ShardedParam], name: str) -> GatherWork:
        work = self.gatherer.issue(params, name=name)
        for p in params:
            self._inflight[id(p)] = work
            self._count_live(p)
        return work

    def _count_live(self, p: ShardedParam) -> None:
        if p.live_owner is self:  # already counted (released behind our back and gathered again)
            return
        p.live_owner = self
        self.live_numel += p.padded_numel
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    def _wait(self, work: GatherWork) -> None:
        work.wait()
        for p in work.params:
            self._inflight.pop(id(p), None)

    def _release(self, p: ShardedParam) -> None:
        p.release()
        self._kept.pop(id(p), None)
        if p.live_owner is self:
            p.live_owner = None
            self.live_numel -= p.padded_numel

    def _releasable(self, p: ShardedParam, after_event: int | None = None) -> bool:
        """The release rule (see [Note: the release rule] in partition.py), plus, after trace event ``after_event``
        of a step that follows the trace, keeping a parameter used again soon.

        [Note: shared parameters stay within a pass] a tied weight (embedding / LM head) is kept between its uses
        inside one forward or one backward, so it is gathered once per pass; the live budget still rules: _make_room
        gives kept parameters up first when a fetch needs room."""
        if not p.releasable:
            return False
        if after_event is None:
            return True
        distance = self.trace.reuse_distance(p, after_event)
        reused_soon = distance is not None and distance < self.max_reuse_distance
        return not (reused_soon or self.trace.used_again_in_pass(p, after_event))

    def release_param(self, p: ShardedParam) -> None:
        """Release ``p`` on behalf of someone else (GatheredParameters' exit), keeping the live count right."""
        self._release(p)

    def _make_room(self, numel: int) -> None:
        """Give up parameters kept for reuse (oldest first) until ``numel`` more fits under max_live_parameters."""
        for p in list(self._kept.values()):
            if self.live_numel + numel <= self.max_live:
                return
            if self._releasable(p):  # not one a GatheredParameters block holds, nor one a module uses
                self._release(p)

    def _prefetch_after(self, index: int) -> None:
        """Issue gathers for the parameters of the events after ``index``, within the prefetch and live budgets.

        Gathers already in flight count against the prefetch budget. A parameter gathered sequentially
        (``stage3_allgather_sequential``, or its bucket under "auto") is prefetched alone and only when nothing else
        is in flight, as the point of that strategy is a small transient footprint.
        """
        in_flight = sum({id(w): w.numel for w in self._inflight.values()}.values())
        budget = self.prefetch_numel - in_flight
        chosen: list[ShardedParam] = []
        size = 0
        for p in self._upcoming(index):
            if self.live_numel + size + p.padded_numel > self.max_live:
                break
            if p.gather_sequential:
                if not chosen and not in_flight:
                    chosen.append(p)
                break
            if size + p.padded_numel > budget:
                break
            chosen.append(p)
            size += p.padded_numel
        if chosen:
            self.prefetch_count += len(chosen)
            self._issue(chosen, f"prefetch after {self.trace.events[index].module}")

    def _upcoming(self, index: int):
        """Not-yet-gathered parameters of the trace events after ``index``, in order of first use."""
        seen: set[int] = set()
        for params in self.trace.params[index + 1:]:
            for p in params:
                if p.status is ParamStatus.NOT_AVAILABLE and id(p) not in seen:
                    seen.add(id(p))
                    yield p

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
