"""A module's ``zero_grad()`` drops the gradients its engine holds for it (stages 2-3).

torch's ``nn.Module.zero_grad`` drops what waits in its parameters' ``.grad``. At stages 2-3 nothing waits there:
each gradient hook hands ``.grad`` to the reducer as it comes (zero/grads.py), and the window's gradients are in the
reducer's shards. So ``netD.zero_grad()``, which DeepSpeed's own GAN example calls before the discriminator's
step, dropped nothing: the discriminator's gradients from the generator's backward (which runs through it) were
added to its next update. initialize installs this on every module of the model at stages 2-3 (at stages 0-1 the
gradients do wait in ``.grad``); a module whose parameters lead to no reducer (after ``destroy()``) gets torch's
alone.
"""

from __future__ import annotations

from torch import nn

from .._instance_methods import install_bound_wrapper, wrapped
from .partition import sharded_param_of

__all__ = ["install_module_zero_grad"]


def install_module_zero_grad(model: nn.Module) -> None:
    for module in model.modules():
        install_bound_wrapper(module, "zero_grad", zero_grad)


def zero_grad(self: nn.Module, set_to_none: bool = True) -> None:
    """torch's ``zero_grad``, then this window's gradients of the module's parameters dropped from their reducer."""
    wrapped(self, zero_grad, "zero_grad")(set_to_none)
    dropped: dict = {}  # reducer -> ids of its parameters here (a model is one engine's, but a module may be shared)
    for param in self.parameters():
        sp = sharded_param_of(param)
        if sp is not None and sp.grad_reducer is not None:
            dropped.setdefault(sp.grad_reducer, set()).add(id(sp))
    for reducer, params in dropped.items():
        reducer.zero_grad(params)
