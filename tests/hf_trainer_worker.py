"""Run by tests/test_hf_trainer.py under torchrun (2 CPU ranks): ZeroTrainer against the plain (DDP) Trainer.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/hf_trainer_worker.py SUITE WORKDIR

Each suite trains the same tiny Llama on the same data with the same seed twice, once with transformers' Trainer
(Accelerate wraps it in DDP) and once with ZeroTrainer, and checks the logged losses, grad norms, learning rates and
eval losses step by step; any mismatch raises, so the process exits non-zero with the values in the message.
Tolerances: fp32 losses agree to 1e-4 relative (in practice ~1e-7: the same math, gradients averaged in another
order); resuming is bitwise; bf16 is compared with 3e-2, since the engine computes with bf16 weights while the plain
Trainer autocasts with fp32 weights.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys

import accelerate
import torch
import torch.distributed as dist
import transformers
from transformers import Trainer, TrainingArguments

import zero_engine.hf
from zero_engine.hf import ZeroTrainer, ZeroTrainerMixin
from zero_engine.zero.partition import sharded_param_of

from gloo_threads import destroy_group_and_check

STAGE3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
VOCAB, SEQ = 97, 16


def tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seed=1):
        self.ids = torch.randint(3, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long)}


def training_args(out, **overrides):
    # 22 samples, 2 per rank and micro-batch, 2 ranks: 6 micro-batches per rank and epoch; accumulation 4 leaves a
    # window of 2 at the end of each epoch. Clipping at 0.5 acts (the norms are ~0.5-0.9); warm-up then linear.
    base = dict(output_dir=out, per_device_train_batch_size=2, per_device_eval_batch_size=4,
                gradient_accumulation_steps=4, num_train_epochs=2, learning_rate=1e-2, warmup_steps=1,
                max_grad_norm=0.5, logging_steps=1, report_to=[], use_cpu=True, seed=0, save_strategy="no",
                disable_tqdm=True, dataloader_num_workers=0)
    base.update(overrides)
    return TrainingArguments(**base)


def history(trainer, keys=("loss", "grad_norm", "learning_rate", "eval_loss")):
    return [{k: h[k] for k in keys if k in h} for h in trainer.state.log_history
            if any(k in h for k in ("loss", "eval_loss"))]


def close(a, b, rtol, what):
    if isinstance(a, dict):
        if a.keys() != b.keys():
            raise AssertionError(f"{what}: keys {sorted(a)} != {sorted(b)}")
        for k in a:
            close(a[k], b[k], rtol, f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            raise AssertionError(f"{what}: {len(a)} entries != {len(b)}\n{a}\n{b}")
        for i, (x, y) in enumerate(zip(a, b)):
            close(x, y, rtol, f"{what}[{i}]")
    elif isinstance(a, torch.Tensor):
        if not torch.allclose(a.float(), b.float(), rtol=rtol, atol=rtol * b.float().abs().max().item()):
            raise AssertionError(f"{what}: max diff {(a.float() - b.float()).abs().max().item()} (rtol {rtol})")
    elif not math.isclose(a, b, rel_tol=rtol, abs_tol=1e-12):
        raise AssertionError(f"{what}: {a} != {b} (rtol {rtol})")


def check(condition, message):
    if not condition:
        raise AssertionError(message)


def plain_and_zero(work, name, zero_config, model_fn=tiny_llama, plain_cls=Trainer, zero_cls=ZeroTrainer,
                   n_train=22, **overrides):
    common = dict(train_dataset=Tokens(n_train), eval_dataset=Tokens(8, seed=2))
    plain = plain_cls(model=model_fn(), args=training_args(f"{work}/{name}-plain", **overrides), **common)
    plain.train()
    zero = zero_cls(model=model_fn(), args=training_args(f"{work}/{name}-zero", **overrides), zero_config=zero_config,
                    **common)
    return plain, zero


# ---- suites --------------------------------------------------------------------------------------------------------
def suite_stage3(work):
    """Stage 3: eval before train, GA with an epoch remainder, clipping, schedule, eval and checkpoints every 2
    steps, predict, generate with ranks finishing at different lengths, save_model -> from_pretrained, resume."""
    every2 = dict(eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2)
    plain, zero = plain_and_zero(work, "s3", STAGE3, **every2)
    rank = dist.get_rank()
    fresh = Trainer(model=tiny_llama(), args=training_args(f"{work}/s3-eval"), eval_dataset=Tokens(8, seed=2))
    close(zero.evaluate()["eval_loss"], fresh.evaluate()["eval_loss"], 1e-5, "eval before train")
    sp = sharded_param_of(zero.model.model.layers[0].mlp.up_proj.weight)
    check(sp is not None and sp.shard.numel() < sp.numel and not sp.is_available, "stage 3: not partitioned")
    zero.train()
    full = history(zero)  # before the evaluations below add to it
    close(full, history(plain), 1e-4, "stage 3 log history")
    check(len([h for h in history(zero) if "loss" in h]) == 4, f"expected 4 steps: {history(zero)}")
    norms = [h["grad_norm"] for h in history(zero) if "grad_norm" in h]
    check(max(norms) > 0.5, f"clipping never acted (max_grad_norm 0.5, norms {norms}): the parity would not test it")
    check(zero.state.total_flos == plain.state.total_flos > 0, f"total_flos {zero.state.total_flos} != "
          f"{plain.state.total_flos}")

    ckpt = f"{work}/s3-zero/checkpoint-2"
    check(os.path.isdir(f"{ckpt}/zero_engine") and os.path.isfile(f"{ckpt}/model.safetensors"),
          f"checkpoint layout: {sorted(os.listdir(ckpt))}")

    pz, pp = zero.predict(Tokens(6, seed=3)), plain.predict(Tokens(6, seed=3))
    close(torch.as_tensor(pz.predictions), torch.as_tensor(pp.predictions), 1e-4, "predict logits")
    close(pz.metrics["test_loss"], pp.metrics["test_loss"], 1e-4, "predict loss")

    prompt = Tokens(1, seed=4).ids[:, :5]
    new = 2 if rank == 0 else 5  # rank 0 finishes first: without synced_gpus its peers would wait in a gather
    zero.model.eval()
    out_zero = zero.model.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)
    out_plain = plain.model.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)
    check(torch.equal(out_zero, out_plain), f"generate: {out_zero} != {out_plain}")

    zero.save_model(f"{work}/s3-saved")
    if rank == 0:
        reloaded = transformers.LlamaForCausalLM.from_pretrained(f"{work}/s3-saved")
        x = Tokens(2, seed=5).ids
        with torch.no_grad():
            close(reloaded(x).logits, plain.model(x).logits, 1e-4, "save_model -> from_pretrained logits")
    dist.barrier()

    # A model loaded into the shards by zero_engine.hf.from_pretrained, evaluated before any train(); then the
    # example (the two-line switch) fine-tunes it for a few steps from the same directory.
    loaded = zero_engine.hf.from_pretrained(transformers.LlamaForCausalLM, f"{work}/s3-saved", config=STAGE3)
    check(sharded_param_of(loaded.model.layers[0].mlp.up_proj.weight) is not None, "from_pretrained: not sharded")
    evaluator = ZeroTrainer(model=loaded, args=training_args(f"{work}/s3-loaded"), eval_dataset=Tokens(8, seed=2),
                            zero_config=STAGE3)
    close(evaluator.evaluate()["eval_loss"], zero.evaluate()["eval_loss"], 1e-6, "from_pretrained, evaluate first")
    evaluator.engine.destroy()
    run_example(["--model", f"{work}/s3-saved", "--output", f"{work}/example", "--steps", "4", "--save-every", "2"])
    check(os.path.isfile(f"{work}/example/final/model.safetensors")
          and os.path.isdir(f"{work}/example/checkpoint-4/zero_engine"), "example: no final model or checkpoint-4")

    resumed = ZeroTrainer(model=tiny_llama(), args=training_args(f"{work}/s3-resumed", **every2),
                          train_dataset=Tokens(22), eval_dataset=Tokens(8, seed=2), zero_config=STAGE3)
    resumed.train(resume_from_checkpoint=ckpt)
    after = [h for h in history(resumed)]
    check(after == full[-len(after):] and len(after) >= 3, f"resume not bitwise:\n{after}\n{full}")
    return resumed


def run_example(argv):
    """examples/finetune_trainer.py's main() on these ranks, with these command-line arguments."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                        "finetune_trainer.py")
    spec = importlib.util.spec_from_file_location("finetune_trainer", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    saved, sys.argv = sys.argv, [path, *argv]
    try:
        example.main()
    finally:
        sys.argv = saved


def suite_stages12(work):
    """Stages 1 and 2 (parameters whole, gradients reduced at the boundary / in every backward); then the config's
    own optimizer and scheduler blocks with "auto" values, filled from the arguments and stepped by the engine."""
    plain, zero = plain_and_zero(work, "s1", {"zero_optimization": {"stage": 1}}, max_steps=3)
    zero.train()
    close(history(zero), history(plain), 1e-4, "stage 1 log history")
    zero = ZeroTrainer(model=tiny_llama(), args=training_args(f"{work}/s2", max_steps=3), train_dataset=Tokens(22),
                       zero_config={"zero_optimization": {"stage": 2}})
    zero.train()
    close(history(zero), history(plain), 1e-4, "stage 2 log history")

    from zero_engine.schedulers import build_scheduler

    auto = "auto"
    schedule = {"warmup_min_lr": auto, "warmup_max_lr": auto, "warmup_num_steps": auto, "total_num_steps": auto,
                "warmup_type": "linear"}
    config = {"zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": auto, "betas": auto, "weight_decay": auto}},
              "scheduler": {"type": "WarmupDecayLR", "params": schedule}}
    zero = ZeroTrainer(model=tiny_llama(), args=training_args(f"{work}/blocks", max_steps=4, warmup_steps=2,
                                                              adam_beta2=0.95, weight_decay=0.01),
                       train_dataset=Tokens(22), zero_config=config)
    zero.train()
    group = zero.engine.optimizer.param_groups[0]
    check(tuple(group["betas"]) == (0.9, 0.95) and group["weight_decay"] == 0.01, f"optimizer block: {group}")
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    reference = build_scheduler("WarmupDecayLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 2,
                                                  "total_num_steps": 4, "warmup_type": "linear"}, probe)
    expected = []
    for _ in range(4):
        expected.append(probe.param_groups[0]["lr"])
        reference.step()
    lrs = [h["learning_rate"] for h in history(zero) if "loss" in h]
    close(lrs, expected, 1e-9, "scheduler block: learning rates")


