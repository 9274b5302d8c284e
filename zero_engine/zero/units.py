"""Gather units: which modules gather and release parameters, and which parameters each one gathers.

By default every module with parameters of its own is a unit: its hooks gather exactly those parameters before it
runs and release them after (children have their own hooks). A *leaf module* (DeepSpeed's name: "ZeRO-3 leaf
module") is a unit for its whole subtree: its hooks gather every parameter below it at once, and its descendants get
no hooks. Two reasons to mark one:

- **Fewer, larger gathers.** A transformer block of six small layers becomes one unit: one fetch, one prefetch
  decision and one or two collectives instead of six, with hooks on one module instead of six (bench/compare.py's
  demo model: 9 units instead of 28). The price: all the block's parameters are live while any of it runs, as
  with FSDP2's per-block wrapping.
- **Data-dependent children.** A mixture-of-experts block runs a different subset of its experts on each rank;
  per-module hooks would gather different parameters on different ranks (a divergence the watchdog reports). As
  one unit, every rank gathers every expert, in the same collective. Hence DeepSpeed's default classes, kept here.

A module is a leaf when ``module._z3_leaf`` is true (the attribute DeepSpeed uses, so code written for
``deepspeed.utils.set_z3_leaf_modules`` works unchanged). It is set, before ``initialize``, by:

- ``zero_optimization.leaf_module {classes, names, name_suffixes}`` (class names, plain or fully qualified;
  module names as in ``named_modules()``; name suffixes);
- ``zero_optimization.module_granularity_threshold``: DeepSpeed's automatic rule, see ``mark_by_granularity``;
- ``zero_engine.utils.set_z3_leaf_modules(model, [cls])`` and its siblings, as in DeepSpeed.

[Note: a compiled module is one unit]
A module compiled on its own (``module.compile()``, or ``torch.compile(module)`` put in the model in its place) is
a unit of its whole subtree, like a leaf: its hooks run eagerly around the compiled call (see [Note: hooks under
torch.compile] in hooks.py) and nothing inside the compiled region gathers, so Dynamo captures the region as one
graph. A unit inside it would be a graph break at each of its hooks. This is FSDP2's recipe (``fully_shard`` and
compile each transformer block), and it costs what leaf blocks cost: the block's parameters are live together.
The model's root is the exception: compiling the whole model keeps the units below it (graph breaks at their
hooks; see compile.py).
"""

from __future__ import annotations

import itertools
import logging
import sys
from typing import Callable, Iterable, Iterator

import torch.nn as nn

from ..config.zero_models import DEFAULT_LEAF_CLASSES
from ..errors import ConfigError
from .external import registered_external_parameters
from .traced import is_traced

log = logging.getLogger("zero_engine.units")

__all__ = ["DEFAULT_LEAF_CLASSES", "apply_leaf_module_config", "gather_units", "get_z3_leaf_modules", "is_compiled",
           "mark_by_granularity", "set_z3_leaf_modules", "set_z3_leaf_modules_by_name",
           "set_z3_leaf_modules_by_suffix", "unset_z3_leaf_modules", "z3_leaf_module"]

_MAX_LEAF_NUMEL = 10**9  # DeepSpeed's Z3_MAX_LEAF_SIZE: the granularity rule never makes a larger subtree one unit


def z3_leaf_module(module: nn.Module) -> bool:
    return bool(getattr(module, "_z3_leaf", False))


def is_compiled(module: nn.Module) -> bool:
    """``module.compile()`` was called, or ``module`` is what ``torch.compile(m)`` returned. Cheap: the engine asks
    it of every module at each forward (compile.py)."""
    if getattr(module, "_compiled_call_impl", None) is not None:
        return True
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # never imported: nothing was torch.compile'd
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if z3_leaf_module(m)]


def _class_matches(module: nn.Module, wanted) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _flag(modules: Iterable[nn.Module], flag: bool) -> list[nn.Module]:
    modules = list(modules)
    for m in modules:
        m._z3_leaf = flag
    return modules


