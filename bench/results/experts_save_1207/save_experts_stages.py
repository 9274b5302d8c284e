import os, sys, tempfile
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "tests")); sys.path.insert(0, ROOT)
import torch, torch.distributed as dist
import zero_engine
from zero_engine.testing import run_ranks


def body(out, stage, extra):
    from test_expert_parallel import _hf_moe_llama, ds_config
    from zero_engine.moe import expert_parallel_groups
    import zero_engine.hf as zhf
    model = _hf_moe_llama(expert_parallel_groups(2))
    cfg = {**ds_config(gas=1, stage=stage, stage3_gather_16bit_weights_on_model_save=True, **extra), "bf16": {"enabled": True}}
    engine, *_ = zero_engine.initialize(model=model, config=cfg)
    x = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    zhf.save_pretrained(engine, out + "/hf")
    assert engine.save_16bit_model(out, "m16.bin")
    engine.destroy()


if __name__ == "__main__":
    from safetensors.torch import load_file
    for world, stage, extra in ((4, 1, {}), (4, 2, {}), (8, 3, {"zero_hpz_partition_size": 2}), (8, 3, {"zero_quantized_weights": True})):
        out = tempfile.mkdtemp()
        run_ranks(body, world, out, stage, extra, timeout=300)
        hf = load_file(out + "/hf/model.safetensors")
        m16 = torch.load(out + "/m16.bin")
        bad = [k for k in hf if not torch.equal(hf[k], m16[k])]
        print(world, stage, extra, "tensors", len(hf), set(hf) ^ set(m16), "differ", bad)
