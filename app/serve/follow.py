"""Served names that follow a registry alias (`--adapter speller=models:/speller@champion`).

Every `interval_s` (and on `POST /v1/admin/reload`) each alias is asked for its version. A new version is
downloaded beside the old one (in this thread), checked to be on the served base, loaded by the engine that
answers adapters (between two of its steps) under a name of its own, and only then does the served name point
at it: a request is answered wholly by the version it started on, and none by a half-loaded adapter. The
replaced adapter is deleted once the requests that named it have ended (each engine's `retire`). A failed check
leaves the versions served as they were, and says why in the log.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

from mlflow.tracking import MlflowClient

from app.errors import first_line
from app.serve.api import Served
from app.tracking.adapters import Base, adapter_folder, base_of, registered_version

log = logging.getLogger(__name__)


class AliasFollower:
    def __init__(self, served: Served, followed: dict[str, str], base: Base, interval_s: float):
        self.served, self.followed, self.base = served, followed, base
        self.lock, self.loads = threading.Lock(), itertools.count(1)
        if interval_s > 0:
            threading.Thread(target=self._poll, args=(interval_s,), name="follow-aliases", daemon=True).start()

    def check(self) -> dict[str, str]:
        """Move each following name to its alias's version now; {name: what answers it}."""
        with self.lock:
            client = MlflowClient()
            for name, alias in self.followed.items():
                version = "models:/{}/{}".format(*registered_version(client, alias))
                if self.served.label(self.served.adapter(name)) != version:
                    self._switch(name, version)
            return {name: self.served.label(self.served.adapter(name)) for name in self.followed}

    def _switch(self, name: str, version: str) -> None:
        folder = adapter_folder(version)
        recorded = base_of(folder, version)
        if not recorded.same_as(self.base):
            raise ValueError(f"{version} was trained on {recorded}, not on the served base {self.base}")
        loaded, before = f"{name}@{version.rsplit('/', 1)[-1]}#{next(self.loads)}", self.served.adapter(name)
        self.served.engines.load_adapter(loaded, str(folder))
        self.served.labels[loaded] = version
        self.served.routes[name] = loaded  # one assignment: every request from here on
        self.served.engines.retire(before)
        log.warning("%s now answers with %s (was %s)", name, version, self.served.label(before))

    def _poll(self, interval_s: float) -> None:
        while True:
            time.sleep(interval_s)
            try:
                self.check()
            except Exception as e:  # the registry away for a while: the versions served stay
                log.warning("following %s: %s", ", ".join(self.followed.values()), first_line(e, 300))
