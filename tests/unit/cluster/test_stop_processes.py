"""cluster/stop_processes.py, as local-down.sh runs it: it stops the recorded processes, what they started, and
what the stack started whose parent has gone (found by the stack's id), and leaves every other process alone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from tests.helpers import REPO

SCRIPT = REPO / "cluster" / "stop_processes.py"
SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]


def _orphan_with_the_stack_id(stack_id: str, pid_file) -> psutil.Process:
    """A sleeper whose parent exits at once (as a Ray process started by a dying one): no one's descendant."""
    spawn = (f"import subprocess; p = subprocess.Popen({SLEEP!r}); open({str(pid_file)!r}, 'w').write(str(p.pid))")
    subprocess.run([sys.executable, "-c", spawn], env={**os.environ, "FINETUNE_STACK_ID": stack_id}, check=True)
    return psutil.Process(int(pid_file.read_text()))


def _ended(proc: psutil.Process) -> bool:
    """Gone, or a zombie (dead; its parent, init here, has not reaped it yet)."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_stop_ends_the_recorded_their_children_and_the_stacks_orphans_and_nothing_else(tmp_path):
    stack_id = "a1b2c3d4" * 4
    recorded = subprocess.Popen([sys.executable, "-c", f"import subprocess; subprocess.Popen({SLEEP!r}).wait()"])
    orphan = _orphan_with_the_stack_id(stack_id, tmp_path / "orphan.pid")
    other = subprocess.Popen(SLEEP, env={**os.environ, "FINETUNE_STACK_ID": "another-stack"})
    decoy = subprocess.Popen(SLEEP)
    try:
        deadline = time.monotonic() + 30
        while not psutil.Process(recorded.pid).children() and time.monotonic() < deadline:
            time.sleep(0.1)
        child = psutil.Process(recorded.pid).children()[0]
        record = tmp_path / "processes.json"
        subprocess.run([sys.executable, str(SCRIPT), "record", "--out", str(record), "--stack-id", stack_id,
                        "--pid", str(recorded.pid)], check=True)
        stop = subprocess.run([sys.executable, str(SCRIPT), "stop", str(record), "--grace", "5"],
                              capture_output=True, text=True)
        assert stop.returncode == 0, stop.stderr
        recorded.wait(timeout=10)
        assert _ended(child) and _ended(orphan)
        assert other.poll() is None and decoy.poll() is None
    finally:
        for proc in (recorded, other, decoy):
            proc.kill()
        if not _ended(orphan):
            orphan.kill()
