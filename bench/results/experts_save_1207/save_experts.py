"""Ad-hoc: hf.save_pretrained of MoE experts against save_16bit_model's file, tensor by tensor (README.md here)."""
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zero_engine  # noqa: E402
from zero_engine.testing import run_ranks  # noqa: E402

CASES = [  # (world, stage, steps, zero_optimization extras; "NVME" in a value: the run's swap directory)
    (4, 3, 1, {}),
    (4, 3, 2, {"offload_param": {"device": "nvme", "nvme_path": "NVME"},
               "offload_optimizer": {"device": "nvme", "nvme_path": "NVME"}}),
    (4, 1, 1, {}),
    (4, 2, 1, {}),
    (8, 3, 1, {"zero_hpz_partition_size": 2}),
    (8, 3, 1, {"zero_quantized_weights": True}),
]


def body(out, stage, steps, extra):
    from test_expert_parallel import _hf_moe_llama, ds_config

    import zero_engine.hf as zhf
    from zero_engine.moe import expert_parallel_groups

    model = _hf_moe_llama(expert_parallel_groups(2))
    extra = {k: ({**v, "nvme_path": out + "/swap"} if isinstance(v, dict) and v.get("nvme_path") else v)
             for k, v in extra.items()}
    config = {**ds_config(gas=1, stage=stage, stage3_gather_16bit_weights_on_model_save=True, **extra),
              "bf16": {"enabled": True}}
    engine, *_ = zero_engine.initialize(model=model, config=config)
    for step in range(steps):
        x = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank() + 10 * step))
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    zhf.save_pretrained(engine, out + "/hf")
    assert engine.save_16bit_model(out, "m16.bin")
    engine.destroy()


if __name__ == "__main__":
    from safetensors.torch import load_file

    for world, stage, steps, extra in CASES:
        out = tempfile.mkdtemp()
        os.makedirs(out + "/swap")
        run_ranks(body, world, out, stage, steps, extra, timeout=300)
        hf, m16 = load_file(out + "/hf/model.safetensors"), torch.load(out + "/m16.bin")
        differ = [k for k in hf if not torch.equal(hf[k], m16[k])]
        expert = tuple(hf["model.layers.1.mlp.experts.w2"].shape)
        print(f"world {world}, stage {stage}, {steps} step(s), {sorted(extra)}: {len(hf)} tensors, names differ: "
              f"{sorted(set(hf) ^ set(m16))}, values differ: {differ}, an expert weight {expert}")
