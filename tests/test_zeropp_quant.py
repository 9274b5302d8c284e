"""ZeRO++ qwZ (int8 weight gathers) and qgZ (int4 gradient all-to-all): zero_engine/zero/quantize.py.

Bodies named ``_*_body`` run on every rank of the simulated world (module level, so the rank pool imports them).

Tolerances. The kernels are checked against their exact bound: every dequantized element is within half a step
(``max|block| / (2 qmax)``) of its value. Training changes numerics, so parity with one process (world 4, AdamW
lr 1e-3, 4 steps of 2 micro-steps, clipping 1.0) is stated against what the quantization can do; the exact engine
runs beside it on the same data (it stays within 1e-5 / 2e-4, as test_mesh.py states):

* qwZ: forward and backward compute with weights within 1/254 of their block's largest magnitude (the masters stay
  exact, so the error does not accumulate): the loss moves by ~1e-4 relative and the gradients by ~0.4%. AdamW
  normalises each element's step, so an element whose gradient is smaller than that perturbation may step
  differently: measured 5e-5 (loss) and 1.7e-3 (parameters, relative L2); stated 5e-4 and 5e-3.
* qgZ: each rank's gradient within 1/14 of its block's largest magnitude before the average (~8% relative L2 per
  rank, ~4% after averaging 4 independent roundings), so more elements step differently: measured 2e-4 (loss) and
  7.6e-3 (parameters); stated 2e-3 and 2e-2. hpZ 2 + qwZ + qgZ together: measured 1.8e-4 and 7.5e-3, same bound.
A run that ignored the quantization would pass these bounds too, so each test also asserts that the quantized run
differs from the exact one and that the collectives moved the quantized kinds.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zero_engine
from zero_engine.config import ConfigError, load_config
from zero_engine.testing import run_ranks
from zero_engine.testing.loop import resume_in_new_engine, train_global_batch
from zero_engine.testing.models import GPT, GPTConfig, make_batches
from zero_engine.testing.shards import gathered_params, whole_from_shards
from zero_engine.utils import safe_get_full_fp32_param
from zero_engine.zero import GatheredParameters
from zero_engine.zero.partition import sharded_param_of
from zero_engine.zero.quantize import (BLOCK, dequantize, dequantize_shards, payload_bytes, quantize,
                                       quantize_shards)

from session_run import run_in_session

TIMEOUT = 120
WORLD = 4
REPO = Path(__file__).resolve().parents[1]


# ---- the kernels ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [1, 255, 256, 1000, 4097])
def test_round_trip_is_within_half_a_step_of_each_block(bits, numel):
    torch.manual_seed(numel)
    x = torch.randn(3, numel) * torch.rand(3, numel) * 5  # heavy-tailed, as gradients are
    payload = quantize(x.bfloat16(), bits)
    assert payload.dtype == torch.uint8 and payload.shape == (3, payload_bytes(numel, bits))
    y = dequantize(payload, numel, bits)
    blocks = math.ceil(numel / BLOCK)
    padded = torch.nn.functional.pad(x.bfloat16().float(), (0, blocks * BLOCK - numel))
    half_step = padded.view(3, blocks, BLOCK).abs().amax(2) / (2 ** (bits - 1) - 1) / 2
    bound = half_step.repeat_interleave(BLOCK, 1)[:, :numel]
    exact = x.bfloat16().float()
    assert ((y - exact).abs() <= bound + 1e-6 * exact.abs()).all()  # + fp32 rounding of q * scale
    # bytes: values (bits / 8 each, the last block's padding not sent) + one fp32 scale per block
    assert payload_bytes(numel, bits) == math.ceil(numel * bits / 8) + 4 * blocks


def test_zeros_stay_exact_and_non_finite_values_stay_non_finite():
    assert dequantize(quantize(torch.zeros(2, 300), 4), 300, 4).abs().max() == 0
    x = torch.randn(1, 3 * BLOCK)
    x[0, 3], x[0, BLOCK + 7] = float("inf"), float("nan")
    y = dequantize(quantize(x, 4), 3 * BLOCK, 4)
    # a block with inf/nan dequantizes to non-finite values (the engine's overflow check sees them); others exact-ish
    assert not torch.isfinite(y[0, :2 * BLOCK]).any() and torch.isfinite(y[0, 2 * BLOCK:]).all()


def test_shards_quantized_together_read_as_each_quantized_alone():
    """[Note: a shard's blocks are its own]: a shard's values do not depend on its neighbours in one gather, and the
    bytes are those of each shard alone (the blocks' padding is not sent)."""
    g = torch.Generator().manual_seed(0)
    shards = [torch.randn(n, generator=g) * scale for n, scale in ((300, 1.0), (40, 100.0), (256, 0.01), (1, 3.0))]
    together = quantize_shards(shards)
    assert together.shape == (1, sum(payload_bytes(t.numel(), 8) for t in shards))
    for shard, value in zip(shards, dequantize_shards(together, [t.numel() for t in shards])):
        alone = dequantize(quantize(shard.view(1, -1), 8), shard.numel(), 8)
        assert torch.equal(value, alone)
    assert torch.equal(quantize_shards(shards[:1]), quantize(shards[0].view(1, -1), 8))  # one shard: quantize's row
    # one row whose scales start at an offset not a multiple of 4 (a gather's last rank, or a shard of more than
    # _DEQUANTIZE_CHUNK elements dequantized a row at a time): read through an aligned copy
    assert together.shape[1] % 4 != 0
    odd = torch.randn(1, 41, generator=g)
    assert (dequantize(quantize(odd, 8), 41, 8) - odd).abs().max() <= odd.abs().max() / 254 + 1e-7


def test_int4_packs_two_values_a_byte_and_int8_halves_bf16():
    n = 1 << 16
    assert payload_bytes(n, 8) / (2 * n) == pytest.approx(0.5078, abs=1e-4)  # qwZ vs a bf16 gather
    assert payload_bytes(n, 4) / (4 * n) == pytest.approx(0.1289, abs=1e-4)  # qgZ vs an fp32 reduce-scatter
    assert payload_bytes(n, 4) / (2 * n) == pytest.approx(0.2578, abs=1e-4)  # qgZ vs a bf16 reduce-scatter


# ---- the communicator's all-to-all (qgZ's collective) -------------------------------------------------------------------
def _all_to_all_body():
    from zero_engine.comm import Communicator

    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    send = torch.arange(world * 2, dtype=torch.float32) + 100 * rank  # chunk j (2 elements) goes to rank j
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send, async_op=True, name="probe").wait()
    expected = torch.cat([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 100 * r for r in range(world)])
    return torch.equal(recv, expected), comm.stats()["all_to_all"]


def test_all_to_all_single_exchanges_chunks_and_counts_the_input():
    for same, counted in run_ranks(_all_to_all_body, 3, timeout=TIMEOUT):
        assert same and counted == {"calls": 1, "bytes": 3 * 2 * 4}


# ---- parity with one process --------------------------------------------------------------------------------------------
def ds_config(gas=2, micro=2, lr=1e-3, **zero):
    zero_section = {"stage": 3, "reduce_bucket_size": 700, "stage3_prefetch_bucket_size": 3000,
                    "stage3_param_persistence_threshold": 40, "stage3_max_reuse_distance": 2000,
                    "overlap_comm": True, **zero}
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.1}},
            "zero_optimization": zero_section}




