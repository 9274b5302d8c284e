"""Parameter offload to NVMe (issue 13, ZeRO-Infinity): the stage-3 compute shards live in per-rank files and are
read ahead of their all-gathers along the coordinator's trace (zero_engine/offload/param_swap.py), on simulated ranks.

Parity is bitwise: the swap moves the shard bytes to a file and back unchanged, so losses and parameters must equal
those without offload exactly, in fp32 and bf16, with both gather strategies, and together with optimizer offload.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import zero_engine
from zero_engine.testing import run_ranks
from zero_engine.testing.models import GPT, make_batches

from offload_common import (MODEL, accelerator_code_path, assert_same, checkpoint_body, gathered_params,
                            run_steps)

TIMEOUT = 90


def config(param: str = "none", nvme_path: str | None = None, bf16: bool = False, sequential: bool = False,
           optimizer: str = "none", **param_knobs) -> dict:
    zero = {"stage": 3, "reduce_bucket_size": 700, "stage3_prefetch_bucket_size": 3000,
            "stage3_param_persistence_threshold": 40, "sub_group_size": 900,
            "stage3_allgather_sequential": sequential}
    if param == "nvme":
        # small buckets (buffer_size) so that the model is several swap units and read-ahead has work to do
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_size": 1200,
                                 "buffer_count": 2, **param_knobs}
    if optimizer == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 3,
                                     "pipeline_read": True, "pipeline_write": True}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}, "zero_optimization": zero}
    if bf16:
        cfg["bf16" if bf16 is True else bf16] = {"enabled": True}  # bf16=True, or "fp16"
        if bf16 == "fp16":
            cfg["fp16"]["initial_scale_power"] = 8  # a few overflowing (skipped) steps, most applied
    return cfg


def _eval_loss(engine, batch) -> float:
    """An evaluation forward between steps: no trace followed, shards read on demand."""
    engine.eval()
    with torch.no_grad():
        loss = engine(*batch).float().item()
    engine.train()
    return loss


def _train(cfg: dict, steps: int = 3):
    torch.manual_seed(0)
    engine, *_ = zero_engine.initialize(model=GPT(MODEL), config=cfg)
    batches = make_batches(MODEL, steps, dist.get_world_size() * 4)
    losses = run_steps(engine, batches[:1])
    demand_after_first = engine.param_swapper.demand_reads if engine.param_swapper is not None else 0
    losses.append(_eval_loss(engine, batches[0]))
    demand_after_eval = engine.param_swapper.demand_reads if engine.param_swapper is not None else 0
    losses += run_steps(engine, batches[1:])
    stats = engine.memory_stats()
    swapper = engine.param_swapper
    info = {}
    if swapper is not None:
        info = {"run_dir": swapper.store.run_dir, "buckets": len(swapper.slots), "reads": swapper.reads,
                "resident_between_steps": swapper.resident_numel, "peak_resident": swapper.peak_resident_numel,
                "resident_buckets": sum(s.resident for s in swapper.slots), "buffer_count": swapper.read_ahead,
                "demand_reads": swapper.demand_reads, "writes": swapper.writes,
                "demand_reads_after_first_step": demand_after_first, "demand_reads_after_eval": demand_after_eval,
                "max_in_cpu": swapper.max_in_cpu, "shard_numel": sum(s.numel for s in swapper.slots),
                "prefetches": engine.coordinator.prefetch_count}
    params = gathered_params(engine)
    engine.destroy()
    if swapper is not None:
        info["files_left"] = os.path.exists(info["run_dir"])
    return losses, params, stats, info


def _parity_body(bf16: bool, sequential: bool, nvme_path: str, optimizer: str):
    off = _train(config(bf16=bf16, sequential=sequential))
    nvme = _train(config("nvme", nvme_path, bf16=bf16, sequential=sequential, optimizer=optimizer))
    return off, nvme


@pytest.mark.parametrize("world,bf16,sequential", [
    (1, False, False), (1, True, True), (2, False, False), (2, True, False), (2, False, True), (2, True, True),
    (3, True, False),  # padded shards
    (2, "fp16", False),  # dynamic loss scale: a skipped step updates nothing, so nothing is written back
])
def test_param_nvme_offload_matches_no_offload_bitwise(world, bf16, sequential, tmp_path):
    results = run_ranks(_parity_body, world, bf16, sequential, str(tmp_path), "none", timeout=TIMEOUT)
    for off, nvme in results:
        assert_same(off, nvme, f"world {world} bf16={bf16} sequential={sequential}")
        info = nvme[3]
        assert info["buckets"] > 2, info  # the model is several swap units
        # read ahead along the trace: after the first (recording) step no gather or update waits for a read it
        # had to start itself, except in the evaluation forward (it follows no trace) and the first gather after
        # it (the evaluation freed the read-ahead)
        assert info["demand_reads_after_eval"] > info["demand_reads_after_first_step"] > 0, info
        assert info["demand_reads"] - info["demand_reads_after_eval"] <= 1, info
        # between steps only the next forward's read-ahead is in memory (buffer_count buckets)
        assert 0 < info["resident_buckets"] <= info["buffer_count"], info
        assert info["resident_between_steps"] < info["shard_numel"], info
        assert not info["files_left"], "NVMe files left after engine.destroy()"
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


@pytest.mark.parametrize("bf16", [False, True])
def test_param_and_optimizer_nvme_offload_together_match_bitwise(bf16, tmp_path):
    for off, nvme in run_ranks(_parity_body, 2, bf16, False, str(tmp_path), "nvme", timeout=TIMEOUT):
        assert_same(off, nvme, f"param + optimizer nvme offload, bf16={bf16}")
        assert nvme[2]["by_location"]["nvme"]["optimizer_states"] > 0
        assert not nvme[3]["files_left"]
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


def _read_ahead_body(nvme_path: str, max_in_cpu: int):
    off = _train(config(bf16=True))
    nvme = _train(config("nvme", nvme_path, bf16=True, max_in_cpu=max_in_cpu, buffer_count=3))
    return off, nvme


def test_max_in_cpu_smaller_than_the_model_trains_bitwise_the_same(tmp_path):
    """max_in_cpu below the shards of one rank: read-ahead stops at the limit, what a gather needs is read anyway."""
    for off, nvme in run_ranks(_read_ahead_body, 2, str(tmp_path), 1500, timeout=TIMEOUT):
        assert_same(off, nvme, "max_in_cpu=1500")
        info = nvme[3]
        assert info["shard_numel"] > 2 * info["max_in_cpu"], info
        assert info["peak_resident"] < info["shard_numel"], info  # never the whole model in memory
        assert info["prefetches"] > 0


def _stats_body(nvme_path: str):
    torch.manual_seed(0)
    engine, *_ = zero_engine.initialize(model=GPT(MODEL), config=config("nvme", nvme_path, bf16=True))
    run_steps(engine, make_batches(MODEL, 1, dist.get_world_size() * 4))
    stats = engine.memory_stats()
    shard_bytes = sum(sp.shard_numel * sp.shard.element_size() for sp in engine.sharded)
    resident = engine.param_swapper.resident_bytes
    engine.destroy()
    return stats, shard_bytes, resident


def test_memory_stats_report_the_shards_on_nvme(tmp_path):
    for stats, shard_bytes, resident in run_ranks(_stats_body, 2, str(tmp_path), timeout=TIMEOUT):
        where = stats["by_location"]
        assert where["nvme"]["params_sharded"] == shard_bytes
        assert where["device"]["params_sharded"] == 0 and where["host"]["params_sharded"] == 0
        assert where["nvme"]["files"] == shard_bytes  # the optimizer keeps its states in memory here
        # in memory between steps: the read-ahead of the next forward's first buckets, reported as swap buffers
        assert 0 < resident < shard_bytes and where["host"]["swap_buffers"] == resident


@pytest.mark.parametrize("save,load,bf16", [("nvme", "none", True), ("none", "nvme", True), ("nvme", "nvme", False)])
def test_checkpoint_moves_between_param_offload_and_none_with_bitwise_resume(save, load, bf16, tmp_path):
    nvme = str(tmp_path / "nvme")
    os.makedirs(nvme)
    results = run_ranks(checkpoint_body, 2, config(save, nvme, bf16=bf16), config(load, nvme, bf16=bf16),
                        str(tmp_path / "ckpt"), timeout=TIMEOUT)
    for after_save, resumed in results:
        assert_same(after_save, resumed, f"saved with param offload {save}, loaded with {load}")
    assert os.listdir(nvme) == []


def _gathered_parameters_body(nvme_path: str):
    """GatheredParameters reads a swapped-out shard (read in for its gather) and keeps a modifier's edit."""
    torch.manual_seed(0)
    engine, *_ = zero_engine.initialize(model=GPT(MODEL), config=config("nvme", nvme_path))
    run_steps(engine, make_batches(MODEL, 1, dist.get_world_size() * 4))
    weight = engine.module.lm_head.weight if hasattr(engine.module, "lm_head") else next(engine.module.parameters())
    with zero_engine.zero.GatheredParameters(weight):
        before = weight.detach().clone()
    with zero_engine.zero.GatheredParameters(weight, modifier_rank=0):
        weight.data.add_(1.0)
    with zero_engine.zero.GatheredParameters(weight):
        after = weight.detach().clone()
    run_steps(engine, make_batches(MODEL, 1, dist.get_world_size() * 4))  # training goes on from the edit
    resident = sum(s.resident for s in engine.param_swapper.slots), engine.param_swapper.read_ahead
    engine.destroy()
    return before, after, resident


