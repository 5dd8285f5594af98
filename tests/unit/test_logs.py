"""Importing `app` leaves logging alone; a command's start drops torchao's import-time lines, and only them."""

import logging
import subprocess
import sys

from app.logs import NOISY_LOGGERS, quiet_import_noise

NOISE = ["Failed to load /x/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load this library",
         "Detected no triton, on systems without Triton certain kernels will not work",
         "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile"]


def _passes(logger: logging.Logger, message: str) -> bool:
    return logger.filter(logging.LogRecord(logger.name, logging.WARNING, __file__, 1, message, None, None))


def test_importing_app_adds_no_filter_to_any_logger():
    probe = ("import logging, app, app.logs\n"
             f"print(sum(len(logging.getLogger(name).filters) for name in {NOISY_LOGGERS!r}))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "0"


def test_quiet_import_noise_drops_the_noise_keeps_the_rest_and_installs_once():
    quiet_import_noise()
    quiet_import_noise()
    for name in NOISY_LOGGERS:
        logger = logging.getLogger(name)
        assert len(logger.filters) == 1
        assert not any(_passes(logger, line) for line in NOISE)
        assert _passes(logger, "Failed to quantize layer 3: out of memory")
