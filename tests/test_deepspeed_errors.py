"""Misuse that DeepSpeed answers with an assert, and DeepSpeed's package metadata (issue 26 items 11, 13, 14).

Code written for DeepSpeed catches AssertionError for misuse DeepSpeed asserts on (deepspeed/runtime/engine.py
no_sync, step, backward; deepspeed/__init__.py initialize). zero_engine raises UsageError (a RuntimeError) or
ArgumentError (a ValueError) there, both AssertionErrors too, with its own messages (see zero_engine/errors.py).
Bodies named ``_*_body`` run on simulated ranks.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import zero_engine
import zero_engine as deepspeed
from zero_engine import _version
from zero_engine.testing import run_ranks

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 120


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x).pow(2).mean()


def engine_at(stage):
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=Small(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage}})
    return engine


def outcome(call) -> tuple:
    try:
        call()
    except Exception as error:  # noqa: BLE001 -- the classes are what is checked
        return (type(error).__name__, isinstance(error, AssertionError), isinstance(error, RuntimeError),
                isinstance(error, ValueError), str(error))
    return ("no error",)


def _misuse_body():
    got = {}
    engine = engine_at(1)
    x = torch.randn(2, 4)
    with engine.no_sync():
        got["nested no_sync"] = outcome(lambda: engine.no_sync().__enter__())
        engine.backward(engine(x))
        got["step inside no_sync"] = outcome(engine.step)
    got["backward of a non-scalar"] = outcome(lambda: engine.backward(engine.module.a(x)))
    engine.destroy()
    for stage in (2, 3):  # destroyed after: a stage 2-3 engine's hooks keep it alive in the pooled rank process
        engine = engine_at(stage)
        got[f"no_sync at stage {stage}"] = outcome(lambda: engine.no_sync().__enter__())
        engine.destroy()
    # with a process group, as DeepSpeed's test calls it: refused before any collective, on every rank
    got["initialize(model=None)"] = outcome(lambda: deepspeed.initialize(model=None, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}))
    return got


def test_misuse_deepspeed_asserts_on_is_an_assertion_error_of_our_type():
    expected = {  # name: (class, is RuntimeError, is ValueError, words of our message)
        "nested no_sync": ("UsageError", True, False, "cannot be nested"),
        "step inside no_sync": ("UsageError", True, False, "inside engine.no_sync()"),
        "no_sync at stage 2": ("UsageError", True, False, "ZeRO stage 2"),
        "no_sync at stage 3": ("UsageError", True, False, "ZeRO stage 3"),
        "backward of a non-scalar": ("ArgumentError", False, True, "expected a scalar loss"),
        "initialize(model=None)": ("ArgumentError", False, True, "model is required"),
    }
    for got in run_ranks(_misuse_body, 2, timeout=TIMEOUT):
        for name, (cls, runtime, value, words) in expected.items():
            assert got[name][:4] == (cls, True, runtime, value) and words in got[name][4], (name, got[name])


def test_initialize_without_a_model_is_an_assertion_error_and_a_value_error():
    with pytest.raises(AssertionError, match="model is required") as caught:
        deepspeed.initialize(model=None, config={"train_batch_size": 1})
    assert isinstance(caught.value, ValueError) and type(caught.value) is zero_engine.ArgumentError


def test_the_error_classes_are_both():
    assert issubclass(zero_engine.UsageError, RuntimeError) and issubclass(zero_engine.UsageError, AssertionError)
    assert issubclass(zero_engine.ArgumentError, ValueError) and issubclass(zero_engine.ArgumentError, AssertionError)


# ---- item 13: version and build metadata -----------------------------------------------------------------------------
def test_version_names_are_deepspeeds():
    try:
        installed = importlib.metadata.version("zero_engine")
    except importlib.metadata.PackageNotFoundError:
        installed = _version.VERSION
    assert deepspeed.__version__ == installed
    assert (deepspeed.__version_major__, deepspeed.__version_minor__, deepspeed.__version_patch__) == \
        tuple(int(part) for part in installed.split(".")[:3])
    assert isinstance(deepspeed.__git_hash__, str) and isinstance(deepspeed.__git_branch__, str)


@pytest.mark.parametrize("text, parts", [("0.19.8", (0, 19, 8)), ("1.2.3rc1+local", (1, 2, 3)), ("2.0", (2, 0, 0)),
                                         ("garbage", (0, 0, 0))])
def test_version_parts(text, parts):
    assert _version.parse_version(text) == parts


def test_git_info_of_this_checkout_is_what_git_says():
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    said = [subprocess.run(["git", "rev-parse", *args, "HEAD"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.strip() for args in (["--short=7"], ["--abbrev-ref"])]
    assert (deepspeed.__git_hash__, deepspeed.__git_branch__) == tuple(said) == _version.git_info()


def test_git_info_reads_loose_packed_detached_and_worktree_checkouts(tmp_path):
    commit, other = "0123456789abcdef0123456789abcdef01234567", "fedcba9876543210fedcba9876543210fedcba98"
    main = tmp_path / "repo" / ".git"
    (main / "refs" / "heads").mkdir(parents=True)
    (main / "HEAD").write_text("ref: refs/heads/main\n")
    (main / "refs" / "heads" / "main").write_text(commit + "\n")
    assert _version.git_info(main.parent) == ("0123456", "main")
    (main / "refs" / "heads" / "main").unlink()  # after `git gc`: in packed-refs
    (main / "packed-refs").write_text(f"# pack-refs with: peeled\n{commit} refs/heads/main\n")
    assert _version.git_info(main.parent) == ("0123456", "main")
    (main / "HEAD").write_text(other + "\n")  # detached
    assert _version.git_info(main.parent) == ("fedcba9", "HEAD")
    worktree_git = main / "worktrees" / "wt"  # `git worktree add`: .git is a file; branches in the main repository
    worktree_git.mkdir(parents=True)
    (worktree_git / "HEAD").write_text("ref: refs/heads/feature/x\n")
    (worktree_git / "commondir").write_text("../..\n")
    (main / "refs" / "heads" / "feature").mkdir()
    (main / "refs" / "heads" / "feature" / "x").write_text(other + "\n")
    (tmp_path / "wt").mkdir()
    (tmp_path / "wt" / ".git").write_text(f"gitdir: {worktree_git}\n")
    assert _version.git_info(tmp_path / "wt") == ("fedcba9", "feature/x")
    assert _version.git_info(tmp_path / "no-checkout") == ("unknown", "unknown")  # an installed wheel
    (main / "HEAD").write_text("ref: refs/heads/unborn\n")  # a branch without commits
    assert _version.git_info(main.parent) == ("unknown", "unknown")


def test_the_build_reads_the_version_from_the_one_place_it_is_written():
    """pyproject.toml declares the version dynamic, read by setuptools (statically) from zero_engine/_version.py."""
    from setuptools.config.expand import read_attr

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" in project["project"]["dynamic"] and "version" not in project["project"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert read_attr(attr, root_dir=str(REPO)) == _version.VERSION
