"""A training script written the way DeepSpeed's tutorials write one; the only change is the import line.

    torchrun --nproc_per_node 2 examples/ds_tutorial.py --deepspeed --deepspeed_config ds_config.json \
        --checkpoint_dir ckpt --save_at 2

With `import deepspeed` instead of the first import below, this file is a DeepSpeed script (tests/test_deepspeed_
tutorial.py runs it under zero_engine at ZeRO stages 1-3 and checks it against one-process training, and under
DeepSpeed itself when DeepSpeed is installed).
"""

import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import zero_engine as deepspeed  # <- the one change: `import deepspeed`


def add_argument():
    parser = argparse.ArgumentParser(description="DeepSpeed-tutorial-style training")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--checkpoint_dir", type=str, default=None)
    parser.add_argument("--save_at", type=int, default=-1, help="save a checkpoint after this optimizer step")
    parser.add_argument("--resume", action="store_true", help="load the latest checkpoint and continue from it")
    parser.add_argument("--output", type=str, default=None, help="rank 0 writes losses and final weights here")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 48)
        self.fc2 = nn.Linear(48, 48)
        self.fc3 = nn.Linear(48, 5)

    def forward(self, x):
        x = F.gelu(self.fc1(x))
        x = F.gelu(self.fc2(x))
        return self.fc3(x)


def make_dataset(samples, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 16, generator=g)
    y = torch.randint(0, 5, (samples,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def main():
    args = add_argument()
    deepspeed.init_distributed(dist_backend="gloo")
    with open(args.deepspeed_config) as f:
        ds_config = json.load(f)
    torch.manual_seed(args.seed)
    trainset = make_dataset(args.samples, args.seed)

    with deepspeed.zero.Init(config_dict_or_path=args.deepspeed_config,
                             enabled=ds_config["zero_optimization"]["stage"] == 3):
        net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(args=args, model=net, model_parameters=parameters,
                                                                   training_data=trainset)

    start_step = 0
    if args.resume:
        _, client_state = model_engine.load_checkpoint(args.checkpoint_dir)
        start_step = client_state["step"]

    rank = deepspeed.comm.get_rank()
    world = deepspeed.comm.get_world_size()
    gas = model_engine.gradient_accumulation_steps()
    losses, first_grads = [], None
    step_loss = torch.zeros(())
    micro = 0
    for epoch in range(args.epochs):
        for inputs, labels in trainloader:
            micro += 1
            if micro <= start_step * gas:  # already trained before the checkpoint
                continue
            loss = F.cross_entropy(model_engine(inputs), labels)
            model_engine.backward(loss)
            if model_engine.is_gradient_accumulation_boundary() and first_grads is None:
                # after the last backward of the window, before the step: the averaged full gradients
                first_grads = {n: deepspeed.utils.safe_get_full_grad(p)
                               for n, p in model_engine.module.named_parameters()}
            model_engine.step()
            step_loss += loss.detach() / gas
            if model_engine.was_step_applied():
                deepspeed.comm.all_reduce(step_loss)
                losses.append(step_loss.item() / world)
                step_loss.zero_()
                if rank == 0:
                    print(f"step {model_engine.global_steps}: loss {losses[-1]:.5f} "
                          f"lr {model_engine.get_lr()[0]:.3g} grad norm {model_engine.get_global_grad_norm():.4f}")
                if model_engine.global_steps == args.save_at and args.checkpoint_dir:
                    model_engine.save_checkpoint(args.checkpoint_dir,
                                                 client_state={"step": model_engine.global_steps})

    weights = {n: deepspeed.utils.safe_get_full_fp32_param(p) for n, p in model_engine.module.named_parameters()}
    exp_avg = {n: deepspeed.utils.safe_get_full_optimizer_state(p, "exp_avg")
               for n, p in model_engine.module.named_parameters()}
    deepspeed.comm.barrier()
    if rank == 0 and args.output:
        torch.save({"losses": losses, "weights": weights, "exp_avg": exp_avg, "first_grads": first_grads,
                    "global_steps": model_engine.global_steps,
                    "batch": (model_engine.train_batch_size(), model_engine.train_micro_batch_size_per_gpu(), gas),
                    "stage": model_engine.zero_optimization_stage()}, args.output)
    # The engine, then the group, before the interpreter ends: a gloo group left to exit can abort the rank (README)
    model_engine.destroy()
    deepspeed.comm.destroy_process_group()


if __name__ == "__main__":
    main()
