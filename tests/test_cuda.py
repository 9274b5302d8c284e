"""CUDA: streams and events, host<->device copies, engine parity on a GPU (NCCL at world 1, gloo at world 2 on one
GPU), 16-bit training, save_16bit_model's device memory. Every test here skips without CUDA (the reason is shown
with ``pytest -rs``); ``make gpu-check`` runs them together with the FusedAdam parity tests in tests/test_ops.py.

Parity tolerances are those of tests/test_zero3.py (fp32: 1e-4 loss, 1e-3 parameters) and tests/test_precision.py
(bf16: 2e-2 loss / 1e-2 masters; fp16: 5e-3 / 5e-3), for the same reasons (different reduction orders; 16-bit
compute). On a GPU, cuBLAS picks different kernels for a micro-batch than for the full batch, which is within them.
"""

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from zero_engine.zero.streams import CommStreams, to_device, to_host

from session_run import run_in_session

ROOT = Path(__file__).resolve().parent.parent
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (run `make gpu-check` on a GPU)")
TOLERANCES = {"fp32": (1e-4, 1e-3), "bf16": (2e-2, 1e-2), "fp16": (5e-3, 5e-3)}


def test_streams_collapse_to_no_ops_off_cuda():
    """On CPU (and meta) the stream API runs the enclosed code in place and returns no events."""
    streams = CommStreams(torch.device("cpu"))
    assert streams.all_gather is None and streams.reduce_scatter is None and streams.current() is None
    out = torch.zeros(3)
    with streams.issue_on(streams.all_gather):
        out.add_(1)
    assert out.tolist() == [1.0, 1.0, 1.0]
    assert streams.record() is None
    streams.wait(None)
    host = torch.arange(3.0)
    assert to_device(host, torch.device("cpu")) is host
    copy = torch.empty(3)
    assert to_host(host, out=copy) is None and copy.tolist() == [0.0, 1.0, 2.0]


@needs_cuda
def test_side_stream_is_ordered_after_compute_and_consumer_after_side_stream():
    """A long matmul on the compute stream, its result read on the all-gather stream, that read waited for by an
    event: the values are right although the host never synchronised in between."""
    device = torch.device("cuda", torch.cuda.current_device())
    streams = CommStreams(device)
    a = torch.randn(4096, 4096, device=device)
    produced = a @ a  # queued on the compute stream; still running when the side stream is entered
    with streams.issue_on(streams.all_gather):
        copied = produced * 2
    done = streams.record(streams.all_gather)
    streams.wait(done)
    result = copied + 0
    torch.cuda.synchronize()
    torch.testing.assert_close(result, (a @ a) * 2)


@needs_cuda
def test_pinned_copies_are_asynchronous_and_correct():
    device = torch.device("cuda", torch.cuda.current_device())
    host = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    on_device = to_device(host, device)
    back = torch.empty_like(host).pin_memory()
    event = to_host(on_device * 3, out=back)
    assert event is not None
    event.synchronize()
    torch.testing.assert_close(back, host * 3)


def _run_parity(nproc: int, backend: str, precision: str, tmp_path) -> dict:
    out = tmp_path / f"parity_{backend}_{nproc}_{precision}.json"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(ROOT / "tests" / "cuda_parity_worker.py"), backend, precision, str(out)]
    proc = run_in_session(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_engine_parity_on_cuda_world1_nccl(precision, tmp_path):
    result = _run_parity(1, "nccl", precision, tmp_path)
    loss_tol, param_tol = TOLERANCES[precision]
    assert result["backend"] == "nccl"
    assert result["loss_rel_err"] < loss_tol and result["param_rel_err"] < param_tol, result


@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_engine_parity_on_cuda_world2_one_gpu_gloo(precision, tmp_path):
    """Two ranks on one GPU (NCCL refuses that): gloo moves CUDA tensors through host memory."""
    result = _run_parity(2, "gloo", precision, tmp_path)
    loss_tol, param_tol = TOLERANCES[precision]
    assert result["world"] == 2
    assert result["loss_rel_err"] < loss_tol and result["param_rel_err"] < param_tol, result


@needs_cuda
def test_large_parameters_gathered_as_one_nccl_group_train_bitwise_as_one_by_one(tmp_path):
    """On NCCL the engine gathers a request's large parameters as one group ([Note: large parameters gathered as one
    group] in zero/gather.py): bitwise the same training as one all-gather each, with fewer all-gathers a step."""
    out = tmp_path / "grouped.json"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
           str(ROOT / "tests" / "cuda_grouped_gather_worker.py"), str(out)]
    proc = run_in_session(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert result["engine_groups_on_nccl"] is True and result["backend"] == "nccl"
    assert result["losses"][0] == result["losses"][1] and result["params_equal"], result
    grouped, separate = result["gathers"]
    assert grouped < separate, result


def _fused_adam_grads_body(in_kernel: bool):
    """bf16 ZeRO-3 on CUDA, clipped (the kernel's scale is not 1): what FusedAdam is handed as gradients, how far
    each ``engine.step()`` raises the allocator's peak above where it started, and the training. The first step
    also creates Adam's two fp32 moments (8 bytes a shard element), so the rises compared are the later steps'."""
    import torch.distributed as dist

    from offload_common import record_kernel_grads

    import zero_engine
    from zero_engine.ops import FusedAdam
    from zero_engine.testing.models import GPT, GPTConfig, make_batches

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=4, n_embd=256, n_head=4, vocab_size=256)
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "gradient_clipping": 0.1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zero_engine.initialize(model=GPT(cfg), config=config)
    assert isinstance(engine.optimizer.optimizer, FusedAdam), type(engine.optimizer.optimizer)
    seen = record_kernel_grads(engine, in_kernel)  # in_kernel False: the fp32-copy path, as before grad_scale
    losses, rises = [], []
    for x, y in make_batches(cfg, 3, 2):
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        engine.step()
        rises.append(torch.cuda.max_memory_allocated() - before)
        losses.append(loss.item())
    params = {sp.fqn: sp.shard.cpu() for sp in engine.sharded}
    shard_elements = sum(sp.shard_numel for sp in engine.sharded)
    engine.destroy()
    dist.barrier()
    return losses, params, set(seen), rises, shard_elements


