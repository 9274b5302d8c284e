"""Module hooks that tell the coordinator when a module's parameters are needed, in forward and in backward.

forward:  pre-hook  -> gather the module's own parameters (``recurse=False``; children have their own hooks)
          post-hook -> release them
backward: a multi-grad hook on the module's outputs fires before the module's backward  -> gather again
          an identity autograd function on the module's inputs runs after its backward  -> release

[Note: end of backward]
Not every module's post-backward fires: a module whose inputs need no gradient (the embedding reading token ids,
a root whose inputs are data) never gets the input-side function run. So the first backward hook of a pass queues
one callback on autograd's execution engine; it runs when the whole backward is done and flushes the last
gradient buckets and releases whatever is still gathered.

[Note: frozen parameters in recomputation]
Non-reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=False)``) runs the forward of a
checkpointed region again inside backward, and keeps what that recomputation saves for the backward ops. It keeps a
tensor that requires grad as a ``detach()``ed alias (its own shape, sharing the storage our gather fills again before
the module's backward), but a tensor that does not (a frozen weight: PEFT's base model) as the Parameter itself. Our
post-forward release swaps that Parameter's data for an empty tensor, so torch's check of the recomputed tensors
(run when backward first unpacks one) sees shape [0] and raises CheckpointError; the backward op would read nothing.
So a post-forward inside backward keeps the module's frozen parameters gathered; its post-backward releases them
(or, if its inputs need no gradient, the end of backward does). Trainable parameters are released as before.

[Note: recomputation stopped early]
torch stops a recomputation as soon as it has recomputed the last tensor it needs, by raising
``_StopRecomputationError`` from inside the op that saves it, so the modules then running (often the block's last
Linear; a whole leaf block) end their forward with an exception. The post-forward hook is therefore registered with
``always_call=True``: otherwise that recomputation's gather would stay counted in ``active_users`` (its parameters
gathered to the end of backward; with leaf blocks, every block) and its scope in external.py left open (later reads
attributed to a module no longer running). A forward that raises for any other reason is closed the same way.

[Note: hooks under torch.compile]
Every hook here gathers, releases, issues collectives and keeps Python state: nothing a compiled graph can hold. So
each one is ``torch.compiler.disable``d (as FSDP2 marks its hooks): Dynamo never traces it. A unit's hooks run
around its module's ``_call_impl``, which ``Module.compile()`` and ``torch.compile(module)`` leave outside the graph
(hooks of the compiled module itself run eagerly, before and after it), so a compiled module that is one unit runs
with no graph break. A unit *inside* a compiled region would be a graph break at each of its hooks: units.py makes
a compiled module a unit of its whole subtree for that reason (see [Note: a compiled module is one unit]).

[Note: the hooks' common case]
Most units are called with tensors only and return one tensor (a block: ``block(x)``). For them the hooks skip
the pytree walks (``tree_flatten`` of the arguments and of the output, ``tree_unflatten``) and put a plain tensor
hook on the output instead of ``register_multi_grad_hook``: with one tensor, its "any" mode is that hook plus a
lock and a table of graph tasks, since a tensor's hook already runs once per backward, when its gradient is
complete. On the demo (8 units) that is 0.9 of the hooks' 2.9 ms of CPU a step (docs/benchmarks.md); any other
call takes the general path.

[Note: an input passed twice stays one tensor]
The identity function on a unit's inputs returns a new tensor for each input it is given. A tensor passed at several
places must come out as one tensor at all of them: modules test their inputs for identity, and
``nn.MultiheadAttention`` (called ``self_attn(x, x, x)`` by ``nn.TransformerEncoderLayer``) projects query, key and
value with one matmul only when ``query is key is value``. Given three tensors, it took its three-matmul path: the
same values forward, gradients that differed from one process's in the last bits, and three matmuls for one.

[Note: the sum of a unit input's gradients]
The identity function on a unit's inputs also groups the gradients that reach an input: those from inside the unit
are summed at its output first, then added to those from outside it (the residual stream, another unit). Plain torch
sums them all in one sequence, as they arrive. A tensor read at two places or more inside a unit and elsewhere too
(an RMSNorm reads its input twice, ``x.pow(2)`` and ``x * rsqrt(...)``, and the residual add once more) then gets a
sum associated differently, which can differ in the last bits: HF Llama at stage 3 with one-module units, up to
3e-8 on the embedding's gradient at the first backward (the forward bitwise, stage 2 bitwise; bitwise there with a
leaf unit around each decoder layer). FSDP2 and DeepSpeed wrap their units' inputs the same way.

[Note: an input modified in place]
An output of that identity function is, to autograd, a view of the input made inside a custom Function, and torch
forbids modifying such a view in place ("... is a view and is being modified inplace"): a module whose forward runs
``x.add_(b)`` or ``x.mul_(g)`` (timm's ``LayerScale(inplace=True)``) on its input trains at stages 0-2 and raises at
stage 3, as under FSDP2, which wraps inputs the same way. Returning aliases that are not views (``detach()``) would
let the operation through, but when the caller uses that input again (a residual ``x + block(x)``), autograd would
not see the change and the gradient of what was added would miss that use: silently wrong. So the error stays, and
the post-forward hook adds a note naming the unit and the fix (``_explain_in_place_on_an_input``).

[Note: a gradient penalty's graph reads the parameters]
A gradient penalty (WGAN-GP, R1) takes ``torch.autograd.grad(out, x, create_graph=True)`` inside the step's forward:
a backward that builds a graph, whose nodes (``grad_x = grad_h @ W``) read the parameters themselves, saved as they
were, and are run by the step's backward. Torch runs a backward's hooks with grad mode on only then
(``create_graph``): the engine's own backward never builds one. So a pre-backward hook that finds grad mode on
neither ends the step when that backward ends (its end-of-backward callback is the step's), nor lets anything be
released until the step's backward ends (``keep_until_step_ends``, read by the coordinator's release): the units
that backward gathered stay gathered, and the step's end releases them. Released, their storage was empty when the
step's backward ran those nodes ("setStorage: ... out of bounds for storage of size 0").

[Note: a copy of the model]
``copy.deepcopy(model)`` (an EMA, AveragedModel, a reference model) and ``torch.save(model)`` copy each module's
hook dicts, and each hook, a method bound to the ModuleHooks, with its object: the engine's whole state, up to its
process group, which cannot be copied ("cannot pickle 'ProcessGroup'"). The copy is a plain model instead. Its
hooks are bound to a ModuleHooks without a coordinator, and return at once (LoadStateDictHooks' likewise); its
parameters are plain ``nn.Parameter``s holding the whole value (``ZeroParameter.__deepcopy__``,
``__reduce_ex__``), so a copy is taken of gathered parameters: inside ``GatheredParameters(list(model.parameters()))``
at stage 3, where a released one would copy nothing but its shard and is refused by name.

Parameters a forward uses without owning them (read through an attribute, returned to the caller, registered):
external.py. For that the hooks keep external.py's list of the forwards running, and the model's root is entered
as a scope even when it has no parameters of its own.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import external
from .coordinator import ParamCoordinator
from .partition import ZeroParameter

__all__ = ["ModuleHooks", "BackwardEndCallback"]


class BackwardEndCallback:
    """Runs ``fn`` once when the current backward pass ends. See [Note: end of backward]."""

    def __init__(self, fn: Callable[[], None]):
        self.fn = fn
        self.queued = False  # read by per-parameter hooks before they call queue_if_needed: one call per pass

    def queue_if_needed(self) -> None:
        """Call from inside a backward pass (a hook); later calls in the same pass do nothing."""
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._run)

    def _run(self) -> None:
        self.queued = False
        self.fn()

    def reset(self) -> None:
        """After a backward that raised: autograd dropped the queued callback with the failed graph task."""
        self.queued = False


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward runs once all gradients w.r.t. those inputs are computed."""

    @staticmethod
    def forward(ctx, on_backward: Callable[[], None], *inputs: torch.Tensor):
        ctx.on_backward = on_backward
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.on_backward()
        return (None, *grads)


