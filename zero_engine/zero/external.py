"""Parameters used outside their own module's forward (DeepSpeed's "external parameters").

The hooks (hooks.py) gather a *unit's* parameters around its forward and backward (units.py: a module's own
parameters, or a leaf module's subtree). A forward can also use a parameter it does not own:

* **It reads one through an attribute**: ``self.other.weight`` (a sibling's or a shared weight), or the model's
  forward computing ``hidden @ self.lm_head.weight.T`` without calling ``lm_head`` (TRL's fused LM head). While a
  forward runs, every module's ``_parameters`` dict tells the coordinator about each parameter read from it (the
  lookup ``module.weight`` goes through); a read of a parameter that is not the reader's own gathers it at once and
  makes it part of the *reader's* unit: the innermost unit in forward. From then on it is gathered with that unit in
  forward and backward (prefetched from the trace like the unit's own parameters) and released when the unit ends, as
  DeepSpeed's automatic external-parameter detection does. A read in the model's forward outside every unit (the
  root has no parameters of its own) has no unit to join: the parameter is held to the end of the step.
* **It returns one** (``return out, self.bias``): the caller computes with it after the module ended, so it is held
  gathered to the end of the step (DeepSpeed keeps such "dangling" parameters until its end-of-step release).
* **``register_external_parameter(module, param)``** declares a read ahead: ``module`` gathers ``param`` with its own
  parameters (before ``initialize``, a module without parameters of its own becomes a unit for it).

Outside every forward nothing is gathered: a gather is a collective, and code that reads a parameter on one rank only
(logging on rank 0) would hang. There, using a released parameter's data raises (``ZeroParameter`` in partition.py)
and says to use ``GatheredParameters``.

[Note: reads inside a compiled region]
Dynamo traces ``module.weight`` through this dict's ``__getitem__``. Calling the coordinator there would put the
gathering into the graph (and ``id(param)`` makes Dynamo guard on each parameter's identity: every block would
compile again). So while Dynamo traces, a read is not watched: a compiled module is one unit of its whole subtree
(units.py), whose parameters its hooks gather before the compiled call. A compiled region that reads a partitioned
parameter outside its subtree (so released when the region runs) must declare it with
``register_external_parameter``; such a read is decided while tracing (the parameter's class says it is released)
and raises a RuntimeError naming the region and the parameter when the compiled code runs, instead of a graph over
an empty shard or Dynamo's internal error. partition.py lets Dynamo build its fake tensor of the released parameter
(``_dynamo_is_tracing``) so that this check is reached.

"Held to the end of the step" means: until the end of the backward that follows, or, for a forward without
gradients (evaluation), until the model's forward returns.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .partition import ZeroParameter, sharded_param_of

__all__ = ["register_external_parameter", "unregister_external_parameter", "registered_external_parameters",
           "watch_parameter_reads", "unwatch_parameter_reads", "enter_forward", "leave_forward", "innermost",
           "units_in_forward"]

# The parameters register_external_parameter declared for a module: a list in the module's own ``__dict__`` under
# this name (as DeepSpeed keeps them on the module), so they go with the module, and a copy of the module keeps its
# copies of them. A dictionary beside the modules, keyed weakly by module, could never drop an entry whose parameters
# lead back to their module (see [Note: a parameter holds its partition state] in partition.py).
_REGISTERED = "_zero_engine_external_params"

# The forwards running now, outermost first: (coordinator, module, is_unit, own). The model's root is entered as a
# scope (is_unit False) even when it has no parameters, so a read anywhere in the model's forward has a place to go.
# ``own``: the ids of the nn.Parameters a unit gathers (the unit's live set, ParamUnit.read_ids), so that a read of
# one of them, the common case, costs a set lookup here instead of a call into the coordinator.
_IN_FORWARD: list[tuple[object, nn.Module, bool, "set[int] | frozenset[int]"]] = []


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``parameter``, which another module owns: ``module`` then gathers it
    with its own parameters in forward and backward (ZeRO-3; stages 0-2 keep parameters whole, nothing to do).

    Reads through an attribute in a forward are found on their own; this declares them ahead, before the first step
    (e.g. when the reader gets the parameter as an argument rather than through an attribute). Register before
    ``initialize`` for a module without parameters of its own (it has no hooks afterwards).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_external_parameter: module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(parameter, nn.Parameter):
        raise TypeError("register_external_parameter: parameter must be an nn.Parameter, got "
                        f"{type(parameter).__name__}")
    registered = module.__dict__.setdefault(_REGISTERED, [])
    if not any(p is parameter for p in registered):
        registered.append(parameter)
    for coordinator in _live_coordinators():
        coordinator.add_external(module, parameter, gather_now=_is_running(module))


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo ``register_external_parameter`` (call outside forward and backward)."""
    registered = module.__dict__.get(_REGISTERED, [])
    if not any(p is parameter for p in registered):
        raise ValueError(f"unregister_external_parameter: this parameter is not registered as external for the "
                         f"{type(module).__name__} given; register_external_parameter(module, parameter) first")
    registered[:] = [p for p in registered if p is not parameter]
    for coordinator in _live_coordinators():
        coordinator.remove_external(module, parameter)