@needs_cuda
def test_fused_adam_takes_bf16_gradient_shards_without_an_fp32_copy():
    """FusedAdam scales the 16-bit gradient shards in its kernel, as CPUAdam does: they go in as they are, the
    step allocates no fp32 copy of them (4 bytes a shard element; measured by the CUDA allocator), and training is
    bitwise what converting them first gave."""
    from zero_engine.testing import run_ranks

    losses, params, seen, rises, elements = run_ranks(_fused_adam_grads_body, 1, True, timeout=120)[0]
    ref_losses, ref_params, ref_seen, ref_rises, _ = run_ranks(_fused_adam_grads_body, 1, False, timeout=120)[0]
    rise, ref_rise = max(rises[1:]), max(ref_rises[1:])  # after the first step, which creates Adam's moments
    assert seen == {(torch.bfloat16, True, True)}, seen  # the reducer's bf16 shards themselves, clipped
    assert ref_seen == {(torch.float32, False, False)}, ref_seen  # scaled copies before
    assert losses == ref_losses
    assert all(torch.equal(params[name], ref_params[name]) for name in ref_params)
    assert ref_rise >= 4 * elements, (ref_rises, elements)  # the fp32 copy the step made before
    assert rise < elements, (rises, elements)  # now: no copy (the norm's few bytes)


def _save16_body(save_dir):
    import torch.distributed as dist

    import zero_engine
    from zero_engine.testing.models import GPT, GPTConfig

    torch.manual_seed(0)
    # many blocks and a small vocabulary: twice the largest parameter plus slack stays far below the whole model
    model = GPT(GPTConfig(n_layer=8, n_embd=256, n_head=4, vocab_size=256))
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_gather_16bit_weights_on_model_save": True}}
    engine, *_ = zero_engine.initialize(model=model, config=config)
    largest = max(sp.full_bytes for sp in engine.sharded)
    model_bytes = sum(sp.full_bytes for sp in engine.sharded)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    engine.save_16bit_model(save_dir)
    growth = torch.cuda.max_memory_allocated() - before
    state = torch.load(os.path.join(save_dir, "pytorch_model.bin")) if dist.get_rank() == 0 else {}
    return growth, largest, model_bytes, {k: v.device.type for k, v in state.items()}


@needs_cuda
def test_save_16bit_model_streams_to_host(tmp_path):
    """Rank 0's GPU holds one gathered parameter at a time (plus allocator slack), never the whole model."""
    from zero_engine.testing import run_ranks

    growth, largest, model_bytes, devices = run_ranks(_save16_body, 1, str(tmp_path), timeout=120)[0]
    assert set(devices.values()) == {"cpu"}
    assert growth <= 2 * largest + (1 << 20) < model_bytes, (growth, largest, model_bytes)


def _edit_with_offload_body(offload_param: bool):
    """bf16 ZeRO-3 on CUDA with the optimizer (fp32 masters) on the host and, with ``offload_param``, the compute
    shards too; one step, then a modifier_rank block edits one row of a weight (before and after, the fp32 values
    of the whole weight, read from the masters), then one more step."""
    import zero_engine
    from zero_engine.testing.models import GPT, GPTConfig, make_batches
    from zero_engine.utils import safe_get_full_fp32_param
    from zero_engine.zero import GatheredParameters

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=128)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"}}
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero}
    engine, *_ = zero_engine.initialize(model=GPT(cfg), config=config)
    batches = list(make_batches(cfg, 2, 2))
    losses = []

    def step(x, y):
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())

    step(*batches[0])
    weight = engine.module.lm_head.weight
    before = safe_get_full_fp32_param(weight)
    with GatheredParameters(weight, modifier_rank=0), torch.no_grad():
        weight[3].fill_(2.0)
    after = safe_get_full_fp32_param(weight)
    step(*batches[1])
    shard_devices = {sp.shard.device.type for sp in engine.sharded}
    master_devices = {sp.master.device.type for sp in engine.sharded if sp.master is not None}
    engine.destroy()
    return before, after, losses, shard_devices, master_devices