def suite_precision(work):
    """bf16 against the plain Trainer's bf16 autocast; fp16 with a forced overflow: the schedule does not step."""
    plain, zero = plain_and_zero(work, "bf16", STAGE3, bf16=True, max_steps=3)
    zero.train()
    check(zero.engine.compute_dtype == torch.bfloat16, f"bf16: engine computes in {zero.engine.compute_dtype}")
    close(history(zero, ("loss", "learning_rate")), history(plain, ("loss", "learning_rate")), 3e-2, "bf16")

    fp16 = {**STAGE3, "fp16": {"enabled": True, "initial_scale_power": 21, "hysteresis": 1}}
    zero = ZeroTrainer(model=tiny_llama(), args=training_args(f"{work}/fp16", max_steps=5, warmup_steps=0,
                                                              gradient_accumulation_steps=1),
                       train_dataset=Tokens(22), zero_config=fp16)
    zero.train()
    engine, schedule = zero.engine, zero.lr_scheduler.scheduler
    check(1 <= engine.skipped_steps < engine.global_steps == 5, f"fp16: {engine.skipped_steps} skipped of "
          f"{engine.global_steps}: the initial scale 2**21 overflows here, 2**18 does not")
    applied = engine.global_steps - engine.skipped_steps
    check(schedule.last_epoch == applied, f"fp16: scheduler stepped {schedule.last_epoch} times, {applied} "
          "steps applied")
    lrs = [h["learning_rate"] for h in history(zero) if "loss" in h]
    check(lrs[0] == lrs[engine.skipped_steps] == 1e-2, f"fp16: the LR moved during skipped steps: {lrs}")


