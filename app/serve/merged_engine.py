"""Adapters served by vLLM with each merged into a copy of the base's weights (`auto` on CPUs): one vLLM engine
per served adapter, answering at the base's speed.

On a CPU, vLLM's LoRA products are plain torch loops beside every linear layer (and switching LoRA on slows the
base's own requests through the same layers); an adapter merged into the weights costs nothing at decode. The
price is a copy of the base per adapter (on disk, written by app/model/merge.py, and in memory) and a vLLM engine
each, so `auto` takes this route for a few adapters only (app/serve/engines.py). A new version of a followed
alias is merged and its engine started beside the old one (the old one answers meanwhile); once the name points
at the new one, the old engine is stopped when its last request has ended, and its folder deleted.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch

from app.model.merge import write_merged
from app.serve import vllm_engine
from app.serve.jobs import Job
from app.serve.vllm_engine import VllmEngine

log = logging.getLogger(__name__)
PREFIX = "merged-adapters-"  # then the replica's process id


def local_folder(base: str, revision: str | None) -> Path:
    """The base's weights on disk: its folder, or the hub cache's snapshot of it."""
    if Path(base).is_dir():
        return Path(base)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(base, revision=revision))


class MergedAdapters:
    """The served adapters, each a vLLM engine over the base with that adapter merged in (`start(folder, name)`
    starts one whose own weights answer `name`)."""

    name = "vllm-merged"

    def __init__(self, base: str, revision: str | None, adapters: dict[str, str], dtype: str,
                 start: Callable[[str, str], VllmEngine]):
        self.base, self.dtype, self.start = local_folder(base, revision), getattr(torch, dtype), start
        remove_orphans()
        self.root = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
        self.engines: dict[str, VllmEngine] = {}
        self.folders: dict[str, Path] = {}
        self.loads = itertools.count(1)
        self.lock = threading.Lock()  # `engines`, read by submit on the API's thread
        try:
            for name, folder in adapters.items():
                self.load_adapter(name, folder)
        except BaseException:
            self.close()
            raise

    @property
    def steps(self) -> int:
        return sum(engine.steps for engine in list(self.engines.values()))

    @property
    def broken(self) -> str | None:
        return next((engine.broken for engine in list(self.engines.values()) if engine.broken), None)

    def submit(self, job: Job) -> None:
        with self.lock:  # counted in flight before a retirement can look
            self.engines[job.adapter].submit(job)

    def load_adapter(self, name: str, folder: str) -> None:
        """Merges the adapter into a copy of the base and starts its engine (blocking: tens of seconds)."""
        merged = self.root / str(next(self.loads))
        try:
            write_merged(self.base, Path(folder), merged, self.dtype)
            engine = self.start(str(merged), name)
        except BaseException:
            shutil.rmtree(merged, ignore_errors=True)
            raise
        with self.lock:
            self.engines[name], self.folders[name] = engine, merged

    def retire(self, name: str) -> None:
        """`name`'s engine stops once its requests have ended (RETIRE_AFTER_S at the least), its folder deleted."""
        threading.Thread(target=self._stop_when_idle, args=(name,), name=f"retire-{name}", daemon=True).start()

    def _stop_when_idle(self, name: str) -> None:
        time.sleep(vllm_engine.RETIRE_AFTER_S)
        while True:
            with self.lock:
                engine = self.engines[name]
                if not engine.in_flight(name):
                    del self.engines[name]
                    folder = self.folders.pop(name)
                    break
            time.sleep(0.2)
        engine.close()
        shutil.rmtree(folder, ignore_errors=True)
        log.warning("%s retired: its merged engine stopped", name)

    def close(self) -> None:
        for engine in list(self.engines.values()):
            engine.close()
        shutil.rmtree(self.root, ignore_errors=True)


def remove_orphans() -> None:
    """Merged copies left by replicas that died without closing (killed): their folders name their process."""
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        pid = folder.name.removeprefix(PREFIX).split("-")[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