def test_gathered_parameters_reads_and_edits_offloaded_shards(tmp_path):
    for before, after, resident in run_ranks(_gathered_parameters_body, 2, str(tmp_path), timeout=TIMEOUT):
        assert before.numel() > 0 and torch.equal(after, before + 1.0)
        buckets, buffer_count = resident
        assert buckets <= buffer_count  # what GatheredParameters read was given back by the next step


def test_config_needs_a_path_for_nvme():
    from zero_engine.config import load_config
    from zero_engine.errors import ConfigError

    with pytest.raises(ConfigError, match="nvme_path"):
        load_config(config("nvme", None), world_size=1)


def _model16_body(cfg: dict, out: str):
    torch.manual_seed(0)
    engine, *_ = zero_engine.initialize(model=GPT(MODEL), config=cfg)
    run_steps(engine, make_batches(MODEL, 1, dist.get_world_size() * 4))
    engine.save_16bit_model(out)
    engine.destroy()


def test_save_16bit_model_reads_offloaded_shards(tmp_path):
    """save_16bit_model gathers outside the coordinator: the shards are read in for it, and the file is the same."""
    files = {}
    for param in ("none", "nvme"):
        cfg = config(param, str(tmp_path), bf16=True)
        cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
        run_ranks(_model16_body, 2, cfg, str(tmp_path / param), timeout=TIMEOUT)
        files[param] = torch.load(tmp_path / param / "pytorch_model.bin")
    assert files["none"].keys() == files["nvme"].keys()
    for name in files["none"]:
        assert torch.equal(files["none"][name], files["nvme"][name]), name