def suite_compile(work):
    """TrainingArguments.torch_compile at stage 3: the engine compiles each decoder layer (zero_config's compile
    section, filled from the arguments), Accelerate compiles nothing; the losses are the uncompiled Trainer's (the
    aot_eager backend runs the traced graphs without Inductor's reordered float math, and compiles in seconds)."""
    from zero_engine.compile import compiled_modules

    plain, zero = plain_and_zero(work, "compile", STAGE3, max_steps=3, torch_compile=True,
                                 torch_compile_backend="aot_eager")
    zero.train()
    layers = zero.engine.module.model.layers
    compiled = compiled_modules(zero.engine.module)
    check(zero.engine.config.compile.backend == "aot_eager", f"compile section: {zero.engine.config.compile}")
    check(all(id(layer) in compiled for layer in layers), f"compile: {len(compiled)} compiled modules, "
          f"{len(layers)} decoder layers")
    check(id(zero.engine.module) not in compiled, "compile: the whole model was compiled")
    close(history(zero), history(plain), 1e-4, "torch_compile log history")


def suite_neftune(work):
    """NEFTune (neftune_noise_alpha) at stage 3: uniform noise added to the input embeddings' output in training,
    drawn from each rank's generator as under DDP, so the losses are the plain Trainer's (the first one bitwise: the
    same weights, batch and noise); the hook is gone after train()."""
    from transformers.integrations.neftune import neftune_post_forward_hook

    quiet = Trainer(model=tiny_llama(), args=training_args(f"{work}/neftune-quiet", max_steps=3),
                    train_dataset=Tokens(22))
    quiet.train()
    plain, zero = plain_and_zero(work, "neftune", STAGE3, max_steps=3, neftune_noise_alpha=5.0)
    zero.train()  # the Trainer seeds the generator at construction: nothing else may draw from it before this
    close(history(zero), history(plain), 1e-4, "NEFTune log history")
    first, noisy, without = history(zero)[0]["loss"], history(plain)[0]["loss"], history(quiet)[0]["loss"]
    check(first == noisy, f"NEFTune: first loss {first}, the plain Trainer's {noisy}")
    check(abs(first - without) > 1e-3, f"NEFTune: the first loss {first} is the noiseless {without}")
    embeddings = zero.model.get_input_embeddings()
    left = [hook for hook in embeddings._forward_hooks.values() if hook is neftune_post_forward_hook]
    check(not hasattr(embeddings, "neftune_noise_alpha") and not left, "NEFTune: its hook is left after train()")