def _parity_body(zero):
    """One-process AdamW on the full batch against the engine with ``zero`` (and the exact engine beside it)."""
    world = dist.get_world_size()
    cfg = GPTConfig(frozen_param=True, reuse_block=True)
    results = {}
    for name, extra in (("exact", {}), ("quantized", zero)):
        torch.manual_seed(0)
        model = GPT(cfg)
        reference = copy.deepcopy(model)
        config = ds_config(**extra)
        engine, *_ = zero_engine.initialize(model=model, config=config)
        params = [p for p in reference.parameters() if p.requires_grad]
        ref_opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
        worst_loss = 0.0
        for x, y in make_batches(cfg, 4, world * 2 * 2):
            ref_opt.zero_grad()
            ref_loss = reference(x, y)
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            ref_opt.step()
            ours = train_global_batch(engine, x, y, 2, 2)
            worst_loss = max(worst_loss, abs(ours - ref_loss.item()) / abs(ref_loss.item()))
        ours, ref = whole_from_shards(engine), dict(reference.named_parameters())
        diff = sum((ours[n] - ref[n].detach()).pow(2).sum() for n in ours).sqrt()
        norm = sum(ref[n].detach().pow(2).sum() for n in ours).sqrt()
        results[name] = (worst_loss, (diff / norm).item(), ours, engine.comm_stats())
        engine.destroy()
    moved = max((results["exact"][2][n] - results["quantized"][2][n]).abs().max().item() for n in results["exact"][2])
    return {name: r[:2] for name, r in results.items()}, moved, results["quantized"][3]


