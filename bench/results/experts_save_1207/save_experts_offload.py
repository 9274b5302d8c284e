"""Ad-hoc: save_pretrained of experts under NVMe parameter + optimizer offload equals save_16bit_model's file."""
import os, sys, tempfile
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "tests")); sys.path.insert(0, ROOT)
import torch, torch.distributed as dist
import zero_engine
from zero_engine.testing import run_ranks


def body(out, offload):
    from test_expert_parallel import _hf_moe_llama, ds_config
    from zero_engine.moe import expert_parallel_groups
    import zero_engine.hf as zhf
    model = _hf_moe_llama(expert_parallel_groups(2))
    zero = {"stage3_gather_16bit_weights_on_model_save": True}
    if offload:
        zero.update(offload_param={"device": "nvme", "nvme_path": out + "/swap"},
                    offload_optimizer={"device": "nvme", "nvme_path": out + "/swap"})
    cfg = {**ds_config(gas=1, **zero), "bf16": {"enabled": True}}
    engine, *_ = zero_engine.initialize(model=model, config=cfg)
    for seed in range(2):
        x = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank() + 10 * seed))
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    zhf.save_pretrained(engine, out + "/hf")
    assert engine.save_16bit_model(out, "m16.bin")
    engine.destroy()


if __name__ == "__main__":
    from safetensors.torch import load_file
    for offload in (False, True):
        out = tempfile.mkdtemp(); os.makedirs(out + "/swap")
        run_ranks(body, 4, out, offload, timeout=300)
        hf = load_file(out + "/hf/model.safetensors")
        m16 = torch.load(out + "/m16.bin")
        assert set(hf) == set(m16), set(hf) ^ set(m16)
        bad = [k for k in hf if not torch.equal(hf[k], m16[k])]
        print("offload", offload, "tensors", len(hf), "differ", bad, hf["model.layers.1.mlp.experts.w2"].shape)
