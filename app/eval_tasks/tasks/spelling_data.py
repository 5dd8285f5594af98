"""The embedded demo's held-out numbers as lm-evaluation-harness datasets (its tasks' `custom_dataset`).

The data is the one `jobs.build_embedded` writes: `embedded_data` in the task metadata (`jobs.evaluate`
passes it), else $FINETUNE_EMBEDDED_DATA, else `.cache/embedded/data` under the working directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import datasets


def held_out(file: str, embedded_data: str | None = None, **_) -> datasets.DatasetDict:
    folder = Path(embedded_data or os.environ.get("FINETUNE_EMBEDDED_DATA") or ".cache/embedded/data")
    path = folder / file
    if not path.exists():
        raise FileNotFoundError(f"{path}: the embedded demo's data is not there; build it with "
                                "`python -m jobs.build_embedded` or pass its folder as embedded_data")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