def registered_external_parameters(module: nn.Module) -> list[nn.Parameter]:
    return list(module.__dict__.get(_REGISTERED, []))


# ---- reads during forward ----------------------------------------------------------------------------------------
class _WatchedParameters(dict):
    """A module's ``_parameters``: ``module.weight`` looks the parameter up here (nn.Module.__getattr__), so a lookup
    during a forward is the read of a parameter by the forward running. Holds nothing else: copies and pickles of the
    module stay plain."""

    def __getitem__(self, key):
        param = dict.__getitem__(self, key)
        if torch.compiler.is_compiling():  # see [Note: reads inside a compiled region]
            if type(param) is ZeroParameter:  # released: decided while tracing, raised when the graph runs
                _refuse_released_read_in_compiled_region(param)
            return param
        if _IN_FORWARD and param is not None:
            coordinator, module, is_unit, own = _IN_FORWARD[-1]  # innermost(), without a call: a read per parameter
            if id(param) not in own:  # not one the unit gathers: the coordinator decides (external, held...)
                coordinator.on_read(param, module if is_unit else None)
        return param

    def __reduce__(self):
        return dict, (dict(self),)


@torch.compiler.disable(reason="zero_engine: a compiled region read a partitioned parameter it does not gather")
def _refuse_released_read_in_compiled_region(param: nn.Parameter) -> None:
    """See [Note: reads inside a compiled region]. Disabled for Dynamo: a graph break, so that it raises when the
    compiled code runs, with the rank, the region and the parameter in the message."""
    sp = sharded_param_of(param)
    region = "a compiled module"
    if _IN_FORWARD:
        coordinator, module, is_unit = innermost()
        region = coordinator.module_names.get(module, region) if is_unit else "the model's compiled forward"
    rank = f"rank {sp.rank}: " if sp is not None else ""
    name = sp.fqn if sp is not None else "a parameter"
    raise RuntimeError(
        f"{rank}{region} is compiled (torch.compile) and reads {name}, which ZeRO-3 has partitioned and which is not "
        f"a parameter of {region}: a compiled module is one gather unit that gathers its own subtree before the "
        f"compiled call, and a parameter it reads from outside would be an empty shard in the graph. Declare the read "
        f"before the first step with zero_engine.zero.register_external_parameter(<{region}>, <{name}>), or make "
        "the owner of the parameter part of the compiled module, or compile a module that contains both. (A region "
        "of engine.compile(traced=True) cannot read a parameter from outside it: not supported yet with "
        "compile.traced; compile without traced.)")


def watch_parameter_reads(root: nn.Module) -> None:
    """Every module's ``_parameters`` watched, but those inside a traced region (traced.py): its graph reads its
    parameters whole, put in place for the call, and nothing there is gathered by a unit."""
    from .traced import traced_modules

    skip = traced_modules(root)
    for module in root.modules():
        if type(module._parameters) is dict and id(module) not in skip:
            module._parameters = _WatchedParameters(module._parameters)


def unwatch_parameter_reads(root: nn.Module) -> None:
    for module in root.modules():
        if type(module._parameters) is _WatchedParameters:
            module._parameters = dict(module._parameters)


def enter_forward(coordinator, module: nn.Module, is_unit: bool,
                  own: "set[int] | frozenset[int]" = frozenset()) -> None:
    """``module``'s forward starts; ``own``: for a unit, the ids of the nn.Parameters it gathers (kept up to date by
    the unit: it is the unit's own set)."""
    _IN_FORWARD.append((coordinator, module, is_unit, own))


def leave_forward(module: nn.Module, is_unit: bool) -> None:
    """Drop ``module``'s entry and any above it (left there by a forward that raised)."""
    for i in range(len(_IN_FORWARD) - 1, -1, -1):
        if _IN_FORWARD[i][1] is module and _IN_FORWARD[i][2] is is_unit:
            del _IN_FORWARD[i:]
            return


def innermost() -> tuple[object, nn.Module, bool]:
    return _IN_FORWARD[-1][:3]


def units_in_forward(coordinator) -> list[nn.Module]:
    return [module for c, module, is_unit, _ in _IN_FORWARD if c is coordinator and is_unit]


def _is_running(module: nn.Module) -> bool:
    return any(m is module and is_unit for _, m, is_unit, _ in _IN_FORWARD)


def _live_coordinators():
    from .coordinator import ParamCoordinator

    return list(ParamCoordinator.live)

