"""Making a checkpoint visible all at once, and finding the newest complete one.

[Note: crash consistency]
A checkpoint is written into a staging directory ``<save_dir>/.<tag>.tmp-<nonce>`` that no reader looks at. Every
rank fsyncs its own files; once all have reported, rank 0 writes ``metadata.json`` (which lists every file's size
and checksum), fsyncs the staging directory, and renames it to ``<save_dir>/<tag>``. Only then is ``latest``
replaced, by writing ``latest.tmp``, fsyncing it and renaming it over ``latest``. So at every instant:

- a crash while ranks write (any rank, any byte) leaves only a staging directory: the previous checkpoint and
  ``latest`` are untouched; a later save removes the leftover once it is provably abandoned (below);
- ``<tag>`` either does not exist or is complete (renames are atomic), and ``latest`` names a complete directory.

Saving a tag that already exists must not leave a moment with no complete copy: the old directory is first renamed
to ``.<tag>.previous``, the new one renamed in, and the old one deleted. A crash between the two renames leaves
``.<tag>.previous`` complete; ``resolve_checkpoint`` falls back to it (reading only: loading never modifies a
checkpoint), and the next save of that tag cleans up.

[Note: several jobs, one save_dir]
Two jobs may save into the same directory (a restarted job while the old one still runs, two experiments sharing a
path). A save must never remove a staging directory another job is still writing. So a staging directory is named
after its job (``.<tag>.tmp-<host>-<pid>-<nonce>``, rank 0's process) and holds ``.owner.json`` (host, pid, the
process's start time, nonce). A save removes another staging directory only when it is provably abandoned (see
[Note: provably abandoned] in zero_engine/_owned_dirs.py, shared with NVMe swap directories): its owner ran on this
host, in this pid namespace, and that process is gone; or its owner ran elsewhere (another host, another container)
and nothing in it was modified for ``STALE_STAGING_S``.
Before the rename, rank 0 checks that every file the ranks reported is in the staging directory with the size they
wrote, so a directory emptied by anything else is never published (the SHA-256 of each file is in metadata.json and
checked at load). ``latest`` is replaced through a job-private temporary file.

[Note: several writers, one file]
``latest`` and the offline converter's output are single files that several processes may write at once: two jobs
sharing a save_dir, or every rank of a job calling convert_zero_checkpoint_to_fp32_state_dict as DeepSpeed's own
tests do. Each writer writes ``<file>.tmp-<host>-<pid>-<nonce>`` (its own), fsyncs it and renames it over the file
(``private_temporary``). A reader sees the old file or one writer's complete file, never a mix, and concurrent
converters write identical bytes, so whichever rename lands last leaves the same file. A temporary left by a
writer that was killed is removed by the next writer on the same host once that process is gone.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import uuid
from contextlib import contextmanager
from typing import Iterator

from .._owned_dirs import OWNER_FILE, STALE_S, abandoned_because, process_start_time, write_owner
from ._errors import CheckpointError
from ._metadata import LATEST_FILE, METADATA_FILE

log = logging.getLogger("zero_engine.checkpoint")

__all__ = ["check_tag", "check_dir_argument", "create_staging", "remove_stale_staging", "publish", "write_latest",
           "private_temporary", "resolve_checkpoint", "fsync_dir", "STALE_STAGING_S"]

_STAGING = re.compile(r"^\..+\.tmp-.+$")
_HOST_IN_NAME = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())  # in the names of staging dirs, temporaries
# A staging directory of another host (or without an owner file) untouched this long is taken as abandoned.
STALE_STAGING_S = STALE_S


def check_tag(tag: str) -> str:
    tag = str(tag)
    if not tag or tag in (".", "..", LATEST_FILE) or "/" in tag or "\\" in tag or tag.startswith(".") or \
            "\0" in tag:
        raise ValueError(f"checkpoint tag {tag!r}: a tag names a directory inside save_dir; use a plain name "
                         "such as 'global_step100' (no path separators, not starting with '.', not 'latest')")
    return tag


def check_dir_argument(call: str, name: str, value) -> str:
    """``value`` as a path string; ValueError for None or an empty path (DeepSpeed's ValueError for save_dir): an
    empty path would mean the current directory, which nobody means."""
    try:
        path = os.fspath(value)
    except TypeError:
        path = None
    if not isinstance(path, str) or not path:
        raise ValueError(f"{call}: {name} must be a non-empty path (a str or os.PathLike), got {value!r}")
    return path


def create_staging(save_dir: str, tag: str, nonce: str | None = None, owner_pid: int | None = None) -> str:
    """Create ``<save_dir>/.<tag>.tmp-<host>-<pid>-<nonce>`` owned by process ``owner_pid`` (default: this one).

    See [Note: several jobs, one save_dir]."""
    pid = os.getpid() if owner_pid is None else owner_pid
    nonce = nonce or uuid.uuid4().hex[:16]
    path = os.path.join(save_dir, f".{tag}.tmp-{_HOST_IN_NAME}-{pid}-{nonce}")
    os.mkdir(path)
    write_owner(path, pid, nonce=nonce)
    return path


def _previous_dir(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, f".{tag}.previous")


def fsync_dir(path: str) -> None:
    """Make a directory's entries (created or renamed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_staging(save_dir: str) -> list[str]:
    """Delete staging directories left by saves that provably crashed; returns their names.

    Another job's save in progress is left alone (see [Note: several jobs, one save_dir])."""
    removed = []
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        if not (_STAGING.match(name) and os.path.isdir(path)):
            continue
        reason = abandoned_because(path, STALE_STAGING_S)
        if reason is None:
            log.info("left %s alone: another save may still be writing it", path)
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.warning("removed incomplete checkpoint %s left by a save that did not finish (%s)", path, reason)
        removed.append(name)
    return removed


def check_staged_files(staging: str, expected_files: dict[str, int]) -> None:
    """Every file the ranks reported is in ``staging`` with the size they wrote, else CheckpointError."""
    problems = []
    for name, nbytes in sorted(expected_files.items()):
        try:
            size = os.stat(os.path.join(staging, name)).st_size
        except FileNotFoundError:
            problems.append(f"{name}: missing")
            continue
        if size != nbytes:
            problems.append(f"{name}: {size} bytes, expected {nbytes}")
    if problems:
        raise CheckpointError(f"not publishing {staging}: it does not hold what the ranks wrote ({'; '.join(problems)})"
                              "; was it removed or changed by another job saving into the same directory?")


def publish(save_dir: str, staging: str, tag: str, expected_files: dict[str, int] | None = None) -> str:
    """Rename a complete, fsynced staging directory to ``<save_dir>/<tag>`` (see [Note: crash consistency]).

    ``expected_files``: name -> size of every file the ranks wrote; checked before anything is renamed."""
    if expected_files is not None:
        check_staged_files(staging, expected_files)
    try:
        os.remove(os.path.join(staging, OWNER_FILE))  # bookkeeping of the save, not part of the checkpoint
    except FileNotFoundError:
        pass
    fsync_dir(staging)
    final = os.path.join(save_dir, tag)
    previous = _previous_dir(save_dir, tag)
    if os.path.isdir(final):
        if os.path.isdir(previous):  # a complete `final` exists, so this is an older leftover
            shutil.rmtree(previous)
        os.rename(final, previous)
    os.rename(staging, final)
    fsync_dir(save_dir)
    if os.path.isdir(previous):
        shutil.rmtree(previous)
    return final


@contextmanager
def private_temporary(path: str) -> Iterator[str]:
    """Yield a temporary path of this writer's own; when the block has written (and fsynced) it, rename it over
    ``path``. On an exception the temporary is removed and ``path`` is untouched. See [Note: several writers, one
    file]."""
    _remove_abandoned_temporaries(path)
    tmp = f"{path}.tmp-{_HOST_IN_NAME}-{os.getpid()}-{uuid.uuid4().hex[:16]}"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(os.path.dirname(path) or ".")


def _remove_abandoned_temporaries(path: str) -> None:
    directory, name = os.path.split(path)
    pattern = re.compile(re.escape(name) + r"\.tmp-(.+)-(\d+)-[0-9a-f]+$")
    try:
        entries = os.listdir(directory or ".")
    except OSError:
        return
    for entry in entries:
        match = pattern.match(entry)
        if match and match.group(1) == _HOST_IN_NAME and process_start_time(int(match.group(2))) is None:
            try:
                os.remove(os.path.join(directory, entry))
            except OSError:
                pass  # another writer removed it first


def write_latest(save_dir: str, tag: str) -> None:
    with private_temporary(os.path.join(save_dir, LATEST_FILE)) as tmp:
        with open(tmp, "w") as f:
            f.write(tag)
            f.flush()
            os.fsync(f.fileno())


def _tags_in(directory: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(directory)
                      if os.path.isfile(os.path.join(directory, n, METADATA_FILE)) and not n.startswith("."))
    except OSError:
        return []


def resolve_checkpoint(load_dir: str, tag: str | None, missing_ok: bool = False) -> tuple[str, str] | None:
    """``(directory, tag)`` of the checkpoint to load; None when ``tag`` is None and there is no ``latest``.

    ``load_dir`` is the save_dir given to save_checkpoint; a checkpoint directory itself (holding metadata.json)
    is accepted too when no tag is given. A ``load_dir`` that does not exist is an error (a typo in a resume path
    must not silently start from scratch) unless ``missing_ok``, which returns None as DeepSpeed does.
    """
    load_dir = os.path.abspath(os.fspath(load_dir))
    if not os.path.isdir(load_dir):
        if missing_ok:
            return None
        what = "is not a directory" if os.path.exists(load_dir) else "does not exist"
        raise CheckpointError(f"load_dir {load_dir} {what}; check the path, or pass missing_ok=True to start from "
                              "scratch when nothing was saved there yet")
    if tag is None:
        if os.path.isfile(os.path.join(load_dir, METADATA_FILE)):
            return load_dir, os.path.basename(load_dir)
        latest = os.path.join(load_dir, LATEST_FILE)
        if not os.path.isfile(latest):
            return None
        try:
            with open(latest, "rb") as f:
                tag = f.read().decode("utf-8").strip()
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"{latest} is not UTF-8 text ({exc.reason} at byte {exc.start}); it should hold "
                                  f"the tag of a checkpoint in {load_dir}; pass tag= (tags there: "
                                  f"{_tags_in(load_dir)})") from None
        if not tag:
            raise CheckpointError(f"{latest} is empty; pass tag= (tags in {load_dir}: {_tags_in(load_dir)})")
    tag = check_tag(tag)
    path = os.path.join(load_dir, tag)
    if os.path.isdir(path):
        return path, tag
    previous = _previous_dir(load_dir, tag)
    if os.path.isfile(os.path.join(previous, METADATA_FILE)):
        log.warning("checkpoint %s: the directory is missing but %s is complete (a save of the same tag was "
                    "interrupted); loading that", path, previous)
        return previous, tag
    raise CheckpointError(f"checkpoint {tag!r} not found: no directory {path} (complete checkpoints in {load_dir}: "
                          f"{_tags_in(load_dir) or 'none'})")
