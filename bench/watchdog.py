"""What the never-hang machinery costs, and how fast it answers (issue 10).

    flock /work/locks/bench.lock python bench/watchdog.py overhead [--rounds 6 --steps 12]
    flock /work/locks/bench.lock python bench/watchdog.py detection

overhead: the demo's GPT at ZeRO-3 on 2 simulated ranks, step time with the watchdog and the step fingerprint on
(the defaults) and off (``stall_timeout_s: 0, step_fingerprint: false``), step by step in ABBA pairs inside the same
rank processes so that the machine's load hits both alike; prints the median step time of each and the median of
the per-pair ratios with its quartiles.

detection: a same-shaped branch divergence from step 2 (tests/test_watchdog.py's model) with the default
``stall_timeout_s``; prints how long after the divergent step began each rank raised, and the message.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zero_engine  # noqa: E402
from zero_engine.testing import RankError, run_ranks  # noqa: E402
from zero_engine.testing.models import GPT, GPTConfig, make_batches  # noqa: E402

MODEL = dict(vocab_size=512, block_size=64, n_layer=4, n_head=8, n_embd=256)  # examples/train_gpt.py's default


def _config(watchdog: bool) -> dict:
    engine = {} if watchdog else {"stall_timeout_s": 0, "step_fingerprint": False}
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "overlap_comm": True}, "zero_engine": engine}


def overhead_body(rounds: int, steps: int) -> dict:
    """Both engines step on the same batch back to back, in ABBA order (off-on, then on-off, ...), so that the
    machine's load, which drifts over seconds here, hits both alike; the ratio is taken per pair."""
    rank = dist.get_rank()
    cfg = GPTConfig(**MODEL)
    batches = make_batches(cfg, steps + 2, 4 * dist.get_world_size(), seed=1)
    times: dict[str, list[float]] = {"off": [], "on": []}
    engines = {}
    for label in ("off", "on"):
        torch.manual_seed(0)
        engines[label], *_ = zero_engine.initialize(model=GPT(cfg), config=_config(label == "on"))
    pair = 0
    for _ in range(rounds):
        for i, (x, y) in enumerate(batches):
            order = ("off", "on") if pair % 2 == 0 else ("on", "off")
            pair += 1
            for label in order:
                engine = engines[label]
                dist.barrier()
                start = time.perf_counter()
                engine.backward(engine(x[4 * rank: 4 * rank + 4], y[4 * rank: 4 * rank + 4]))
                engine.step()
                if i >= 2:  # warm-up
                    times[label].append(time.perf_counter() - start)
    for engine in engines.values():
        engine.destroy()
    return times


def overhead(rounds: int, steps: int) -> None:
    results = run_ranks(overhead_body, 2, rounds, steps, timeout=3000)
    off = statistics.median(t for r in results for t in r["off"])
    on = statistics.median(t for r in results for t in r["on"])
    ratios = sorted(a / b for r in results for a, b in zip(r["on"], r["off"]))
    q1, med, q3 = (ratios[int(q * (len(ratios) - 1))] for q in (0.25, 0.5, 0.75))
    n = len(results[0]["on"])
    print(f"GPT {MODEL}, ZeRO-3, 2 ranks (gloo), {rounds} rounds x {steps} timed steps per rank, on/off in ABBA pairs")
    print(f"median step, watchdog+fingerprint off: {off * 1e3:.1f} ms")
    print(f"median step, watchdog+fingerprint on : {on * 1e3:.1f} ms  ({n} steps per rank)")
    print(f"on/off per pair: median {med:.4f} (quartiles {q1:.4f} .. {q3:.4f}); overhead {(med - 1) * 100:+.2f}%")


def detection() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import test_watchdog

    started = time.monotonic()
    try:
        run_ranks(test_watchdog._branch_divergence_body, 2, 3, False, True, timeout=600, grace_after_failure=120,
                  stall=None)
    except RankError as error:
        for failure in error.failures:
            print(f"rank {failure.rank}: {failure.exception}\n")
    print(f"whole call (pool start-up included): {time.monotonic() - started:.1f}s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["overhead", "detection"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    overhead(args.rounds, args.steps) if args.what == "overhead" else detection()
