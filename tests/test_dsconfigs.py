"""The 40 real ds_config.json files in ../shared/dsconfigs: each one's exact outcome.

A file either loads (checked at world sizes 1, 2 and 8, where its batch numbers allow -- at 16 and 32 for the MiCS
and ZeRO++ files, whose groups of 16 must divide the world -- with the resolved batch
sizes, stage, precision, optimizer, scheduler and offload devices), or fails with "not supported yet" for a feature
we lack, or -- the one real typo -- with the did-you-mean error. Two files carry no batch size at all; DeepSpeed
refuses those, and so do we (each also loads once a micro batch is added, so nothing else in it is a problem).
docs/config.md lists the same outcomes; a test keeps the two in agreement.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

import pytest

from zero_engine.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
DSCONFIGS = next(
    (path for path in (REPO.parent / "shared" / "dsconfigs", REPO / "shared" / "dsconfigs") if path.is_dir()),
    REPO.parent / "shared" / "dsconfigs",
)
DOCS = REPO / "docs" / "config.md"


class Loads(NamedTuple):
    batch: dict[int, tuple[int, int, int]]  # world size -> (train, micro, gas)
    stage: int
    precision: str  # "fp16" | "bf16" | "fp32"
    optimizer: str | None
    scheduler: str | None
    offload: tuple[str, str]  # (offload_param, offload_optimizer) device, "-" when absent


class Fails(NamedTuple):
    kind: str  # "not supported yet" | "did you mean" | "no batch size"
    message: str  # exact start of the error message
    loads_with: dict | None = None  # keys that make it load (files without any batch size)


AUTO_BATCH = {1: (8, 8, 1), 2: (16, 8, 1), 8: (64, 8, 1)}  # all "auto": HF's micro 8, accumulation 1


def per_rank(train: int) -> dict[int, tuple[int, int, int]]:
    """Only train_batch_size (and accumulation 1) given: the micro batch is train / world."""
    return {world: (train, train // world, 1) for world in (1, 2, 8)}


def micro_only(micro: int) -> dict[int, tuple[int, int, int]]:
    return {world: (micro * world, micro, 1) for world in (1, 2, 8)}


def nsy(message: str) -> Fails:
    return Fails("not supported yet", message)


EXPECTED: dict[str, Loads | Fails] = {
    "CarperAI__trlx__examples__summarize_rlhf__sft__ds_config_gptj.json":
        Loads(per_rank(128), 2, "fp16", "adamw", "WarmupLR", ("cpu", "cpu")),
    # ZeRO++ hpZ 16 + qwZ + qgZ: loads where 16 divides the world (tests/test_zeropp_quant.py trains hpZ 2 + qwZ + qgZ
    # at world 4)
    "LLaVA-VL__LLaVA-NeXT__scripts__zero3pp.json":
        Loads({16: (128, 8, 1), 32: (256, 8, 1)}, 3, "fp32", "adamw", None, ("none", "none")),
    "LambdaLabsML__distributed-training-guide__alternative-frameworks__deepspeed__ds_config.json":
        Loads(micro_only(1), 3, "bf16", "adamw", "WarmupCosineLR", ("-", "-")),
    # MiCS shard groups of 16: loads where 16 divides the world (tests/test_mesh.py trains it at world 4 with the
    # shard size set to 2, and checks the error at a world 16 does not divide)
    "NVlabs__VILA__scripts__zero3_mics_tiny_fixed.json":
        Loads({16: (128, 8, 1), 32: (256, 8, 1)}, 3, "fp32", None, None, ("-", "-")),
    "OpenBMB__MiniCPM-V__finetune__ds_config_zero3.json":
        Loads(AUTO_BATCH, 3, "fp32", "adamw", "WarmupLR", ("none", "none")),
    "OpenGVLab__InternVL__internvl_chat__zero_stage3_config_100b_1e7_offload.json":
        Loads(AUTO_BATCH, 3, "fp32", "adamw", None, ("cpu", "cpu")),
    "OpenGVLab__InternVL__segmentation__zero_configs__adam_zero1_amp.json":
        nsy('amp: {"enabled": true, "opt_level": "O1"} is not supported yet (Apex AMP'),
    "OpenGVLab__InternVL__segmentation__zero_configs__adam_zero3_fp16.json":
        nsy('optimizer.type: "ZeroOneAdam" is not supported yet; supported: Adam, AdamW, SGD'),
    "allenai__open-instruct__configs__ds_configs__stage3_offloading.conf.json":
        Loads(AUTO_BATCH, 3, "fp32", "adamw", "WarmupDecayLR", ("cpu", "cpu")),
    "axolotl-ai-cloud__axolotl__deepspeed_configs__zero1_torch_compile.json":
        Loads(AUTO_BATCH, 1, "fp32", None, None, ("-", "-")),  # compile: {"disable": false}: engine.compile()
    "axolotl-ai-cloud__axolotl__deepspeed_configs__zero3_bf16_cpuoffload_all.json":
        Loads(AUTO_BATCH, 3, "bf16", None, None, ("cpu", "cpu")),
    "deepspeedai__DeepSpeedExamples__Megatron-LM__scripts__ds_zero2_config.json":
        Loads(per_rank(128), 2, "fp16", "adam", None, ("-", "-")),
    "deepspeedai__DeepSpeedExamples__inference__sglang__ds_offload_nvme_aio.json":
        Loads({1: (1, 1, 1)}, 3, "fp32", None, None, ("nvme", "-")),  # train_batch_size 1: one rank only
    "deepspeedai__DeepSpeedExamples__megatron__Megatron-LM-v1.1.5-ZeRO3__examples__ds_zero_stage_3_config_release.json":
        Loads(per_rank(64), 3, "fp16", None, None, ("cpu", "cpu")),
    "deepspeedai__DeepSpeedExamples__megatron__Megatron-LM-v1.1.5-ZeRO3__examples__ds_zero_stage_infinity_config.json":
        Fails("did you mean", "zero_optimization.stage3_param_persitence_threshold: unknown key; "
                              "did you mean stage3_param_persistence_threshold?"),
    "deepspeedai__DeepSpeedExamples__qanet__deepspeed_bsz512_1cycle.json":
        nsy('scheduler.type: "OneCycle" is not supported yet; supported: WarmupLR, WarmupDecayLR, WarmupCosineLR'),
    "deepspeedai__DeepSpeedExamples__training__DeepSpeed-ZenFlow__finetuning__zf_config.json":
        nsy('zero_optimization.zenflow: {"topk_ratio": 0.1'),
    "deepspeedai__DeepSpeedExamples__training__bf16_master_weight__configs__bf16_full.json":
        nsy("3 config problems:\n  bf16.bf16_master_weights_and_grads: true is not supported yet"),
    "deepspeedai__DeepSpeedExamples__training__bing_bert__deepspeed_bsz64k_lamb_config_seq128.json":
        nsy('2 config problems:\n  optimizer.type: "Lamb" is not supported yet'),
    "deepspeedai__DeepSpeedExamples__training__imagenet__config__ds_fp16_z1_config.json":
        Loads(per_rank(256), 1, "fp16", "adam", None, ("-", "-")),
    "deepspeedai__DeepSpeed__deepspeed__autotuning__config_templates__template_zero3.json":
        Fails("no batch size", "no batch size: give train_batch_size or train_micro_batch_size_per_gpu",
              loads_with={"train_micro_batch_size_per_gpu": 1}),
    "deepspeedai__DeepSpeed__tests__model__BingBertSquad__deepspeed_bsz24_fp16_eigenvalue_quantize_config.json":
        nsy("3 config problems:\n  optimizer.params.bias_correction: false is not supported yet"),
    "deepspeedai__DeepSpeed__tests__model__Megatron_GPT2__ds_config_func_bs8_zero2_offload.json":
        Loads(per_rank(8), 2, "fp16", None, None, ("-", "cpu")),
    "deepspeedai__DeepSpeed__tests__torch_compile__ds_config_z3_deepcompile_no_persist.json":
        nsy("compile.deepcompile: true is not supported yet (DeepCompile"),
    "deepspeedai__Megatron-DeepSpeed__examples_deepspeed__universal_checkpointing__ds_config.json":
        nsy('data_types: {"grad_accum_dtype": "fp32"} is not supported yet'),
    "haotian-liu__LLaVA__scripts__zero3_offload.json":
        Loads(AUTO_BATCH, 3, "fp32", "adamw", "WarmupLR", ("cpu", "cpu")),
    "hiyouga__LLaMA-Factory__examples__deepspeed__ds_z0_config.json":
        Loads(AUTO_BATCH, 0, "fp32", None, None, ("-", "-")),
    # ZeRO-2 + AutoTP 2 (tests/test_autotp.py trains it at world 4 = dp 2 x tp 2 on a tiny Llama)
    "hiyouga__LLaMA-Factory__examples__deepspeed__ds_z2_autotp_config.json":
        Loads(AUTO_BATCH, 2, "fp32", None, None, ("-", "-")),
    "hiyouga__LLaMA-Factory__examples__deepspeed__ds_z3_config.json":
        Loads(AUTO_BATCH, 3, "fp32", None, None, ("-", "-")),
    "hiyouga__LLaMA-Factory__examples__deepspeed__ds_z3_fp8_config.json":
        Loads(AUTO_BATCH, 3, "fp32", None, None, ("-", "cpu")),
    "huggingface__accelerate__examples__alst_ulysses_sequence_parallelism__sp-alst.ds-config.json":
        nsy('seq_parallel_communication_data_type: "bf16" is not supported yet (sequence parallelism)'),
    "huggingface__accelerate__examples__deepspeed_config_templates__zero_stage1_config.json":
        Loads(AUTO_BATCH, 1, "fp16", "adamw", "WarmupDecayLR", ("-", "-")),
    "huggingface__accelerate__examples__deepspeed_config_templates__zero_stage2_offload_config.json":
        Loads(AUTO_BATCH, 2, "fp16", "adamw", "WarmupDecayLR", ("-", "cpu")),
    "huggingface__accelerate__tests__deepspeed__ds_config_zero3_model_only.json":
        Loads(micro_only(1), 3, "fp32", None, None, ("cpu", "-")),
    "huggingface__transformers__tests__deepspeed__ds_config_zero3.json":
        Fails("no batch size", "no batch size: give train_batch_size or train_micro_batch_size_per_gpu",
              loads_with={"train_micro_batch_size_per_gpu": 1}),
    "huggingface__transformers__tests__deepspeed__ds_config_zero3_bf16.json":
        Loads(AUTO_BATCH, 3, "fp32", "adamw", "WarmupLR", ("cpu", "cpu")),
    "lm-sys__FastChat__playground__deepspeed_config_s2.json":
        Loads(AUTO_BATCH, 2, "fp32", None, None, ("-", "cpu")),
    "lm-sys__FastChat__playground__deepspeed_config_s3.json":
        Loads(AUTO_BATCH, 3, "fp32", None, None, ("cpu", "cpu")),
    "modelscope__ms-swift__swift__llm__ds_config__zero3_offload.json":
        Loads(AUTO_BATCH, 3, "fp32", "adamw", "WarmupCosineLR", ("cpu", "none")),
    "tatsu-lab__stanford_alpaca__configs__default_offload_opt_param.json":
        Loads(AUTO_BATCH, 3, "fp32", "adamw", "WarmupDecayLR", ("cpu", "cpu")),
}

pytestmark = pytest.mark.skipif(not DSCONFIGS.is_dir(), reason=f"{DSCONFIGS} not present")


def test_every_file_has_an_expected_outcome():
    on_disk = sorted(path.name for path in DSCONFIGS.glob("*.json"))
    assert on_disk == sorted(EXPECTED), "add the new/renamed dsconfig to EXPECTED with its exact outcome"
    assert len(on_disk) == 40


LOADING = [(name, world) for name, expected in EXPECTED.items() if isinstance(expected, Loads)
           for world in expected.batch]
FAILING = [name for name, expected in EXPECTED.items() if isinstance(expected, Fails)]


@pytest.mark.parametrize(("name", "world"), LOADING, ids=[f"{name[:60]}-w{world}" for name, world in LOADING])
def test_file_loads(name, world):
    expected = EXPECTED[name]
    cfg = load_config(DSCONFIGS / name, world_size=world)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (
        expected.batch[world])
    assert cfg.world_size == world
    assert cfg.zero_optimization.stage == expected.stage
    assert cfg.compute_dtype_name == expected.precision
    assert (cfg.optimizer.type if cfg.optimizer else None) == expected.optimizer
    assert (cfg.scheduler.type if cfg.scheduler else None) == expected.scheduler
    zero = cfg.zero_optimization
    devices = tuple(section.device if section is not None else "-"
                    for section in (zero.offload_param, zero.offload_optimizer))
    assert devices == expected.offload


@pytest.mark.parametrize("name", FAILING, ids=[name[:60] for name in FAILING])
def test_file_fails_as_expected(name):
    expected = EXPECTED[name]
    with pytest.raises(ConfigError) as caught:
        load_config(DSCONFIGS / name, world_size=1)
    message = str(caught.value)
    assert message.startswith(expected.message)
    assert expected.kind in message
    if expected.kind == "not supported yet":
        # Every problem listed is a missing feature, none a plain error.
        problems = message.splitlines()[1:] or [message]
        assert all("not supported yet" in problem for problem in problems)
    if expected.loads_with is not None:
        raw = json.loads((DSCONFIGS / name).read_text())
        load_config({**raw, **expected.loads_with}, world_size=1)


def test_docs_table_lists_each_file_with_its_outcome():
    rows = {}
    for line in DOCS.read_text().splitlines():
        match = re.match(r"\| `([^`]+\.json)` \| ([^|]+) \|", line)
        if match:
            rows[match.group(1)] = match.group(2).strip()
    assert sorted(rows) == sorted(EXPECTED), "docs/config.md's dsconfig table must list every file once"
    for name, expected in EXPECTED.items():
        outcome = "loads" if isinstance(expected, Loads) else expected.kind
        assert rows[name] == outcome, f"docs/config.md says {rows[name]!r} for {name}, tests expect {outcome!r}"


# ---- a config without an optimizer: Hugging Face's model-only ZeRO-3 config ------------------------------------------
MODEL_ONLY = "huggingface__accelerate__tests__deepspeed__ds_config_zero3_model_only.json"


def _model_only_body(path):
    import torch
    import torch.distributed as dist

    import zero_engine
    from zero_engine.testing.models import GPT, GPTConfig, make_batches

    torch.manual_seed(0)
    model = GPT(GPTConfig())
    reference = GPT(GPTConfig())
    reference.load_state_dict(model.state_dict())
    engine, optimizer, _, _ = zero_engine.initialize(model=model, config=path)
    engine.eval()
    x, y = make_batches(model.cfg, 1, dist.get_world_size())[0]
    with torch.no_grad():
        loss = engine(x[dist.get_rank():][:1], y[dist.get_rank():][:1]).item()
        expected = reference(x[dist.get_rank():][:1], y[dist.get_rank():][:1]).item()
    partitioned = all(sp.shard_numel < sp.numel for sp in engine.sharded if sp.numel > 64)
    engine.destroy()
    return optimizer is None, engine.stage, partitioned, abs(loss - expected)


@pytest.mark.skipif(not (DSCONFIGS / MODEL_ONLY).is_file(), reason="HF's model-only config not present")
def test_model_only_config_initializes_without_an_optimizer_and_runs_forward():
    from zero_engine.testing import run_ranks

    for no_optimizer, stage, partitioned, diff in run_ranks(_model_only_body, 2, str(DSCONFIGS / MODEL_ONLY),
                                                            timeout=120):
        assert no_optimizer and stage == 3 and partitioned
        assert diff <= 1e-6  # the same fp32 sums as one process, up to the order of a few reductions
