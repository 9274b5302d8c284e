"""``run_in_session``: ``subprocess.run`` for the tests that launch ranks (torchrun, a script that forks workers).

``subprocess.run``'s timeout kills the launcher alone. A rank that hangs then outlives its test: after a
bench/comm_floor.py rank hung at exit in CI (see [Note: the group's last holder] in bench/_worker.py), that rank
was still there 20 minutes after its test had failed, and the job's later tests shared the machine with it. Here
the command runs in a session of its own, and everything it started is killed when it ends or times out: nothing
it started outlives the test.

[Note: torchrun's ranks are sessions of their own]
Killing the command's session is not enough: torchrun starts each rank with ``start_new_session=True`` (torch's
elastic ``SubprocessHandler``), so its ranks are outside the session, and they hold the output pipes. A Trainer
test's torchrun that timed out under load had its agent killed and its two ranks training on; reading the output
to its end then waited for them, past pytest's own timeout. So the command also gets a tag in its environment
(``ZERO_ENGINE_TEST_RUN``), which every process it starts inherits, sessions of their own included, and what carries
the tag is killed too (psutil reads the environments). Reading what is left of the output after a kill waits a few
seconds at most.
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid

import psutil

_TAG = "ZERO_ENGINE_TEST_RUN"
_DRAIN_S = 10.0  # reading the output after a kill: whatever holds the pipes still is not waited for


def run_in_session(cmd, *, timeout: float, check: bool = False, capture_output: bool = False,
                   input=None, **kwargs) -> subprocess.CompletedProcess:
    """As ``subprocess.run(cmd, timeout=..., check=..., capture_output=..., input=..., **kwargs)``, and every
    process the command started is killed when it returns or times out (``TimeoutExpired`` then, as there)."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    tag = uuid.uuid4().hex
    kwargs["env"] = {**(kwargs.get("env") or os.environ), _TAG: tag}
    with subprocess.Popen(cmd, start_new_session=True, **kwargs) as proc:
        try:
            stdout, stderr = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_everything(proc.pid, tag)
            stdout, stderr = _drain(proc)
            raise subprocess.TimeoutExpired(proc.args, timeout, output=stdout, stderr=stderr) from None
        finally:
            _kill_everything(proc.pid, tag)  # what the command left behind (it exited, its children may not have)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if check:
        done.check_returncode()
    return done


def _kill_everything(session: int, tag: str) -> None:
    """The command's session, and every process carrying its tag (see [Note: torchrun's ranks are sessions of their
    own])."""
    try:
        os.killpg(session, signal.SIGKILL)
    except ProcessLookupError:  # nothing left in it
        pass
    me = os.getpid()
    for process in psutil.process_iter():
        try:
            if process.pid != me and process.environ().get(_TAG) == tag:
                process.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass


def _drain(proc: subprocess.Popen):
    """What the command wrote, read for ``_DRAIN_S`` at most once everything was killed."""
    try:
        return proc.communicate(timeout=_DRAIN_S)
    except subprocess.TimeoutExpired as still:  # a process we could not see holds a pipe: its output is left
        return still.output, still.stderr
