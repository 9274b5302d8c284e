"""Making a checkpoint visible all at once, and finding the newest complete one.

[Note: crash consistency]
A checkpoint is written into a staging directory ``<save_dir>/.<tag>.tmp-<nonce>`` that no reader looks at. Every
rank fsyncs its own files; once all have reported, rank 0 writes ``metadata.json`` (which lists every file's size
and checksum), fsyncs the staging directory, and renames it to ``<save_dir>/<tag>``. Only then is ``latest``
replaced, by writing ``latest.tmp``, fsyncing it and renaming it over ``latest``. So at every instant:

- a crash while ranks write (any rank, any byte) leaves only a staging directory: the previous checkpoint and
  ``latest`` are untouched; the next save removes the leftover;
- ``<tag>`` either does not exist or is complete (renames are atomic), and ``latest`` names a complete directory.

Saving a tag that already exists must not leave a moment with no complete copy: the old directory is first renamed
to ``.<tag>.previous``, the new one renamed in, and the old one deleted. A crash between the two renames leaves
``.<tag>.previous`` complete; ``resolve_checkpoint`` falls back to it (reading only: loading never modifies a
checkpoint), and the next save of that tag cleans up.
"""

from __future__ import annotations

import logging
import os
import re
import shutil

from ._errors import CheckpointError
from ._metadata import LATEST_FILE, METADATA_FILE

log = logging.getLogger("zero_engine.checkpoint")

__all__ = ["check_tag", "staging_dir", "remove_stale_staging", "publish", "write_latest", "resolve_checkpoint",
           "fsync_dir"]

_STAGING = re.compile(r"^\..+\.tmp-[0-9a-f]+$")


def check_tag(tag: str) -> str:
    tag = str(tag)
    if not tag or tag in (".", "..", LATEST_FILE) or "/" in tag or "\\" in tag or tag.startswith(".") or \
            "\0" in tag:
        raise ValueError(f"checkpoint tag {tag!r}: a tag names a directory inside save_dir; use a plain name "
                         "such as 'global_step100' (no path separators, not starting with '.', not 'latest')")
    return tag


def staging_dir(save_dir: str, tag: str, nonce: str) -> str:
    return os.path.join(save_dir, f".{tag}.tmp-{nonce}")


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
    """Delete staging directories left by saves that crashed; returns their names."""
    removed = []
    for name in os.listdir(save_dir):
        if _STAGING.match(name) and os.path.isdir(os.path.join(save_dir, name)):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
            removed.append(name)
    if removed:
        log.warning("removed %d incomplete checkpoint(s) left by an earlier save that did not finish: %s",
                    len(removed), ", ".join(removed))
    return removed


def publish(save_dir: str, staging: str, tag: str) -> str:
    """Rename a complete, fsynced staging directory to ``<save_dir>/<tag>`` (see [Note: crash consistency])."""
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


def write_latest(save_dir: str, tag: str) -> None:
    path = os.path.join(save_dir, LATEST_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(save_dir)


def _tags_in(directory: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(directory)
                      if os.path.isfile(os.path.join(directory, n, METADATA_FILE)) and not n.startswith("."))
    except OSError:
        return []


def resolve_checkpoint(load_dir: str, tag: str | None) -> tuple[str, str] | None:
    """``(directory, tag)`` of the checkpoint to load; None when ``tag`` is None and there is no ``latest``.

    ``load_dir`` is the save_dir given to save_checkpoint; a checkpoint directory itself (holding metadata.json)
    is accepted too when no tag is given.
    """
    load_dir = os.path.abspath(os.fspath(load_dir))
    if tag is None:
        if os.path.isfile(os.path.join(load_dir, METADATA_FILE)):
            return load_dir, os.path.basename(load_dir)
        latest = os.path.join(load_dir, LATEST_FILE)
        if not os.path.isfile(latest):
            return None
        with open(latest) as f:
            tag = f.read().strip()
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