@pytest.mark.parametrize("zero,loss_tol,param_tol", [
    ({"zero_quantized_weights": True}, 5e-4, 5e-3),
    ({"zero_quantized_gradients": True}, 2e-3, 2e-2),
    ({"zero_quantized_weights": True, "zero_quantized_gradients": True, "zero_hpz_partition_size": 2}, 2e-3, 2e-2),
], ids=["qwZ", "qgZ", "hpZ2+qwZ+qgZ"])
def test_parity_with_one_process_within_the_stated_tolerance(zero, loss_tol, param_tol):
    for errors, moved, stats in run_ranks(_parity_body, WORLD, zero, timeout=TIMEOUT):
        (exact_loss, exact_param), (loss_err, param_err) = errors["exact"], errors["quantized"]
        assert exact_loss < 1e-5 and exact_param < 2e-4, errors["exact"]  # the engine itself is exact
        assert loss_err < loss_tol and param_err < param_tol, errors
        assert moved > 0  # the quantized run really is another run
        if zero.get("zero_quantized_gradients"):
            assert stats["reduce_scatter"]["calls"] == 0 and stats["all_to_all"]["calls"] > 0
        else:
            assert stats["all_to_all"]["calls"] == 0


# ---- bytes per step --------------------------------------------------------------------------------------------------
def _bytes_body():
    """One optimizer step (2 micro-steps) of a bf16 model, exact and with qwZ + qgZ, bytes per kind."""
    cfg = GPTConfig()
    out = {}
    for name, extra in (("exact", {}), ("quantized", {"zero_quantized_weights": True,
                                                       "zero_quantized_gradients": True})):
        torch.manual_seed(0)
        config = {**ds_config(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=10**6, **extra),
                  "bf16": {"enabled": True}}
        engine, *_ = zero_engine.initialize(model=GPT(cfg), config=config)
        rank, world = dist.get_rank(), dist.get_world_size()
        for step in range(2):
            engine.reset_comm_stats()
            for x, y in make_batches(cfg, 2, world * 2, seed=step):
                engine.backward(engine(x[rank * 2: rank * 2 + 2], y[rank * 2: rank * 2 + 2]))
                engine.step()
        gathered = [sp for sp in engine.sharded if not sp.is_persistent]
        out[name] = (engine.comm_stats(), [sp.shard_numel for sp in gathered],
                     sum(sp.padded_numel * 2 for sp in engine.sharded if sp.is_persistent),
                     [b.per_rank for b in engine.reducer.buckets])
        engine.destroy()
    return out


def test_qwz_gathers_int8_and_scales_and_qgz_reduces_int4():
    for out in run_ranks(_bytes_body, WORLD, timeout=TIMEOUT):
        exact, _, persistent, _ = out["exact"]
        stats, shard_numels, persistent_q, per_rank = out["quantized"]
        assert persistent == persistent_q
        # qwZ: one run (the prefetch bucket covers every unit's small parameters), 4 gathers a step (2 micro-steps x
        # forward + backward) of int8 + one fp32 scale per 256 elements, plus the exact refresh of the persistent ones
        int8 = stats["all_gather"]["bytes"] - persistent
        bf16 = exact["all_gather"]["bytes"] - persistent
        assert 0.49 < int8 / bf16 < 0.55, (int8, bf16)
        assert int8 % WORLD == 0
        # qgZ: every bucket's row of int4 + scales, 2 micro-steps; the exact run reduce-scatters fp32 gradients
        assert stats["all_to_all"]["bytes"] == 2 * sum(WORLD * payload_bytes(n, 4) for n in per_rank)
        assert stats["reduce_scatter"]["bytes"] == 0
        ratio = stats["all_to_all"]["bytes"] / exact["reduce_scatter"]["bytes"]
        assert ratio <= 0.25, ratio  # "/ 4 or better" against the fp32 reduction of bf16 gradients


# ---- config --------------------------------------------------------------------------------------------------------
def test_llava_next_zero3pp_config_loads():
    path = REPO.parent / "shared" / "dsconfigs" / "LLaVA-VL__LLaVA-NeXT__scripts__zero3pp.json"
    if not path.exists():
        pytest.skip(f"{path} not here")
    zc = load_config(json.loads(path.read_text()), world_size=16).zero_optimization
    assert (zc.zero_quantized_weights, zc.zero_quantized_gradients, zc.zero_hpz_partition_size) == (True, True, 16)


