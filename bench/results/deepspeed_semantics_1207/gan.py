"""DeepSpeedExamples' DCGAN loop (gan/gan_deepspeed_train.py: two engines, the modules' zero_grad, the generator's
backward through the discriminator) against one torch process, per stage, on 2 ranks with the same data.

    PYTHONPATH=<deepspeed 0.19.8> DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python gan.py 0 1 2 3
    ONE_BACKWARD=1 ... python gan.py 1 2 3     # the discriminator's two losses in one backward

2026-12-07, max |difference| of generator / discriminator after 3 steps: stage 0: 0 / 0; stage 1: 0.015 / 0.21
(two discriminator backwards a step at gradient_accumulation_steps 1), 0 / 0 with ONE_BACKWARD; stages 2 and 3:
AssertionError in both variants ("The parameter ... has already been reduced. Gradient computed twice for this
partition", stage3.py's "len(set(p.ds_id ...)) == len(params_in_bucket)"): the generator's backward runs through the
discriminator. zero_engine: bitwise at stages 0-3 in both variants (tests/test_engine_optimizer.py).
"""
import copy, os, sys
import torch, torch.nn as nn
import torch.multiprocessing as mp

def worker(rank, stage, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    disc = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1), nn.Sigmoid())
    ref_gen, ref_disc = copy.deepcopy(gen), copy.deepcopy(disc)
    params = {"lr": 0.1, "momentum": 0.5}
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    ed, *_ = deepspeed.initialize(model=disc, optimizer=torch.optim.SGD(disc.parameters(), **params), config=cfg)
    eg, *_ = deepspeed.initialize(model=gen, optimizer=torch.optim.SGD(gen.parameters(), **params), config=cfg)
    opt_d = torch.optim.SGD(ref_disc.parameters(), **params); opt_g = torch.optim.SGD(ref_gen.parameters(), **params)
    bce, ones, zeros = nn.BCELoss(), torch.ones(4, 1), torch.zeros(4, 1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        real, noise = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        ref_disc.zero_grad(); fake = ref_gen(noise)
        if os.environ.get("ONE_BACKWARD"):
            (bce(ref_disc(real), ones) + bce(ref_disc(fake.detach()), zeros)).backward()
        else:
            bce(ref_disc(real), ones).backward(); bce(ref_disc(fake.detach()), zeros).backward()
        opt_d.step()
        ref_gen.zero_grad(); bce(ref_disc(fake), ones).backward(); opt_g.step()
        disc.zero_grad()
        if os.environ.get("ONE_BACKWARD"):
            fake = gen(noise); ed.backward(bce(disc(real), ones) + bce(disc(fake.detach()), zeros))
        else:
            ed.backward(bce(disc(real), ones)); fake = gen(noise)
            ed.backward(bce(disc(fake.detach()), zeros))
        ed.step()
        gen.zero_grad(); eg.backward(bce(disc(fake), ones)); eg.step()
    from deepspeed.utils import safe_get_full_fp32_param
    out = []
    for m, r in ((gen, ref_gen), (disc, ref_disc)):
        out.append(max(((safe_get_full_fp32_param(p) if stage else p.detach()) - q.detach()).abs().max().item()
                       for p, q in zip(m.parameters(), r.parameters())))
    if rank == 0:
        print("deepspeed stage", stage, "max diff gen / disc:", out, flush=True)

if __name__ == "__main__":
    import random
    for stage in map(int, sys.argv[1:]):
        mp.spawn(worker, args=(stage, random.randint(20000, 40000)), nprocs=2)
