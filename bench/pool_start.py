"""How long a fresh pool of simulated ranks takes to its first call's reply: spawned, or forked from the server.

    OMP_NUM_THREADS=1 python bench/pool_start.py --start spawn        # each rank imports torch again
    OMP_NUM_THREADS=1 python bench/pool_start.py --start forkserver   # as run_ranks starts them (the default)

Starts ``--pools`` pools of ``--world`` ranks one after the other in this process, each discarded after one call (as
a pool is after a failed call), and prints each one's seconds. See [Note: ranks forked from a preloaded server] in
zero_engine/testing/_pool.py.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import zero_engine.testing._pool as pool  # noqa: E402
from zero_engine.testing import run_ranks  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", choices=("forkserver", "spawn"), default="forkserver")
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--pools", type=int, default=4)
    args = parser.parse_args(argv)
    if args.start == "spawn":
        pool._rank_context = lambda: multiprocessing.get_context("spawn")
    seconds = []
    for _ in range(args.pools):
        start = time.perf_counter()
        run_ranks(os.getpid, args.world, timeout=300)
        seconds.append(round(time.perf_counter() - start, 2))
        pool.discard_pool(args.world, pool.get_pool(args.world))
    print(f"{args.start}, {args.world} ranks: seconds to the first reply, pool by pool: {seconds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
