"""Hugging Face transformers models under ZeRO-3: pretrained checkpoints in and out of the shards, and the Trainer.

    model = zero_engine.hf.from_pretrained(AutoModelForCausalLM, "models/llama", config="ds_config.json")
    engine, *_ = zero_engine.initialize(model=model, config="ds_config.json")
    ...
    zero_engine.hf.save_pretrained(engine, "out/llama-finetuned")    # loads with plain transformers

    trainer = zero_engine.hf.ZeroTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                                         zero_config="ds_config.json")   # transformers.Trainer on the engine

from_pretrained streams each tensor of the checkpoint (safetensors, sharded safetensors with an index, or
pytorch_model.bin) into each rank's shard, so no rank ever holds the whole model; save_pretrained gathers one tensor
at a time onto rank 0, which writes safetensors shards. ZeroTrainer and ZeroTrainerMixin (for Trainer subclasses
such as TRL's) are in trainer.py. transformers is optional (``pip install 'zero_engine[hf]'``): it is imported when
one of these is used.
"""

from ._load import from_pretrained
from ._resize import resize_token_embeddings
from ._save import save_pretrained

__all__ = ["from_pretrained", "resize_token_embeddings", "save_pretrained", "ZeroTrainer", "ZeroTrainerMixin"]


def __getattr__(name):
    if name in ("ZeroTrainer", "ZeroTrainerMixin"):  # imports transformers: only when asked for
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
