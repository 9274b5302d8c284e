"""``run_in_session``: ``subprocess.run`` for the tests that launch ranks (torchrun, a script that forks workers).

``subprocess.run``'s timeout kills the launcher alone. A rank that hangs then outlives its test: after a
bench/comm_floor.py rank hung at exit in CI (see [Note: the group's last holder] in bench/_worker.py), that rank
was still there 20 minutes after its test had failed, and the job's later tests shared the machine with it. Here
the command runs in a session of its own, and the session is killed when the command ends or times out: nothing
it started outlives the test.
"""

from __future__ import annotations

import os
import signal
import subprocess


def run_in_session(cmd, *, timeout: float, check: bool = False, capture_output: bool = False,
                   input=None, **kwargs) -> subprocess.CompletedProcess:
    """As ``subprocess.run(cmd, timeout=..., check=..., capture_output=..., input=..., **kwargs)``, and every
    process the command started is killed when it returns or times out (``TimeoutExpired`` then, as there)."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with subprocess.Popen(cmd, start_new_session=True, **kwargs) as proc:
        try:
            stdout, stderr = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_session(proc.pid)
            stdout, stderr = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, output=stdout, stderr=stderr) from None
        finally:
            _kill_session(proc.pid)  # what the command left behind (it exited, its children may not have)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if check:
        done.check_returncode()
    return done


def _kill_session(session: int) -> None:
    try:
        os.killpg(session, signal.SIGKILL)
    except ProcessLookupError:  # nothing left in it
        pass