def suite_best(work):
    """load_best_model_at_end (here the eval loss rises: the best is the first step's, not the last)."""
    best = dict(eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1, max_steps=3,
                load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=False)
    zero = ZeroTrainer(model=tiny_llama(), args=training_args(f"{work}/best", **best), train_dataset=Tokens(22),
                       eval_dataset=Tokens(8, seed=2), zero_config=STAGE3)
    zero.train()
    evals = [h["eval_loss"] for h in zero.state.log_history if "eval_loss" in h]
    check(zero.state.best_metric == min(evals) and min(evals) != evals[-1], f"best: {zero.state.best_metric}, "
          f"evals {evals}")
    close(zero.evaluate()["eval_loss"], zero.state.best_metric, 1e-6, "load_best_model_at_end")


def suite_peft(work):
    """PEFT LoRA: frozen base weights partitioned, adapters trained as under DDP; the adapter saved and reloaded."""
    import peft

    def lora():
        model = tiny_llama()
        torch.manual_seed(1)
        return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                          lora_dropout=0.0))

    # transformers' default activation checkpointing: torch's non-reentrant variant, recomputing frozen weights
    plain, zero = plain_and_zero(work, "lora", STAGE3, model_fn=lora, max_steps=3, activation_checkpointing=True,
                                 ddp_find_unused_parameters=False)
    base = zero.model.get_base_model().model.layers[0].mlp.up_proj.weight
    check(not base.requires_grad and sharded_param_of(base) is not None
          and sharded_param_of(base).shard.numel() < sharded_param_of(base).numel, "LoRA: base weight not partitioned")
    zero.train()
    close(history(zero), history(plain), 1e-4, "LoRA log history")
    zero.save_model(f"{work}/lora-saved")
    if dist.get_rank() == 0:
        check(os.path.isfile(f"{work}/lora-saved/adapter_model.safetensors"), "LoRA: no adapter file")
        reloaded = peft.PeftModel.from_pretrained(tiny_llama(), f"{work}/lora-saved")
        x = Tokens(2, seed=5).ids
        with torch.no_grad():
            close(reloaded(x).logits, plain.model(x).logits, 1e-4, "LoRA adapter reloaded")
    dist.barrier()
    return zero