@pytest.mark.parametrize("key", ["zero_quantized_weights", "zero_quantized_gradients"])
def test_quantized_keys_need_stage_3(key):
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, key: True}}
    with pytest.raises(ConfigError, match=f"zero_optimization.{key}.*needs zero_optimization.stage 3"):
        load_config(config, world_size=2)


def test_nontrainable_weights_key_is_refused_clearly():
    config = {"train_micro_batch_size_per_gpu": 1,
              "zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}}
    with pytest.raises(ConfigError, match="zero_quantized_nontrainable_weights.*not supported yet"):
        load_config(config, world_size=2)


# ---- the demo ------------------------------------------------------------------------------------------------------
def _demo_final_loss(tmp_path, config: dict, name: str) -> float:
    (tmp_path / f"{name}.json").write_text(json.dumps(config))
    losses = tmp_path / f"{name}_losses.json"
    done = run_in_session(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD),
         "examples/train_gpt.py", "--config", str(tmp_path / f"{name}.json"), "--steps", "20", "--n-layer", "2",
         "--n-embd", "64", "--block-size", "16", "--losses", str(losses)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(losses.read_text())[-1]


def test_demo_final_loss_within_2_percent_of_unquantized(tmp_path):
    """examples/configs/zero3pp.json (hpZ 2 + qwZ + qgZ, bf16) under torchrun at world 4 on a smaller model (2
    layers, 64 wide, 16 tokens a sequence: bf16 matmuls are slow on CPUs without bf16 units, and this test took two
    minutes of the suite at 64 tokens), and the same config with both quantized keys off: the final losses within 2%
    (the issue's bar; measured 0.3% on the full demo model, docs/benchmarks.md, and 0.15% here)."""
    config = json.loads((REPO / "examples" / "configs" / "zero3pp.json").read_text())
    quantized = _demo_final_loss(tmp_path, config, "quantized")
    config["zero_optimization"].update(zero_quantized_weights=False, zero_quantized_gradients=False)
    exact = _demo_final_loss(tmp_path, config, "exact")
    assert abs(quantized - exact) / exact < 0.02, (quantized, exact)


# ---- resume ---------------------------------------------------------------------------------------------------------
def _resume_body(save_dir: str, resume: bool):
    """qwZ at world 2, 5 steps of 2 micro-steps; ``resume``: saved after step 1, loaded into an engine built from
    another seed (whose first step records the module order again, so its gathers take other runs of parameters)."""
    cfg = GPTConfig(vocab_size=97, block_size=16, n_layer=3, n_embd=33, n_head=3)
    config = ds_config(stage3_prefetch_bucket_size=10**6, stage3_param_persistence_threshold=0,
                       stage3_max_reuse_distance=0, zero_quantized_weights=True, leaf_module={"classes": ["Block"]})

    def build(seed: int):
        torch.manual_seed(seed)
        return zero_engine.initialize(model=GPT(cfg), config=config)[0]

    engine = build(0)
    batches = make_batches(cfg, 10, 2, seed=dist.get_rank())
    losses = []
    for step in range(5):
        for x, y in batches[2 * step: 2 * step + 2]:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        if resume and step == 1:
            engine = resume_in_new_engine(engine, lambda: build(1), save_dir)
    engine.destroy()
    return losses


def test_a_run_resumed_under_qwz_trains_bitwise_as_the_uninterrupted_one(tmp_path):
    """[Note: a shard's blocks are its own] in quantize.py: before, a block's scale could span two parameters, so the
    values a forward read depended on which parameters one gather took, and the resumed run (its first step records
    the trace again, gathering on demand) trained to other losses than the uninterrupted one."""
    straight = run_ranks(_resume_body, 2, str(tmp_path / "a"), False, timeout=TIMEOUT)
    resumed = run_ranks(_resume_body, 2, str(tmp_path / "b"), True, timeout=TIMEOUT)
    assert resumed == straight


def _offload_body(scratch: str, offload: str | None, precision: str):
    """qwZ at world 2, 3 steps of 2 micro-steps, the parameters' shards on the device, on the host or on NVMe."""
    cfg = GPTConfig(vocab_size=97, block_size=16, n_layer=3, n_embd=33, n_head=3, frozen_param=True)
    zero = dict(stage3_param_persistence_threshold=40, zero_quantized_weights=True)
    if offload == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": scratch, "buffer_size": 4000, "buffer_count": 5,
                                 "max_in_cpu": 20000}  # a few buckets in memory at a time: read in step after step
    elif offload == "cpu":
        zero["offload_param"] = {"device": "cpu"}
    config = ds_config(**zero)
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    torch.manual_seed(0)
    engine, *_ = zero_engine.initialize(model=GPT(cfg), config=config)
    losses = [train_global_batch(engine, x, y, 2, 2) for x, y in make_batches(cfg, 3, 8, seed=3)]
    whole = gathered_params(engine)  # reads the shards in from wherever they are
    whole.update({f"fp32/{name}": safe_get_full_fp32_param(p) for name, p in engine.module.named_parameters()
                  if p.requires_grad})
    reads = engine.param_swapper.reads if engine.param_swapper is not None else 0
    engine.destroy()
    return losses, whole, reads


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_qwz_with_parameter_offload_trains_bitwise_as_without(tmp_path, precision):
    """Offload moves the shards, not their values: qwZ quantizes the shard that the gather reads in (from NVMe, or a
    device copy of the host shards), so the losses and weights are those of qwZ with the shards on the device."""
    on_device = run_ranks(_offload_body, 2, "", None, precision, timeout=TIMEOUT)
    for offload in ("cpu", "nvme"):
        scratch = tmp_path / offload
        scratch.mkdir()
        offloaded = run_ranks(_offload_body, 2, str(scratch), offload, precision, timeout=TIMEOUT)
        for (losses, whole, reads), (expected_losses, expected, _) in zip(offloaded, on_device):
            assert reads > 20 or offload == "cpu", reads  # from the files, step after step
            assert losses == expected_losses, (offload, losses, expected_losses)
            assert all(torch.equal(whole[n], expected[n]) for n in expected), offload


