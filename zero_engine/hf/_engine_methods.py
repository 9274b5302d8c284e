"""What initialize() changes on a transformers model (any model with these methods), on the instance only.

* ``generate`` defaults to ``synced_gpus=True`` where a forward is collective (stage 3 gathers parameters; a tp
  mesh dim splits layers) and there are several ranks: transformers does that for DeepSpeed's ZeRO-3 and FSDP alone.
  Without it a rank whose sequences end first stops calling forward while the others still gather, and the run
  stops with RankDivergenceError; with it, finished ranks keep running forwards until every rank is done.
* ``resize_token_embeddings`` is refused: the engine's optimizer and buckets hold the old embedding (_resize.py).

The ZeroTrainer installs the same ``generate`` (trainer.py).
"""

from __future__ import annotations

from torch import nn

from .._instance_methods import install_bound_wrapper, wrapped
from ._resize import install_resize_token_embeddings

__all__ = ["adapt_transformers_model", "install_synced_generate"]


def adapt_transformers_model(model: nn.Module, collective_forward: bool) -> None:
    """``collective_forward``: the engine's forwards run collectives (stage 3, or a tp dim), on several ranks."""
    install_resize_token_embeddings(model)
    if collective_forward:
        install_synced_generate(model)


def install_synced_generate(model: nn.Module) -> None:
    if callable(getattr(model, "generate", None)):
        install_bound_wrapper(model, "generate", generate)


def generate(self, *args, **kwargs):
    """The model's ``generate`` with ``synced_gpus=True`` unless the caller says otherwise."""
    kwargs.setdefault("synced_gpus", True)
    return wrapped(self, generate, "generate")(*args, **kwargs)
