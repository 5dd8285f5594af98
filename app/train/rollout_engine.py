"""What a rollout actor runs: one decoding loop, in a thread of its own, over the requests of every training rank
that reaches it. Requests of the same adapter share the engine's batch (app/engine/: a rank's answers join the rows
of another rank's still being decoded, and with rollout.batch_rows a finished answer's row goes to the next
waiting answer).

Every request names the adapter step it must be sampled with and carries that adapter (fetched only when the
engine does not hold it yet, checked against the trainer's checksum before it samples anything): the engine
swaps adapters only when no answer runs, so an answer is always sampled with the adapter its request named,
whatever order the requests arrive in, and an actor that Ray restarts needs nothing re-sent.

Plain threads and torch: the actor (app/launch/rollout_group.py) calls `sample` from as many threads as it has
callers; the unit tests call it from their own threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from app.config.rollout import RolloutSection
from app.engine.sequence import Sequence
from app.train.sampling import Sampled, Sampler, seeded_answers


@dataclass(eq=False)
class Request:
    """One call's answers, the adapter they are sampled with, and how it ended."""

    answers: list[Sequence]
    version: int
    checksum: str
    weights: Callable[[], dict[str, torch.Tensor]]
    idle_seconds: float
    done: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None
    sampled_with: tuple[int, str] = (-1, "")  # the step and checksum of the adapter the engine held for it

    @property
    def finished(self) -> bool:
        return all(answer.done for answer in self.answers)


class RolloutEngine:
    def __init__(self, sampler: Sampler, rollout: RolloutSection):
        self.sampler, self.rollout, self.core = sampler, rollout, sampler.core
        if self.core is not None:
            self.core.max_rows = rollout.batch_rows or 1 << 16
        self.changed = threading.Condition()
        self.waiting: list[Request] = []  # requests not started, in arrival order
        self.running: list[Request] = []  # requests whose answers are decoding (all of the adapter held)
        self.idle_since: float | None = time.perf_counter()  # when it last ran out of work (None: busy)
        self.serial = threading.Lock()
        self.broken: BaseException | None = None  # what stopped the decoding loop, if it stopped
        if self.core is not None:
            threading.Thread(target=self.serve, daemon=True, name="rollout-engine").start()

    def sample(self, prompts: list[list[int]], seed: int, first: int, version: int, checksum: str,
               weights: Callable[[], dict[str, torch.Tensor]]) -> Sampled:
        """rollout.num_generations answers to each prompt with the adapter of step `version` (its weights fetched by
        `weights` if the engine does not hold it), the i-th seeded by its place `first + i` in the caller's
        request; raises why that adapter was refused."""
        if self.core is None:  # transformers' generate: one request at a time
            with self.serial:
                self.hold(version, checksum, weights)
                return Sampled(self.sampler.sample(prompts, self.rollout, seed, first), version, checksum)
        answers = seeded_answers(prompts, self.rollout, seed, first, self.sampler.adapter)
        with self.changed:
            if self.broken is not None:
                raise RuntimeError(f"the rollout engine stopped: {self.broken!r}")
            idle = time.perf_counter() - self.idle_since if self.idle_since is not None else 0.0
            request = Request(answers, version, checksum, weights, idle)
            self.waiting.append(request)
            self.idle_since = None
            self.changed.notify()
        request.done.wait()
        if request.error is not None:
            raise request.error
        return Sampled([self.sampler.completion(answer) for answer in answers], *request.sampled_with,
                       request.idle_seconds)

    def hold(self, version: int, checksum: str, weights: Callable[[], dict[str, torch.Tensor]]) -> None:
        """The adapter of step `version` swapped in unless held, checked against its checksum."""
        if (version, checksum) != (self.sampler.version, self.sampler.checksum):
            self.sampler.load_adapter(weights(), version, checksum)

    def serve(self) -> None:
        """The loop (`serving`); if it ever stops, every request waiting and every later one is answered why."""
        try:
            self.serving()
        except BaseException as error:
            with self.changed:
                self.broken, waiting, self.waiting = error, self.waiting, []
            self.fail(list(dict.fromkeys(self.running + waiting)), RuntimeError(f"the rollout engine stopped: "
                                                                                f"{error!r}"))
            raise

    def serving(self) -> None:
        """Start the requests the held adapter can serve (or swap adapters when none runs), decode a step, answer
        the requests whose answers all ended."""
        while True:
            with self.changed:
                while not self.waiting and not self.running:
                    self.idle_since = self.idle_since or time.perf_counter()
                    self.changed.wait()
                starting = self.startable()
            try:
                self.start(starting)
            except Exception as error:  # noqa: BLE001 - an adapter refused: its callers raise it, the rest go on
                self.fail(starting, error)
            if self.core.busy:
                self.core.step()
            self.answer_finished()

    def startable(self) -> list[Request]:
        """The waiting requests of the adapter held, or when nothing runs, those of the oldest waiting request's."""
        if not self.waiting:
            return []
        if self.running:
            key = (self.sampler.version, self.sampler.checksum)
        else:
            key = (self.waiting[0].version, self.waiting[0].checksum)
        starting = [r for r in self.waiting if (r.version, r.checksum) == key]
        self.waiting = [r for r in self.waiting if (r.version, r.checksum) != key]
        return starting

    def start(self, starting: list[Request]) -> None:
        """The requests' adapter swapped in if it is not the one held (checked against its checksum), their answers
        handed to the engine."""
        if not starting:
            return
        self.hold(starting[0].version, starting[0].checksum, starting[0].weights)
        self.running += starting
        for request in starting:
            request.sampled_with = (self.sampler.version, self.sampler.checksum)
            for answer in request.answers:
                self.core.add(answer)

    def answer_finished(self) -> None:
        """The requests whose answers all ended are answered (with the engine's error, if a step failed them)."""
        for request in [r for r in self.running if r.finished]:
            self.running.remove(request)
            failed = next((a.error for a in request.answers if a.error is not None), None)
            request.error = None if failed is None else RuntimeError(f"sampling failed: {failed}")
            request.done.set()

    def fail(self, requests: list[Request], error: Exception) -> None:
        """The requests answered with `error`."""
        self.running = [r for r in self.running if r not in requests]
        for request in requests:
            request.error = error
            request.done.set()
