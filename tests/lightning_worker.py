"""Runs Lightning Trainers on 2 CPU ranks for tests/test_lightning.py: ``python lightning_worker.py OUT_DIR``.

Lightning's own subprocess launcher starts rank 1 by re-running this script, so every scenario below runs on both
ranks in the same order. Rank 0 writes ``OUT_DIR/results.pt``: per scenario, every rank's losses, the final
parameters, step counters and error messages, for the test to compare (DDP runs are the reference).
"""

import contextlib
import io
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

import zero_engine.lightning  # noqa: F401  (registers strategy="zero_engine")
from zero_engine.lightning import ZeroEngineStrategy
from zero_engine.testing.models import GPTConfig

from gloo_threads import destroy_group_and_check

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SAMPLES, BATCH = 20, 2  # 5 micro-batches per rank per epoch on 2 ranks: accumulation 2 leaves a remainder of 1


def dataset():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 5, generator=g)
    return TensorDataset(x, torch.tanh(x @ torch.randn(5, 3, generator=g)) + 0.1 * torch.randn(SAMPLES, 3, generator=g))


class Regressor(pl.LightningModule):
    """An MLP with odd sizes (shards padded), built in configure_model (under zero.Init at stage 3)."""

    def __init__(self):
        super().__init__()
        self.net = None
        self.losses, self.weight_dtypes = [], set()
        self.built_partitioned = None

    def configure_model(self):
        if self.net is not None:
            return
        self.net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
        first = self.net[0].weight  # partitioned as soon as built, under zero.Init: a shard of its 35 elements
        self.built_partitioned = hasattr(first, "ds_tensor") and first.ds_tensor.numel() < first.ds_numel

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.losses.append(float(loss.detach()))
        self.weight_dtypes.add(str(self.net[2].bias.dtype))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y).float(), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).float()

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ManualRegressor(Regressor):
    """Manual optimization: the engine steps when opt.step() is called."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        optimizer.step()
        optimizer.zero_grad()


class ClipsItself(Regressor):
    """Asks for another clipping value than the Trainer's, which the engine's step cannot honour."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=1.0, gradient_clip_algorithm="norm")


def loader(shuffle=True):
    return DataLoader(dataset(), batch_size=BATCH, shuffle=shuffle)


def trainer(strategy, root, **kwargs):
    kwargs.setdefault("max_epochs", 2)
    kwargs.setdefault("enable_checkpointing", "callbacks" in kwargs)
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                      num_sanity_val_steps=0, **kwargs)


def config(stage, **extra):
    return {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, **extra}


