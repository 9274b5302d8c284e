"""Optimizer offload (issue 13): placement, CPU and NVMe offload of masters and Adam moments, on simulated ranks.

Parity is bitwise: offload changes where the fp32 masters, the moments and the gradient shards live and in which
order the sub-groups are read and written, never the arithmetic (same CPUAdam kernel over the same values, gradient
shards kept in the same dtype; see [Note: gradient shards on the host] in zero/grads.py). So losses and parameters
with offload must equal those without it exactly, in fp32 and bf16, at stages 1-3.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

import zero_engine
from zero_engine.offload.placement import Placement
from zero_engine.testing import run_ranks
from zero_engine.testing.models import GPT, make_batches

from offload_common import (MODEL, accelerator_code_path, assert_same, checkpoint_body, gathered_params,
                            record_kernel_grads, run_steps)

TIMEOUT = 60


def config(stage: int, offload: str, nvme_path: str | None = None, bf16: bool = False, **offload_knobs) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 700, "stage3_prefetch_bucket_size": 3000,
            "stage3_param_persistence_threshold": 40, "sub_group_size": 3000}
    if offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True, **offload_knobs}
    elif offload == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 3,
                                     "pipeline_read": True, "pipeline_write": True, **offload_knobs}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}, "zero_optimization": zero}
    if bf16:
        cfg["bf16" if bf16 is True else bf16] = {"enabled": True}  # bf16=True, or "fp16"
        if bf16 == "fp16":
            cfg["fp16"]["initial_scale_power"] = 8  # so that most of the few steps apply
    return cfg


def _train(cfg: dict, steps: int = 3, separate_host: bool = False):
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(MODEL)
    # separate_host: the accelerator's code path (host copies, host gradient shards) on a CPU-only machine
    with accelerator_code_path() if separate_host else contextlib.nullcontext():
        engine, *_ = zero_engine.initialize(model=model, config=cfg)
        losses = run_steps(engine, make_batches(MODEL, steps, world * 4))
        stats = engine.memory_stats()
        stats["applied_steps"] = engine.global_steps - engine.skipped_steps
        params = gathered_params(engine)
        files = [engine.optimizer.swapper.store.run_dir] if getattr(engine.optimizer, "swapper", None) else []
        engine.destroy()
    return losses, params, stats, [os.path.exists(f) for f in files]


def _parity_body(stage: int, bf16: bool, nvme_path: str):
    off = _train(config(stage, "none", bf16=bf16))
    cpu = _train(config(stage, "cpu", bf16=bf16))
    nvme = _train(config(stage, "nvme", nvme_path, bf16=bf16))
    return off, cpu, nvme


@pytest.mark.parametrize("stage,bf16,world", [(stage, bf16, 2) for stage in (1, 2, 3) for bf16 in (False, True)]
                         + [(3, True, 1)])
def test_offload_cpu_and_nvme_match_no_offload_bitwise(stage, bf16, world, tmp_path):
    results = run_ranks(_parity_body, world, stage, bf16, str(tmp_path), timeout=TIMEOUT)
    for off, cpu, nvme in results:
        assert_same(off, cpu, f"stage {stage} bf16={bf16} cpu offload")
        assert_same(off, nvme, f"stage {stage} bf16={bf16} nvme offload")
        assert nvme[3] == [False], "NVMe files left after engine.destroy()"
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


@pytest.mark.parametrize("stage,precision,world", [(3, "fp16", 2), (3, True, 3), (1, False, 3)])
def test_offload_parity_fp16_and_odd_world(stage, precision, world, tmp_path):
    """fp16 (dynamic loss scale: overflowing steps are skipped) and world 3 (padded shards)."""
    results = run_ranks(_parity_body, world, stage, precision, str(tmp_path), timeout=TIMEOUT)
    for off, cpu, nvme in results:
        assert off[2]["applied_steps"] >= 2, off[2]["applied_steps"]  # parity of updates, not of skipped steps
        assert_same(off, cpu, f"stage {stage} {precision} world {world} cpu offload")
        assert_same(off, nvme, f"stage {stage} {precision} world {world} nvme offload")


def _separate_host_body(stage: int, bf16: bool, offload: str, nvme_path: str):
    off = _train(config(stage, "none", bf16=bf16))
    host = _train(config(stage, offload, nvme_path, bf16=bf16), separate_host=True)
    return off, host


@pytest.mark.parametrize("stage,bf16,offload", [(2, False, "cpu"), (3, True, "cpu"), (1, True, "nvme"),
                                                (3, False, "nvme")])
def test_accelerator_code_path_on_the_cpu_matches_bitwise(stage, bf16, offload, tmp_path):
    """Separate host masters, host gradient shards and shard copies back (the CUDA path), run with CPU tensors;
    under NVMe the fp32 masters are then separate and swap too."""
    for off, host in run_ranks(_separate_host_body, 2, stage, bf16, offload, str(tmp_path), timeout=TIMEOUT):
        assert_same(off, host, f"stage {stage} bf16={bf16} separate-host {offload} offload")
        # fp32 masters are separate host copies now, even in fp32 training
        where = "host" if offload == "cpu" else "nvme"
        assert host[2]["master_params"] > 0 and host[2]["by_location"][where]["master_params"] > 0


def _grads_in_kernel_body(in_kernel: bool):
    """bf16 stage 3 with CPU optimizer offload; records what CPUAdam is handed as gradients at each sub-group."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    cfg = config(3, "cpu", bf16=True)
    cfg["gradient_clipping"] = 0.1  # clipped: the kernel's scale is not 1
    engine, *_ = zero_engine.initialize(model=GPT(MODEL), config=cfg)
    seen = record_kernel_grads(engine, in_kernel)  # in_kernel False: the fp32-copy path, for the bitwise comparison
    losses = run_steps(engine, make_batches(MODEL, 3, world * 4))
    params = gathered_params(engine)
    engine.destroy()
    return (losses, params), set(seen)


