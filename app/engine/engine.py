"""The engine core (app/engine/core.py) in a thread of its own: sequences submitted from any thread join the
running batch at the next step, and work on the model itself (loading or deleting an adapter) runs between two
steps, never during one.

Each sequence's listener is called on this thread after every step that changed it. If the thread itself dies
(a bug past the step's own handling), every sequence it held and every later one fails with the reason, and
`broken` says so: the server's health check then has Ray Serve replace the replica.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from app.engine.core import EngineCore
from app.engine.sequence import Sequence

log = logging.getLogger(__name__)
RETIRE_AFTER_S = 5.0  # a replaced adapter is deleted once unused this long after its replacement


@dataclass(eq=False)
class Chore:
    """Work on the model, done by the engine's thread between two steps."""

    work: Callable[[], object]
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class Engine:
    def __init__(self, core: EngineCore, name: str = "engine"):
        self.core = core
        self.incoming: queue.Queue[Sequence | Chore] = queue.Queue()
        self.retired: dict[str, tuple[float, Callable[[], None]]] = {}
        self.broken: BaseException | None = None
        self.closing = threading.Lock()  # a sequence is queued before the thread dies, or failed at once
        threading.Thread(target=self.serve, name=name, daemon=True).start()

    @property
    def steps(self) -> int:
        return self.core.steps

    def submit(self, seq: Sequence) -> None:
        with self.closing:
            if self.broken is None:
                self.incoming.put(seq)
                return
        seq.error = f"the engine stopped: {self.broken!r}"
        seq.tell(True)

    def between_steps(self, work: Callable[[], object]) -> concurrent.futures.Future:
        """`work()` on the engine's thread when no step runs; its result (or exception) in the future."""
        chore = Chore(work)
        self.incoming.put(chore)
        return chore.done

    def retire(self, adapter: str, delete: Callable[[], None]) -> None:
        """`adapter` is asked for no more: `delete()` it once no sequence names it, RETIRE_AFTER_S after now."""
        self.between_steps(lambda: self.retired.setdefault(adapter, (time.monotonic(), delete)))

    def serve(self) -> None:
        try:
            while True:
                self.take(block=not self.core.busy)
                self.delete_retired()
                for seq in self.core.step():
                    seq.tell(seq.done)
        except BaseException as error:
            with self.closing:
                self.broken = error
            log.exception("the engine stopped")
            self.fail_everything(error)
            raise

    def take(self, block: bool) -> None:
        """What was submitted since the last step (waiting for something when nothing runs)."""
        while True:
            try:
                item = self.incoming.get(block=block)
            except queue.Empty:
                return
            block = False
            if isinstance(item, Sequence):
                self.core.add(item)
                continue
            self.core.router.forget()  # a chore may load or delete adapters: PEFT's state as PEFT left it
            try:
                item.done.set_result(item.work())
            except Exception as e:  # noqa: BLE001 - the caller hears of it; decoding goes on
                item.done.set_exception(e)
            finally:
                self.core.router.forget()

    def delete_retired(self) -> None:
        named = {row.seq.adapter for row in self.core.rows} | {seq.adapter for seq in self.core.waiting}
        for adapter, (since, delete) in list(self.retired.items()):
            if time.monotonic() - since >= RETIRE_AFTER_S and adapter not in named:
                self.core.router.forget()
                delete()
                self.core.router.forget()
                del self.retired[adapter]

    def fail_everything(self, error: BaseException) -> None:
        message = f"the engine stopped: {error!r}"
        held = [row.seq for row in self.core.rows] + list(self.core.waiting)
        while True:
            try:
                item = self.incoming.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Sequence):
                held.append(item)
            else:
                item.done.set_exception(RuntimeError(message))
        for seq in held:
            seq.error = message
            seq.tell(True)