# ---- the swapper on its own (no engine, one process) -------------------------------------------------------------
def _swapper(tmp_path, **knobs):
    from types import SimpleNamespace

    from zero_engine.offload.param_swap import ParamSwapper
    from zero_engine.zero.partition import ShardedParam, flatten_shards

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (300, 200, 500, 100, 400)]
    sharded = [ShardedParam(p, f"p{i}", i, rank=0, world_size=1) for i, p in enumerate(params)]
    for sp in sharded:
        sp.release()
    buckets = flatten_shards([[sp] for sp in sharded], 500)  # [300, 200] [500] [100, 400]
    offload = SimpleNamespace(nvme_path=str(tmp_path), max_in_cpu=knobs.get("max_in_cpu", 10**9),
                              buffer_count=knobs.get("buffer_count", 2))
    values = [sp.shard.clone() for sp in sharded]
    swapper = ParamSwapper(buckets, offload, rank=0)
    swapper.start()
    return swapper, sharded, values


def _storage_bytes(sp) -> int:
    return sp.bucket.flat.untyped_storage().nbytes()


def test_swapper_frees_reads_back_and_writes_updates(tmp_path):
    swapper, sharded, values = _swapper(tmp_path)
    assert [len(s.bucket.params) for s in swapper.slots] == [2, 1, 2]
    assert all(_storage_bytes(sp) == 0 for sp in sharded) and swapper.resident_numel == 0
    assert swapper.file_bytes() == sum(v.numel() * 4 for v in values)
    swapper.ensure_in(sharded[3:4])  # one bucket on demand: the same values, the others stay out
    assert torch.equal(sharded[3].shard, values[3]) and torch.equal(sharded[4].shard, values[4])
    assert _storage_bytes(sharded[0]) == 0 and swapper.demand_reads == 1
    swapper.after_fetch([sharded[0:1], sharded[2:3]])  # read ahead 2 buckets (buffer_count), free the unneeded one
    assert [s.resident for s in swapper.slots] == [True, True, False]

    def update(group):  # an optimizer sub-group updating its shards in place
        for sp in group:
            sp.shard.add_(1.0)
    update_in_memory = swapper.around_update(update, [sharded[:3], sharded[3:]])
    update_in_memory(sharded[:3])
    update_in_memory(sharded[3:])
    swapper.after_step()
    assert swapper.resident_numel == 0 and swapper.demand_reads == 1  # the second sub-group's bucket: read ahead
    swapper.close()  # reads everything back, removes the files
    for sp, value in zip(sharded, values):
        assert torch.equal(sp.shard, value + 1.0), sp.fqn
    assert os.listdir(tmp_path) == []


