"""Train a small GPT with Lightning and zero_engine's strategy (generated data, no downloads).

    python examples/train_lightning.py --devices 2 --stage 3        # Lightning starts the second rank itself

The LightningModule is ordinary Lightning code: the GPT is built in configure_model (under zero.Init at stage 3,
so each layer is partitioned as it is built), configure_optimizers returns a torch AdamW and a scheduler, and the
Trainer's flags (accumulate_grad_batches, gradient_clip_val, precision) become the engine's config. The only
zero_engine line is the strategy. Prints the loss curve, the validation loss and rank 0's model-state memory.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl

from zero_engine.lightning import ZeroEngineStrategy
from zero_engine.testing.models import GPT, GPTConfig, make_batches


class GPTModule(pl.LightningModule):
    def __init__(self, cfg: GPTConfig, lr: float, steps: int):
        super().__init__()
        self.cfg, self.lr, self.steps = cfg, lr, steps
        self.model = None
        self.losses: list[float] = []

    def configure_model(self):
        if self.model is None:  # Lightning may call it again (validate after fit)
            self.model = GPT(self.cfg)

    def training_step(self, batch, batch_idx):
        loss = self.model(*batch)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(*batch).float(), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def loader(cfg: GPTConfig, batches: int, batch_size: int, seed: int, shuffle: bool) -> DataLoader:
    pairs = make_batches(cfg, batches, batch_size, seed=seed)
    data = TensorDataset(torch.cat([idx for idx, _ in pairs]), torch.cat([targets for _, targets in pairs]))
    return DataLoader(data, batch_size=batch_size, shuffle=shuffle)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu", help="cpu, gpu or auto")
    parser.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    parser.add_argument("--config", default=None, help="a ds_config JSON file (default: the stage, persistence 0)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=...)")
    parser.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, bf16-true, 16-mixed")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--checkpoint", default=None, help="save a checkpoint directory here after training")
    args = parser.parse_args()

    cfg = GPTConfig(vocab_size=97, block_size=32, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)
    # persistence 0: partition every parameter of this small model (the default keeps small ones whole)
    config = args.config or {"zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0}}
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(strategy=ZeroEngineStrategy(config=config), accelerator=args.accelerator,
                         devices=args.devices, max_steps=args.steps, accumulate_grad_batches=args.accumulate,
                         gradient_clip_val=1.0, precision=args.precision, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=4)
    module = GPTModule(cfg, lr=3e-3, steps=args.steps)
    micro_batches = args.steps * args.accumulate * args.devices
    trainer.fit(module, loader(cfg, micro_batches, 8, seed=0, shuffle=True),
                loader(cfg, 4 * args.devices, 8, seed=1, shuffle=False))
    if args.checkpoint:
        trainer.save_checkpoint(args.checkpoint)  # a directory: every rank writes its shards
    engine = trainer.strategy.engine
    stats = engine.memory_stats()
    if trainer.is_global_zero:
        n = sum(sp.numel for sp in engine.sharded)
        print(f"zero_engine stage {engine.stage} under Lightning, {trainer.world_size} ranks, {n} parameters, "
              f"{trainer.global_step} steps (engine: {engine.global_steps})")
        print("loss: " + " ".join(f"{loss:.3f}" for loss in module.losses[::max(1, len(module.losses) // 10)])
              + f" ... {module.losses[-1]:.3f}")
        print(f"val_loss {float(trainer.callback_metrics['val_loss']):.3f}; rank 0 model states "
              f"{engine.model_state_bytes(stats) / 2**20:.2f} MiB (one rank unsharded: {16 * n / 2**20:.2f} MiB)")
        if args.checkpoint:
            print(f"checkpoint directory: {args.checkpoint} (resume: trainer.fit(..., ckpt_path=...))")
    engine.destroy()  # waits for every rank, stops the watchdog, lets go of the group


if __name__ == "__main__":
    main()
    torch.distributed.destroy_process_group()  # before the interpreter ends: a gloo group left to exit can abort a rank
