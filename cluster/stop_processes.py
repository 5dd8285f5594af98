"""Stop processes and all their descendants: SIGTERM, then SIGKILL what is left after a grace period.

    python cluster/stop_processes.py [--pid PID ...] [--cmdline TEXT ...] [--grace SECONDS]

--cmdline selects every process of this user whose command line contains TEXT (a Ray cluster's temp
dir or GCS port), so one cluster can be stopped without `ray stop`, which stops them all.
"""

import argparse
import os

import psutil


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pid", type=int, action="append", default=[])
    parser.add_argument("--cmdline", action="append", default=[])
    parser.add_argument("--grace", type=float, default=10.0)
    args = parser.parse_args()
    roots = [psutil.Process(p) for p in args.pid if p > 0 and psutil.pid_exists(p)]
    for proc in psutil.process_iter(["cmdline", "uids"]):
        command = " ".join(proc.info["cmdline"] or [])
        mine = proc.info["uids"] is not None and proc.info["uids"].real == os.getuid()
        if mine and proc.pid != os.getpid() and any(text in command for text in args.cmdline):
            roots.append(proc)
    victims = {p.pid: p for root in roots for p in [root, *_descendants(root)]}.values()
    for proc in victims:
        _signal(proc.terminate)
    _, alive = psutil.wait_procs(list(victims), timeout=args.grace)
    for proc in alive:
        _signal(proc.kill)


def _descendants(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _signal(send) -> None:
    try:
        send()
    except psutil.NoSuchProcess:
        pass


if __name__ == "__main__":
    main()
