"""Fine-tune a Hugging Face causal LM from a local directory under ZeRO-3 (CPU ranks, no downloads).

    python examples/finetune_hf.py --make-tiny models/tiny-llama          # a tiny random Llama to try it on
    torchrun --standalone --nproc_per_node 2 examples/finetune_hf.py \\
        --model models/tiny-llama --config examples/configs/hf_finetune.json --output runs/tiny --steps 40

The pretrained weights are streamed into each rank's shards (zero_engine.hf.from_pretrained: no rank holds the whole
model); every --checkpoint-every steps a resumable engine checkpoint goes to OUTPUT/checkpoints (rerun the same
command to resume from the latest); at the end OUTPUT/final is written with zero_engine.hf.save_pretrained and
loads with plain transformers.AutoModelForCausalLM.from_pretrained. Training text: --data FILE (tokenized with the
model's tokenizer), or, without it, a generated sequence task (counting modulo the vocabulary) whose loss visibly
falls.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

import zero_engine
import zero_engine.hf


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--make-tiny", metavar="DIR", help="write a tiny random Llama to DIR and exit")
    parser.add_argument("--model", help="local directory of a transformers causal LM (config.json + weights)")
    parser.add_argument("--config", default="examples/configs/hf_finetune.json", help="a DeepSpeed-style JSON config")
    parser.add_argument("--output", default="runs/finetune_hf")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--data", help="a text file to fine-tune on (needs a tokenizer in --model)")
    parser.add_argument("--save-dtype", choices=["compute", "float32"], default="compute",
                        help="final save_pretrained dtype: the compute dtype, or the fp32 master weights")
    return parser.parse_args()


def make_tiny(directory: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    print(f"wrote a tiny random Llama ({sum(1 for _ in os.scandir(directory))} files) to {directory}")


class TokenWindows(torch.utils.data.Dataset):
    """Fixed-length windows of one token stream; each item is (input_ids, labels), labels = inputs (HF shifts)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self):
        return max(1, (self.tokens.numel() - 1) // self.seq_len)

    def __getitem__(self, i):
        window = self.tokens[i * self.seq_len: (i + 1) * self.seq_len]
        return {"input_ids": window, "labels": window}


def load_tokens(args, vocab_size: int) -> torch.Tensor:
    if args.data:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        with open(args.data) as f:
            return torch.tensor(tokenizer(f.read())["input_ids"], dtype=torch.long)
    start = torch.arange(256) * 7  # generated: runs counting up modulo the vocabulary, from varied starts
    return ((start[:, None] + torch.arange(args.seq_len)[None, :]) % vocab_size).reshape(-1)


class Progress:
    """tqdm on rank 0 when it is installed; otherwise one plain line every 10 steps."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self.total, self.enabled, self.bar = total, enabled, None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=initial, desc="fine-tune", unit="step", file=sys.stdout)
            except ImportError:
                pass

    def update(self, step: int, loss: float, seconds: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", s_per_step=f"{seconds:.2f}")
            self.bar.update(1)
        elif step % 10 == 0 or step == self.total:
            print(f"step {step}/{self.total}  loss {loss:.3f}  {seconds:.2f}s/step", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def main() -> None:
    args = parse_args()
    if args.make_tiny:
        make_tiny(args.make_tiny)
        return
    if not args.model:
        sys.exit("--model DIR is required (or --make-tiny DIR to create one)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    zero_engine.init_distributed()
    rank = dist.get_rank()
    from transformers import AutoModelForCausalLM

    model = zero_engine.hf.from_pretrained(AutoModelForCausalLM, args.model, config=args.config)
    dataset = TokenWindows(load_tokens(args, model.config.vocab_size), args.seq_len)
    engine, _, loader, _ = zero_engine.initialize(model=model, config=args.config, training_data=dataset)
    checkpoints = os.path.join(args.output, "checkpoints")
    if os.path.exists(os.path.join(checkpoints, "latest")):
        path, _ = engine.load_checkpoint(checkpoints)
        if rank == 0:
            print(f"resumed from {path} at step {engine.global_steps}", flush=True)
    engine.train()
    progress = Progress(args.steps, engine.global_steps, enabled=rank == 0)
    epoch = 0
    while engine.global_steps < args.steps:
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            start = time.perf_counter()
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            step = engine.global_steps
            progress.update(step, loss.item(), time.perf_counter() - start)
            if step % args.checkpoint_every == 0 or step == args.steps:
                engine.save_checkpoint(checkpoints, tag=f"step{step}")
            if step >= args.steps:
                break
        epoch += 1
    progress.close()
    final = os.path.join(args.output, "final")
    zero_engine.hf.save_pretrained(engine, final, dtype=torch.float32 if args.save_dtype == "float32" else None)
    if rank == 0:
        print(f"saved {final} (load it with transformers.AutoModelForCausalLM.from_pretrained)", flush=True)
    # Every rank done, nothing in flight, watchdog stopped; only then the group goes (see engine.destroy()).
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