def suite_sft(work):
    """TRL's SFTTrainer through the mixin against plain SFTTrainer (pre-tokenized data, TRL's default fused LM
    head and activation checkpointing), at each stage in SFT_STAGES; prints "OK sft-stageN" after each."""
    import datasets
    import trl

    class ZeroSFTTrainer(ZeroTrainerMixin, trl.SFTTrainer):
        pass

    train = datasets.Dataset.from_dict({"input_ids": Tokens(22).ids.tolist()})
    for stage in (int(s) for s in os.environ.get("SFT_STAGES", "2,3").split(",")):
        config = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
        runs = {}
        for name, cls, kwargs in (("plain", trl.SFTTrainer, {}), ("zero", ZeroSFTTrainer, {"zero_config": config})):
            args = trl.SFTConfig(output_dir=f"{work}/sft{stage}-{name}", per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-2, logging_steps=1,
                                 report_to=[], use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True,
                                 max_grad_norm=0.5, dataset_num_proc=None, max_length=None,
                                 bf16=False)  # SFTConfig turns bf16 on by default; fp32 compares to 1e-4
            trainer = cls(model=tiny_llama(), args=args, train_dataset=train, processing_class=tokenizer(), **kwargs)
            trainer.train()
            runs[name] = history(trainer, ("loss", "grad_norm", "learning_rate", "mean_token_accuracy"))
        close(runs["zero"], runs["plain"], 1e-4, f"SFTTrainer stage {stage}")
        if dist.get_rank() == 0:
            print(f"OK sft-stage{stage}", flush=True)


def suite_dpo(work):
    """TRL's DPOTrainer through the mixin against plain DPOTrainer at stage 3, with a reference model that
    sync_ref_model mixes with the policy after every step: the reference model (loaded into the shards by
    zero_engine.hf.from_pretrained) is partitioned by an engine of its own (as TRL's prepare_deepspeed does), and the
    mix reads both models gathered. Also DPO with a LoRA policy (dpo_with_lora). Returns the ZeroTrainer."""
    import datasets
    import trl

    class ZeroDPOTrainer(ZeroTrainerMixin, trl.DPOTrainer):
        pass

    words = torch.randint(3, VOCAB, (16, 15), generator=torch.Generator().manual_seed(3))
    text = [[" ".join(f"t{int(i)}" for i in part) for part in row.split([5, 4, 6])] for row in words]
    train = datasets.Dataset.from_dict({key: [row[k] for row in text]
                                        for k, key in enumerate(("prompt", "chosen", "rejected"))})
    if importlib.util.find_spec("peft") is not None:
        dpo_with_lora(work, ZeroDPOTrainer, train)

    # The zero run's reference model is loaded into the shards (as a model too large for one rank would be): TRL's
    # accelerator.prepare_model(ref_model) must leave it to its engine
    accelerate.PartialState()
    saved = f"{work}/dpo-reference"
    if dist.get_rank() == 0:
        tiny_llama().save_pretrained(saved)
    dist.barrier()

    def reference(name):
        if name == "plain":
            return tiny_llama()
        return zero_engine.hf.from_pretrained(transformers.LlamaForCausalLM, saved, config=STAGE3)

    runs, trainers = {}, {}
    for name, cls, kwargs in (("plain", trl.DPOTrainer, {}), ("zero", ZeroDPOTrainer, {"zero_config": STAGE3})):
        args = trl.DPOConfig(output_dir=f"{work}/dpo-{name}", per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-2, logging_steps=1,
                             report_to=[], use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True, bf16=False,
                             dataset_num_proc=None, sync_ref_model=True, ref_model_sync_steps=1,
                             ref_model_mixup_alpha=0.5)
        trainers[name] = cls(model=tiny_llama(), ref_model=reference(name), args=args, train_dataset=train,
                             processing_class=tokenizer(), **kwargs)
        trainers[name].train()
        runs[name] = history(trainers[name], ("loss", "grad_norm", "rewards/chosen", "rewards/rejected",
                                              "logps/chosen", "logps/rejected"))
    zero = trainers["zero"]
    sp = sharded_param_of(zero.ref_model.model.layers[0].mlp.up_proj.weight)
    check(sp is not None and sp.shard.numel() < sp.numel, "DPO: reference model not partitioned")
    check(list(zero.reference_engines) == ["ref_model"], f"reference engines {list(zero.reference_engines)}")
    close(runs["zero"], runs["plain"], 1e-4, "DPOTrainer stage 3 with sync_ref_model")
    # The synced reference is the policies' mix: it differs from the plain run's as little as the policies differ
    # (Adam's first steps turn float noise in the smallest gradients into updates of up to lr x 1e-3)
    def gathered(model):
        with zero_engine.zero.GatheredParameters(list(model.parameters())):
            return {n: p.detach().clone() for n, p in model.named_parameters()}

    def largest_difference(a, b):
        return max((a[n] - b[n]).abs().max().item() for n in a)

    refs = [gathered(trainers[name].ref_model) for name in ("plain", "zero")]
    policies = [gathered(trainers[name].model) for name in ("plain", "zero")]
    apart, moved = largest_difference(*refs), largest_difference(refs[0], gathered(tiny_llama()))
    print("DPO reference apart", apart, "policies apart", largest_difference(*policies), "moved", moved)
    check(moved > 1e-3 and apart <= max(largest_difference(*policies), 1e-7),
          f"DPO: the synced reference models are {apart} apart, moved {moved}")
    return zero


