"""Directories owned by one process (checkpoint staging, NVMe swap), and when one is provably abandoned.

[Note: provably abandoned]
A directory that a process writes for a while (a checkpoint being staged, a rank's NVMe swap files) holds
``.owner.json``: host, pid, the process's start time. Another process may delete it only when it is provably
abandoned: its owner ran on this host and that process is gone (pid not running, a zombie, or running but started
at another time: the pid was reused); or its owner ran elsewhere, or it has no owner file (liveness cannot be
checked from here), and nothing in it was modified for ``STALE_S`` (a day). A live job's directory is never touched,
whoever shares the path.
"""

from __future__ import annotations

import json
import os
import socket
import time

import psutil

__all__ = ["OWNER_FILE", "STALE_S", "process_start_time", "write_owner", "abandoned_because"]

OWNER_FILE = ".owner.json"
STALE_S = 24 * 3600.0
_HOST = socket.gethostname()


def process_start_time(pid: int) -> float | None:
    """When process ``pid`` started (None: no such process); with the pid it identifies a process uniquely."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process.create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:
        return -1.0  # it exists (another user's); its start time is unknown


def write_owner(directory: str, pid: int | None = None, **extra) -> dict:
    """Write ``directory/.owner.json`` naming process ``pid`` (default: this one) on this host as its owner."""
    pid = os.getpid() if pid is None else pid
    owner = {"host": _HOST, "pid": pid, "started": process_start_time(pid), **extra}
    with open(os.path.join(directory, OWNER_FILE), "x") as f:
        json.dump(owner, f)
    return owner


def _last_modified(path: str) -> float:
    newest = os.stat(path).st_mtime
    for root, dirs, files in os.walk(path):
        for name in files + dirs:
            try:
                newest = max(newest, os.stat(os.path.join(root, name)).st_mtime)
            except OSError:
                pass
    return newest


def abandoned_because(path: str, stale_s: float = STALE_S) -> str | None:
    """Why the directory at ``path`` is provably abandoned, or None when its owner may still use it."""
    try:
        with open(os.path.join(path, OWNER_FILE)) as f:
            owner = json.load(f)
    except (OSError, ValueError):
        owner = None
    if isinstance(owner, dict) and owner.get("host") == _HOST and isinstance(owner.get("pid"), int):
        started = process_start_time(owner["pid"])
        if started is None:
            return f"its owner, pid {owner['pid']} on this host, has exited"
        if started != -1.0 and owner.get("started") not in (None, started):
            return f"its owner, pid {owner['pid']} on this host, has exited (the pid now names another process)"
        return None
    try:
        age = time.time() - _last_modified(path)
    except OSError:
        return None  # removed meanwhile (its owner closed it)
    if age > stale_s:
        where = f"owned by host {owner.get('host')}" if isinstance(owner, dict) else "without an owner file"
        return f"{where}, nothing written in it for {age / 3600:.1f} h"
    return None
