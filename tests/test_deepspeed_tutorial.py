"""A DeepSpeed-tutorial-style script (examples/ds_tutorial.py), unchanged but for `import zero_engine as deepspeed`,
run on 2 simulated ranks at ZeRO stages 1-3: argparse with add_config_arguments, initialize(args=...,
training_data=...), zero.Init(config_dict_or_path=...), the loop with is_gradient_accumulation_boundary /
was_step_applied, save_checkpoint at a step and a second run that resumes from it, deepspeed.utils.safe_get_*.

Checked against one-process training of the same model on the same global batches (the micro-batches the
DistributedSampler gives each rank, in the order the script sees them). The ranks' micro-batch losses and gradients
are averaged in another order than the one-process full batch: fp32 rounding of ~1e-7 relative per step (measured:
losses 1.3e-7, first gradients 1.7e-7, final weights 8e-8 and exp_avg 2e-7, relative L2, at every stage). Losses,
gradients, weights and exp_avg must agree to 1e-5: two orders of margin for 6 steps of a small MLP (test_zero3.py
allows 2e-4 for AdamW over longer runs, where division by sqrt(v) amplifies differences in tiny gradients). The
resumed run must end bit-for-bit where the uninterrupted one did.

With ``ZERO_ENGINE_DEEPSPEED_PYTHON`` (or ``BENCH_DEEPSPEED_PYTHON``) naming a Python where ``import deepspeed``
works, the same script with ``import deepspeed`` is also run under DeepSpeed itself (CPU accelerator, gloo, torchrun)
and its results must equal zero_engine's to the same 1e-5 (measured with DeepSpeed 0.19.8 at stage 3: losses 7.5e-8,
first gradients 1.7e-7, weights 7.8e-8, exp_avg 1.8e-7 from the one-process reference). Skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import runpy
import socket
import sys

import pytest
import torch
import torch.nn.functional as F

from zero_engine.testing import run_ranks

from session_run import run_in_session

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "ds_tutorial.py")
TIMEOUT = 120
WORLD, MICRO, GAS, SAMPLES, SEED, LR = 2, 2, 2, 48, 1234, 1e-2


def ds_config(stage: int) -> dict:
    return {"train_batch_size": MICRO * GAS * WORLD, "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8,
                                                      "weight_decay": 0.01, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, "allgather_bucket_size": 2000,
                                  "stage3_param_persistence_threshold": 0}}


def _run_script(argv: list[str]) -> None:
    """On each rank: the script as `python ds_tutorial.py argv...` would run it (the group is already up)."""
    saved = sys.argv
    sys.argv = [SCRIPT, *argv]
    try:
        runpy.run_path(SCRIPT, run_name="__main__")
    finally:
        sys.argv = saved


def _tutorial_module():
    spec = importlib.util.spec_from_file_location("ds_tutorial", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference(steps: int) -> dict:
    """One process, full global batches in the order the ranks see them, torch AdamW + clip_grad_norm_."""
    tutorial = _tutorial_module()
    torch.manual_seed(SEED)
    net = tutorial.Net()
    data = tutorial.make_dataset(SAMPLES, SEED)
    per_rank = [list(torch.utils.data.DistributedSampler(data, num_replicas=WORLD, rank=r)) for r in range(WORLD)]
    opt = torch.optim.AdamW(net.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    losses, first_grads = [], None
    for step in range(steps):
        idx = [i for m in range(step * GAS, (step + 1) * GAS) for r in range(WORLD)
               for i in per_rank[r][m * MICRO:(m + 1) * MICRO]]
        x, y = data.tensors[0][idx], data.tensors[1][idx]
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in net.named_parameters()}
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "weights": {n: p.detach() for n, p in net.named_parameters()},
            "exp_avg": {n: opt.state[p]["exp_avg"] for n, p in net.named_parameters()}, "first_grads": first_grads}


def rel_l2(ours: dict, ref: dict) -> float:
    diff = sum((ours[n].float() - ref[n].float()).pow(2).sum() for n in ref).sqrt()
    return (diff / sum(ref[n].float().pow(2).sum() for n in ref).sqrt()).item()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_tutorial_script_matches_one_process_training_and_resumes(stage, tmp_path):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(ds_config(stage)))
    common = ["--deepspeed", "--deepspeed_config", str(config), "--samples", str(SAMPLES), "--seed", str(SEED),
              "--checkpoint_dir", str(tmp_path / "ckpt")]
    run_ranks(_run_script, WORLD, common + ["--save_at", "3", "--output", str(tmp_path / "full.pt")], timeout=TIMEOUT)
    run_ranks(_run_script, WORLD, common + ["--resume", "--output", str(tmp_path / "resumed.pt")], timeout=TIMEOUT)
    full, resumed = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt")
    steps = SAMPLES // (MICRO * GAS * WORLD)
    ref = reference(steps)

    assert full["stage"] == stage and full["batch"] == (MICRO * GAS * WORLD, MICRO, GAS)
    assert full["global_steps"] == steps == resumed["global_steps"]
    assert len(full["losses"]) == steps
    worst = max(abs(a - b) / abs(b) for a, b in zip(full["losses"], ref["losses"]))
    assert worst < 1e-5, (full["losses"], ref["losses"])
    assert rel_l2(full["first_grads"], ref["first_grads"]) < 1e-5
    assert rel_l2(full["weights"], ref["weights"]) < 1e-5
    assert rel_l2(full["exp_avg"], ref["exp_avg"]) < 1e-5
    # resumed after step 3: the same last losses and bit-identical final states
    assert resumed["losses"] == full["losses"][3:]
    for n in full["weights"]:
        assert torch.equal(resumed["weights"][n], full["weights"][n]), n
        assert torch.equal(resumed["exp_avg"][n], full["exp_avg"][n]), n


def _deepspeed_python() -> str | None:
    return os.environ.get("ZERO_ENGINE_DEEPSPEED_PYTHON") or os.environ.get("BENCH_DEEPSPEED_PYTHON") or None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(_deepspeed_python() is None,
                    reason="set ZERO_ENGINE_DEEPSPEED_PYTHON to a Python with deepspeed to compare with DeepSpeed")
def test_same_script_under_deepspeed_itself_gives_the_same_results(tmp_path):
    text = open(SCRIPT).read()
    assert text.count("import zero_engine as deepspeed") == 1
    script = tmp_path / "ds_tutorial_deepspeed.py"
    script.write_text(text.replace("import zero_engine as deepspeed", "import deepspeed"))  # the one change
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(ds_config(3)))
    args = ["--deepspeed", "--deepspeed_config", str(config), "--samples", str(SAMPLES), "--seed", str(SEED)]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    done = run_in_session([_deepspeed_python(), "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
                           "--master_port", str(_free_port()), str(script), *args, "--output",
                           str(tmp_path / "deepspeed.pt")], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    run_ranks(_run_script, WORLD, args + ["--output", str(tmp_path / "ours.pt")], timeout=TIMEOUT)
    theirs, ours = torch.load(tmp_path / "deepspeed.pt"), torch.load(tmp_path / "ours.pt")
    assert theirs["batch"] == ours["batch"] and theirs["global_steps"] == ours["global_steps"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], theirs["losses"]))
    assert worst < 1e-5, (ours["losses"], theirs["losses"])
    for key in ("first_grads", "weights", "exp_avg"):
        assert rel_l2(ours[key], theirs[key]) < 1e-5, key
