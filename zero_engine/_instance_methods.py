"""Wrapping a method of one model instance (its ``generate``) without breaking copies of the model.

A wrapper set as ``model.generate = closure`` keeps calling the original model after ``copy.deepcopy(model)`` (TRL
builds its reference model so): deepcopy treats a function as atomic. A method bound to the model is rebound to the
copy instead. So a wrapper is a module-level function of ``(self, *args, **kwargs)``, installed bound to the
instance, and it finds the method it wraps with ``wrapped(self, wrapper, name)``: the instance's own method from
before (another wrapper: the Trainer's and ``engine.compile()``'s both wrap ``generate``), or the class's.
"""

from __future__ import annotations

import types

__all__ = ["install_bound_wrapper", "wrapped"]


def install_bound_wrapper(obj, name: str, wrapper) -> None:
    """Sets ``obj.<name>`` to ``wrapper`` bound to ``obj``, once (a second call with the same wrapper outermost does
    nothing). ``wrapper.__name__`` must be ``name``: a pickled model unpickles the bound method as
    ``getattr(model, name)``, the class's."""
    assert wrapper.__name__ == name, f"name {wrapper.__name__!r} {name!r}"
    before = obj.__dict__.get(name)
    if getattr(before, "__func__", None) is wrapper:
        return
    if before is not None:
        obj.__dict__[_before_key(wrapper)] = before
    setattr(obj, name, types.MethodType(wrapper, obj))


def wrapped(self, wrapper, name: str):
    """The method that ``wrapper`` (installed on ``self`` by ``install_bound_wrapper``) wraps."""
    return self.__dict__.get(_before_key(wrapper)) or getattr(type(self), name).__get__(self)


def _before_key(wrapper) -> str:
    return f"_zero_engine_before_{wrapper.__module__}.{wrapper.__qualname__}"