def dpo_with_lora(work, zero_cls, train):
    """DPO with a LoRA policy and no reference model: TRL's reference pass is the policy with its adapters off, a
    forward without gradients between the loss's forward and its backward. Prints "OK dpo-lora"."""
    import peft
    import trl

    runs = {}
    for name, cls, kwargs in (("plain", trl.DPOTrainer, {}), ("zero", zero_cls, {"zero_config": STAGE3})):
        args = trl.DPOConfig(output_dir=f"{work}/dpo-lora-{name}", per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-2, logging_steps=1,
                             report_to=[], use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True, bf16=False,
                             dataset_num_proc=None)
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                               init_lora_weights=False)  # random B: the adapters change the first step's output
        torch.manual_seed(7)
        trainer = cls(model=tiny_llama(), peft_config=lora, args=args, train_dataset=train,
                      processing_class=tokenizer(), **kwargs)
        trainer.train()
        runs[name] = history(trainer, ("loss", "grad_norm", "rewards/chosen", "rewards/rejected"))
    check(all(h["grad_norm"] > 0 for h in runs["zero"]), f"DPO with LoRA: no gradient {runs['zero']}")
    close(runs["zero"], runs["plain"], 1e-4, "DPOTrainer with LoRA, stage 3")
    if dist.get_rank() == 0:
        print("OK dpo-lora", flush=True)


