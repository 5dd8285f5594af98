"""The driver's background steps (the model checks beside Ray's start, the data beside the worker group's):
their outcome reaches the main thread, and a job that is already ending prints no thread traceback."""

import threading

import pytest

from app.launch.background import in_background


def test_the_result_and_the_error_reach_whoever_asks():
    assert in_background("ok", lambda a, b: a + b, 2, 3).result(timeout=10) == 5
    told = []
    failed = in_background("bad", lambda: 1 / 0, on_error=told.append)
    with pytest.raises(ZeroDivisionError):
        failed.result(timeout=10)
    [error] = told
    assert isinstance(error, ZeroDivisionError)


def test_telling_the_ranks_after_ray_is_gone_prints_no_traceback(monkeypatch):
    uncaught = []
    monkeypatch.setattr(threading, "excepthook", uncaught.append)
    done = threading.Event()

    def tell_ranks(_error):  # what passes.fail.remote does once ray.shutdown() ran
        done.set()
        raise RuntimeError("Ray has not been started yet")

    failed = in_background("data", lambda: 1 / 0, on_error=tell_ranks)
    assert done.wait(10) and isinstance(failed.exception(timeout=10), ZeroDivisionError)
    for thread in threading.enumerate():
        if thread.name == "data":
            thread.join(10)
    assert uncaught == []
