"""A record that learns, without walking the model, that torch registered a module or a parameter somewhere.

Used by the checks that run at every forward (guards.py ``ModelSnapshot``, compile.py ``CompiledModules``): torch's
global registration hooks set the record's ``changed`` flag, and the check walks the model only then.
"""

from __future__ import annotations

import weakref

from torch.nn.modules.module import register_module_module_registration_hook, register_module_parameter_registration_hook

__all__ = ["watch_registrations"]


def watch_registrations(record, parameters: bool = False) -> weakref.finalize:
    """Set ``record.changed = True`` whenever a module (and, with ``parameters``, a parameter) is registered in any
    module. Returns the finalizer that removes the hooks: call it when the record's engine is destroyed; garbage
    collection of the record calls it too (the hooks hold the record weakly, so a dropped engine is never kept
    alive by them)."""
    this = weakref.ref(record)

    def mark_changed(*args) -> None:  # returns None: the registration goes on unchanged
        target = this()
        if target is not None:
            target.changed = True
    handles = [register_module_module_registration_hook(mark_changed)]
    if parameters:
        handles.append(register_module_parameter_registration_hook(mark_changed))
    return weakref.finalize(record, _remove_all, handles)


def _remove_all(handles) -> None:
    for handle in handles:
        handle.remove()