def test_cpu_adam_takes_bf16_gradient_shards_without_an_fp32_copy():
    """The 16-bit gradient shards go into CPUAdam as they are (the kernel scales them in fp32: no fp32 copy of the
    gradients, 4 bytes per parameter of the sub-group less during the step), bitwise equal to converting them first
    (clipped: the kernel's scale is not 1)."""
    for (fused, seen), (copied, _) in zip(run_ranks(_grads_in_kernel_body, 2, True, timeout=TIMEOUT),
                                               run_ranks(_grads_in_kernel_body, 2, False, timeout=TIMEOUT)):
        assert seen == {(torch.bfloat16, True, True)}, seen  # the reducer's bf16 shards themselves, clipped
        assert_same(fused, copied, "bf16 gradients into CPUAdam vs fp32 copies")


def _buffers_body(nvme_path: str, buffer_count: int, pipeline: bool):
    cfg = config(3, "nvme", nvme_path, bf16=True, buffer_count=buffer_count, pipeline_read=pipeline,
                 pipeline_write=pipeline)
    return _train(cfg)


@pytest.mark.parametrize("buffer_count,pipeline", [(1, True), (2, False)])
def test_nvme_buffer_counts_and_pipelines_give_the_same_result(buffer_count, pipeline, tmp_path):
    ref = run_ranks(_parity_body, 1, 3, True, str(tmp_path), timeout=TIMEOUT)[0][0]
    got = run_ranks(_buffers_body, 1, str(tmp_path), buffer_count, pipeline, timeout=TIMEOUT)[0]
    assert_same(ref, got, f"buffer_count={buffer_count} pipeline={pipeline}")


def _pool_body(nvme_path: str, buffer_count: int):
    cfg = config(3, "nvme", nvme_path, bf16=True, buffer_count=buffer_count)
    cfg["zero_optimization"]["sub_group_size"] = 1000  # many sub-groups per rank, a few buffers
    torch.manual_seed(0)
    engine, *_ = zero_engine.initialize(model=GPT(MODEL), config=cfg)
    swapper = engine.optimizer.swapper
    acquire, peak = swapper._acquire, []

    def counted(*args, **kwargs):
        buffer = acquire(*args, **kwargs)
        peak.append(swapper._allocated)
        return buffer
    swapper._acquire = counted
    run_steps(engine, make_batches(MODEL, 2, dist.get_world_size() * 4))
    groups = len(swapper.groups)
    engine.destroy()
    return groups, max(peak)


