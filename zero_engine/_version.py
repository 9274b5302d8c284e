"""The package version and the build's git commit, under DeepSpeed's names (``deepspeed.__version__``,
``__version_major__``..., ``__git_hash__``, ``__git_branch__``; read by scripts, bug-report tools and version checks).

``VERSION`` below is the one place the version is written: the build reads it from this file (setup.py), so the
installed distribution's metadata carries the same string. ``__version__`` is that metadata when zero_engine is
installed, else ``VERSION`` (a source checkout on the path). The git commit and branch are known only at build time:
the build writes them into ``_git_info.py`` (never run git at import: it is slow, and fails loudly outside a
checkout); without that file they are "unknown", as in DeepSpeed's own builds without git.
"""

from __future__ import annotations

import re

VERSION = "0.1.0"


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


def git_info() -> tuple[str, str]:
    """(commit, branch) written by the build, or ("unknown", "unknown")."""
    try:
        from ._git_info import git_branch, git_hash
    except ImportError:
        return "unknown", "unknown"
    return git_hash, git_branch
