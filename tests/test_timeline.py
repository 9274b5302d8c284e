"""Memory timeline: records at every hook event, written per rank, drawn by `zero-engine plot`."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

import zero_engine
from zero_engine.cli import main as cli_main
from zero_engine.testing import run_ranks
from zero_engine.testing.models import GPT, GPTConfig, make_batches


def _timeline_body(path, sequential):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_allgather_sequential": sequential,
                                    "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0},
              "zero_engine": {"memory_timeline": {"enabled": True, "path": path}}}
    engine, *_ = zero_engine.initialize(model=model, config=config)
    for x, y in make_batches(model.cfg, 2, 2):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    return str(engine.timeline.path), engine.coordinator.fetch_count, dist.get_rank()


@pytest.mark.parametrize("sequential", [False, True])
def test_timeline_records_every_hook_event_and_plots(tmp_path, sequential):
    results = run_ranks(_timeline_body, 2, str(tmp_path / "tl"), sequential, timeout=120)
    files = []
    for path, fetches, rank in results:
        assert path.endswith(f"tl.rank{rank}.jsonl")
        rows = [json.loads(line) for line in open(path)]
        fetch_rows = [r for r in rows if r["event"].startswith("fetch")]
        assert len(fetch_rows) == fetches and sum(r["event"] == "step" for r in rows) == 2
        assert any(r["params_gathered"] > 0 for r in rows) and rows[-1]["params_gathered"] == 0
        assert all(r["rss"] > 0 for r in rows)
        files.append(path)
    png = tmp_path / "tl.png"
    assert cli_main(["plot", *files, "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
