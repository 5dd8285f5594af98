"""The workers' one hook point: off unless $FINETUNE_WORKER_HOOKS names a module; the driver forwards that name and
the module's own settings, nothing else."""

import os

from app.launch import worker_hooks
from tests.faults import DIE_IN_CHECKPOINT, STEP_SECONDS, inject


def _clear(monkeypatch) -> None:
    for name in list(os.environ):
        if name.startswith(worker_hooks.HOOKS_ENV):
            monkeypatch.delenv(name)


def test_without_a_hooks_module_nothing_is_forwarded_or_called(monkeypatch):
    _clear(monkeypatch)
    monkeypatch.setenv("FINETUNE_STORAGE", "/shared")
    assert worker_hooks.forwarded() == {}
    assert worker_hooks.step_pacing() is None
    worker_hooks.checkpoint_written(12, True)


def test_the_named_module_and_its_settings_are_forwarded_and_its_hooks_called(monkeypatch, tmp_path):
    _clear(monkeypatch)
    marker = tmp_path / "fired"
    inject(monkeypatch, STEP_SECONDS, "0.01")
    inject(monkeypatch, DIE_IN_CHECKPOINT, f"12:{marker}")
    monkeypatch.setenv("FINETUNE_STORAGE", "/shared")
    assert worker_hooks.forwarded() == {worker_hooks.HOOKS_ENV: "tests.faults", STEP_SECONDS: "0.01",
                                        DIE_IN_CHECKPOINT: f"12:{marker}"}
    assert callable(worker_hooks.step_pacing())
    worker_hooks.checkpoint_written(11, True)  # another step: the fault waits for step 12
    worker_hooks.checkpoint_written(12, False)  # another rank: only the last one dies
    assert not marker.exists()