@pytest.mark.parametrize("buffer_count", [1, 2])
def test_the_first_step_keeps_the_swap_buffers_within_buffer_count(buffer_count, tmp_path):
    """The first step creates the Adam moments, so every sub-group's buffer must grow (master -> master + moments).
    The grown buffer replaces the small one: were the small one pooled, the next sub-group's read could take it and
    grow as well, and every sub-group's states would be in memory at once (out of memory on a model that needs NVMe
    offload at all). Buffers alive: buffer_count, plus the one being replaced while its master is copied."""
    for groups, peak in run_ranks(_pool_body, 1, str(tmp_path), buffer_count, timeout=TIMEOUT):
        assert groups >= 6 * buffer_count, groups  # enough sub-groups for an unbounded pool to show
        assert peak <= buffer_count + 1, f"{peak} swap buffers alive at once with buffer_count={buffer_count}"


@pytest.mark.parametrize("save,load", [("nvme", "none"), ("none", "nvme"), ("cpu", "nvme")])
def test_checkpoint_moves_between_offload_and_no_offload_with_bitwise_resume(save, load, tmp_path):
    nvme = str(tmp_path / "nvme")
    os.makedirs(nvme)
    results = run_ranks(checkpoint_body, 2, config(3, save, nvme, bf16=True), config(3, load, nvme, bf16=True),
                        str(tmp_path / "ckpt"), timeout=TIMEOUT)
    for after_save, resumed in results:
        assert_same(after_save, resumed, f"saved with {save}, loaded with {load}")
    assert os.listdir(nvme) == []


def _stats_body(nvme_path: str):
    torch.manual_seed(0)
    engine, *_ = zero_engine.initialize(model=GPT(MODEL), config=config(3, "nvme", nvme_path, bf16=True))
    run_steps(engine, make_batches(MODEL, 1, dist.get_world_size() * 4))
    # between steps the masters and moments are on disk only: the tensors the optimizer keys are 0-element
    opt = engine.optimizer
    resident = sum(sp.master.numel() for sp in opt.sharded) + sum(
        t.numel() for s in opt.optimizer.state.values() for t in s.values() if t.dim() > 0)
    with opt.states_in_memory():
        inside = sum(sp.master.numel() for sp in opt.sharded)
    stats = engine.memory_stats()
    groups = len(opt.swapper.groups)
    engine.destroy()
    return stats, resident, inside, sum(sp.shard_numel for sp in opt.sharded), groups


def test_memory_stats_by_location_under_nvme_offload(tmp_path):
    stats, resident, inside, numel, groups = run_ranks(_stats_body, 2, str(tmp_path), timeout=TIMEOUT)[0]
    assert resident == 0 and inside == numel
    where = stats["by_location"]
    assert where["nvme"]["master_params"] == stats["master_params"] > 0
    assert where["nvme"]["optimizer_states"] == stats["optimizer_states"] == 2 * stats["master_params"]
    states = stats["master_params"] + stats["optimizer_states"]  # files: each slot padded to 4 KiB for O_DIRECT
    assert states <= where["nvme"]["files"] < states + 3 * 4096 * groups
    assert where["device"]["params_sharded"] == stats["params_sharded"]
    assert where["device"]["master_params"] == where["device"]["optimizer_states"] == 0
    assert where["host"]["swap_buffers"] > 0


def test_placement_from_config_and_log(caplog):
    cfg = zero_engine.config.load_config(config(2, "cpu"), world_size=1)
    placement = Placement.from_config(cfg.zero_optimization, torch.device("cpu"))
    assert (placement.params, placement.masters, placement.optimizer_states, placement.grads) == \
        ("device", "host", "host", "host")
    assert not placement.has_separate_host and not placement.pins  # pin_memory asked, nothing to pin on a CPU
    caplog.set_level("INFO", logger="zero_engine.offload")
    placement.log_once(0)
    text = caplog.text
    assert "optimizer states: host" in text and "already live in host memory" in text
    assert "pin_memory ignored (no accelerator)" in text
    plain = Placement.from_config(zero_engine.config.load_config(config(3, "none"), world_size=1).zero_optimization,
                                  torch.device("cpu"))
    assert plain.optimizer_states == "device" and plain.grads == "device"


