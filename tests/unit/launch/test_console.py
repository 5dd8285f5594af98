"""What a job prints of its workers' output (the filter runs on the lines Ray forwards to the driver)."""

from app.launch.console import WorkerLines

PROGRESS = "step 10/300 | loss 2.5254 | lr 1.62e-03 | grad_norm 1.950 | 1,980 tok/s | eta 1m33s"
CLEANER = ("Failed to query Ray Train Controller actor state. State API may be temporarily unavailable. "
           "Continuing to monitor.")


def test_progress_lines_go_out_bare_and_noise_is_dropped_with_its_source_line():
    bare, kept = WorkerLines()([PROGRESS, "Reporting training result 3: TrainingReport(...)",
                                "warning: something the user should see",
                                "/x/peft.py:12: FutureWarning: `ExecutionOptions.exclude_resources` is deprecated",
                                "  warnings.warn(", "after"])
    assert bare == [PROGRESS]
    assert kept == ["warning: something the user should see", "after"]


def test_a_warning_ray_repeats_on_every_poll_is_printed_once_per_job():
    lines = WorkerLines()
    printed = [kept for _ in range(5) for kept in lines([CLEANER])[1]]
    assert printed == [CLEANER]
    assert lines(["a real error"])[1] == ["a real error"]


def test_torchaos_import_lines_from_the_workers_are_dropped():
    noise = ["Failed to load /x/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load this library",
             "W1204 22:36:10.968000 24355 torch/utils/_pytree.py:630] <enum 'KernelPreference'> is an Enum subclass "
             "and is now natively supported by torch.compile as an opaque value type."]
    assert WorkerLines()([*noise, "a real warning"]) == ([], ["a real warning"])
