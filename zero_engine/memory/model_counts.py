"""What a memory estimate needs to know about a model, counted without touching its data: the size of every unique
parameter and of what each gather unit holds while it runs (estimator.py turns these into bytes per rank)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from zero_engine.zero.tensor_parallel import local_of
from zero_engine.zero.units import gather_units

__all__ = ["ModelCounts", "count_model_params"]


@dataclass(frozen=True)
class ModelCounts:
    """What the estimate needs to know about a model: every unique parameter's size and the layers' groupings.

    ``layers`` holds, per gather unit (a module with parameters of its own, or a leaf module with its subtree's: see
    zero/units.py), the element counts of the parameters that are gathered while it runs: its own and those of its
    ancestors (a parent's own parameters stay gathered while its children run). A tied parameter appears once in
    ``numels`` and in every layer that uses it.
    """

    numels: tuple[int, ...]
    trainable: tuple[bool, ...]
    layers: tuple[tuple[int, ...], ...]
    largest_layer_params: int  # DeepSpeed's definition: the most parameter elements any one module owns
    largest_layer_name: str = ""
    shared_numels: tuple[int, ...] = ()  # parameters that several modules use as their own (a tied embedding)

    def __post_init__(self):
        if len(self.numels) != len(self.trainable):
            raise ValueError(f"ModelCounts: {len(self.numels)} numels but {len(self.trainable)} trainable flags")

    @property
    def total_params(self) -> int:
        return sum(self.numels)

    @property
    def trainable_params(self) -> int:
        return sum(n for n, t in zip(self.numels, self.trainable) if t)


def count_model_params(model: nn.Module) -> ModelCounts:
    """Sizes of a model's unique parameters and layers, without touching their data (meta tensors are fine). A
    parameter split by tensor parallelism (a DTensor) counts its tp-local piece: what one rank shards over dp."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    params = list(model.parameters())  # unique by identity: a tied weight is counted once
    if params and not any(p.numel() for p in params):
        raise ValueError("model: every parameter has 0 elements -- was it already partitioned by "
                         "zero_engine.initialize (stage 3 frees full parameters)? Estimate before initialize, or "
                         "on a copy built on the meta device.")
    largest, largest_name = 0, ""
    layers: list[tuple[int, ...]] = []
    owners: dict[int, int] = {}  # id(param) -> units that gather it
    # The engine's gather units (zero/units.py: a leaf module gathers its whole subtree); while one runs, the units
    # above it (its ancestors, e.g. the root's own embedding) are gathered too.
    units = {name: params for name, _, params in gather_units(model)}
    for name, own in units.items():
        for p in own:
            owners[id(p)] = owners.get(id(p), 0) + 1
        own_numel = sum(local_of(p).numel() for p in own)
        if own_numel > largest:
            largest, largest_name = own_numel, name or "<root>"
        chain, ancestor = [], name
        while ancestor:
            ancestor = ancestor.rpartition(".")[0]
            chain.append(units.get(ancestor, ()))
        live = {id(p): p for params in [*reversed(chain), own] for p in params}  # outermost first
        layers.append(tuple(local_of(p).numel() for p in live.values()))
    return ModelCounts(numels=tuple(local_of(p).numel() for p in params),
                       trainable=tuple(p.requires_grad for p in params), layers=tuple(layers),
                       largest_layer_params=largest, largest_layer_name=largest_name,
                       shared_numels=tuple(local_of(p).numel() for p in params if owners.get(id(p), 0) > 1))
