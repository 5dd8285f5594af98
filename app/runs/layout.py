"""Where a run's files live: the one definition of the output and run directory layout.

    <train.output_dir>/                    an absolute local path, or a URI (s3://, gs://, ...)
        mlflow.db, mlartifacts/            the local MLflow store (when no tracking server is configured)
        <run_name>/                        one run: Ray Train's run folder (RunConfig(name, storage_path))
            run.json                       its MLflow run (what --resume continues), its data's digests
            writer.json                    the job writing the run now (app/runs/claim.py): released at its end
            checkpoint_*/                  sharded training checkpoints, written and pruned by Ray Train
            adapter/                       the exported PEFT adapter; complete once adapter/COMPLETE exists
                finetune_config.yaml       the config of the run that trained it
            samples.json                   the sample generations table
            unsent.jsonl                   what the tracking server did not take (app/tracking/journal.py)

Every other module names these files through the constants below. Files are read and written through
pyarrow's filesystems, the ones Ray Train uses for checkpoints, so a URI output directory holds all of it.
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

RUN_RECORD = "run.json"
WRITER_CLAIM = "writer.json"
ADAPTER = "adapter"
ADAPTER_COMPLETE = "COMPLETE"  # in adapter/
ADAPTER_RUN_CONFIG = "finetune_config.yaml"  # in adapter/
SAMPLES = "samples.json"
JOURNAL = "unsent.jsonl"


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
        return self.path(ADAPTER)

    def holds(self, relative: str) -> bool:
        """Whether `relative` names a place inside the run directory: not absolute, no `..`, and on a
        local disk no symbolic link (at it, or in the folder it names) leading out."""
        if not relative or relative.startswith("/") or "://" in relative or ".." in relative.split("/"):
            return False
        if not self.is_local:
            return True
        root, target = Path(self.root).resolve(), Path(self.path(relative))
        inside = [target]
        for folder, names, files in os.walk(target):
            inside += [Path(folder, name) for name in names + files]
        return all(p.resolve().is_relative_to(root) for p in inside)

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

    def replace_text(self, text: str, *parts: str) -> None:
        """Write the file whole or not at all: on a local disk beside it, then renamed over it (a full disk or a
        kill midway leaves the old file); an object store replaces an object in one put."""
        if not self.is_local:
            self.write_text(text, *parts)
            return
        target = Path(self.path(*parts))
        staged = target.with_name(f"{target.name}.partial-{os.getpid()}")
        try:
            staged.write_text(text)
            os.replace(staged, target)
        finally:
            staged.unlink(missing_ok=True)

    def modified(self, *parts: str) -> float:
        """When the file was last written, in seconds since the epoch."""
        filesystem, where = self._where(*parts)
        info = filesystem.get_file_info(where)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(where)
        return info.mtime.timestamp()

    def append_lines(self, lines: list[str], *parts: str) -> None:
        """Appended where the filesystem can append; rewritten whole on object stores. A last line left
        unfinished (by a crash) is ended first, so that it spoils no new line."""
        text = "".join(line + "\n" for line in lines)
        if self.is_local:
            Path(self.path(*parts)).parent.mkdir(parents=True, exist_ok=True)
            with open(self.path(*parts), "a+b") as f:  # opened at the end; writes always go there
                if f.tell():
                    f.seek(f.tell() - 1)
                    text = ("" if f.read(1) == b"\n" else "\n") + text
                f.write(text.encode())
            return
        before = self.read_text(*parts) if self.exists(*parts) else ""
        self.write_text(before + ("\n" if before and not before.endswith("\n") else "") + text, *parts)

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

    def write_record(self, mlflow_run_id: str, train_digests: list[str] | None = None) -> None:
        """The run's MLflow run, and the digests of the data it trains on (what a resume must find again)."""
        record = {"mlflow_run_id": mlflow_run_id} | ({"train_digests": train_digests} if train_digests else {})
        self.write_text(json.dumps(record), RUN_RECORD)

    def has_record(self) -> bool:
        return self.exists(RUN_RECORD)

    def recorded_mlflow_run_id(self) -> str:
        return json.loads(self.read_text(RUN_RECORD))["mlflow_run_id"]

    def recorded_train_digests(self) -> list[str] | None:
        """The data digests the run started with; None where there is no record, or it holds none."""
        return json.loads(self.read_text(RUN_RECORD)).get("train_digests") if self.has_record() else None

    # -- the adapter: written whole or not at all ------------------------------------------------------------

    def adapter_complete(self) -> bool:
        return self.exists(ADAPTER, ADAPTER_COMPLETE)

    def publish_adapter(self, local_folder: Path) -> None:
        """Copy a finished adapter folder to `adapter/` in one step: a rename on local disks; on object
        stores an upload with the COMPLETE marker last. A partial adapter left by a crash is replaced."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        if self.is_local:
            for leftover in Path(self.root).glob(f"{ADAPTER}.partial-*"):  # from an export that was interrupted
                shutil.rmtree(leftover, ignore_errors=True)
            partial = Path(self.path(f"{ADAPTER}.partial-{os.getpid()}"))
            shutil.copytree(local_folder, partial)
            (partial / ADAPTER_COMPLETE).write_text(stamp)
            _readable_as_umask_allows(partial)  # the staging folder was private to this process
            if Path(self.adapter).exists():
                shutil.rmtree(self.adapter)
            os.rename(partial, self.adapter)
            return
        self.delete(ADAPTER)
        filesystem, where = self._where(ADAPTER)
        filesystem.create_dir(where, recursive=True)
        for file in sorted(local_folder.iterdir()):
            pafs.copy_files(str(file), f"{where}/{file.name}", source_filesystem=pafs.LocalFileSystem(),
                            destination_filesystem=filesystem)
        self.write_text(stamp, ADAPTER, ADAPTER_COMPLETE)

    def local_copy(self, *parts: str) -> tuple[str, tempfile.TemporaryDirectory | None]:
        """A local path holding `parts` (the path itself for a local run; a downloaded copy otherwise)."""
        if self.is_local:
            return self.path(*parts), None
        holder = tempfile.TemporaryDirectory(prefix="run-")
        filesystem, where = self._where(*parts)
        target = Path(holder.name) / parts[-1]
        if filesystem.get_file_info(where).type == pafs.FileType.Directory:
            target.mkdir()  # copy_files makes the folders it finds inside, not the one it copies into
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

