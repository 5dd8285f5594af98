"""Log lines that say nothing about a run, dropped where a process starts (`quiet_import_noise`): importing
`app` changes no logging of its own accord.

Importing torchao (transformers imports it whenever it is installed; NF4 needs it) writes them in every
process: its CUDA kernel libraries failing to load, or Triton missing, on machines without them (NF4 uses
neither), and torch's notice that torchao registers enums it no longer needs to."""

from __future__ import annotations

import logging
import re

IMPORT_NOISE = re.compile(r"Failed to load \S+\.so|Detected no triton|is an Enum subclass and is now natively")
NOISY_LOGGERS = ("torchao", "torchao.kernel.intmm", "torch.utils._pytree")  # a filter sees its own logger's lines


class _DropImportNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not IMPORT_NOISE.search(str(record.msg))


def quiet_import_noise() -> None:
    """Before torchao is first imported (a command's start): its import-time lines are dropped. Once only."""
    for name in NOISY_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropImportNoise) for f in logger.filters):
            logger.addFilter(_DropImportNoise())
