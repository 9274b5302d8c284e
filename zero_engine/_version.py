"""The package version and the git commit, under DeepSpeed's names (``deepspeed.__version__``,
``__version_major__``..., ``__git_hash__``, ``__git_branch__``; read by scripts, bug-report tools and version checks).

``VERSION`` below is the one place the version is written: pyproject.toml's build reads it from this file, so the
installed distribution's metadata carries the same string. ``__version__`` is that metadata when zero_engine is
installed, else ``VERSION`` (a source checkout on the path, not installed).

The commit and branch are those of the git checkout zero_engine is imported from (a source tree, an editable
install), read from its ``.git`` files: git itself is never run at import (a subprocess is slow, and fails loudly
outside a checkout). An installed wheel has no checkout: "unknown", as DeepSpeed's builds without git say.
"""

from __future__ import annotations

import re
from pathlib import Path

VERSION = "0.1.0"
UNKNOWN = "unknown"


def installed_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("zero_engine")
    except metadata.PackageNotFoundError:
        return VERSION


def parse_version(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of "1.2.3", "1.2.3rc1+local" or "1.2" (a missing part is 0), as DeepSpeed exports."""
    match = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", version)
    if match is None:
        return 0, 0, 0
    return tuple(int(part or 0) for part in match.groups())  # type: ignore[return-value]


def git_info(root: Path | None = None) -> tuple[str, str]:
    """(short commit, branch) of the checkout at ``root`` (default: the one holding this package), as
    ``git rev-parse --short HEAD`` and ``--abbrev-ref HEAD`` print them ("HEAD" when detached); ("unknown",
    "unknown") when there is none or its files are not as expected."""
    root = Path(__file__).resolve().parent.parent if root is None else root
    try:
        return _read_checkout(root)
    except (OSError, ValueError, UnicodeDecodeError):
        return UNKNOWN, UNKNOWN


def _read_checkout(root: Path) -> tuple[str, str]:
    dot_git = root / ".git"
    if dot_git.is_file():  # a worktree (or submodule): "gitdir: <its own git directory>"
        pointer = dot_git.read_text().strip()
        if not pointer.startswith("gitdir:"):
            raise ValueError(pointer)
        git_dir = (root / pointer[len("gitdir:"):].strip()).resolve()
    else:
        git_dir = dot_git
    common = git_dir  # where a worktree's branches live
    if (git_dir / "commondir").is_file():
        common = (git_dir / (git_dir / "commondir").read_text().strip()).resolve()
    head = (git_dir / "HEAD").read_text().strip()
    if not head.startswith("ref: "):
        return head[:7], "HEAD"
    ref = head[len("ref: "):]
    branch = ref[len("refs/heads/"):] if ref.startswith("refs/heads/") else ref
    for base in (git_dir, common):
        if (base / ref).is_file():
            return (base / ref).read_text().strip()[:7], branch
    packed = common / "packed-refs"
    for line in packed.read_text().splitlines() if packed.is_file() else ():
        if line.endswith(" " + ref):
            return line.split()[0][:7], branch
    raise ValueError(f"{ref} has no commit yet")
