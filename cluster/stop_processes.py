"""Record the processes of a local stack, and later stop exactly those (and what they started).

    python cluster/stop_processes.py record --out FILE [--pid PID ...] [--cmdline TEXT ...]
    python cluster/stop_processes.py stop FILE [--grace SECONDS]

`record` writes each process's pid and start time: the given pids, and this user's processes whose
command line contains TEXT (a Ray cluster's own temp dir; at least 12 characters, so that a short or
empty pattern cannot select unrelated processes). `stop` sends SIGTERM to the recorded processes that
still run with the same start time (a pid the system has since given to another process is left alone)
and to their descendants, then SIGKILL after a grace period, and names what it could not stop.
`ray stop` would stop every Ray cluster of the machine, a test session's included.
"""

import argparse
import json
import os
import sys

import psutil

MIN_PATTERN = 12


def record(out: str, pids: list[int], patterns: list[str]) -> None:
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
        json.dump(rows, f, indent=1)


def stop(recorded: str, grace: float) -> int:
    if not os.path.exists(recorded):
        print(f"nothing recorded at {recorded}: nothing stopped")
        return 1
    roots = []
    for row in json.load(open(recorded)):
        try:
            proc = psutil.Process(row["pid"])
            if abs(proc.create_time() - row["started"]) < 1.0:
                roots.append(proc)
        except psutil.NoSuchProcess:
            pass
    victims = {p.pid: p for root in roots for p in [root, *_descendants(root)]}.values()
    for proc in victims:
        _signal(proc.terminate)
    _, alive = psutil.wait_procs(list(victims), timeout=grace)
    for proc in alive:
        _signal(proc.kill)
    _, still = psutil.wait_procs(alive, timeout=5)
    for proc in still:
        print(f"could not stop pid {proc.pid}", file=sys.stderr)
    return 1 if still else 0


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
    rec.add_argument("--pid", type=int, action="append", default=[])
    rec.add_argument("--cmdline", action="append", default=[])
    st = commands.add_parser("stop")
    st.add_argument("recorded")
    st.add_argument("--grace", type=float, default=10.0)
    args = parser.parse_args()
    if args.command == "record":
        record(args.out, args.pid, args.cmdline)
        return 0
    return stop(args.recorded, args.grace)


if __name__ == "__main__":
    sys.exit(main())
