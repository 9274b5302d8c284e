"""Builds the C++/CUDA ops in ``zero_engine/csrc/`` on first use, and says clearly why when it cannot.

The sources ship inside the package (package data) and are found through ``importlib.resources``, so an
installed wheel builds from its own copy.

Each op is compiled just in time by ``torch.utils.cpp_extension.load`` (ninja) into torch's extensions
directory (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions/<python>_<cuda>/``), then
loaded as a torch operator library: ``load_op("cpu_adam")`` returns the ``torch.ops.<namespace>``
object whose attributes are the op's functions.

[Note: when an op is rebuilt]
ninja recompiles an object when its command line or any file it includes changed (torch writes
depfiles), and torch's versioner rebuilds under a new name when the sources or flags changed within a
process. To make both notice a change to a header too, the flags carry a hash of the op's sources
and of every header in ``zero_engine/csrc/includes`` (``-DZE_SOURCES_HASH=...``). A second process
finds the cached library and only loads it (well under a second); a cold build of ``cpu_adam`` takes
about 10 s, since the binding includes only ``<torch/library.h>`` rather than ``<torch/extension.h>``.

[Note: one build per source version]
The extension name (and so its build directory and its torch.ops namespace) carries the first 8 hex digits of
that hash too. torch's extensions directory is shared by every install on the machine: two checkouts or venvs
with different kernel sources would otherwise rebuild the same directory in turn, and a process could load the
library the other one just built, whose operator signature no longer matches its Python (seen as "adam_step()
is missing value for argument ..."). With the hash in the name each source version builds and loads its own.
The hash covers where the sources are, too (their real path, links resolved): the ninja file torch writes names
them by path, so two checkouts of the same sources sharing one directory rebuilt it in turn as well, each build
holding torch's lock on it while the other's processes waited. A test suite run from a fresh clone next to
another checkout, and a script importing this package through a linked directory (tests/test_profile_step.py's
``--tree``), rebuilt it that way, and one such wait outlasted the test's 240 s under load. Now each location builds
once and a linked directory is its target.

[Note: instruction set chosen from the CPU's flags, not -march=native]
The CPU kernel is compiled for AVX-512, AVX2 or plain scalar code according to ``/proc/cpuinfo``,
with explicit ``-m`` flags. ``-march=native`` would give the same command line on every machine, so a
build cache shared between machines (a network home directory, a CI cache) could hand a binary with
AVX-512 instructions to a CPU without them; explicit flags put the level into the command line, the
extension name and the op namespace, so each level is built and cached separately.

[Note: a build lock left behind]
torch builds an op holding a lock file in its build directory, and a process that finds the file waits for it to go,
without end. A process killed while building (Ctrl-C during the first run, a cancelled CI job) leaves the file
behind, and every later run then hung at its first op, silently (seen here: a killed test run left one, and the
next run's every test timed out in its session fixture). A build of ours takes seconds (a cold ``cpu_adam`` about
10 s, ``fused_adam``'s nvcc about a minute), so ``_wait_for_build_lock`` waits for a lock as torch would, but takes
one untouched for ``STALE_LOCK_S`` (15 minutes) for such a leftover: it removes it, with a warning naming the file,
and the build goes on.

Environment:
    ZERO_ENGINE_DISABLE_OPS     ``1``/``all`` disables every op, or a comma list such as ``cpu_adam``;
                                a disabled op fails to "build", which makes the fallback testable.
    ZERO_ENGINE_CPU_ADAM_SIMD   ``avx512``/``avx2``/``scalar``: build that level instead of the best one
                                the CPU supports (for tests and benchmarks).
"""

from __future__ import annotations

import hashlib
import importlib.resources
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

DISABLE_ENV = "ZERO_ENGINE_DISABLE_OPS"
SIMD_ENV = "ZERO_ENGINE_CPU_ADAM_SIMD"
OP_NAMES = ("cpu_adam", "fused_adam")

# A real directory: the compiler needs paths (a package imported from a zip has none, and its ops cannot build).
CSRC_DIR = Path(str(importlib.resources.files("zero_engine") / "csrc")).resolve()  # [Note: one build per source ...]
INCLUDE_DIR = CSRC_DIR / "includes"

_ERROR_TAIL_CHARS = 3000
STALE_LOCK_S = 15 * 60  # see [Note: a build lock left behind]


class OpBuildError(RuntimeError):
    """An op cannot be built or loaded here; ``reason`` says why and what would fix it."""

    def __init__(self, op_name: str, reason: str) -> None:
        self.op_name = op_name
        self.reason = reason
        super().__init__(f"cannot build op {op_name!r}: {reason}")


@dataclass(frozen=True)
class SimdLevel:
    name: str
    description: str
    cpu_flags: tuple[str, ...]  # all must be in /proc/cpuinfo's flags
    cflags: tuple[str, ...]


