"""A step of the driver run beside the main thread (the checks while Ray starts, the data while the worker
group starts), its outcome held in a Future."""

from __future__ import annotations

import threading
from concurrent.futures import Future


def in_background(name: str, fn, *args, on_error=None) -> Future:
    """`fn(*args)` in a daemon thread of the driver: its result, or what it raised, in the Future, which is
    set before `on_error(exception)` tells anyone else (the main thread then finds it done); a failure of
    `on_error` itself prints nothing (no traceback from a thread after the job's own one-line error)."""
    done: Future = Future()

    def run() -> None:
        try:
            done.set_result(fn(*args))
        except BaseException as e:  # raised in the driver's main thread, by whoever asks for the result
            done.set_exception(e)
            if on_error is not None:
                try:
                    on_error(e)
                except Exception:  # the job is ending already (Ray shut down): the main thread raises the reason
                    pass

    threading.Thread(target=run, name=name, daemon=True).start()
    return done


def raise_failure(step: Future) -> None:
    """Raise what a finished background step raised (nothing if it is running or succeeded)."""
    if step.done() and step.exception() is not None:
        raise step.exception() from None
