"""stage3_allgather_sequential: "auto": per-bucket choice from the memory headroom, decided once at initialize."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import zero_engine
from zero_engine.testing import run_ranks
from zero_engine.testing.models import GPTConfig
from zero_engine.zero.gather import choose_sequential_buckets
from zero_engine.zero.partition import ShardedParam, flatten_shards

from test_zero3 import ds_config, train_and_compare

TIMEOUT = 120


class _OneRank:
    rank, world_size = 0, 1


def _buckets(numels, bucket_numel):
    params = [ShardedParam(nn.Parameter(torch.zeros(n)), f"p{i}", i, 0, 1) for i, n in enumerate(numels)]
    for sp in params:
        sp.release()
    return flatten_shards([[p] for p in params], bucket_numel)


def test_auto_gathers_only_the_buckets_that_do_not_fit(caplog):
    buckets = _buckets([100, 100, 5000, 100], bucket_numel=1000)  # [p0, p1] [p2] [p3]
    assert [len(b.params) for b in buckets] == [2, 1, 1]
    # p2's bucket costs 2 x 5000 x 4 bytes coalesced; the others at most 1600. 20000 left: only p2's switches.
    with caplog.at_level(logging.INFO, logger="zero_engine.gather"):
        chosen = choose_sequential_buckets(buckets, headroom_bytes=30_000, states_to_come=10_000, comm=_OneRank())
    assert chosen == [buckets[1]]
    assert [sp.gather_sequential for b in buckets for sp in b.params] == [False, False, True, False]
    assert "1 of 3 buckets gathered sequentially" in caplog.text


def test_auto_with_room_keeps_everything_coalesced(caplog):
    buckets = _buckets([100, 5000], bucket_numel=1000)
    with caplog.at_level(logging.INFO, logger="zero_engine.gather"):
        assert choose_sequential_buckets(buckets, 10**9, 0, _OneRank()) == []
    assert "every bucket gathered coalesced" in caplog.text


def _auto_body(memory_limit):
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("zero_engine.gather").addHandler(handler)
    logging.getLogger("zero_engine.gather").setLevel(logging.INFO)
    flags = []

    def check(engine):
        flags.append(sum(sp.gather_sequential for sp in engine.sharded))

    config = ds_config(3, "auto")
    config["zero_engine"] = {"memory_limit": memory_limit}
    loss_err, param_err = train_and_compare(GPTConfig(frozen_param=True), config, steps=3, check=check)
    return loss_err, param_err, flags[-1], records


@pytest.mark.parametrize("memory_limit,all_sequential", [(1, True), (2**50, False)])
def test_auto_switch_forced_by_budget_trains_like_single_process(memory_limit, all_sequential):
    for rank, (loss_err, param_err, n_sequential, records) in enumerate(
            run_ranks(_auto_body, 2, memory_limit, timeout=TIMEOUT)):
        assert loss_err < 1e-5 and param_err < 2e-4, (loss_err, param_err)
        assert (n_sequential > 0) == all_sequential
        if rank == 0:
            assert any(("gathered sequentially" if all_sequential else "every bucket gathered coalesced") in m
                       for m in records), records
