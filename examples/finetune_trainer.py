"""Fine-tune with transformers' Trainer under ZeRO-3: the usual Trainer script, two lines changed (CPU ranks, no
downloads).

    torchrun --standalone --nproc_per_node 2 examples/finetune_trainer.py --output runs/trainer --steps 20

A tiny random Llama learns a sequence task (counting modulo the vocabulary) whose loss visibly falls. The two
changed lines are marked: ``ZeroTrainer`` instead of ``Trainer``, and ``zero_config=`` (the ds_config you would
have given to ``TrainingArguments(deepspeed=...)``; its "auto" values come from the TrainingArguments). Evaluation
runs before and after training; checkpoints (model + the engine's sharded optimizer state) go to
OUTPUT/checkpoint-N every --save-every steps, ``--resume`` continues from the latest; OUTPUT/final loads with plain
``AutoModelForCausalLM.from_pretrained``. With --model DIR, a local transformers causal LM is loaded into the
shards with ``zero_engine.hf.from_pretrained`` instead (no rank holds the whole model).
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

import zero_engine.hf
from zero_engine.hf import ZeroTrainer  # (1) instead of: from transformers import Trainer

ZERO_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_param_persistence_threshold": 1000},
}


class Counting(torch.utils.data.Dataset):
    """Windows of 0, 1, 2, ... modulo the vocabulary, each starting elsewhere: the next token is predictable."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int):
        starts = torch.randint(0, vocab, (n, 1), generator=torch.Generator().manual_seed(seed))
        self.ids = (starts + torch.arange(seq_len)) % vocab

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", default="runs/finetune_trainer")
    parser.add_argument("--model", help="a local transformers causal LM directory (default: a tiny random Llama)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--resume", action="store_true", help="continue from the latest OUTPUT/checkpoint-N")
    args = parser.parse_args()

    if args.model:
        from transformers import AutoModelForCausalLM

        model = zero_engine.hf.from_pretrained(AutoModelForCausalLM, args.model, config=ZERO_CONFIG)
    else:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=128))
    vocab = model.config.vocab_size
    training_args = TrainingArguments(
        output_dir=args.output, max_steps=args.steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=3e-3, warmup_steps=3, lr_scheduler_type="linear", max_grad_norm=1.0, bf16=args.bf16,
        logging_steps=5, eval_strategy="steps", eval_steps=args.save_every, save_strategy="steps",
        save_steps=args.save_every, per_device_eval_batch_size=8, report_to=[], disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(), seed=0)
    trainer = ZeroTrainer(model=model, args=training_args, train_dataset=Counting(256, 32, vocab, seed=1),
                          eval_dataset=Counting(32, 32, vocab, seed=2),
                          zero_config=ZERO_CONFIG)  # (2) the ds_config, instead of TrainingArguments(deepspeed=)
    before = trainer.evaluate()["eval_loss"]
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    after = trainer.evaluate()["eval_loss"]
    trainer.save_model(f"{args.output}/final")
    if trainer.is_world_process_zero():
        print(f"eval loss {before:.3f} -> {after:.3f}; the model is in {args.output}/final")
    trainer.engine.destroy()  # waits for every rank, stops the watchdog, lets go of the group


if __name__ == "__main__":
    main()
    torch.distributed.destroy_process_group()  # before the interpreter ends: a gloo group left to exit can abort a rank