def all_ranks(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def fit(strategy, root, ckpt_path=None, module=Regressor, **kwargs):
    pl.seed_everything(0, verbose=False)
    model = module()
    t = trainer(strategy, root, **kwargs)
    t.fit(model, train_dataloaders=loader(), val_dataloaders=loader(shuffle=False), ckpt_path=ckpt_path)
    engine = getattr(t.strategy, "engine", None)
    state = (t.strategy.lightning_module_state_dict() if engine is not None  # gathered onto rank 0 (collective)
             else {k: v.detach().clone() for k, v in model.state_dict().items()})
    result = {"losses": all_ranks(model.losses), "state": state, "global_step": t.global_step,
              "engine_steps": engine.global_steps if engine is not None else None,
              "skipped_steps": engine.skipped_steps if engine is not None else None,
              "batch_sizes": engine.get_batch_info() if engine is not None else None,
              "grad_norm": engine.get_global_grad_norm() if engine is not None else None,  # the last, unclipped
              "dtypes": sorted(model.weight_dtypes), "built_partitioned": all_ranks(model.built_partitioned),
              "val_loss": float(t.callback_metrics["val_loss"]) if "val_loss" in t.callback_metrics else None}
    return t, model, result


def error_of(fn):
    try:
        fn()
    except Exception as error:  # the test checks the type and the message
        return f"{type(error).__name__}: {error}"
    return None


def main(out):
    results = {}
    root = os.path.join(out, "runs")
    # 1. No accumulation: DDP against stages 1-3 (stage 3 also through the registered name, default config).
    t, _, results["ddp"] = fit("ddp", root)
    ddp_checkpoint = os.path.join(out, "ddp.ckpt")
    t.save_checkpoint(ddp_checkpoint)
    for stage in (1, 2, 3):
        results[f"zero{stage}"] = fit(ZeroEngineStrategy(config=config(stage)), root)[2]
    results["zero_registered"] = fit("zero_engine", root)[2]
    # 2. Accumulation 2 over 5 micro-batches per epoch (a remainder of 1) and clipping by norm.
    ga = dict(accumulate_grad_batches=2, gradient_clip_val=0.05)
    results["ddp_ga"] = fit("ddp", root, **ga)[2]
    results["zero1_ga"] = fit(ZeroEngineStrategy(config=config(1)), root, **ga)[2]
    every_epoch, best = os.path.join(out, "every_epoch"), os.path.join(out, "best")  # checkpoint directories
    results["zero3_ga"] = fit(ZeroEngineStrategy(config=config(3)), root, callbacks=[
        ModelCheckpoint(dirpath=every_epoch, save_top_k=-1),
        ModelCheckpoint(dirpath=best, monitor="val_loss", save_top_k=1)], **ga)[2]
    results["checkpoints"] = {"every_epoch": sorted(os.listdir(every_epoch)), "best": sorted(os.listdir(best))}
    # 3. bf16 and fp16: the engine computes in 16 bits from fp32 masters.
    results["zero3_bf16"] = fit(ZeroEngineStrategy(config=config(3)), root, precision="bf16-mixed")[2]
    # (a small initial loss scale: 2**16, the default, overflows this model's fp16 gradients in the first steps)
    results["zero2_fp16"] = fit(ZeroEngineStrategy(config=config(2, fp16={"initial_scale_power": 4})), root,
                                precision="16-true")[2]
    # Manual optimization.
    results["ddp_manual"] = fit("ddp", root, module=ManualRegressor)[2]
    results["zero3_manual"] = fit(ZeroEngineStrategy(config=config(3)), root, module=ManualRegressor)[2]
    # 4. Resume from ModelCheckpoint's epoch-1 directory with a new Trainer and module: equals the 2-epoch run.
    results["zero3_resumed"] = fit(ZeroEngineStrategy(config=config(3)), root,
                                   ckpt_path=os.path.join(every_epoch, "epoch=0-step=3.ckpt"), **ga)[2]
    # ... and from DDP's single-file checkpoint: weights and loops, a fresh optimizer (a warning says so).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results["zero3_from_ddp"] = fit(ZeroEngineStrategy(config=config(3)), root, ckpt_path=ddp_checkpoint,
                                        max_epochs=3)[2]
    results["from_ddp_warnings"] = [str(w.message) for w in caught if "ZeroEngineStrategy" in str(w.message)]
    # 5. Evaluation after fit (same Trainer), a weights-only export, and evaluation of that file from scratch.
    t, model, results["eval_run"] = fit(ZeroEngineStrategy(config=config(3)), root, max_epochs=1)
    rank = dist.get_rank()
    t.strategy.barrier()
    results["collectives"] = all_ranks((float(t.strategy.reduce(torch.tensor(rank + 1.0), reduce_op="sum")),
                                        t.strategy.broadcast(rank * 10 + 7)))
    results["validate"] = t.validate(model, dataloaders=loader(shuffle=False), verbose=False)[0]["val_loss"]
    predictions = t.predict(model, dataloaders=DataLoader(dataset(), batch_size=SAMPLES))
    results["predict"] = all_ranks(torch.cat(predictions))
    exported = os.path.join(out, "weights.ckpt")
    t.save_checkpoint(exported, weights_only=True)
    results["exported"] = torch.load(exported, weights_only=True)["state_dict"] if dist.get_rank() == 0 else None
    for stage in (1, 3):  # evaluation only: an engine that never steps, the file loaded into its shards
        t2 = trainer(ZeroEngineStrategy(config=config(stage)), root)
        results[f"validate_from_file{stage}"] = t2.validate(Regressor(), dataloaders=loader(shuffle=False),
                                                            ckpt_path=exported, verbose=False)[0]["val_loss"]
        saved = os.path.join(out, f"evaluated{stage}.ckpt")  # a full save from evaluation: the weights in one file
        t2.save_checkpoint(saved)
        results[f"eval_engine{stage}"] = (t2.strategy.engine.optimizer is None,
                                          t2.strategy.engine.memory_stats()["master_params"],
                                          torch.load(saved, weights_only=False)["state_dict"]
                                          if dist.get_rank() == 0 else None)
    # 6. What is refused.
    results["err_precision"] = error_of(lambda: trainer(ZeroEngineStrategy(), root, precision="64-true"))
    results["err_clip_value"] = error_of(lambda: fit(ZeroEngineStrategy(config=config(1)), root,
                                                     gradient_clip_val=0.5, gradient_clip_algorithm="value"))
    results["err_accumulation"] = error_of(lambda: fit(
        ZeroEngineStrategy(config=config(1, gradient_accumulation_steps=4)), root, accumulate_grad_batches=2))
    results["err_optimizer_block"] = error_of(lambda: ZeroEngineStrategy(
        config=config(1, optimizer={"type": "AdamW", "params": {"lr": 0.1}})))
    results["err_clip_mismatch"] = error_of(lambda: fit(ZeroEngineStrategy(config=config(1)), root,
                                                        module=ClipsItself))
    results["err_spawn"] = error_of(lambda: ZeroEngineStrategy(start_method="spawn"))
    results["err_second_fit"] = error_of(lambda: t.fit(model, train_dataloaders=loader()))
    results["err_other_module"] = error_of(lambda: t.validate(Regressor(), dataloaders=loader(), verbose=False))
    # 7. The test GPT (tied embeddings, a parameter read by the root's forward, re-initialised after construction)
    # against DDP, and the example script itself, in these processes.
    sys.path.insert(0, os.path.join(REPO, "examples"))
    import train_lightning

    gpt = GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=3, n_embd=33)
    for name, strategy in (("gpt_ddp", "ddp"), ("gpt_zero3", ZeroEngineStrategy(config=config(3)))):
        pl.seed_everything(0, verbose=False)
        module = train_lightning.GPTModule(gpt, lr=3e-3, steps=4)
        t = trainer(strategy, root, max_steps=4)
        t.fit(module, train_lightning.loader(gpt, 16, 4, seed=0, shuffle=True))
        state = (t.strategy.lightning_module_state_dict() if name != "gpt_ddp" else
                 {k: v.detach().clone() for k, v in module.state_dict().items()})
        results[name] = {"losses": all_ranks(module.losses), "state": state}
    sys.argv = ["train_lightning.py", "--steps", "3", "--accumulate", "2", "--checkpoint",
                os.path.join(out, "example_ckpt")]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train_lightning.main()
    results["example_output"] = printed.getvalue()
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out, "results.pt"))
    dist.barrier()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
    destroy_group_and_check()  # each rank; an error here exits non-zero
