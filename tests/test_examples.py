"""The example configs README points users to: each one loads, and the NVMe one trains under torchrun (issue 13)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from zero_engine.config import load_config

from session_run import run_in_session

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "examples" / "configs").glob("*.json"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_example_config_loads(path):
    load_config(json.loads(path.read_text()), world_size=2)


def test_nvme_example_trains_with_its_states_on_disk_and_leaves_no_files(tmp_path):
    """examples/configs/zero3_nvme.json (optimizer states and parameter shards in files) with its own command, on a
    smaller model and under a private nvme_path: the run exits 0, the losses are finite, and the per-run files are
    gone after exit."""
    config = json.loads((REPO / "examples" / "configs" / "zero3_nvme.json").read_text())
    nvme = tmp_path / "nvme"
    for section in ("offload_optimizer", "offload_param"):
        config["zero_optimization"][section]["nvme_path"] = str(nvme)
    (tmp_path / "config.json").write_text(json.dumps(config))
    losses = tmp_path / "losses.json"
    done = run_in_session(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "examples/train_gpt.py", "--config", str(tmp_path / "config.json"), "--steps", "4", "--n-layer", "2",
         "--n-embd", "64", "--losses", str(losses)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    values = json.loads(losses.read_text())  # rank 0's per-step losses
    assert len(values) == 4 and all(math.isfinite(v) for v in values), values
    assert nvme.is_dir() and list(nvme.iterdir()) == [], list(nvme.iterdir())
