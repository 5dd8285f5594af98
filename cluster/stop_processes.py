"""Record the processes of a local stack, and later stop exactly those (and what they started).

    python cluster/stop_processes.py record --out FILE [--stack-id ID] [--pid PID ...] [--cmdline TEXT ...]
    python cluster/stop_processes.py stop FILE [--grace SECONDS]

`record` writes each process's pid and start time: the given pids, and this user's processes whose
command line contains TEXT (a Ray cluster's own temp dir; at least 12 characters, so that a short or
empty pattern cannot select unrelated processes). `stop` sends SIGTERM to the recorded processes that
still run with the same start time (a pid the system has since given to another process is left alone),
to their descendants, and to this user's processes whose environment carries the stack's id
(`FINETUNE_STACK_ID`, which local-up.sh gives the processes it starts and they pass on), then SIGKILL after
a grace period; it goes round again for what the stopping processes started meanwhile (a process whose
parent died before the first round is no one's descendant: the id finds it), and names what it could not
stop. `ray stop` would stop every Ray cluster of the machine, a test session's included.
"""

import argparse
import json
import os
import sys
import time

import psutil

MIN_PATTERN = 12
STACK_ID = "FINETUNE_STACK_ID"
ROUNDS = 3


def record(out: str, stack_id: str, pids: list[int], patterns: list[str]) -> None:
    short = [p for p in patterns if len(p.strip()) < MIN_PATTERN]
    if short:
        sys.exit(f"refusing command-line pattern {short[0]!r}: shorter than {MIN_PATTERN} characters")
    chosen = {p: psutil.Process(p) for p in pids if p > 0 and psutil.pid_exists(p)}
    for proc in psutil.process_iter(["cmdline", "uids"]):
        command = " ".join(proc.info["cmdline"] or [])
        mine = proc.info["uids"] is not None and proc.info["uids"].real == os.getuid()
        if mine and proc.pid != os.getpid() and any(p in command for p in patterns):
            chosen[proc.pid] = proc
    rows = [{"pid": p.pid, "started": p.create_time(), "cmdline": " ".join(p.cmdline())[:200]}
            for p in chosen.values()]
    with open(out, "w") as f:
        json.dump({"stack_id": stack_id, "processes": rows}, f, indent=1)


def stop(recorded: str, grace: float) -> int:
    if not os.path.exists(recorded):
        print(f"nothing recorded at {recorded}: nothing stopped")
        return 1
    with open(recorded) as f:
        content = json.load(f)
    rows, stack_id = (content, "") if isinstance(content, list) else (content["processes"], content["stack_id"])
    roots = [proc for proc in map(_recorded_process, rows) if proc is not None]
    still: list[psutil.Process] = []
    for _ in range(ROUNDS):
        victims = {p.pid: p for root in roots for p in [root, *_descendants(root)]}
        victims |= {p.pid: p for p in _carrying(stack_id)}
        victims = {pid: p for pid, p in victims.items() if not _ended(p)}
        if not victims:
            break
        still = _terminate(list(victims.values()), grace)
    for proc in still:
        print(f"could not stop pid {proc.pid}", file=sys.stderr)
    return 1 if still else 0


def _recorded_process(row: dict) -> psutil.Process | None:
    try:
        proc = psutil.Process(row["pid"])
        return proc if abs(proc.create_time() - row["started"]) < 1.0 else None
    except psutil.NoSuchProcess:
        return None


def _carrying(stack_id: str) -> list[psutil.Process]:
    """This user's processes whose environment names the stack (none for a record without an id)."""
    found = []
    for proc in psutil.process_iter(["uids"]) if stack_id else []:
        try:
            if proc.info["uids"].real == os.getuid() and proc.pid != os.getpid() \
                    and proc.environ().get(STACK_ID) == stack_id:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, AttributeError):
            pass
    return found


def _terminate(victims: list[psutil.Process], grace: float) -> list[psutil.Process]:
    """SIGTERM, SIGKILL after `grace` seconds; the processes still alive after both (a zombie has ended: only its
    parent can reap it)."""
    for proc in victims:
        _signal(proc.terminate)
    alive = _wait(victims, grace)
    for proc in alive:
        _signal(proc.kill)
    return _wait(alive, 5)


def _wait(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (alive := [p for p in procs if not _ended(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _ended(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _descendants(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _signal(send) -> None:
    try:
        send()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record")
    rec.add_argument("--out", required=True)
    rec.add_argument("--stack-id", default="", help=f"the {STACK_ID} the stack's processes carry")
    rec.add_argument("--pid", type=int, action="append", default=[])
    rec.add_argument("--cmdline", action="append", default=[])
    st = commands.add_parser("stop")
    st.add_argument("recorded")
    st.add_argument("--grace", type=float, default=10.0)
    args = parser.parse_args()
    if args.command == "record":
        record(args.out, args.stack_id, args.pid, args.cmdline)
        return 0
    return stop(args.recorded, args.grace)


if __name__ == "__main__":
    sys.exit(main())