@needs_cuda
@pytest.mark.parametrize("offload_param", [False, True], ids=["masters on host", "shards and masters on host"])
def test_an_edit_on_cuda_reaches_host_masters_and_shards_and_keeps_the_other_bits(offload_param):
    """GatheredParameters(modifier_rank=...) compares and writes where each copy lives: the gathered weight on the
    GPU, the shards (on the host under offload_param) and the fp32 masters (on the host under offload_optimizer)."""
    from zero_engine.testing import run_ranks

    before, after, losses, shards, masters = run_ranks(_edit_with_offload_body, 1, offload_param, timeout=120)[0]
    assert masters == {"cpu"} and shards == ({"cpu"} if offload_param else {"cuda"}), (shards, masters)
    assert (after[3] == 2.0).all()
    rest = torch.ones(after.shape[0], dtype=torch.bool)
    rest[3] = False
    assert torch.equal(after[rest], before[rest])  # the fp32 bits of every row not edited
    assert all(map(torch.isfinite, map(torch.tensor, losses))), losses


@needs_cuda
def test_hf_offload_and_helpers_on_cuda_world1_nccl(tmp_path):
    """from_pretrained builds the shards on the GPU; with the masters and the compute shards on the host, the
    helpers that gather them (safe_get_full_fp32_param, save_pretrained's fp32 masters) gather on the device, and an
    edit in GatheredParameters(modifier_rank=0) reaches the host masters (tests/cuda_offload_api_worker.py)."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file
    from test_hf import save, tiny_llama

    model_dir, save_dir, out = tmp_path / "llama", tmp_path / "saved", tmp_path / "result.json"
    save(tiny_llama(), str(model_dir))
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
           str(ROOT / "tests" / "cuda_offload_api_worker.py"), "nccl", str(model_dir), str(save_dir), str(out)]
    proc = run_in_session(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert result["loaded_on"] == ["cuda"] and result["engine_device"] == "cuda", result
    assert result["masters_on"] == ["cpu"] and result["shards_on"] == ["cpu"], result
    assert all(map(math.isfinite, result["losses"])), result["losses"]
    assert result["master_row3"] == [2.0] * len(result["master_row3"])
    saved = load_file(str(save_dir / "model.safetensors"))["lm_head.weight"]
    assert saved.dtype == torch.float32
    assert saved[3].tolist() == result["master_row3"] and saved[0].tolist() == result["master_row0"]


def _host_grads_read_at_once_body():
    import zero_engine
    from zero_engine.utils import safe_get_local_grad

    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 4096, bias=False)  # a 64 MB gradient shard: its copy to the host takes a while
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 1 << 25,
                                    "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    engine, *_ = zero_engine.initialize(model=model, config=config)
    same = []
    for _ in range(3):
        loss = engine(torch.randn(2, 4096, device=engine.device)).square().mean()
        engine.backward(loss)
        at_once = safe_get_local_grad(model.weight)  # right after backward: the copy may still be running
        torch.cuda.synchronize()
        same.append(torch.equal(at_once, safe_get_local_grad(model.weight)))
        engine.step()
    engine.destroy()
    return same


@needs_cuda
def test_host_gradient_shards_read_right_after_backward_on_cuda_are_complete():
    """Under offload_optimizer the gradient shards come to pinned host memory by non-blocking copies; a helper that
    reads them on the host (safe_get_local_grad, checkpoints) waits for those copies first."""
    from zero_engine.testing import run_ranks

    assert run_ranks(_host_grads_read_at_once_body, 1, timeout=120)[0] == [True, True, True]


def _cuda_rng_body(save_dir):
    import zero_engine
    from zero_engine.checkpoint._reader import CheckpointReader

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 1}}
    engine, *_ = zero_engine.initialize(model=torch.nn.Linear(8, 8), config=config)
    torch.cuda.manual_seed(5)
    saved = torch.cuda.get_rng_state()
    engine.save_checkpoint(save_dir, tag="rng")
    torch.cuda.manual_seed(9)
    engine.load_checkpoint(save_dir, tag="rng")
    restored = torch.equal(torch.cuda.get_rng_state(), saved)
    with CheckpointReader(os.path.join(save_dir, "rng")) as reader:
        names = sorted(n for n in reader.file(0).entries if n.startswith("rng/cuda"))
    engine.destroy()
    return restored, names


@needs_cuda
def test_a_checkpoint_keeps_the_cuda_rng_state_of_the_ranks_own_device_only(tmp_path):
    """One entry, the current device's: restoring every visible device's states failed where the loading rank sees
    fewer devices than the saving one (a per-rank CUDA_VISIBLE_DEVICES)."""
    from zero_engine.testing import run_ranks

    restored, names = run_ranks(_cuda_rng_body, 1, str(tmp_path), timeout=120)[0]
    assert restored and names == ["rng/cuda"], (restored, names)