def test_stage_0_with_offload_is_refused():
    cfg = config(0, "cpu")
    cfg["zero_optimization"]["stage"] = 0
    with pytest.raises(Exception, match="offload_optimizer needs zero_optimization.stage >= 1"):
        run_ranks(_train, 1, cfg, timeout=TIMEOUT)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the device->host / host->device copies")
def test_cuda_offload_cpu_keeps_states_on_the_host():
    assert run_ranks(_cuda_body, 1, timeout=TIMEOUT)[0]


def _cuda_body():
    cfg = config(3, "cpu", bf16=True)
    engine, *_ = zero_engine.initialize(model=GPT(MODEL), config=cfg)
    x, y = next(iter(make_batches(MODEL, 1, 2)))
    for _ in range(2):
        engine.backward(engine(x.cuda(), y.cuda()))
        engine.step()
    sp = engine.sharded[0]
    state = engine.optimizer.optimizer.state[engine.optimizer.masters[id(sp.param)]]
    ok = sp.master.device.type == "cpu" and sp.master.is_pinned() and state["exp_avg"].device.type == "cpu"
    ok = ok and sp.shard.device.type == "cuda" and engine.memory_stats()["by_location"]["host"]["master_params"] > 0
    engine.destroy()
    return ok


def _estimator_body(cases, nvme_path: str):
    return [_train(config(stage, offload, nvme_path, bf16=bf16), steps=1)[2] for stage, offload, bf16 in cases]


ESTIMATOR_CASES = [(3, "nvme", True), (2, "cpu", False), (1, "cpu", True)]


def test_offload_aware_estimate_matches_memory_stats_by_location(tmp_path):
    from zero_engine.memory.estimator import PRECISIONS, GatherPolicy, count_model_params, estimate_rank_memory

    world = 2
    with torch.device("meta"):
        counts = count_model_params(GPT(MODEL))
    results = run_ranks(_estimator_body, world, ESTIMATOR_CASES, str(tmp_path), timeout=TIMEOUT)
    for rank, per_case in enumerate(results):
        for (stage, offload, bf16), measured in zip(ESTIMATOR_CASES, per_case):
            zc = zero_engine.config.load_config(config(stage, offload, str(tmp_path), bf16=bf16),
                                                world_size=world).zero_optimization
            est = estimate_rank_memory(counts, world, stage, PRECISIONS["bf16" if bf16 else "fp32"],
                                       GatherPolicy.from_zero_config(zc), offload_optimizer=offload,
                                       accelerator=False, sub_group_size=zc.sub_group_size,
                                       buffer_count=zc.offload_optimizer.buffer_count)
            where = f"rank {rank}/{world}, stage {stage}, {offload}, bf16={bf16}"
            want, got = est.by_location(), measured["by_location"]
            for location in ("device", "host", "nvme"):
                for key in ("params_sharded", "master_params", "grads", "optimizer_states"):
                    w, g = want[location][key], got[location][key]
                    assert abs(w - g) <= 0.02 * max(w, g), (where, location, key, w, g)
            assert got["host"]["swap_buffers"] <= want["host"]["swap_buffers"], where
            assert (got["nvme"]["files"] > 0) == (offload == "nvme"), where


