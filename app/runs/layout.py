"""Where a run's files live: the one definition of the output and run directory layout.

    <train.output_dir>/                    an absolute local path, or a URI (s3://, gs://, ...)
        mlflow.db, mlartifacts/            the local MLflow store (when no tracking server is configured)
        <run_name>/                        one run: Ray Train's run folder (RunConfig(name, storage_path))
            run.json                       which MLflow run this directory belongs to (what --resume continues)
            writer.json                    the job writing the run now: claimed atomically, released at its end
            checkpoint_*/                  sharded training checkpoints, written and pruned by Ray Train
            adapter/                       the exported PEFT adapter; complete once adapter/COMPLETE exists
            samples.json                   the sample generations table
            unsent.jsonl                   what the tracking server did not take (`python -m jobs.sync` sends it)

Files are read and written through pyarrow's filesystems, the ones Ray Train uses for checkpoints, so a
URI output directory holds all of it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pyarrow.fs as pafs

ADAPTER_COMPLETE = "COMPLETE"


def is_uri(location: str) -> bool:
    return "://" in location


@dataclass(frozen=True)
class OutputDir:
    root: str  # absolute local path or URI

    @property
    def is_local(self) -> bool:
        return not is_uri(self.root)

    @property
    def mlflow_store(self) -> Path:
        return Path(self.root) / "mlflow.db"

    def run(self, name: str) -> RunDir:
        return RunDir(f"{self.root.rstrip('/')}/{name}")


@dataclass(frozen=True)
class RunDir:
    root: str  # absolute local path or URI

    @cached_property
    def fs(self) -> tuple[pafs.FileSystem, str]:
        return pafs.FileSystem.from_uri(self.root)

    @property
    def name(self) -> str:
        return self.root.rstrip("/").rsplit("/", 1)[-1]

    @property
    def is_local(self) -> bool:
        return not is_uri(self.root)

    def path(self, *parts: str) -> str:
        """A file or folder of the run, as a local path or URI like the root."""
        return "/".join([self.root.rstrip("/"), *parts])

    @property
    def adapter(self) -> str:
        return self.path("adapter")

    # -- plain file access, local or remote -----------------------------------------------------------

    def _where(self, *parts: str) -> tuple[pafs.FileSystem, str]:
        filesystem, base = self.fs
        return filesystem, "/".join([base.rstrip("/"), *parts])

    def exists(self, *parts: str) -> bool:
        filesystem, where = self._where(*parts)
        return filesystem.get_file_info(where).type != pafs.FileType.NotFound

    def read_text(self, *parts: str) -> str:
        filesystem, where = self._where(*parts)
        with filesystem.open_input_stream(where) as f:
            return f.read().decode()

    def write_text(self, text: str, *parts: str) -> None:
        filesystem, where = self._where(*parts)
        filesystem.create_dir(where.rsplit("/", 1)[0], recursive=True)
        with filesystem.open_output_stream(where) as f:
            f.write(text.encode())

    def append_lines(self, lines: list[str], *parts: str) -> None:
        """Appended where the filesystem can append; rewritten whole on object stores."""
        if self.is_local:
            Path(self.path(*parts)).parent.mkdir(parents=True, exist_ok=True)
            with open(self.path(*parts), "a") as f:
                f.writelines(line + "\n" for line in lines)
            return
        before = self.read_text(*parts) if self.exists(*parts) else ""
        self.write_text(before + "".join(line + "\n" for line in lines), *parts)

    def delete(self, *parts: str) -> None:
        filesystem, where = self._where(*parts)
        info = filesystem.get_file_info(where)
        if info.type == pafs.FileType.Directory:
            filesystem.delete_dir(where)
        elif info.type == pafs.FileType.File:
            filesystem.delete_file(where)

    def checkpoints(self) -> list[str]:
        filesystem, base = self.fs
        if not self.exists():
            return []
        infos = filesystem.get_file_info(pafs.FileSelector(base))
        return sorted(self.path(i.base_name) for i in infos
                      if i.type == pafs.FileType.Directory and i.base_name.startswith("checkpoint_"))

    # -- the run record ----------------------------------------------------------------------------------

    def write_record(self, mlflow_run_id: str) -> None:
        self.write_text(json.dumps({"mlflow_run_id": mlflow_run_id}), "run.json")

    def has_record(self) -> bool:
        return self.exists("run.json")

    def recorded_mlflow_run_id(self) -> str:
        return json.loads(self.read_text("run.json"))["mlflow_run_id"]

    # -- one writer at a time ------------------------------------------------------------------------------

    def claim(self, owner: dict, still_running) -> None:
        """Become the run's only writer, or raise RunBusy naming the job that is. A claim whose job has
        ended (`still_running(claim)` is False: killed, its node lost) is taken over.

        Local disks create the claim atomically (O_EXCL). Object stores have no create-if-absent here:
        the claim is written, then read back after a moment, and the later of two racing jobs sees the
        other's claim and stops."""
        current = self.writer()
        if current is not None:
            if still_running(current):
                raise RunBusy(current)
            self._retire_claim(current)
        text = json.dumps(owner)
        if self.is_local:
            Path(self.root).mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(self.path("writer.json"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                raise RunBusy(self.writer() or {}) from None
            with os.fdopen(fd, "w") as f:
                f.write(text)
            return
        self.write_text(text, "writer.json")
        time.sleep(1.0)
        if self.writer() != owner:
            raise RunBusy(self.writer() or {})

    def _retire_claim(self, stale: dict) -> None:
        """Set a dead writer's claim aside. Locally by an atomic rename, so that of two jobs taking over the
        same stale claim only one succeeds (the other then meets the winner's new claim)."""
        if not self.is_local:
            self.delete("writer.json")
            return
        aside = self.path(f"writer.json.stale-{os.getpid()}-{time.time_ns()}")
        try:
            os.rename(self.path("writer.json"), aside)
        except FileNotFoundError:
            raise RunBusy(self.writer() or stale) from None
        if json.loads(Path(aside).read_text()) != stale:  # a fresh claim was moved by mistake: put it back
            os.rename(aside, self.path("writer.json"))
            raise RunBusy(self.writer() or stale)
        os.remove(aside)

    def writer(self) -> dict | None:
        """The current claim; None only when there is none (an unreadable claim is not taken for none)."""
        if not self.exists("writer.json"):
            return None
        try:
            return json.loads(self.read_text("writer.json"))
        except FileNotFoundError:
            return None
        except json.JSONDecodeError:
            return {"host": "?", "pid": None, "since": "unreadable writer.json"}

    def release(self, owner: dict) -> None:
        if self.writer() == owner:
            self.delete("writer.json")

    # -- the adapter: written whole or not at all ------------------------------------------------------------

    def adapter_complete(self) -> bool:
        return self.exists("adapter", ADAPTER_COMPLETE)

    def publish_adapter(self, local_folder: Path) -> None:
        """Copy a finished adapter folder to `adapter/` in one step: a rename on local disks; on object
        stores an upload with the COMPLETE marker last. A partial adapter left by a crash is replaced."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        if self.is_local:
            for leftover in Path(self.root).glob("adapter.partial-*"):  # from an export that was interrupted
                shutil.rmtree(leftover, ignore_errors=True)
            partial = Path(self.path(f"adapter.partial-{os.getpid()}"))
            shutil.copytree(local_folder, partial)
            (partial / ADAPTER_COMPLETE).write_text(stamp)
            _readable_as_umask_allows(partial)  # the staging folder was private to this process
            if Path(self.adapter).exists():
                shutil.rmtree(self.adapter)
            os.rename(partial, self.adapter)
            return
        self.delete("adapter")
        filesystem, where = self._where("adapter")
        filesystem.create_dir(where, recursive=True)
        for file in sorted(local_folder.iterdir()):
            pafs.copy_files(str(file), f"{where}/{file.name}", source_filesystem=pafs.LocalFileSystem(),
                            destination_filesystem=filesystem)
        self.write_text(stamp, "adapter", ADAPTER_COMPLETE)

    def local_copy(self, *parts: str) -> tuple[str, tempfile.TemporaryDirectory | None]:
        """A local path holding `parts` (the path itself for a local run; a downloaded copy otherwise)."""
        if self.is_local:
            return self.path(*parts), None
        holder = tempfile.TemporaryDirectory(prefix="run-")
        filesystem, where = self._where(*parts)
        target = Path(holder.name) / parts[-1]
        if filesystem.get_file_info(where).type == pafs.FileType.Directory:
            pafs.copy_files(where, str(target), source_filesystem=filesystem,
                            destination_filesystem=pafs.LocalFileSystem())
        else:
            target.write_bytes(filesystem.open_input_stream(where).read())
        return str(target), holder


def _readable_as_umask_allows(folder: Path) -> None:
    status = Path("/proc/self/status")
    umask = next((int(line.split()[1], 8) for line in (status.read_text().splitlines() if status.exists() else [])
                  if line.startswith("Umask:")), 0o022)  # read, not set: os.umask would change it for every thread
    folder.chmod(0o777 & ~umask)
    for file in folder.iterdir():
        file.chmod(0o666 & ~umask)


class RunBusy(Exception):
    """Another job is writing the run."""

    def __init__(self, claim: dict):
        super().__init__(claim)
        self.claim = claim