def _by_classes(model: nn.Module, classes, flag: bool, raise_if_not_found: bool) -> list[nn.Module]:
    classes = [classes] if isinstance(classes, (str, type)) else list(classes)
    for c in classes:
        if not isinstance(c, (str, type)):
            raise TypeError(f"leaf_module_classes: expected classes or class names, got {c!r}")
    found = _flag((m for m in model.modules() if any(_class_matches(m, c) for c in classes)), flag)
    if not found and raise_if_not_found:
        raise ValueError(f"no module of class {', '.join(map(str, classes))} in the model")
    return found


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes, raise_if_not_found: bool = True) -> list[nn.Module]:
    """Mark every module of these classes (types, or names plain or fully qualified) as a leaf; call before
    ``initialize``. Returns the modules marked."""
    return _by_classes(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes, raise_if_not_found: bool = True) -> list[nn.Module]:
    return _by_classes(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: nn.Module, module_names: list[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Mark modules by their ``named_modules()`` names. Returns (modules marked, names not found)."""
    by_name = dict(model.named_modules())
    missing = [n for n in module_names if n not in by_name]
    if missing and raise_if_not_found:
        raise ValueError(f"no module named {', '.join(missing)} in the model")
    return _flag((by_name[n] for n in module_names if n in by_name), flag), missing


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes: list[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Mark modules whose ``named_modules()`` name ends with one of the suffixes. Returns (marked, unmatched)."""
    named = list(model.named_modules())
    matched = [m for name, m in named if any(name.endswith(s) for s in module_name_suffixes)]
    missing = [s for s in module_name_suffixes if not any(name.endswith(s) for name, _ in named)]
    if missing and raise_if_not_found:
        raise ValueError(f"no module name ends with {', '.join(missing)} in the model")
    return _flag(matched, flag), missing


def apply_leaf_module_config(model: nn.Module, cfg) -> list[nn.Module]:
    """``zero_optimization.leaf_module``. DeepSpeed's default classes may be absent from a model (no error); a class,
    name or suffix the file names itself must match something, or it is a mistake worth an error."""
    marked = {}
    if cfg.classes:
        own = [c for c in cfg.classes if c not in DEFAULT_LEAF_CLASSES]
        for m in set_z3_leaf_modules(model, cfg.classes, raise_if_not_found=False):
            marked[id(m)] = m
        for c in own:
            if not any(_class_matches(m, c) for m in model.modules()):
                raise ConfigError(f"zero_optimization.leaf_module.classes: no module of class {c!r} in the model; "
                                 "give the class name (e.g. \"Block\") or its fully qualified name")
    for key, wanted, setter in (("names", cfg.names, set_z3_leaf_modules_by_name),
                                ("name_suffixes", cfg.name_suffixes, set_z3_leaf_modules_by_suffix)):
        modules, missing = setter(model, wanted, raise_if_not_found=False)
        if missing:
            raise ConfigError(f"zero_optimization.leaf_module.{key}: {', '.join(map(repr, missing))} matches no "
                              "module of the model; use names as model.named_modules() gives them")
        marked.update((id(m), m) for m in modules)
    return list(marked.values())


def _is_container(module: nn.Module) -> bool:
    return type(module).__name__ in nn.modules.container.__all__


def mark_by_granularity(model: nn.Module, threshold: int, numel_of: Callable[[nn.Parameter], int]) -> list[nn.Module]:
    """``zero_optimization.module_granularity_threshold``, DeepSpeed's rule: a module's granularity is the
    parameter elements of its subtree divided by its layers (the module itself, its non-container descendants with
    parameters, counting a plain layer as 1); going down from the root, the first module whose granularity is at
    most ``threshold`` becomes a leaf. Layers without children and containers (ModuleList...) never do. A parameter
    shared by two modules counts in both, as in DeepSpeed. Returns the modules marked."""
    granularity: dict[int, int] = {}

    def walk(module: nn.Module) -> tuple[int, int]:
        if not any(True for _ in module.parameters()):
            granularity[id(module)] = sys.maxsize
            return 0, 0
        numel = sum(numel_of(p) for p in module.parameters(recurse=False))
        children = list(module.children())
        if not children:
            granularity[id(module)] = sys.maxsize
            return 1, numel
        layers = 0
        for child in children:
            child_layers, child_numel = walk(child)
            layers += child_layers
            numel += child_numel
        if _is_container(module):
            granularity[id(module)] = sys.maxsize
            return layers, numel
        layers += 1
        granularity[id(module)] = numel // layers if numel <= _MAX_LEAF_NUMEL else sys.maxsize
        return layers, numel

    walk(model)
    marked: list[nn.Module] = []

    def mark(module: nn.Module) -> None:
        if not any(True for _ in module.parameters()):
            return
        if granularity[id(module)] <= threshold:
            module._z3_leaf = True
            marked.append(module)
            return
        for child in module.children():
            mark(child)

    mark(model)
    if not marked:
        smallest = min(granularity.values())
        log.warning("zero_optimization.module_granularity_threshold=%d marks no module: the smallest granularity "
                    "in this model is %d; set the threshold at least that high to take effect", threshold, smallest)
    return marked


def gather_units(model: nn.Module) -> Iterator[tuple[str, nn.Module, list[nn.Parameter]]]:
    """(name, module, parameters it gathers) for every unit, in ``named_modules()`` order: a leaf module with its
    whole subtree's parameters (no unit below it), any other module with its own parameters (and those of its
    ParameterList / ParameterDict children, which are never called), each with the parameters registered as its
    external ones (external.py). Modules that gather nothing are left out; each list is free of duplicates (a weight
    tied inside a leaf is gathered once). The coordinator makes a ``ParamUnit`` of each (unit.py)."""
    in_model = {id(p) for p in model.parameters()}

    def registered(module: nn.Module, name: str) -> list[nn.Parameter]:
        params = registered_external_parameters(module)
        for p in params:
            if id(p) not in in_model:
                raise ValueError(f"register_external_parameter({name or '<root>'}, ...): the parameter (shape "
                                 f"{tuple(p.shape)}) is not a parameter of the model given to initialize")
        return params

    def own(module: nn.Module) -> Iterator[nn.Parameter]:
        yield from module.parameters(recurse=False)
        for child in module.children():
            if isinstance(child, (nn.ParameterList, nn.ParameterDict)):
                yield from own(child)

    seen: set[int] = set()  # a module registered under two names is one unit, named as named_modules() does

    def walk(name: str, module: nn.Module):
        if id(module) in seen or isinstance(module, (nn.ParameterList, nn.ParameterDict)):
            return  # ParameterList / ParameterDict: gathered by the module that owns them
        if is_traced(module):
            return  # its graph gathers its subtree's parameters (traced.py): no unit, no hook
        seen.add(id(module))
        if z3_leaf_module(module) or (name and is_compiled(module)):  # [Note: a compiled module is one unit]
            if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
                raise ValueError(f"{name or '<root>'}: a {type(module).__name__} is marked as a ZeRO-3 leaf module, "
                                 "but its forward never runs, so its parameters would never be gathered; mark the "
                                 "modules it holds instead (e.g. leaf_module.classes: [\"Block\"])")
            externals = (p for sub_name, sub in module.named_modules(prefix=name) for p in registered(sub, sub_name))
            params = list({id(p): p for p in itertools.chain(module.parameters(), externals)}.values())
            if params:
                yield name, module, params
            return
        params = list({id(p): p for p in itertools.chain(own(module), registered(module, name))}.values())
        if params:
            yield name, module, params
        for child_name, child in module.named_children():
            yield from walk(f"{name}.{child_name}" if name else child_name, child)

    yield from walk("", model)
