"""bench/gpu_check.py (what `make gpu-check` runs after the CUDA tests), checked here at toy size on the CPU: every
part runs in its own process and reports, the JSON and markdown are written, and without CUDA a full run refuses."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA; this machine has a GPU")
def test_full_run_without_cuda_refuses_with_a_clear_message(capsys, tmp_path):
    assert gpu_check.main(["--out", str(tmp_path / "r")]) == gpu_check.NO_CUDA_EXIT
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_tiny_run_writes_json_and_markdown(tmp_path):
    out = tmp_path / "gpu_check"
    parts = "adam,zero3,fsdp2,deepspeed,fake8_zero3,fake8_zero3_reuse0,syncs"
    assert gpu_check.main(["--tiny", "--parts", parts, "--out", str(out), "--warmup", "1", "--steps", "1"]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    results = report["results"]
    assert list(results) == parts.split(",")
    assert results["adam"]["ours_ms"] > 0 and results["adam"]["hbm_bound_ms"] > 0
    assert results["zero3"]["step_ms"] > 0 and results["zero3"]["params"] > 0
    assert results["fsdp2"]["step_ms"] > 0
    for part in ("zero3", "fsdp2"):  # each timed step's own time too: is a slow run slow in every step?
        assert len(results[part]["step_ms_each"]) == 1 and results[part]["step_ms_each"][0] > 0
    assert results["fake8_zero3"]["model_state_bytes"] > 0
    assert results["fake8_zero3_reuse0"]["model_state_bytes"] == results["fake8_zero3"]["model_state_bytes"]
    assert "world1_nccl" in results["syncs"] if torch.cuda.is_available() else "skipped" in results["syncs"]
    assert "step_ms" in results["deepspeed"] or "skipped" in results["deepspeed"]
    md = out.with_suffix(".md").read_text()
    assert "## Adam step" in md and "| zero3 |" in md and "world 8" in md and "each step, min-max ms" in md


def test_demo_size_runs_the_demo_gpt(tmp_path):
    out = tmp_path / "gpu_check"
    assert gpu_check.main(["--size", "demo", "--parts", "zero3", "--out", str(out), "--warmup", "1", "--steps", "1"]
                          ) == (0 if torch.cuda.is_available() else gpu_check.NO_CUDA_EXIT)
    cfg, micro = gpu_check.model_config(False, "demo")
    assert (cfg.n_layer, cfg.n_embd, cfg.vocab_size, cfg.block_size, micro) == (4, 256, 512, 64, 8)
    demo = json.loads((ROOT / "examples" / "configs" / "zero3.json").read_text())["zero_optimization"]
    ours = gpu_check._zero3_config(micro, size="demo")["zero_optimization"]
    assert {k: v for k, v in ours.items() if k in demo} == demo, "the demo config's stage-3 keys"


def test_a_failing_part_is_reported_not_hidden(tmp_path):
    out = tmp_path / "gpu_check"
    assert gpu_check.main(["--tiny", "--parts", "zero3", "--out", str(out), "--part-timeout", "1"]) == 1
    assert "timed out" in json.loads(out.with_suffix(".json").read_text())["results"]["zero3"]["error"]


def test_profile_writes_each_parts_op_table(tmp_path):
    # --profile: after the timed steps, as many more under torch.profiler; its op table in DIR/<part>.txt
    out, folder = tmp_path / "gpu_check", tmp_path / "profiles"
    assert gpu_check.main(["--tiny", "--parts", "zero3,fsdp2", "--out", str(out), "--warmup", "1", "--steps", "2",
                           "--profile", str(folder)]) == 0
    for part in ("zero3", "fsdp2"):
        table = (folder / f"{part}.txt").read_text()
        assert table.startswith(f"# {part}: 2 steps under torch.profiler")
        assert "aten::" in table and "Self CPU" in table


def test_zero_optimization_overrides_reach_the_zero3_part(tmp_path):
    # --zero-optimization: keys merged into the zero3 parts' config; each reports a steady step's collectives, so a
    # prefetch bucket too small for any parameter (nothing prefetched: one gather per unit, when it runs) shows more
    # all-gathers than a huge one (one gather for many units)
    def all_gathers(bucket: int) -> int:
        out = tmp_path / f"bucket{bucket}"
        overrides = json.dumps({"stage3_prefetch_bucket_size": bucket, "stage3_param_persistence_threshold": 0})
        assert gpu_check.main(["--tiny", "--parts", "zero3", "--out", str(out), "--warmup", "2", "--steps", "1",
                               "--zero-optimization", overrides]) == 0
        result = json.loads(out.with_suffix(".json").read_text())["results"]["zero3"]
        assert result["zero_optimization_overrides"] == json.loads(overrides)
        return result["collectives_per_step"]["all_gather"]

    assert all_gathers(1) > all_gathers(10**9) > 0


@pytest.mark.parametrize("given", ["{stage3_prefetch_bucket_size: 1}", "[1, 2]"])
def test_zero_optimization_that_is_not_a_json_object_is_refused_before_any_part_runs(given, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--tiny", "--parts", "zero3", "--out", str(tmp_path / "r"), "--zero-optimization", given])
    assert exit_info.value.code == 2
    assert "--zero-optimization" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()
