"""torch.compile with the engine: regional compilation (``engine.compile()``, the config's ``compile`` section), and
modules the user compiled themselves, before or after ``initialize``.

[Note: how a compiled region composes with ZeRO-3]
What Dynamo guards on must not change between steps, and what it traces must not gather. Three things make that so:

* **The hooks run eagerly.** Every hook is ``torch.compiler.disable``d (hooks.py, [Note: hooks under
  torch.compile]); the hooks of a compiled module itself run around its compiled call, not inside it.
* **A compiled module is one unit** (units.py, [Note: a compiled module is one unit]): its hooks gather its whole
  subtree before the compiled call, so Dynamo sees whole parameters and no hook inside the region (no graph break).
  A module compiled after ``initialize`` is noticed at the next forward, which makes the units again
  (``refresh_units_if_compiled``).
* **Gather and release keep what Dynamo guards on.** A parameter keeps its identity and its storage object (release
  resizes the storage, gather fills the same one: partition.py), and inside a compiled call it is always gathered:
  class ``GatheredZeroParameter``, full shape. Dynamo's guards on the parameters (type, shape, strides, dtype,
  requires_grad) hold on every call, so the region compiles once per distinct shape: blocks of one shape share one
  graph, and nothing recompiles after the first step.
  A DTensor parameter of a tensor-parallel block keeps its spec and the identity of its local tensor likewise
  (tensor_parallel.py, [Note: compiled blocks with DTensor parameters]).

The whole model compiled (``model.compile()``) trains too, with graph breaks at the units' hooks: see
[Note: the whole model compiled at ZeRO-3].

What cannot be compiled fails with a message: a compiled region that reads a parameter outside its subtree (which
its unit does not gather) raises a ``RuntimeError`` naming the region and the parameter (external.py,
[Note: reads inside a compiled region]) instead of Dynamo's internal error.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.nn as nn

from ._instance_methods import install_bound_wrapper, wrapped
from ._registrations import watch_registrations
from .zero.units import gather_units, is_compiled, z3_leaf_module

log = logging.getLogger("zero_engine.compile")

__all__ = ["CompiledModules", "compile_engine", "compiled_modules", "compile_regions", "generate_without_recompiling",
           "log_whole_model_compiled", "refresh_units_if_compiled"]

_compiled_call_impl = operator.attrgetter("_compiled_call_impl")  # what module.compile() sets (None: not compiled)


def compiled_modules(model: nn.Module) -> frozenset[int]:
    """ids of the compiled modules of the model: those below the root are units (units.py); the root is not."""
    return frozenset(id(m) for m in model.modules() if is_compiled(m))


class CompiledModules:
    """The compiled modules of a model when its units were made, and a check at each forward that none was compiled
    (or un-wrapped) since, without walking the model.

    [Note: noticing a compilation without a walk]
    A module becomes compiled in one of two ways. ``torch.compile(m)`` put in the model in ``m``'s place registers an
    ``OptimizedModule``, and so does anything else that changes the module tree: torch's global module registration
    hook marks this record changed (``watch_registrations``, as for ``ModelSnapshot`` in guards.py). ``module.compile()`` only sets the
    module's ``_compiled_call_impl`` and registers nothing, so the check compares that attribute of every module
    the last walk found with what it was then: one C-level ``map`` over a list, no generator walk and no frame per
    module (``model.modules()`` ran 206 Python frames a forward on the demo). Only when one of the two says so is
    the model walked again, and the units made again if its compiled modules changed."""

    def __init__(self, model: nn.Module):
        self._take(model)
        self.changed = False
        self.close = watch_registrations(self)  # destroy() calls it; else garbage collection

    def _take(self, model: nn.Module) -> None:
        self.modules = list(model.modules())
        self.impls = list(map(_compiled_call_impl, self.modules))
        self.ids = frozenset(id(m) for m in self.modules if is_compiled(m))

    def differ(self, model: nn.Module) -> bool:
        """Whether the model's compiled modules differ from the recorded ones (walked only when something
        changed: see [Note: noticing a compilation without a walk]); the record is brought up to date."""
        if not self.changed and list(map(_compiled_call_impl, self.modules)) == self.impls:
            return False
        before = self.ids
        self._take(model)
        self.changed = False
        return self.ids != before


def log_whole_model_compiled(engine) -> None:
    """[Note: the whole model compiled at ZeRO-3] ``model.compile()`` (or ``engine.module.compile()``) keeps the
    units below the root: their hooks must gather and release eagerly, so Dynamo breaks the graph at each of them
    (and a break inside a loop, such as the loop over the blocks, makes Dynamo run the rest of that frame eagerly).
    It trains correctly and compiles nothing after the first step, but little of the model is in graphs; regional
    compilation (``engine.compile()``, or each block's ``compile()``) gives one graph per block. Logged when the
    units are made (at initialize, or when compiled modules are noticed), with their number, so a user sees why the
    model runs mostly eagerly."""
    if engine.comm.rank == 0 and is_compiled(engine.module):
        log.warning("zero_engine: the whole model is compiled at ZeRO-3; Dynamo breaks its graph at the hooks of "
                    "each of its %d gather units (they gather and release eagerly), so much of it runs eagerly. "
                    "Compile the blocks instead for one graph per block: engine.compile(), or block.compile() on each "
                    "(count the breaks with torch._dynamo.utils.counters['graph_break'])",
                    len(engine.coordinator.units))


def refresh_units_if_compiled(engine) -> None:
    """At a forward: if modules were compiled (or un-wrapped) since the units were made, make them again, so that a
    compiled module is one unit (see [Note: how a compiled region composes with ZeRO-3]). Outside a step only: a
    forward inside a step (an evaluation forward before the backward) keeps the units until the step ends."""
    coordinator = engine.coordinator
    if coordinator is None or coordinator.in_step or not engine.compiled_at_units.differ(engine.module):
        return
    from .wiring import build_gathering

    build_gathering(engine, engine.module)
    if engine.comm.rank == 0:
        log.info("zero_engine: modules were compiled since the gather units were made; units made again (%d): "
                 "each compiled module below the root is one unit of its whole subtree", len(engine.coordinator.units))


def compile_regions(model: nn.Module, stage: int, tp: bool = False) -> list[tuple[str, nn.Module]]:
    """What ``engine.compile()`` compiles, each with its own ``module.compile()`` (with ``tp``, a block compiled as
    its children is marked a leaf here: see the Note below):

    * stages 0-2 (parameters whole, no hooks): the whole model, as DeepSpeed does; with tensor parallelism (``tp``),
      the regions of stage 3 instead: see [Note: compiled regions with tp];
    * stage 3: the leaf modules if the model has some (a leaf is already one unit); else the *blocks*: each module
      with parameters held in an ``nn.ModuleList`` / ``nn.Sequential`` that has children of its own (a transformer
      block, torchtitan's regions); else each unit's module. The rest of the model (embeddings, final norm, head)
      runs eagerly between the regions.

    [Note: compiled regions with tp] torch (2.13) cannot compile a region with DTensor parameters and activation
    checkpointing inside it: AOTAutograd's forward saves a DeviceMesh among the tensors it checks ("expected all
    tensors_saved_with_vc_check to be Tensors"), reproduced without zero_engine (a test GPT, MLPs split by
    parallelize_module, torch.utils.checkpoint around each block, ``model.compile()``; or a transformers Llama
    whose decoder layers, each checkpointing inside its forward as Hugging Face's gradient checkpointing does,
    are compiled one by one), while the same models with the checkpoint outside every compiled region train. So
    with a tp dim every stage compiles the blocks, as torchtitan does, and a block that checkpoints inside its
    forward (``checkpoints_inside``) is not compiled itself: its children are, and the checkpoint around them runs
    eagerly (its recomputation calls the same compiled children, so it saves what the forward saved). The block
    stays one unit, as it would be compiled: it is marked a leaf. Its children as units of their own did not
    recompute what they saved (torch's CheckpointError: a split attention weight saved whole, recomputed
    partitioned), and the whole block is what the recomputation in the backward reads anyway.

    Nor can torch (2.13) compile DTensor parameters with dynamic shapes: a second sequence length, which makes
    Dynamo recompile with the length dynamic, raised "RecursionError: maximum recursion depth exceeded" from the
    aot_eager backend (reproduced without zero_engine: a Llama split by parallelize_module, its layers compiled,
    lengths 16, 11, 7). So with a tp dim the regions compile with ``dynamic=False`` unless the compile kwargs say
    otherwise: each new length compiles once, up to Dynamo's recompile limit (8), after which new lengths run
    eagerly with Dynamo's warning; pad lengths to a few sizes to stay compiled.
    """
    if stage < 3 and not tp:
        return [("<root>", model)]
    named = list(model.named_modules())
    regions = [(n, m) for n, m in named if n and z3_leaf_module(m)]
    if not regions:
        for name, container in named:
            if isinstance(container, (nn.ModuleList, nn.Sequential)):
                for child_name, child in container.named_children():
                    if next(child.children(), None) is not None and next(child.parameters(), None) is not None:
                        regions.append((f"{name}.{child_name}" if name else child_name, child))
    if not regions:
        regions = [(name, module) for name, module, _ in gather_units(model) if name]
    if tp:
        regions = [region for name, module in regions for region in
                   (_children_as_regions(name, module) if checkpoints_inside(module) else [(name, module)])]
    return regions


def checkpoints_inside(module: nn.Module) -> bool:
    """Does ``module``'s forward run activation checkpointing around its body: torch's ``checkpoint_wrapper``, or a
    Hugging Face layer with gradient checkpointing on (transformers 5 checkpoints inside each decoder layer's
    forward)?"""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return isinstance(module, CheckpointWrapper) or getattr(module, "gradient_checkpointing", False) is True


def _children_as_regions(name: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of a block that checkpoints inside, compiled in its place; the block made one unit (a leaf)."""
    module._z3_leaf = True
    return [(f"{name}.{child_name}", child) for child_name, child in module.named_children()
            if next(child.parameters(), None) is not None]


def compile_engine(engine, backend: Any = None, compile_kwargs: dict | None = None, traced: bool = False) -> None:
    """``engine.compile()``: see the method's docstring (deepspeed_api.py)."""
    kwargs = dict(compile_kwargs or {})
    if backend is not None:
        kwargs["backend"] = backend
    if "backend" not in kwargs:
        kwargs["backend"] = "inductor"
    tp = engine.mesh.tp_size > 1
    regions = compile_regions(engine.module, engine.stage, tp=tp)
    if tp:  # see [Note: compiled regions with tp]
        kwargs.setdefault("dynamic", False)
    if traced:
        _compile_traced(engine, regions, kwargs)
        return
    for name, module in regions:
        if is_compiled(module):
            continue  # compiled already (by the user, or a second engine.compile()): keep that compilation
        module.compile(**kwargs)
    _warn_if_a_kv_cache_splits_the_graphs(engine, regions)
    generate_without_recompiling(engine.module)
    engine.is_compiled = True
    if engine.comm.rank == 0:
        log.info("zero_engine: compiled %d region(s) with backend %r (%s)", len(regions), kwargs["backend"],
                 ", ".join(name for name, _ in regions[:4]) + (", ..." if len(regions) > 4 else ""))
    refresh_units_if_compiled(engine)


def _warn_if_a_kv_cache_splits_the_graphs(engine, regions: list[tuple[str, nn.Module]]) -> None:
    """[Note: a KV cache in training forwards] A transformers model whose ``config.use_cache`` is True builds a KV
    cache in every forward, training ones too, and hands it to each decoder layer, which writes its own entry
    (``cache.layers[layer_idx]``). Dynamo guards on that entry's state, so layers compiled one by one (the regions
    here) compile one graph each instead of sharing one, and once a code object has ``recompile_limit`` graphs (8)
    the layers after run eagerly: a 12-layer Llama compiled 8 graphs and ran 4 layers eagerly (tests/test_compile.py).
    transformers' Trainer sets ``config.use_cache = False`` for training (its ``use_cache`` argument); a plain loop
    keeps the default, so the user is told. ``generate()`` keeps its cache either way (it reads
    ``generation_config``)."""
    config = getattr(engine.module, "config", None)
    if engine.comm.rank != 0 or len(regions) < 2 or getattr(config, "use_cache", None) is not True:
        return
    import torch._dynamo  # not at import: Dynamo loads only where something is compiled

    log.warning("zero_engine: engine.compile() compiled %d regions of a transformers model whose config.use_cache "
                "is True: each training forward builds a KV cache that Dynamo guards on per layer, so each layer "
                "compiles a graph of its own and past torch._dynamo.config.recompile_limit (%d) the rest run "
                "eagerly. Set model.config.use_cache = False for training, as transformers' Trainer does "
                "(generate() keeps its cache)", len(regions), torch._dynamo.config.recompile_limit)


def generate_without_recompiling(model: nn.Module) -> None:
    """[Note: generate does not spend the training's compilations] ``generate()`` calls the compiled regions with a
    KV cache and lengths that grow by one token a call: Dynamo compiles each layer again per cache state and length
    until the code object holds ``recompile_limit`` graphs (8), and from then on any new shape runs eagerly, the
    training's included. Measured: a Llama trained at length 16 (1 graph), then generating, then trained at length 11
    kept 8 graphs, 7 of them generate's, and ran length 11 eagerly for good (as TRL's online trainers alternate). So the
    model's ``generate`` runs under ``torch.compiler.set_stance("eager_on_recompile")``: it uses the graphs the
    regions have where their guards hold (few: generate runs without gradients, the training's graphs with them), and
    runs eagerly where it would have compiled, a region's first graph included. Set once, on the model instance
    (``engine.generate`` and ``engine.module.generate``, as TRL calls it, are that method)."""
    if callable(getattr(model, "generate", None)):
        install_bound_wrapper(model, "generate", _generate)


def _generate(self, *args, **kwargs):
    """The model's ``generate``, recompiling nothing: see [Note: generate does not spend the training's
    compilations] (traced regions run eagerly without gradients anyway: [Note: a traced region without gradients
    runs eagerly] in zero/traced.py)."""
    with torch.compiler.set_stance("eager_on_recompile"):
        return wrapped(self, _generate, "generate")(*args, **kwargs)


_generate.__name__ = "generate"  # install_bound_wrapper's rule (pickling)


def _compile_traced(engine, regions: list[tuple[str, nn.Module]], kwargs: dict) -> None:
    """``engine.compile(traced=True)``: each region a traced region (zero/traced.py, [Note: the traced mode]), then
    the units made again without them."""
    from .wiring import build_gathering
    from .zero.traced import connect, is_traced, refuse_unsupported, trace_regions

    refuse_unsupported(engine, regions)
    if engine.coordinator is not None and engine.coordinator.in_step:
        raise RuntimeError("engine.compile(traced=True) inside a step (between a forward and its backward); call it "
                           "before the first forward or after a step")
    fresh = [(name, module) for name, module in regions if not is_traced(module)]
    for name, module in fresh:
        if is_compiled(module):
            raise NotImplementedError(f"compile.traced: {name} is compiled already (module.compile(), torch.compile "
                                      "or engine.compile() without traced): a region is compiled one way; compile "
                                      "with traced=True only, on a model whose blocks are not compiled yet")
    new = trace_regions(engine, fresh, kwargs)
    if not new:
        return  # traced already (a second engine.compile(traced=True)): nothing to do
    _warn_if_a_kv_cache_splits_the_graphs(engine, fresh)
    engine.traced_regions = [*engine.traced_regions, *new]
    build_gathering(engine, engine.module)  # the units without the traced regions' subtrees (units.py)
    connect(engine, new)
    generate_without_recompiling(engine.module)
    engine.is_compiled = True
    if engine.comm.rank == 0:
        log.info("zero_engine: traced %d region(s) with backend %r (gathers %s inside each graph, gradients "
                 "reduce-scattered there): %s", len(new), kwargs["backend"],
                 "one per parameter" if engine.config.zero_optimization.allgather_sequential is True
                 else "one per flat shard", ", ".join(repr(r) for r in new[:4]) + (", ..." if len(new) > 4 else ""))
