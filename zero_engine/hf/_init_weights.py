"""transformers' weight init of a model built under zero.Init: each module's with its parameters gathered.

A transformers model initialises its weights at the end of its constructor (``post_init`` -> ``initialize_weights``:
each module's ``_init_weights``, children first). Under zero.Init every submodule is partitioned by then, and
``_init_weights`` does more than the ``torch.nn.init`` calls that zero.Init's mode gathers for: it indexes an
embedding's padding row (BERT, OPT, BART, Gemma, a Llama with a pad token), builds Whisper's sinusoids from a
parameter's shape, converts ViT's position embeddings to fp32. Each failed on a released parameter. So for its block
zero.Init puts this in place of ``PreTrainedModel.initialize_weights``: the modules are walked in transformers' order
(so the same random numbers are drawn as in a build without zero.Init), and each module's ``_initialize_weights``
runs with its own parameters and its direct children's gathered, rank 0's values kept. transformers does the same
for DeepSpeed's zero.Init (``integrations.deepspeed.initialize_weights_zero3``).
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch import nn

from ..zero.gathered import GatheredParameters
from ..zero.partition import ParamStatus, sharded_param_of

__all__ = ["gathered_initialize_weights"]


@contextlib.contextmanager
def gathered_initialize_weights():
    """``PreTrainedModel.initialize_weights`` is ``_initialize_weights_gathered`` inside the block (zero.Init enters
    it when transformers is imported: no transformers model can be built otherwise)."""
    cls = sys.modules["transformers.modeling_utils"].PreTrainedModel
    before = cls.__dict__["initialize_weights"]
    cls.initialize_weights = _initialize_weights_gathered
    try:
        yield
    finally:
        cls.initialize_weights = before


def _initialize_weights_gathered(self) -> None:
    from transformers.initialization import guard_torch_init_functions
    from transformers.modeling_utils import PreTrainedModel

    custom = self.is_custom_code() if hasattr(self, "is_custom_code") else False

    def apply(module: nn.Module, init) -> None:
        for child in module.children():
            apply(child, child._initialize_weights if isinstance(child, PreTrainedModel) else init)
        params = [*module.parameters(recurse=False)]
        for child in module.children():  # _init_weights may reach into a direct child (Whisper's embed_positions)
            if not isinstance(child, PreTrainedModel):
                params += child.parameters(recurse=False)
        released = [p for p in dict.fromkeys(params)
                    if (sp := sharded_param_of(p)) is not None and sp.status is ParamStatus.NOT_AVAILABLE]
        with GatheredParameters(released, modifier_rank=0, enabled=bool(released)):
            init(module, custom)

    with torch.no_grad(), guard_torch_init_functions():
        apply(self, self._initialize_weights)