# Best first. The kernels need AVX-512F only (no BW/VL); F16C and FMA come with both vector levels.
SIMD_LEVELS = (
    SimdLevel("avx512", "AVX-512 kernel", ("avx512f", "avx2", "fma", "f16c"),
              ("-mavx512f", "-mavx2", "-mfma", "-mf16c", "-DZE_SIMD_AVX512")),
    SimdLevel("avx2", "AVX2 kernel", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c", "-DZE_SIMD_AVX2")),
    SimdLevel("scalar", "scalar kernel", (), ()),
)


@dataclass(frozen=True)
class BuildPlan:
    """Everything needed to build one op; ``name`` is both the extension name and the op namespace."""

    op_name: str
    name: str
    description: str
    sources: tuple[Path, ...]
    cflags: tuple[str, ...]
    cuda_cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    with_cuda: bool = False


_loaded_ops: dict[str, Any] = {}
_load_lock = threading.Lock()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo; empty where there is none (macOS, some containers)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def choose_simd_level(flags: frozenset[str] | None = None, requested: str | None = None) -> SimdLevel:
    """The best level the CPU supports, or ``requested`` (from $ZERO_ENGINE_CPU_ADAM_SIMD) if it is supported."""
    flags = cpu_flags() if flags is None else flags
    if requested is None:
        requested = os.environ.get(SIMD_ENV) or None
    by_name = {level.name: level for level in SIMD_LEVELS}
    if requested is not None:
        if requested not in by_name:
            raise ValueError(f"{SIMD_ENV}={requested!r} is not a kernel level; use one of {sorted(by_name)}")
        level = by_name[requested]
        missing = [flag for flag in level.cpu_flags if flag not in flags]
        if missing:
            raise OpBuildError("cpu_adam", f"{SIMD_ENV}={requested} asks for CPU flags this CPU lacks: {missing}")
        return level
    return next(level for level in SIMD_LEVELS if all(flag in flags for flag in level.cpu_flags))


def disabled_ops() -> frozenset[str]:
    value = os.environ.get(DISABLE_ENV, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return frozenset()
    if value in ("1", "all", "true", "yes"):
        return frozenset(OP_NAMES)
    return frozenset(part.strip() for part in value.split(",") if part.strip())


def _sources_hash(sources: tuple[Path, ...]) -> str:
    """Hash of the op's sources and of every shared header, their paths and contents (see [Note: when an op is
    rebuilt] and [Note: one build per source version])."""
    digest = hashlib.sha256()
    for path in sorted(sources) + sorted(INCLUDE_DIR.glob("*")):
        if path.is_file():
            digest.update(str(path.resolve()).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _require_sources(op_name: str, sources: tuple[Path, ...]) -> None:
    missing = [str(path) for path in sources if not path.is_file()]
    if missing:
        raise OpBuildError(op_name, f"source files not found: {missing} (zero_engine ships them as package "
                                    "data in zero_engine/csrc/: reinstall it, from a wheel or with pip install -e)")


def _require_host_toolchain(op_name: str) -> None:
    from torch.utils.cpp_extension import is_ninja_available

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise OpBuildError(op_name, f"no C++ compiler: {compiler!r} is not on PATH (install g++, or set CXX)")
    if not is_ninja_available():
        raise OpBuildError(op_name, "ninja is not available (pip install ninja)")


def find_nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").is_file():
        return str(Path(cuda_home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def nvcc_version(nvcc: str) -> str | None:
    """``"13.0"`` from ``nvcc --version``, or None if it does not run."""
    try:
        output = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+\.\d+)", output)
    return match.group(1) if match else None


def _require_cuda_toolchain(op_name: str) -> None:
    if torch.version.cuda is None:
        raise OpBuildError(op_name, f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None); "
                                    "install a CUDA build of torch")
    nvcc = find_nvcc()
    if nvcc is None:
        raise OpBuildError(op_name, "the CUDA toolkit was not found: no nvcc under $CUDA_HOME or on PATH")
    toolkit = nvcc_version(nvcc)
    if toolkit is None:
        raise OpBuildError(op_name, f"{nvcc} --version did not report a CUDA release")
    if toolkit.split(".")[0] != torch.version.cuda.split(".")[0]:
        raise OpBuildError(op_name, f"CUDA toolkit {toolkit} ({nvcc}) does not match torch's CUDA "
                                    f"{torch.version.cuda}; install a toolkit of major version "
                                    f"{torch.version.cuda.split('.')[0]} or point CUDA_HOME at one")
    if not torch.cuda.is_available():
        raise OpBuildError(op_name, "no CUDA device is visible (torch.cuda.is_available() is False)")


def plan_build(op_name: str) -> BuildPlan:
    """Check the prerequisites of ``op_name`` and say how to build it; raises OpBuildError if it cannot be."""
    if op_name not in OP_NAMES:
        raise ValueError(f"unknown op {op_name!r}; known ops: {list(OP_NAMES)}")
    if op_name in disabled_ops():
        raise OpBuildError(op_name, f"disabled by {DISABLE_ENV}={os.environ.get(DISABLE_ENV)}")
    if op_name == "cpu_adam":
        sources = (CSRC_DIR / "adam" / "cpu_adam.cpp",)
        _require_sources(op_name, sources)
        # -ffp-contract=off: the kernel writes every fused multiply-add it wants explicitly; the compiler must not
        # fuse others (e.g. the gradient's scaling into the moment update), which would round differently from
        # torch's separate grad.float() * coef and break the bitwise parity of the 16-bit gradient path.
        sources_hash = _sources_hash(sources)
        common_cflags = ("-O3", "-fno-math-errno", "-ffp-contract=off", f"-DZE_SOURCES_HASH=0x{sources_hash}")
        _require_host_toolchain(op_name)
        level = choose_simd_level()
        name = f"zero_engine_cpu_adam_{level.name}_{sources_hash[:8]}"  # see [Note: one build per source version]
        return BuildPlan(op_name=op_name, name=name, description=level.description, sources=sources,
                         cflags=common_cflags + level.cflags + ("-fopenmp", f"-DZE_OP_NAMESPACE={name}"),
                         ldflags=("-fopenmp",))
    sources = (CSRC_DIR / "adam" / "fused_adam_binding.cpp", CSRC_DIR / "adam" / "fused_adam.cu")
    _require_sources(op_name, sources)
    _require_host_toolchain(op_name)
    _require_cuda_toolchain(op_name)
    sources_hash = _sources_hash(sources)
    name = f"zero_engine_fused_adam_{sources_hash[:8]}"  # see [Note: one build per source version]
    hash_flag = f"-DZE_SOURCES_HASH=0x{sources_hash}"
    return BuildPlan(op_name=op_name, name=name, description="CUDA multi-tensor kernel", sources=sources,
                     cflags=("-O3", hash_flag, f"-DZE_OP_NAMESPACE={name}"), cuda_cflags=("-O3", hash_flag),
                     with_cuda=True)


def is_loaded(plan: BuildPlan) -> bool:
    return plan.name in _loaded_ops


def build_directory(plan: BuildPlan) -> str:
    """Where torch keeps (or will keep) this op's build; mirrors torch's own choice without creating it."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        accelerator = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{python}_{accelerator}")
    return os.path.join(root, plan.name)


def _wait_for_build_lock(directory: str, stale_after_s: float = STALE_LOCK_S, poll_s: float = 0.5) -> None:
    """Wait while another process builds in ``directory`` (its lock file exists); a lock untouched for
    ``stale_after_s`` was left by a killed build and is removed (see [Note: a build lock left behind])."""
    lock = os.path.join(directory, "lock")
    while True:
        try:
            age = time.time() - os.path.getmtime(lock)
        except OSError:
            return  # no lock (the usual case), or it just went
        if age > stale_after_s:
            logger.warning("removing %s, a build lock untouched for %.0f minutes: left by a build that was killed "
                           "(torch would wait for it forever)", lock, age / 60)
            try:
                os.remove(lock)
            except FileNotFoundError:
                pass
            return
        time.sleep(poll_s)


def load_op(op_name: str, *, verbose: bool = False) -> Any:
    """Build (first use) or load (cached) ``op_name`` and return its ``torch.ops`` namespace.

    Raises OpBuildError with the reason when a prerequisite is missing, the op is disabled, or the
    compiler fails (the error carries the end of the compiler's output).
    """
    plan = plan_build(op_name)
    with _load_lock:
        if plan.name in _loaded_ops:
            return _loaded_ops[plan.name]
        from torch.utils.cpp_extension import load

        started = time.perf_counter()
        _wait_for_build_lock(build_directory(plan))
        try:
            load(name=plan.name, sources=[str(path) for path in plan.sources], extra_cflags=list(plan.cflags),
                 extra_cuda_cflags=list(plan.cuda_cflags), extra_ldflags=list(plan.ldflags),
                 extra_include_paths=[str(INCLUDE_DIR)], with_cuda=plan.with_cuda, is_python_module=False,
                 verbose=verbose)
        except (RuntimeError, OSError, subprocess.SubprocessError, ImportError) as err:
            detail = str(err)[-_ERROR_TAIL_CHARS:]
            raise OpBuildError(op_name, f"compiling {plan.name} failed: {detail}") from err
        namespace = getattr(torch.ops, plan.name)
        _loaded_ops[plan.name] = namespace
        logger.info("loaded op %s (%s) in %.1f s", plan.name, plan.description, time.perf_counter() - started)
        return namespace
