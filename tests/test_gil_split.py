"""bench/gil_split.py: py-spy's raw stacks charged to the innermost Python frame, inside training steps only."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gil_split", ROOT / "bench" / "gil_split.py")
gil_split = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gil_split)

BACKWARD = "process 7:\"python\";<module> (train.py:3);ZeroEngine.backward (zero_engine/engine.py:153)"
STEP = "<module> (train.py:3);ZeroEngine.step (zero_engine/engine.py:195)"
RAW = [
    f"{BACKWARD};backward (torch/autograd/__init__.py:266);GradReducer.add (zero_engine/zero/grads.py:230) 30",
    f"{BACKWARD};GradReducer.add (zero_engine/zero/grads.py:231);_copy_group (zero_engine/zero/grads.py:398) 10",
    f"{STEP};ZeroOptimizer.step (zero_engine/zero/optimizer.py:240);Adam.step (torch/optim/adam.py:10) 20",
    "<module> (train.py:3);ZeroEngine.forward (/w/zero_engine/engine.py:131);GPT.forward "
    "(zero_engine/testing/models.py:107) 8",
    # outside a step (initialize, the training script): not counted
    "<module> (train.py:3);initialize (zero_engine/initialize.py:50) 500",
    "<module> (train.py:9) 100",
    # native frames (py-spy --native) under a Python frame: charged to that frame
    f"{STEP};ZeroOptimizer.step (zero_engine/zero/optimizer.py:240);0x7f00 (libc.so.6) 4",
    "",
]


def test_samples_are_charged_to_the_innermost_python_frame_per_step_and_rank():
    buckets, functions = gil_split.split(RAW, rate=100, steps=5, ranks=2)
    per_sample = 1000 / 100 / 5 / 2  # ms per step and rank that one sample stands for
    assert buckets == pytest.approx({"zero_engine": 44 * per_sample, "torch": 20 * per_sample,
                                     "the model (zero_engine.testing)": 8 * per_sample})
    assert functions == pytest.approx({"zero/grads.py:GradReducer.add": 30 * per_sample,
                                       "zero/grads.py:_copy_group": 10 * per_sample,
                                       "zero/optimizer.py:ZeroOptimizer.step": 4 * per_sample})


def test_the_command_line_prints_each_file(tmp_path, capsys):
    raw = tmp_path / "spy.txt"
    raw.write_text("\n".join(RAW) + "\n")
    assert gil_split.main([str(raw), "--rate", "100", "--steps", "5", "--ranks", "2", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "GIL held in training steps 72.00 ms per step and rank: zero_engine 44.00, torch 20.00" in out
    assert "30.00 ms  zero/grads.py:GradReducer.add" in out
    assert "_copy_group" not in out  # --top 1