_VIEW_MODIFIED_IN_PLACE = "Output 0 of _PostBackward is a view and is being modified inplace"


def _explain_in_place_on_an_input(error: BaseException, unit: str) -> None:
    """Add to torch's error for an in-place operation on a unit's input what it means here and the fix, once (the
    innermost unit running names itself; its parents' hooks see the note). See [Note: an input modified in place]."""
    if not isinstance(error, RuntimeError) or _VIEW_MODIFIED_IN_PLACE not in str(error):
        return
    if any(note.startswith("zero_engine:") for note in getattr(error, "__notes__", ())):
        return
    error.add_note(
        f"zero_engine: the forward of {unit} (or a module it calls) modified in place a tensor given to a module as "
        "its input. At ZeRO stage 3 each module's inputs pass through an identity function that releases its "
        "parameters after its backward, and torch forbids in-place operations on that function's outputs (FSDP2's "
        "inputs are the same). Make the operation out of place (x = x + y for x += y, x = x * g for x.mul_(g)), or "
        "clone the input before modifying it (x = x.clone()).")


def _recomputing() -> bool:
    """A forward that backward runs: activation checkpointing's recomputation."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):  # the usual output: no pytree walk (see [Note: the hooks' common case])
        return [obj]
    leaves, _ = tree_flatten(obj)
    found = [x for x in leaves if isinstance(x, torch.Tensor)]
    if not found and hasattr(obj, "__dataclass_fields__"):  # plain dataclasses are not pytree nodes
        found = _tensors(list(vars(obj).values()))
    return found


def _eager(fn):
    """A hook Dynamo must never trace: see [Note: hooks under torch.compile]."""
    return torch.compiler.disable(fn, recursive=True, reason="zero_engine's ZeRO-3 hooks gather and release eagerly")


class ModuleHooks:
    """Installs and owns the hooks of every module that has parameters of its own."""

    def __init__(self, modules: list[nn.Module], coordinator: ParamCoordinator, backward_end: BackwardEndCallback,
                 root: nn.Module):
        self.coordinator = coordinator
        self.backward_end = backward_end
        self.root = root
        # The root's scope opens before its own unit's hooks run and closes after them, even if its forward raises.
        self._handles = [root.register_forward_pre_hook(self._enter_model, prepend=True)]
        for module in modules:
            self._handles.append(module.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            # always_call: also after a forward that raised; see [Note: recomputation stopped early]
            self._handles.append(module.register_forward_hook(self._post_forward, always_call=True))
        self._handles.append(root.register_forward_hook(self._leave_model, always_call=True))
        external.watch_parameter_reads(root)

    def __reduce__(self):
        """A copy or pickle of the model gets hooks that do nothing: see [Note: a copy of the model]."""
        return _inert_module_hooks, ()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        external.unwatch_parameter_reads(self.root)

    # ---- the model's forward (the root's scope, see external.py) -------------------------------------------------
    @_eager
    def _enter_model(self, module: nn.Module, args) -> None:
        if self.coordinator is None:  # a copy's: [Note: a copy of the model]
            return None
        external.enter_forward(self.coordinator, module, is_unit=False)

    @_eager
    def _leave_model(self, module: nn.Module, args, output) -> None:
        if self.coordinator is None:  # a copy's: [Note: a copy of the model]
            return None
        external.leave_forward(module, is_unit=False)
        self.coordinator.end_model_forward()

    # ---- forward -------------------------------------------------------------------------------------------------
    @_eager
    def _pre_forward(self, module: nn.Module, args, kwargs):
        if self.coordinator is None:  # a copy's: [Note: a copy of the model]
            return None
        self.coordinator.fetch(module, "forward")
        external.enter_forward(self.coordinator, module, is_unit=True, own=self.coordinator.unit_of(module).read_ids)
        if not torch.is_grad_enabled():
            return None
        plain = not kwargs and all(isinstance(x, torch.Tensor) for x in args)  # [Note: the hooks' common case]
        leaves, spec = (list(args), None) if plain else tree_flatten((args, kwargs))
        positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not positions:
            return None  # its release in backward is left to the end-of-backward callback
        # one tensor passed at several places stays one: see [Note: an input passed twice stays one tensor]
        distinct = {id(leaves[i]): leaves[i] for i in positions}
        wrapped = dict(zip(distinct, _PostBackward.apply(lambda: self._post_backward(module), *distinct.values())))
        for i in positions:
            leaves[i] = wrapped[id(leaves[i])]
        return (tuple(leaves), kwargs) if plain else tree_unflatten(leaves, spec)

    @_eager
    def _post_forward(self, module: nn.Module, args, output):
        if self.coordinator is None:  # a copy's: [Note: a copy of the model]
            return None
        failed = sys.exc_info()[1]  # always_call: the hook runs inside torch's handler of an error in the forward
        if failed is not None:
            _explain_in_place_on_an_input(failed, self.coordinator.unit_of(module).name)
        external.leave_forward(module, is_unit=True)
        outputs = _tensors(output)
        for x in outputs:
            if isinstance(x, ZeroParameter):  # returned to the caller, who uses it after this module ends
                self.coordinator.hold_returned(x)
        self.coordinator.release(module, keep_frozen=_recomputing())  # see [Note: frozen parameters in recomputation]
        if torch.is_grad_enabled():
            tensors = [x for x in outputs if x.requires_grad]
            if len(tensors) == 1:  # a tensor's hook runs once per backward already: [Note: the hooks' common case]
                tensors[0].register_hook(lambda _grad: self._pre_backward(module))
            elif tensors:
                register_multi_grad_hook(tensors, lambda _grad: self._pre_backward(module), mode="any")
        return None

    # ---- backward ------------------------------------------------------------------------------------------------
    @_eager
    def _pre_backward(self, module: nn.Module) -> None:
        if torch.is_grad_enabled():  # a backward that builds a graph: see [Note: a gradient penalty's graph ...]
            self.coordinator.keep_until_step_ends = True
        else:
            self.backward_end.queue_if_needed()
        self.coordinator.fetch(module, "backward")

    @_eager
    def _post_backward(self, module: nn.Module) -> None:
        self.coordinator.release(module)


def _inert_module_hooks() -> ModuleHooks:
    inert = object.__new__(ModuleHooks)
    inert.coordinator = None
    return inert
