"""tests/session_run.py: a launched command's processes end with the test, also when the command times out."""

import os
import subprocess
import sys
import time

import pytest

from session_run import run_in_session

# Starts a grandchild that would sleep for a minute, writes its pid, then sleeps itself (or exits at once). The
# grandchild does not hold the output pipes: else reading the output to its end would wait for it.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(float(sys.argv[2]))
"""


# The same, its grandchild in a session of its own (as torchrun starts its ranks), holding the output pipes if
# argv[3] says so (a command that finishes while something holds its pipes is waited for, as by subprocess.run).
PARENT_OF_A_SESSION = """
import subprocess, sys, time
out = None if sys.argv[3] == "pipes" else subprocess.DEVNULL
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True, stdout=out,
                         stderr=out)
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(float(sys.argv[2]))
"""


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie left for a parent that no longer reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads process states from /proc (Linux)")
def test_a_timed_out_command_takes_what_it_started_with_it(tmp_path):
    pid_file = tmp_path / "child.pid"
    with pytest.raises(subprocess.TimeoutExpired):  # 15 s: time for the parent to start on a loaded machine (at
        # 3 s the full suite here once timed it out before it had written its child's pid)
        run_in_session([sys.executable, "-c", PARENT, str(pid_file), "60"], timeout=15, capture_output=True)
    child = int(pid_file.read_text())
    assert _gone_within(child, 10), f"pid {child}, started by the timed-out command, is still running"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads process states from /proc (Linux)")
def test_a_finished_command_leaves_nothing_running_and_returns_as_subprocess_run(tmp_path):
    pid_file = tmp_path / "child.pid"
    done = run_in_session([sys.executable, "-c", PARENT + "print('done')", str(pid_file), "0"], timeout=60,
                          capture_output=True, text=True, check=True)
    assert (done.returncode, done.stdout) == (0, "done\n")
    child = int(pid_file.read_text())
    assert _gone_within(child, 10), f"pid {child}, left behind by the command, is still running"
    with pytest.raises(subprocess.CalledProcessError):
        run_in_session([sys.executable, "-c", "raise SystemExit(3)"], timeout=60, check=True)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads process states from /proc (Linux)")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("sleep", ["60", "0"])
def test_a_process_in_a_session_of_its_own_holding_the_pipes_is_killed_too(tmp_path, sleep):
    """[Note: torchrun's ranks are sessions of their own]: the command times out (60) while a process it started in
    a new session holds its output, or finishes (0) leaving one behind: that one is killed as well, and the call
    returns in seconds."""
    pid_file = tmp_path / "child.pid"
    started = time.monotonic()
    if sleep == "60":
        with pytest.raises(subprocess.TimeoutExpired):  # 15 s, as in the test above: time for the parent to start
            run_in_session([sys.executable, "-c", PARENT_OF_A_SESSION, str(pid_file), sleep, "pipes"], timeout=15,
                           capture_output=True)
    else:
        run_in_session([sys.executable, "-c", PARENT_OF_A_SESSION, str(pid_file), sleep, "none"], timeout=30,
                       capture_output=True, check=True)
    child = int(pid_file.read_text())
    assert _gone_within(child, 10), f"pid {child}, in a session of its own, is still running"
    assert time.monotonic() - started < 40
