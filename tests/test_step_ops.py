"""bench/step_ops.py: the counts it prints are those of one steady step, and move with what they count."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _counts(*args: str) -> dict[str, int]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MASTER_PORT="29563")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "step_ops.py"), "--n-embd", "512", "--layers", "2",
                           *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    return {"gathers": int(re.search(r"all-gather calls of the backend: (\d+)", out).group(1)),
            "copy_ins": int(re.search(r"gradient copy-ins \(_chunk_cat\): (\d+)", out).group(1)),
            "muls": int(re.search(r"scalings \(mul_\): (\d+)", out).group(1))}


def test_step_ops_counts_the_gathers_the_copies_and_the_conversions_of_a_step():
    plain = _counts("--optimizer", "sgd", "--zero-optimization", '{"stage3_max_live_parameters": 3000000}')
    grouped = _counts("--group-large", "--compile", "eager",
                      "--zero-optimization", '{"stage3_max_live_parameters": 3000000}')
    assert grouped["gathers"] < plain["gathers"]  # a block's large matrices in one group
    assert grouped["copy_ins"] < plain["copy_ins"]  # the compiled block's gradients in one copy, not one a Linear
    assert plain["muls"] == 1 and grouped["muls"] == 0  # SGD: fp32 gradients scaled once; CPUAdam: in its kernel