def test_swapper_max_in_cpu_bounds_read_ahead_and_evicts(tmp_path):
    swapper, sharded, values = _swapper(tmp_path, max_in_cpu=600, buffer_count=3)
    swapper.after_fetch([sharded])  # window: the first bucket (500) fits, the second would pass 600
    assert [s.resident for s in swapper.slots] == [True, False, False]
    swapper.ensure_in(sharded[3:])  # on demand: the first bucket (not in use) is freed to make room
    assert [s.resident for s in swapper.slots] == [False, False, True] and swapper.resident_numel == 500
    swapper.ensure_in(sharded)  # more than max_in_cpu at once: read anyway
    assert swapper.resident_numel == 1500
    for sp, value in zip(sharded, values):
        assert torch.equal(sp.shard, value)
    swapper.close()


def test_swapper_refuses_shards_off_the_cpu(tmp_path):
    """The accelerator path (device<->host copies around the files) is not written: refused by name, not wrong."""
    from types import SimpleNamespace

    from zero_engine.offload.param_swap import ParamSwapper
    from zero_engine.zero.partition import ShardedParam, flatten_shards

    sp = ShardedParam(torch.nn.Parameter(torch.empty(64, device="meta")), "w", 0, rank=0, world_size=1)
    offload = SimpleNamespace(nvme_path=str(tmp_path), max_in_cpu=10**9, buffer_count=2)
    with pytest.raises(NotImplementedError, match="offload_param.device=nvme"):
        ParamSwapper(flatten_shards([[sp]], 100), offload, rank=0)
    assert os.listdir(tmp_path) == []


# ---- offload_param: {device: cpu} ------------------------------------------------------------------------------------

def cpu_config(param: str, bf16: bool) -> dict:
    cfg = config(bf16=bf16)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if param == "cpu":
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    return cfg


def _host_path_body(bf16: bool):
    """The accelerator's code path of offload_param cpu (host shards, device copies per gather) on a CPU-only machine:
    Placement says host and device are separate, so the buckets are rebound to host tensors and every gather reads
    fresh copies of them."""
    off = _train(cpu_config("none", bf16))
    with accelerator_code_path():
        torch.manual_seed(0)
        engine, *_ = zero_engine.initialize(model=GPT(MODEL), config=cpu_config("cpu", bf16))
        host = engine.host_params
        flats = [b.flat for b in host.buckets]  # the host tensors the buckets were rebound to at initialize
        batches = make_batches(MODEL, 3, dist.get_world_size() * 4)  # the sequence _train runs
        losses = run_steps(engine, batches[:1]) + [_eval_loss(engine, batches[0])] + run_steps(engine, batches[1:])
        bound_to_host = all(b.flat is flat for b, flat in zip(host.buckets, flats)) and all(
            sp.shard.untyped_storage().data_ptr() == sp.bucket.flat.untyped_storage().data_ptr()
            for sp in engine.sharded)
        copied = host.copied_bytes
        params = gathered_params(engine)
        engine.destroy()
    return off, (losses, params), bound_to_host, copied, host.host_bytes


@pytest.mark.parametrize("bf16", [False, True])
def test_param_cpu_offload_accelerator_path_matches_bitwise(bf16):
    for off, host, bound, copied, host_bytes in run_ranks(_host_path_body, 2, bf16, timeout=TIMEOUT):
        assert_same(off, host, f"offload_param cpu (accelerator path on the CPU), bf16={bf16}")
        assert bound and host_bytes > 0
        assert copied > 3 * host_bytes  # every step's gathers read device copies of the host shards


def test_param_cpu_offload_on_a_cpu_only_run_is_logged_once(caplog):
    from zero_engine.config import load_config
    from zero_engine.offload.placement import Placement

    zc = load_config(cpu_config("cpu", True), world_size=1).zero_optimization
    placement = Placement.from_config(zc, torch.device("cpu"))
    assert placement.params == "host" and not placement.has_separate_host and not placement.pins_params
    caplog.set_level("INFO", logger="zero_engine.offload")
    placement.log_once(0)
    text = caplog.text
    assert text.count("offload_param device cpu: parameters already live in host memory on this CPU-only run") == 1
    assert "compute shards: host" in text and "offload_param.pin_memory ignored (no accelerator)" in text