def _zero_init_body(save_dir: str, use_init: bool):
    """qwZ with every parameter of the test GPT persistent but its largest: built with or without zero.Init, 4 steps
    with a save after step 1 and a load into an engine built from another seed the same way."""
    cfg = GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_embd=33, n_head=3)
    config = ds_config(stage3_param_persistence_threshold=3000, zero_quantized_weights=True)

    def build(seed: int):
        torch.manual_seed(seed)
        with zero_engine.zero.Init(config_dict_or_path=config, enabled=use_init):
            model = GPT(cfg)
        return zero_engine.initialize(model=model, config=config)[0]

    engine = build(0)
    whole_at_start = all(sp.is_available for sp in engine.sharded if sp.is_persistent)
    losses = []
    for step, (x, y) in enumerate(make_batches(cfg, 4, 2, seed=dist.get_rank())):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step == 1:
            engine = resume_in_new_engine(engine, lambda: build(1), save_dir)
    engine.destroy()
    return whole_at_start, losses


def test_persistent_parameters_are_gathered_exactly_whatever_built_the_model(tmp_path):
    """[Note: what stays exact]: a persistent parameter is whole and exact from initialize on. A model built under
    zero.Init arrives partitioned; its persistent parameters were gathered at their first use by qwZ's int8 gather,
    until the first step's exact refresh: that step, and the first after a load, read rounded weights (a resumed run
    was one fp16 rounding step off the uninterrupted one; bench/combinations.py found it)."""
    plain = run_ranks(_zero_init_body, 2, str(tmp_path / "a"), False, timeout=TIMEOUT)
    built_under_init = run_ranks(_zero_init_body, 2, str(tmp_path / "b"), True, timeout=TIMEOUT)
    assert all(whole for whole, _ in built_under_init)
    assert built_under_init == plain


class _EditsInForward(torch.nn.Module):
    """Edits two weights the engine holds gathered, int8-rounded, inside a GatheredParameters block with
    modifier_rank=0 in its forward: the tied embedding weight (kept between its two uses) and the weight of a module
    that runs later (prefetched). Each rank records whether its shards and fp32 masters changed in the edited
    elements only."""

    def __init__(self, tied: torch.nn.Parameter, later: torch.nn.Parameter):
        super().__init__()
        self.edited = [tied, later]  # plain references: only the block gathers them here
        self.lin = torch.nn.Linear(64, 64)
        self.log: list[tuple[list[str], bool]] = []

    def forward(self, h):
        sps = [sharded_param_of(w) for w in self.edited]
        if sps[0] is not None:  # the engine's model (the reference does not run this block)
            statuses = [sp.status.name for sp in sps]
            before = [(sp.shard.clone(), sp.master.detach().clone()) for sp in sps]
            value = 2.0 + len(self.log)  # far from every weight: an edit at 16 bits too
            with GatheredParameters(self.edited, modifier_rank=0), torch.no_grad():
                if dist.get_rank() == 0:
                    self.edited[0][3].fill_(value)
                    self.edited[1][0, :5].fill_(-value)
            kept = True
            for sp, (shard, master), rows in zip(sps, before, (slice(3, 4), (0, slice(0, 5)))):
                mask = torch.zeros(sp.shape, dtype=torch.bool)
                mask[rows] = True
                local = sp.local_slice()
                mask = torch.cat([mask.reshape(-1), mask.new_zeros(sp.padded_numel - sp.numel)])[local]
                n = local.stop - local.start
                edit = value if rows == slice(3, 4) else -value
                for now, then in ((sp.shard[:n], shard[:n]), (sp.master.detach()[:n], master[:n])):
                    kept &= torch.equal(now[~mask], then[~mask]) and bool((now[mask] == edit).all())
            self.log.append((statuses, kept))
        return self.lin(h)