def suite_grpo(work):
    """TRL's GRPOTrainer through the mixin against plain GRPOTrainer at stage 3: generation by the partitioned
    policy, a KL term (beta > 0) against the reference model TRL builds, rewards from a function and from a reward
    model; the reference and the reward model are partitioned by engines of their own. Returns the ZeroTrainer."""
    import datasets
    import trl

    class ZeroGRPOTrainer(ZeroTrainerMixin, trl.GRPOTrainer):
        pass

    # TRL loads the reference and reward models from paths: rank 0 writes them (the group is Accelerate's, as the
    # Trainer starts it)
    accelerate.PartialState()
    policy, scorer = f"{work}/grpo-policy", f"{work}/grpo-reward"
    if dist.get_rank() == 0:
        tiny_llama().save_pretrained(policy)
        config = transformers.LlamaConfig(**{**tiny_llama().config.to_dict(), "num_labels": 1})
        torch.manual_seed(1)
        transformers.LlamaForSequenceClassification(config).save_pretrained(scorer)
        for path in (policy, scorer):
            tokenizer().save_pretrained(path)
    dist.barrier()
    words = torch.randint(3, VOCAB, (16, 5), generator=torch.Generator().manual_seed(3))
    train = datasets.Dataset.from_dict({"prompt": [" ".join(f"t{int(i)}" for i in row) for row in words]})

    def length(completions, **kwargs):
        return [len(c) / 10 for c in completions]

    runs, trainers = {}, {}
    for name, cls, kwargs in (("plain", trl.GRPOTrainer, {}), ("zero", ZeroGRPOTrainer, {"zero_config": STAGE3})):
        args = trl.GRPOConfig(output_dir=f"{work}/grpo-{name}", per_device_train_batch_size=4, num_generations=4,
                              max_completion_length=6, max_steps=3, learning_rate=1e-2, logging_steps=1, beta=0.04,
                              report_to=[], use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True, bf16=False)
        trainers[name] = cls(model=policy, reward_funcs=[length, scorer], args=args, train_dataset=train,
                             processing_class=tokenizer(), **kwargs)
        trainers[name].train()
        runs[name] = history(trainers[name], ("loss", "grad_norm", "reward", "reward_std", "kl",
                                              "completions/mean_length"))
    zero = trainers["zero"]
    for model in (zero.ref_model, zero.reward_funcs[1]):
        sp = sharded_param_of(model.model.layers[0].mlp.up_proj.weight)
        check(sp is not None and sp.shard.numel() < sp.numel, f"GRPO: {type(model).__name__} not partitioned")
    check(list(zero.reference_engines) == ["ref_model", "reward_funcs[1]"], f"{list(zero.reference_engines)}")
    check(any(h.get("kl", 0) > 0 for h in runs["zero"]), f"GRPO: the KL term never acted: {runs['zero']}")
    close(runs["zero"], runs["plain"], 1e-4, "GRPOTrainer stage 3")
    return zero


def suite_distill(work):
    """TRL's DistillationTrainer through the mixin against the plain one at stage 3: TRL routes the student's loss
    through the wrapper it unwraps (``_forward_redirection``), which needs Accelerate's ``unwrap_model`` to take the
    engine off. The teacher stays whole (zero_engine/hf/_reference_models.py says why)."""
    import datasets
    import trl

    class ZeroDistillationTrainer(ZeroTrainerMixin, trl.DistillationTrainer):
        pass

    words = torch.randint(3, VOCAB, (16, 5), generator=torch.Generator().manual_seed(3))
    train = datasets.Dataset.from_dict({"prompt": [" ".join(f"t{int(i)}" for i in row) for row in words]})
    runs = {}
    for name, cls, kwargs in (("plain", trl.DistillationTrainer, {}),
                              ("zero", ZeroDistillationTrainer, {"zero_config": STAGE3})):
        teacher = tiny_llama()
        with torch.no_grad():
            for p in teacher.parameters():
                p.mul_(1.5)
        args = trl.DistillationConfig(output_dir=f"{work}/distill-{name}", per_device_train_batch_size=4,
                                      max_completion_length=6, max_steps=3, learning_rate=1e-2, logging_steps=1,
                                      report_to=[], use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True,
                                      bf16=False)
        trainer = cls(model=tiny_llama(), teacher_model=teacher, args=args, train_dataset=train,
                      processing_class=tokenizer(), **kwargs)
        trainer.train()
        runs[name] = history(trainer, ("loss", "grad_norm"))
    close(runs["zero"], runs["plain"], 1e-4, "DistillationTrainer stage 3")
    return trainer


def tokenizer():
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t3")),
                                               pad_token="t0", bos_token="t1", eos_token="t2", unk_token="t3")
    return tok


if __name__ == "__main__":
    suite, work = sys.argv[1], sys.argv[2]
    alive = None  # the last ZeroTrainer a suite returned, kept alive to the end as a user's script keeps it
    for name in suite.split(","):
        alive = globals()[f"suite_{name}"](work) or alive
        if dist.get_rank() == 0:
            print(f"OK {name}", flush=True)
    if alive is not None:  # README's ending: the trainer's engines destroyed, then the group
        for engine in (alive.engine, *alive.reference_engines.values()):
            engine.destroy()
    destroy_group_and_check()  # the other trainers were dropped: their engines let go of the group when collected
    print("OK exit", flush=True)