def test_param_cpu_offload_without_optimizer_offload_is_refused_on_an_accelerator():
    from zero_engine.offload.param_host import HostShards

    with pytest.raises(NotImplementedError, match="needs offload_optimizer.device cpu or nvme"):
        HostShards([], torch.device("cuda"), pin_memory=False, offloads_optimizer=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: host parameter shards copied to the device")
def test_cuda_param_cpu_offload_keeps_shards_on_the_host():
    results = run_ranks(_cuda_body, 1, timeout=TIMEOUT)[0]
    (plain_losses, plain_params), (losses, params, on_host, pinned) = results
    assert on_host and pinned
    assert plain_losses == losses
    for name in plain_params:
        assert torch.equal(plain_params[name], params[name]), name


def _cuda_body():
    out = []
    for param in ("none", "cpu"):
        torch.manual_seed(0)
        engine, *_ = zero_engine.initialize(model=GPT(MODEL), config=cpu_config(param, bf16=True))
        losses = []
        for x, y in make_batches(MODEL, 3, 2):
            loss = engine(x.cuda(), y.cuda())
            engine.backward(loss)
            engine.step()
            losses.append(loss.float().item())
        params = {sp.fqn: sp.shard.detach().cpu().clone() for sp in engine.sharded}
        if param == "none":
            out.append((losses, params))
        else:
            sp = engine.sharded[0]
            out.append((losses, params, sp.shard.device.type == "cpu", sp.shard.is_pinned()))
        engine.destroy()
    return out


# ---- the LR schedule ------------------------------------------------------------------------------------------------

def _scheduler_body(nvme_path: str):
    out = []
    for param in ("none", "nvme"):
        cfg = config(param, nvme_path)
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                           "warmup_num_steps": 10, "warmup_type": "linear"}}
        torch.manual_seed(0)
        engine, *_ = zero_engine.initialize(model=GPT(MODEL), config=cfg)
        lrs, losses = [], []
        for batch in make_batches(MODEL, 3, dist.get_world_size() * 4):
            losses += run_steps(engine, [batch])  # two micro-steps, one update
            lrs.append(engine.get_lr()[0])
        out.append((lrs, losses))
        engine.destroy()
    return out


def test_lr_schedule_steps_with_and_without_param_offload(tmp_path):
    """The scheduler steps once per applied update whether or not the parameter swapper is on (an earlier version
    of the swap hook in engine.step had captured the scheduler step under `if param_swapper`)."""
    for (lrs, losses), (nvme_lrs, nvme_losses) in run_ranks(_scheduler_body, 2, str(tmp_path), timeout=TIMEOUT):
        assert lrs[0] < lrs[1] < lrs[2], lrs
        assert (lrs, losses) == (nvme_lrs, nvme_losses)


def _corrupted_swap_body(nvme_path: str, checksum: bool):
    """Train one step with parameters and optimizer states on NVMe, overwrite every swap file of this rank with
    random bytes of the same size, train on: the next read of a swap file must raise, naming the file."""
    from zero_engine.offload.nvme import NvmeError

    cfg = {**config("nvme", nvme_path, optimizer="nvme"), "aio": {"checksum": checksum}}
    torch.manual_seed(0)
    engine, *_ = zero_engine.initialize(model=GPT(MODEL), config=cfg)
    batches = make_batches(MODEL, 2, dist.get_world_size() * 4)
    run_steps(engine, batches[:1])
    stores = [engine.param_swapper.store, engine.optimizer.swapper.store]
    for store in stores:
        store.wait_all()
    corrupted = []
    for store in stores:
        for name in sorted(os.listdir(store.directory)):
            path = os.path.join(store.directory, name)
            size = os.path.getsize(path)
            with open(path, "r+b") as f:
                f.write(os.urandom(size))
            corrupted.append(path)
    try:
        outcome = run_steps(engine, batches[1:])
    except NvmeError as error:
        outcome = str(error)
    try:
        engine.destroy()
    except NvmeError:
        pass  # with checksums, destroy() cannot read the corrupt shards back either (and says so)
    return outcome, corrupted, [os.path.exists(s.run_dir) for s in stores]


def test_swap_files_overwritten_on_disk_raise_naming_the_file(tmp_path):
    """Issue 20, item 7: random bytes in a rank's swap files gave NaN losses and exit 0."""
    message, corrupted, left = run_ranks(_corrupted_swap_body, 1, str(tmp_path), True, timeout=TIMEOUT)[0]
    assert isinstance(message, str) and "is corrupt" in message, message
    assert any(f"{path} is corrupt" in message for path in corrupted), (message, corrupted)
    assert left == [False, False], "swap files left after destroy()"
    # aio.checksum: false acts: nothing checks, the garbage is trained on
    (tmp_path / "off").mkdir()
    losses, _, _ = run_ranks(_corrupted_swap_body, 1, str(tmp_path / "off"), False, timeout=TIMEOUT)[0]
    assert isinstance(losses, list), losses
