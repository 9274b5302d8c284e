"""Simulated ranks for tests: real multi-process gloo groups for world sizes 1-4, a fake group for shape-only runs.

    from zero_engine.testing import run_ranks, fake_world

    def gather_shapes(n):                       # module level: it is sent to the ranks by reference
        comm = Communicator()
        ...
        return result

    def test_gather():
        results = run_ranks(gather_shapes, 3, 10, timeout=30)   # one result per rank

    with fake_world(1024) as comm:              # shapes and counters only, in this process
        ...
"""

from zero_engine.testing._fake import fake_world
from zero_engine.testing._harness import (
    RankError,
    RankFailure,
    RankTimeoutError,
    kill_this_rank,
    on_ranks,
    run_ranks,
)
from zero_engine.testing._syncs import cuda_syncs

__all__ = ["run_ranks", "on_ranks", "RankError", "RankTimeoutError", "RankFailure", "fake_world", "kill_this_rank",
           "cuda_syncs"]
