"""NVMe swap directories after a crash: removed on SIGTERM, reclaimed by the next run when provably abandoned.

[Note: swap after a crash]
A rank's swap files are GiBs; a job that dies must not leave them behind for the next run to trip over (ENOSPC).
* SIGTERM (torchrun sends it to the surviving ranks when one fails; schedulers send it before a kill): while this
  process has a store open, a SIGTERM handler removes its swap directories and then ends the process as the default
  action would (the signal is re-raised with the default disposition, so the exit status still says SIGTERM). If
  another handler was installed before (a trainer that saves a checkpoint on SIGTERM), it is called instead and
  decides: the files are left for it (a checkpoint reads optimizer states from them), and removed when the process
  exits. With SIGTERM ignored, nothing is installed. The previous handler is restored when the last store closes.
* SIGKILL, an OOM kill or a power loss run no code. So each run directory holds ``.owner.json`` and a new store
  removes the run directories under ``nvme_path`` that are provably abandoned (see [Note: provably abandoned] in
  zero_engine/_owned_dirs.py, the rule checkpoint staging uses: owner process gone on this host and in this pid
  namespace, or another host's or another container's directory untouched for a day), never another live job's.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import threading

from .._owned_dirs import abandoned_because

__all__ = ["reclaim_abandoned", "remember_run_dir", "forget_run_dir"]

log = logging.getLogger("zero_engine.offload")

_RUN_DIR = re.compile(r"^zero_engine-.+-\d+-rank\d+$")


def reclaim_abandoned(nvme_path: str) -> list[str]:
    """Remove the swap run directories under ``nvme_path`` whose owner is provably gone (see [Note: swap after a
    crash]); returns their names."""
    removed = []
    try:
        names = sorted(os.listdir(nvme_path))
    except OSError:
        return removed
    for name in names:
        path = os.path.join(nvme_path, name)
        if not _RUN_DIR.match(name) or not os.path.isdir(path):
            continue
        reason = abandoned_because(path)
        if reason is None:
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.warning("zero_engine: removed NVMe swap directory %s left by a run that did not finish (%s)", path, reason)
        removed.append(name)
    return removed


# ---- SIGTERM ----------------------------------------------------------------------------------------------------
_open_run_dirs: dict[str, int] = {}  # run directory -> stores of this process open in it
_previous_sigterm = None  # the handler ours replaced, while ours is installed
_sigterm_installed = False


def remember_run_dir(run_dir: str) -> None:
    """A store opened in ``run_dir``: remove it on SIGTERM until ``forget_run_dir``."""
    _open_run_dirs[run_dir] = _open_run_dirs.get(run_dir, 0) + 1
    _install_sigterm_cleanup()


def forget_run_dir(run_dir: str) -> None:
    """A store in ``run_dir`` closed (and removed its files)."""
    left = _open_run_dirs.pop(run_dir, 0) - 1
    if left > 0:
        _open_run_dirs[run_dir] = left
    _restore_sigterm_if_unused()


def _install_sigterm_cleanup() -> None:
    global _previous_sigterm, _sigterm_installed
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; atexit and the next run's reclaim remain
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN or previous is None:
        return  # SIGTERM does not end this process, or a handler set outside Python that cannot be chained
    signal.signal(signal.SIGTERM, _on_sigterm)
    _previous_sigterm, _sigterm_installed = previous, True


def _restore_sigterm_if_unused() -> None:
    global _previous_sigterm, _sigterm_installed
    if not _sigterm_installed or _open_run_dirs or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:  # else someone replaced ours since: leave theirs
        signal.signal(signal.SIGTERM, _previous_sigterm)
    _previous_sigterm, _sigterm_installed = None, False


def _on_sigterm(signum, frame) -> None:
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)  # its owner decides; if it exits, atexit closes the stores
        return
    for run_dir in list(_open_run_dirs):  # the default action ends the process now, without atexit
        shutil.rmtree(run_dir, ignore_errors=True)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
