"""The hold on a run directory: one writer at a time, a new run never reusing a directory, a resumed run
finding its own.

The claim (`writer.json`, naming the job) is taken before the MLflow run is created, so of two jobs
started with one run name (two `--resume X` at once, or two new runs racing) the second stops with one
line and leaves nothing behind. A claim whose job is gone is stale and taken over by the next job:
- made on this host: its process has ended (pid and start time, so a reused pid does not count);
- made on another host (a pod restarted under another name, a lost node): its owner renews it every
  LEASE_SECONDS / 10 while it runs, so one not renewed for LEASE_SECONDS has no owner left;
- empty or not JSON (a full disk, or a crash between create and write): once older than
  UNREADABLE_GRACE_SECONDS; a younger one may be a claim being written.

How a claim is created, set aside and renewed depends on the storage: `LocalClaim` (a local or mounted disk:
atomic create and rename) and `StoredClaim` (an object store: write, then read back), both `RunClaim`s;
`claim_of(run_dir)` picks the one for the run directory.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from app.environment import ray_job_id
from app.errors import UserInputError, first_line, warn
from app.runs.layout import WRITER_CLAIM, RunDir

LEASE_SECONDS = 600.0
UNREADABLE_GRACE_SECONDS = 60.0


class RunBusy(Exception):
    """Another job is writing the run."""

    def __init__(self, owner: dict):
        super().__init__(owner)
        self.owner = owner


def this_process() -> dict:
    """The owner of a claim this process takes."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": psutil.Process().create_time(),
            "ray_job": ray_job_id(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}


@dataclass(frozen=True)
class Claim:
    """writer.json as read: its owner ({} when the file is empty or not JSON), when it was last written
    or renewed (its mtime), and what tells this file apart from any later claim."""

    owner: dict
    written: float
    version: tuple

    def is_live(self) -> bool:
        age = time.time() - self.written
        if not self.owner:
            return age < UNREADABLE_GRACE_SECONDS
        if self.owner.get("host") != socket.gethostname():
            return age < LEASE_SECONDS
        try:
            return abs(psutil.Process(self.owner["pid"]).create_time() - self.owner["started"]) < 1.0
        except (psutil.NoSuchProcess, KeyError, TypeError, ValueError):
            return False


def _owner(text: str) -> dict:
    try:
        owner = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return owner if isinstance(owner, dict) else {}


def _read_local(file: str) -> Claim | None:
    try:
        with open(file, "rb") as f:
            stat, text = os.fstat(f.fileno()), f.read().decode(errors="replace")
    except FileNotFoundError:
        return None
    return Claim(_owner(text), stat.st_mtime, (stat.st_ino, stat.st_mtime_ns, stat.st_size, text))


class RunClaim(ABC):
    """The run directory's one-writer claim: take it, hold it (renewed), release it."""

    def __init__(self, run_dir: RunDir):
        self.run_dir = run_dir
        self.file = run_dir.path(WRITER_CLAIM)

    @abstractmethod
    def current(self) -> Claim | None:
        """The claim now; None when there is none."""

    @abstractmethod
    def _create(self, text: str) -> None:
        """Write a new claim, or raise RunBusy where another job's claim came first."""

    @abstractmethod
    def _retire(self, stale: Claim) -> None:
        """Set a stale claim aside (and never a newer one, made meanwhile)."""

    @abstractmethod
    def _touch(self, owner: dict) -> None:
        """Mark `owner`'s claim as renewed now."""

    def take(self, owner: dict) -> None:
        """Become the run's only writer, or raise RunBusy naming the job that is."""
        current = self.current()
        if current is not None:
            if current.is_live():
                raise RunBusy(current.owner)
            self._retire(current)
        self._create(json.dumps(owner))

    def owner_now(self) -> dict:
        current = self.current()
        return current.owner if current else {}

    def renew(self, owner: dict) -> bool:
        """Refresh the lease of `owner`'s claim; False once the claim is not its own."""
        current = self.current()
        if current is None or current.owner != owner:
            return False
        self._touch(owner)
        return True

    def _new_owner(self, wait_seconds: float = 2.0) -> dict:
        """The owner of a claim just taken over, given a moment to be written: a job creates its claim, then
        writes it, and a reader between the two finds it empty."""
        deadline = time.monotonic() + wait_seconds
        while not (owner := self.owner_now()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return owner

    def release(self, owner: dict) -> None:
        if self.owner_now() == owner:
            self.run_dir.delete(WRITER_CLAIM)

    @contextmanager
    def lease(self, owner: dict, on_lost: Callable[[str], None] | None = None):
        """Hold the taken claim for the block: renewed from a daemon thread, released at the end. Should the
        claim be found taken by another job (this one cut off from the storage past its lease, and the run
        taken over), `on_lost(reason)` is called once from that thread and renewal stops."""
        done = threading.Event()
        renewer = threading.Thread(target=self._renew_until, args=(owner, done, on_lost), name="run-claim-lease",
                                   daemon=True)
        renewer.start()
        try:
            yield
        finally:
            done.set()
            renewer.join()
            self.release(owner)

    def _renew_until(self, owner: dict, done: threading.Event, on_lost: Callable[[str], None] | None) -> None:
        while not done.wait(LEASE_SECONDS / 10):
            try:
                if not self.renew(owner):
                    reason = (f"{self.file}: this job's claim on the run was taken over by another job "
                              f"({describe_owner(self._new_owner())}); this job stops writing the run")
                    if on_lost is None:
                        warn(reason)
                    else:
                        on_lost(reason)
                    return
            except OSError as e:  # the storage is slow or away: the next renewal may land
                warn(f"{self.file}: the claim was not renewed ({first_line(e)})")


class LocalClaim(RunClaim):
    """A claim on a local (or mounted) disk: created atomically (O_EXCL), and a stale one set aside by a
    rename, which only one of several jobs taking it over can do."""

    def current(self) -> Claim | None:
        return _read_local(self.file)

    def _create(self, text: str) -> None:
        Path(self.run_dir.root).mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:  # another job claimed first (one that took over the same stale claim, say)
            raise RunBusy(self.owner_now()) from None
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)  # one small write: readers give an empty claim UNREADABLE_GRACE_SECONDS
        except OSError:
            os.remove(self.file)  # a full disk, say: no empty claim is left to wait out
            raise

    def _retire(self, stale: Claim) -> None:
        """Of two jobs taking over the same stale claim only one moves it (both then race to create theirs,
        and O_EXCL lets one win); a claim made meanwhile, moved by mistake, is put back and stands."""
        try:
            now = os.stat(self.file)
            if (now.st_ino, now.st_mtime_ns, now.st_size) != stale.version[:3]:
                return  # retired and claimed again by another job: O_EXCL decides between us
            aside = f"{self.file}.stale-{os.getpid()}-{threading.get_ident()}-{time.time_ns()}"
            os.rename(self.file, aside)
        except FileNotFoundError:
            return  # retired by another job
        if _read_local(aside) != stale:
            try:
                os.link(aside, self.file)  # back where it was, and never over a claim made meanwhile
            except FileExistsError:
                warn(f"{self.file}: a claim made while a stale one was set aside was displaced by a third job's; "
                     "both jobs may write the run")
        os.remove(aside)

    def _touch(self, owner: dict) -> None:
        os.utime(self.file)


