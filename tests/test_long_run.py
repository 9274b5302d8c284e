"""A long run holds no more than a short one: nothing the engine keeps grows with the number of steps (issue 22).

Issue 22 found one list that did (the step records with ``step_fingerprint`` off: test_watchdog.py). These tests
guard the whole step against the next one, the way a user's week-long run would find it: after a warm-up (the trace
recorded, optimizer states made, checkpoint and eval paths taken once), more steps with what a real run interleaves
(evaluation forwards, checkpoint saves) leave the Python heap (``tracemalloc``), the garbage collector's containers,
the threads and the open files where they were.

Bounds. Measured here (world 2, after 60 steps of warm-up): the number of gc-tracked objects moves by -7 to +1
whatever the number of steps. The traced heap grows by 5-25 KiB over the next 120-300 steps, ever more slowly: blocks
that torch's own ops allocate (``torch.tensor``, ``record_function``, ``all_gather_object``'s byte tensor) and that
stay alive, about 2 KiB per 100 steps by step 1,500 at stage 2 and flat at stage 3 (``bench/soak.py``,
docs/benchmarks.md). So a leak of one gc-tracked object a step (a list, a dict of objects, a tensor, an instance of
ours kept in a list) is ``STEPS`` more objects. One the collector does not track (a string, a number, a tuple or a
dict of only those, such as a record of names and sizes) shows in the heap once it passes ``MAX_HEAP_GROWTH``: from
about 550 bytes a step, as one such record per collective (checked: a string of 50 characters kept per collective
failed this test at stages 2 and 3).
"""

from __future__ import annotations

import tracemalloc

import pytest
import torch
import torch.distributed as dist

import zero_engine
from zero_engine.testing import run_ranks
from zero_engine.testing.long_run import Held, held, run_steps
from zero_engine.testing.models import GPT, GPTConfig, make_batches

TIMEOUT = 240
WARMUP = 60
STEPS = 120  # measured after the warm-up
MAX_HEAP_GROWTH = 64 * 1024  # bytes of Python heap over STEPS (see the module's docstring)
MAX_OBJECT_GROWTH = 30  # gc-tracked objects over STEPS


def _config(variant: str) -> dict:
    zero = {"stage": 3, "overlap_comm": True, "reduce_bucket_size": 20000, "stage3_prefetch_bucket_size": 20000,
            "stage3_param_persistence_threshold": 100, "stage3_max_live_parameters": 60000,
            "stage3_max_reuse_distance": 10000, "leaf_module": {"classes": ["Block"]}}
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero}
    if variant == "fp16_accumulation_offload":  # dynamic loss scale, two micro-steps a step, the step on the host
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
        config["gradient_accumulation_steps"] = 2
        zero["offload_optimizer"] = {"device": "cpu"}
    elif variant == "bf16_param_offload_no_fingerprint":
        config["bf16"] = {"enabled": True}
        zero["offload_param"] = {"device": "cpu"}
        zero["offload_optimizer"] = {"device": "cpu"}
        config["zero_engine"] = {"step_fingerprint": False}
    elif variant == "stage2":
        config["zero_optimization"] = {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 20000}
    return config


def _long_run_body(variant: str, save_dir: str) -> tuple[Held, Held]:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_embd=32, n_head=4)
    engine, *_ = zero_engine.initialize(model=GPT(cfg), config=_config(variant))
    batches = make_batches(cfg, 8, engine.train_micro_batch_size_per_gpu(), seed=dist.get_rank())
    tracemalloc.start()
    try:
        run_steps(engine, batches, 0, WARMUP, eval_every=10, save_every=40, save_dir=save_dir)
        before = held()
        run_steps(engine, batches, WARMUP, STEPS, eval_every=10, save_every=40, save_dir=save_dir)
        after = held()
    finally:
        tracemalloc.stop()
        engine.destroy()
    return before, after


@pytest.mark.parametrize("variant", ["stage3", "fp16_accumulation_offload", "bf16_param_offload_no_fingerprint",
                                     "stage2"])
def test_nothing_the_engine_holds_grows_with_the_number_of_steps(variant, tmp_path):
    for rank, (before, after) in enumerate(run_ranks(_long_run_body, 2, variant, str(tmp_path), timeout=TIMEOUT)):
        heap, objects, threads, files, _ = (a - b for a, b in zip(after, before))
        where = f"rank {rank}, {variant}, over {STEPS} steps: before {before}, after {after}"
        assert heap <= MAX_HEAP_GROWTH, f"Python heap grew {heap} bytes; {where}"
        assert objects <= MAX_OBJECT_GROWTH, f"{objects} more gc-tracked objects; {where}"
        assert threads <= 0, f"{threads} more threads; {where}"
        assert files <= 0, f"{files} more open files; {where}"