class _TiedWithLaterLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 64)
        self.late = torch.nn.Linear(64, 64)
        self.edits = _EditsInForward(self.emb.weight, self.late.weight)
        self.head = torch.nn.Linear(64, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.late(self.edits(self.emb(idx)))).logsumexp(-1).mean()


def _edits_in_forward_body():
    torch.manual_seed(0)
    model = _TiedWithLaterLinear()
    config = ds_config(gas=1, stage3_param_persistence_threshold=0, zero_quantized_weights=True,
                       stage3_prefetch_bucket_size=100_000)
    config["bf16"] = {"enabled": True}
    engine, *_ = zero_engine.initialize(model=model, config=config)
    for _ in range(3):
        loss = engine(torch.randint(0, 50, (2, 5)))
        engine.backward(loss)
        engine.step()
    return model.edits.log


def test_an_edit_inside_a_forward_keeps_the_master_bits_of_what_it_did_not_edit():
    """Under qwZ a weight the engine gathered holds int8-rounded values: a modifier_rank block on it takes only the
    elements it edited into the shards and fp32 masters, not the rounding of the others (see [Note: edits are
    compared with what the block found] in gathered.py)."""
    for log in run_ranks(_edits_in_forward_body, 2, timeout=TIMEOUT):
        statuses = [s for step, _ in log[1:] for s in step]
        assert set(statuses) == {"AVAILABLE", "INFLIGHT"}, log  # kept and prefetched by the engine: not vacuous
        assert all(kept for _, kept in log), log


class _HalvesALaterWeight(torch.nn.Module):
    """Halves the weight of a module that runs after it, in a modifier_rank=0 block in its forward (the reference
    model halves it in place)."""

    def __init__(self, later: torch.nn.Parameter):
        super().__init__()
        self.later = [later]
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, h):
        w = self.later[0]
        with GatheredParameters(w, modifier_rank=0), torch.no_grad():
            if sharded_param_of(w) is None or dist.get_rank() == 0:
                w.mul_(0.5)
        return self.lin(h)


class _HalvingLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.late = torch.nn.Linear(16, 16)
        self.halves = _HalvesALaterWeight(self.late.weight)
        self.head = torch.nn.Linear(16, 50)

    def forward(self, idx):
        return self.head(self.late(self.halves(self.emb(idx)))).logsumexp(-1).mean()


def _edit_then_backward_body(zero: dict):
    from test_release_rule import train_beside_one_process

    torch.manual_seed(0)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0, **zero}
    losses, ref_losses, engine, reference = train_beside_one_process(_HalvingLM(), zero, 4, 50)
    ours = gathered_params(engine)
    same = all(torch.equal(ours[name], p.detach()) for name, p in reference.named_parameters())
    return losses, ref_losses, same


@pytest.mark.parametrize("zero", [{"stage3_prefetch_bucket_size": 1}, {"stage3_prefetch_bucket_size": 100_000}],
                         ids=["gathered by the block", "prefetched"])
def test_an_edit_inside_a_forward_reaches_backwards_gather_from_the_hpz_secondary(zero):
    """hpZ's backward gathers read the secondary shards a forward gather refreshed; an edit in a modifier_rank
    block between the two changes the shards, so backward must not read the copy from before it ([Note: when a
    secondary shard may be read] in hpz.py). Every rank trains on the same micro-batch (SGD, fp32): bitwise."""
    zero = {"zero_hpz_partition_size": 2, **zero}
    for losses, ref_losses, same in run_ranks(_edit_then_backward_body, 4, zero, timeout=TIMEOUT):
        assert losses == ref_losses, (losses, ref_losses)
        assert same, "parameters differ from the one-process run"
