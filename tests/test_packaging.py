"""The wheel: built from pyproject.toml, holding the C++ sources and the JSON Schema inside the package, installed into
a fresh virtual environment (no network: this environment's torch and other dependencies are reused through a .pth
file), where `zero-engine ops --build` compiles the CPU kernel from the installed sources and two ranks train a step.

Slow-ish (about 30-60 s on two cores: the cold build of the cpu_adam kernel and two torchrun launches); it is one test.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytest.importorskip("build", reason="the wheel test needs the `build` package (pip install 'zero_engine[dev]')")

# Run by torchrun in the fresh environment: one ZeRO-3 step on two ranks against plain AdamW in one process.
TWO_RANK_STEP = """
    import copy, sys
    import torch
    import zero_engine

    installed = sys.argv[1]
    if not zero_engine.__file__.startswith(installed):
        raise SystemExit(f"imported {zero_engine.__file__}, not the installed copy under {installed}")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    reference = copy.deepcopy(model)
    adam = {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": adam},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = zero_engine.initialize(model=model, config=config)
    rank = torch.distributed.get_rank()
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    loss = torch.nn.functional.mse_loss(engine(x[4 * rank:4 * rank + 4]), y[4 * rank:4 * rank + 4])
    engine.backward(loss)
    engine.step()
    optimizer = type(engine.optimizer.optimizer).__name__
    if optimizer != "CPUAdam":
        raise SystemExit(f"the engine uses {optimizer}, not the CPUAdam kernel built from the installed sources")
    torch_adam = torch.optim.AdamW(reference.parameters(), lr=adam["lr"], betas=adam["betas"], eps=adam["eps"],
                                   weight_decay=0.0)
    torch.nn.functional.mse_loss(reference(x), y).backward()
    torch_adam.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        with zero_engine.zero.GatheredParameters(p):
            # Same math in another summation order (two half-batch means, then their mean): a few ulp apart.
            torch.testing.assert_close(p.detach().clone(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
    print(f"rank {rank}: step ok with {optimizer}, loss {loss.item():.6f}")
    engine.destroy()  # then the group, as README says a run ends: gloo's threads joined before interpreter exit
    torch.distributed.destroy_process_group()
"""


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        pytest.fail(f"{' '.join(map(str, command))} exited with {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


def _build_wheel(tmp_path: Path) -> Path:
    """Build from a copy of the tracked sources, so the checkout gets no build/ or egg-info directories."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "zero_engine", source / "zero_engine",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(source)],
         timeout=300)
    (wheel,) = dist.glob("zero_engine-*.whl")
    return wheel


def _fresh_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A new venv whose own site-packages comes first; this environment's packages (torch, pydantic, ...) are
    reachable after it through a .pth line, without its .pth files (so no editable zero_engine from a checkout)."""
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120)
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "reuse_outer_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python, site


def test_wheel_ships_sources_in_the_package_and_works_installed(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"zero_engine", wheel.name.split("-py3")[0] + ".dist-info"}, sorted(top_level)
    for shipped in ("zero_engine/csrc/adam/cpu_adam.cpp", "zero_engine/csrc/includes/simd.h",
                    "zero_engine/csrc/adam/fused_adam.cu", "zero_engine/config_schemas/zero_engine.schema.json"):
        assert shipped in names, f"{shipped} is not in {wheel.name}"

    python, site = _fresh_venv(tmp_path)
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
          str(wheel)], timeout=300)
    installed = site / "zero_engine"
    workdir = tmp_path / "work"  # not the checkout: nothing there shadows the installed package
    workdir.mkdir()
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "TORCH_EXTENSIONS_DIR")}
    env.update(OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    cli = str(python.parent / "zero-engine")

    schema_path = _run([cli, "schema", "--path"], cwd=workdir, env=env, timeout=120).stdout.strip()
    assert Path(schema_path) == installed / "config_schemas" / "zero_engine.schema.json"
    printed = json.loads(_run([cli, "schema"], cwd=workdir, env=env, timeout=120).stdout)
    assert printed == json.loads(Path(schema_path).read_text())

    report = _run([cli, "ops", "--build"], cwd=workdir, env=env, timeout=400).stdout
    cpu_row = next(line for line in report.splitlines() if line.startswith("cpu_adam"))
    assert " yes " in cpu_row and "loaded from" in cpu_row, report
    (ninja_file,) = (tmp_path / "extensions").glob("zero_engine_cpu_adam_*/build.ninja")
    assert str(installed / "csrc" / "adam" / "cpu_adam.cpp") in ninja_file.read_text()

    script = workdir / "two_rank_step.py"
    script.write_text(textwrap.dedent(TWO_RANK_STEP))
    result = _run([str(python), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   str(script), str(installed)], cwd=workdir, env=env, timeout=300)
    assert "rank 0: step ok with CPUAdam" in result.stdout and "rank 1: step ok" in result.stdout, result.stdout