def test_estimate_cli_and_deepspeed_keywords_are_offload_aware(capsys):
    from zero_engine.cli import main
    from zero_engine.memory.estimator import estimate_from_counts

    assert main(["estimate", "--params", "7e9", "--largest-layer", "1e9", "--ranks-per-node", "8",
                 "--offload-optimizer", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "Offload: optimizer cpu" in out and out.splitlines()[5].split()[-3:] == ["device", "host", "nvme"]
    est = estimate_from_counts(7e9, 1e9, 8, cpu_offload=True, print_table=False, stages=(3,), precisions=("bf16",))
    row = est.get(3, "bf16")
    plain = estimate_from_counts(7e9, 1e9, 8, print_table=False, stages=(3,), precisions=("bf16",)).get(3, "bf16")
    # DeepSpeed's ZeRO-Offload: only the 16-bit shards stay on the device (2 bytes per parameter / N)
    assert row.by_location()["device"]["total"] == row.params_sharded == plain.params_sharded
    assert row.host_bytes == row.master_params + row.optimizer_states + row.grads + row.host_staging
    assert row.device_bytes < plain.device_bytes and plain.host_bytes == 0


def _edits_body(offload: str, nvme_path: str):
    from zero_engine.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state, \
        safe_set_full_optimizer_state

    world = dist.get_world_size()
    batches = make_batches(MODEL, 3, world * 4)
    torch.manual_seed(0)
    engine, *_ = zero_engine.initialize(model=GPT(MODEL), config=config(3, offload, nvme_path, bf16=True))
    losses = run_steps(engine, batches[:1])
    weight = engine.module.blocks[0].mlp.fc.weight
    with zero_engine.zero.GatheredParameters(weight, modifier_rank=0):
        weight.data.mul_(0.5)  # into the shards and the fp32 masters, which are on disk under nvme
    state = safe_get_full_optimizer_state(weight, "exp_avg")
    safe_set_full_optimizer_state(weight, state * 2, "exp_avg")
    losses += run_steps(engine, batches[1:])
    out = losses, safe_get_full_fp32_param(weight), safe_get_full_optimizer_state(weight, "exp_avg_sq")
    engine.destroy()
    return out


def test_gathered_parameters_edits_and_safe_helpers_reach_nvme_states(tmp_path):
    plain = run_ranks(_edits_body, 2, "none", str(tmp_path), timeout=TIMEOUT)
    nvme = run_ranks(_edits_body, 2, "nvme", str(tmp_path), timeout=TIMEOUT)
    for a, b in zip(plain, nvme):
        assert a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])


def _state_dict_body(offload: str, nvme_path: str):
    torch.manual_seed(0)
    engine, *_ = zero_engine.initialize(model=GPT(MODEL), config=config(2, offload, nvme_path, bf16=True))
    run_steps(engine, make_batches(MODEL, 1, dist.get_world_size() * 4))
    state = engine.optimizer.state_dict()
    engine.optimizer.load_state_dict(state)  # a round trip through the files changes nothing
    again = engine.optimizer.state_dict()
    engine.destroy()
    return state, again


def test_optimizer_state_dict_under_nvme_is_the_same_as_without(tmp_path):
    plain, _ = run_ranks(_state_dict_body, 1, "none", str(tmp_path), timeout=TIMEOUT)[0]
    nvme, again = run_ranks(_state_dict_body, 1, "nvme", str(tmp_path), timeout=TIMEOUT)[0]
    for sd in (nvme, again):
        assert sd["state"].keys() == plain["state"].keys()
        for k, entry in plain["state"].items():
            for name, value in entry.items():
                assert torch.equal(sd["state"][k][name], value), (k, name)


def _branch_body(offload: str, nvme_path: str, stage: int):
    """A module used on rank 0 only (stages 1-2: at stage 3 the engine refuses different module orders)."""
    import dataclasses

    cfg_model = dataclasses.replace(MODEL, optional_branch=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = config(stage, offload, nvme_path, bf16=True)
    engine, *_ = zero_engine.initialize(model=GPT(cfg_model), config=cfg)
    losses = []
    for x, y in make_batches(cfg_model, 2, world * 2):
        loss = engine(x[rank * 2: rank * 2 + 2], y[rank * 2: rank * 2 + 2], use_branch=rank == 0)
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    out = losses, gathered_params(engine)
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_a_module_used_on_some_ranks_only_trains_the_same_with_offload(stage, tmp_path):
    plain = run_ranks(_branch_body, 2, "none", str(tmp_path), stage, timeout=TIMEOUT)
    for offload in ("cpu", "nvme"):
        got = run_ranks(_branch_body, 2, offload, str(tmp_path), stage, timeout=TIMEOUT)
        for a, b in zip(plain, got):
            assert_same(a, b, f"{offload}: branch on rank 0 only")