class StoredClaim(RunClaim):
    """A claim on an object store, which has no create-if-absent here: the claim is written, then read back
    after a moment, and the later of two racing jobs sees the other's claim and stops."""

    def current(self) -> Claim | None:
        try:
            text, written = self.run_dir.read_text(WRITER_CLAIM), self.run_dir.modified(WRITER_CLAIM)
        except FileNotFoundError:
            return None
        return Claim(_owner(text), written, (written, text))

    def _create(self, text: str) -> None:
        self.run_dir.write_text(text, WRITER_CLAIM)
        time.sleep(1.0)
        if self.owner_now() != json.loads(text):
            raise RunBusy(self.owner_now())

    def _retire(self, stale: Claim) -> None:
        if self.current() == stale:
            self.run_dir.delete(WRITER_CLAIM)

    def _touch(self, owner: dict) -> None:
        self.run_dir.write_text(json.dumps(owner), WRITER_CLAIM)


def claim_of(run_dir: RunDir) -> RunClaim:
    """The claim of a run directory, as its storage can hold one."""
    return LocalClaim(run_dir) if run_dir.is_local else StoredClaim(run_dir)


def check_run_dir(run_dir: RunDir, resume: bool) -> None:
    """What `claimed_run` refuses, found without writing anything: another job holds the run, an earlier run
    is there and --resume was not given, or --resume has nothing to continue."""
    current = claim_of(run_dir).current()
    if current is not None and current.is_live():
        raise _busy(run_dir, current.owner)
    _run_to_continue(run_dir, resume)


@contextmanager
def claimed_run(run_dir: RunDir, resume: bool, on_lost: Callable[[str], None] | None = None):
    """Hold the run directory for this job; yields the MLflow run id to continue (None for a new run).

    The run is checked before the claim (a mistake writes nothing) and again once it is held (another
    job may have started the run meanwhile). `on_lost`: see RunClaim.lease."""
    claim, owner = claim_of(run_dir), this_process()
    check_run_dir(run_dir, resume)
    try:
        claim.take(owner)
    except RunBusy as busy:
        raise _busy(run_dir, busy.owner) from None
    try:
        with claim.lease(owner, on_lost):
            yield _run_to_continue(run_dir, resume)
    finally:
        if run_dir.is_local and not any(Path(run_dir.root).iterdir()):
            Path(run_dir.root).rmdir()  # claimed, then stopped before anything was written


def describe_owner(owner: dict) -> str:
    """The job a claim names, for a message."""
    if not owner:
        return f"unknown: its {WRITER_CLAIM} is empty or unreadable, taken over at {UNREADABLE_GRACE_SECONDS:g} s old"
    job = owner.get("ray_job") or f"pid {owner.get('pid')} on {owner.get('host')}"
    return f"{job}, since {owner.get('since')}"


def _busy(run_dir: RunDir, owner: dict) -> UserInputError:
    return UserInputError(f"train.run_name={run_dir.name}: another job ({describe_owner(owner)}) is writing "
                          f"{run_dir.root}; wait for it, or stop it (if it is gone without ending, delete "
                          f"its {WRITER_CLAIM} there)")


def _run_to_continue(run_dir: RunDir, resume: bool) -> str | None:
    if not resume:
        if run_dir.has_record() or run_dir.checkpoints():
            raise UserInputError(f"train.run_name={run_dir.name}: {run_dir.root} holds an earlier run; "
                                 "pass --resume to continue it, or choose another train.run_name")
        return None
    if not run_dir.has_record():
        raise UserInputError(f"--resume: no run to resume at {run_dir.root}; check train.run_name and "
                             "train.output_dir")
    if run_dir.adapter_complete():
        raise UserInputError(f"--resume: run {run_dir.name} already finished ({run_dir.adapter} exists)")
    return run_dir.recorded_mlflow_run_id()
