"""Directories owned by one process (checkpoint staging, NVMe swap), and when one is provably abandoned.

[Note: provably abandoned]
A directory that a process writes for a while (a checkpoint being staged, a rank's NVMe swap files) holds
``.owner.json``: host, pid, the process's start time, and the kernel and pid namespace it ran in (boot id, pid
namespace). Another process may delete it only when it is provably abandoned:

* its owner ran on this host, under this kernel and in this pid namespace, and that process is gone (pid not
  running, a zombie, or running but started at another time: the pid was reused);
* its owner ran on this host before the host restarted (another boot id): every process of that boot is gone;
* otherwise liveness cannot be checked from here (another host; another pid namespace on this host, i.e. another
  container, where the owner's pid means nothing here; no owner file), and nothing in it was modified for
  ``STALE_S`` (a day).

Containers with the host's network share its hostname (``docker --network host``, Kubernetes ``hostNetwork``) but
not its pids: two jobs on one machine sharing an NVMe or checkpoint path would otherwise each see the other's owner
pid as "not running" (or as an unrelated process of their own started at another time) and delete a live job's
files. An owner file without the boot id and namespace (written by an older version) is checked by pid, as then. A
live job's directory is never touched, whoever shares the path.
"""

from __future__ import annotations

import json
import os
import socket
import time

import psutil

__all__ = ["OWNER_FILE", "STALE_S", "process_start_time", "boot_id", "pid_namespace", "write_owner",
           "abandoned_because"]

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


def boot_id() -> str:
    """This kernel's boot id ("" where /proc cannot tell): it changes when the machine restarts."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def pid_namespace() -> str:
    """The pid namespace this process sees ("" where /proc cannot tell): two processes can look up each other's
    pids exactly when they share it (and the kernel)."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def write_owner(directory: str, pid: int | None = None, **extra) -> dict:
    """Write ``directory/.owner.json`` naming process ``pid`` (default: this one, in this pid namespace on this
    host) as its owner."""
    pid = os.getpid() if pid is None else pid
    owner = {"host": _HOST, "pid": pid, "started": process_start_time(pid), "boot": boot_id(),
             "pid_namespace": pid_namespace(), **extra}
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
    here = isinstance(owner, dict) and owner.get("host") == _HOST and isinstance(owner.get("pid"), int)
    if here and owner.get("boot") and boot_id() and owner["boot"] != boot_id():
        return f"its owner, pid {owner['pid']} on this host, ran before the host restarted"
    if here and owner.get("pid_namespace", pid_namespace()) == pid_namespace():
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
        if here:
            where = f"owned by pid {owner['pid']} in another pid namespace (another container) on this host"
        else:
            where = f"owned by host {owner.get('host')}" if isinstance(owner, dict) else "without an owner file"
        return f"{where}, nothing written in it for {age / 3600:.1f} h"
    return None
