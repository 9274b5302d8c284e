"""One rank of a job whose rank 0 fails (launched by tests/test_watchdog.py as plain processes; not collected).

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/rank_failure_worker.py WHERE NVME_DIR [LATE_S]

Rank 0 raises and does not catch it, so the process ends the way a real training script does (traceback through
sys.excepthook, interpreter exit): WHERE is "between_steps" (a ValueError from the data between two steps) or
"initialize" (an NvmeError inside initialize(): rank 0's nvme_path names a regular file). Rank 1 trains on and prints
the DistributedError it gets, as "CAUGHT <type>: <message>", and exits 0. LATE_S: rank 1 sleeps this long after
initialize(), as a rank still loading its data. No launcher: torchrun would end rank 1 as soon as rank 0 exits,
before it could say anything.
"""

import sys
import time

import torch
import torch.distributed as dist

import zero_engine
from zero_engine.testing.models import GPT, GPTConfig, make_batches


def main(where: str, nvme_dir: str, rank1_late_s: float) -> None:
    zero_engine.init_distributed(backend="gloo")
    rank = dist.get_rank()
    nvme_path = nvme_dir
    if where == "initialize" and rank == 0:
        nvme_path = f"{nvme_dir}/a-file"
        open(nvme_path, "w").close()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path}},
              "zero_engine": {"stall_timeout_s": 2}}
    cfg = GPTConfig()
    torch.manual_seed(0)
    started = time.monotonic()
    try:
        engine, *_ = zero_engine.initialize(model=GPT(cfg), config=config)
        if rank == 1:
            time.sleep(rank1_late_s)  # loading its data: rank 0 may fail before rank 1 waits in a collective
        for step, (x, y) in enumerate(make_batches(cfg, 4, 4, seed=1)):
            if rank == 0 and where == "between_steps" and step == 2:
                raise ValueError("bad sample 17: token id 99999 is out of the vocabulary")
            started = time.monotonic()
            engine.backward(engine(x[2 * rank: 2 * rank + 2], y[2 * rank: 2 * rank + 2]))
            engine.step()
    except zero_engine.DistributedError as error:
        if rank == 0:
            raise
        print(f"CAUGHT {type(error).__name__}: {error} [detected after {time.monotonic() - started:.1f}s]",
              flush=True)
        return
    print("FINISHED without an error", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
