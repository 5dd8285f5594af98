"""A rank's endless stream of training micro-batches, with a position that checkpoints can record."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

from app.data.chat import IGNORE_INDEX
from app.data.passes import rank_rows_among_first

RankPass = Callable[[int], Iterable[dict]]  # pass_index -> one pass over this rank's rows


class RankStream:
    """Pass after pass over this rank's rows, so every rank can take exactly max_steps steps.

    Rank `rank` of `world_size` holds rows rank, rank + W, ... of each pass (app/data/passes.py's `deal`), in
    batches cut alike on every rank. `pass_index` and `rows_into_pass` say where the ranks stand together: the
    first `rows_into_pass` rows of pass `pass_index` are trained. A stream resumed there (`skip_rows`) drops the
    rows of its own among them (read and dropped: a stream cannot seek). When the checkpointed run had
    another worker count, the ranks drop counts one row apart; where that empties a rank's first batch, its
    last row stands in with no target (it trains nothing), so every rank still yields as many batches.
    """

    def __init__(self, one_pass: RankPass, device: torch.device, pass_index: int = 0, skip_rows: int = 0,
                 rank: int = 0, world_size: int = 1):
        self.one_pass, self.device, self.world_size = one_pass, device, world_size
        self.pass_index, self.rows_into_pass = pass_index, skip_rows
        self._skip = rank_rows_among_first(skip_rows, rank, world_size)
        self._first_row = skip_rows // world_size  # the row (of this rank's) in whose batch every rank resumes
        self._batches = self._generate()

    def __next__(self) -> dict:
        return next(self._batches)

    def take_figures(self, step_seconds: float) -> dict[str, float]:
        """Figures of the data the last step took (none here; GRPO's stream reports its rollouts')."""
        return {}

    def run_figures(self) -> dict[str, float]:
        """Figures of the attempt for the run's summary (none here; GRPO's stream reports its throughput)."""
        return {}

    def state(self) -> dict:
        """What a checkpoint keeps beyond the data position: nothing here."""
        return {}

    def restore(self, state: dict) -> None:
        pass

    def __iter__(self) -> Iterator[dict]:
        return self

    def _generate(self) -> Iterator[dict]:
        while True:
            read = 0
            for batch in self.one_pass(self.pass_index):
                rows = len(next(iter(batch.values())))  # every column has a value per row
                start, read = read, read + rows
                if read <= self._first_row:  # trained on every rank
                    continue
                self.rows_into_pass = read * self.world_size
                skip = self._skip - start
                if skip >= rows:
                    batch = without_targets(batch)
                elif skip > 0:  # the checkpoint fell inside this batch (another batch size): its rest only
                    batch = {k: v[skip:] for k, v in batch.items()}
                yield to_device(batch, self.device)
            if not read:
                raise RuntimeError(f"this worker's rows of the pass are empty (pass {self.pass_index}); "
                                   "the dataset has fewer rows than workers")
            self.pass_index, self.rows_into_pass, self._skip, self._first_row = self.pass_index + 1, 0, 0, 0


MODEL_INPUTS = ("input_ids", "labels", "position_ids")  # preference pairs: chosen_input_ids, rejected_labels, ...


def without_targets(batch: dict) -> dict:
    """The batch's last row with nothing to learn or count: every label ignored, its real tokens, records per
    source and prompt flag zero (a text column, a prompt's record, kept)."""
    row = {k: v[-1:] if is_text(v) else torch.as_tensor(v[-1:]) for k, v in batch.items()}
    return {k: v if is_text(v) or k.endswith(("input_ids", "position_ids")) else
            torch.full_like(v, IGNORE_INDEX) if k.endswith("labels") else torch.zeros_like(v) for k, v in row.items()}


def is_text(values) -> bool:
    """A column of Python objects (a prompt's record as JSON), which stays as it is, off the device."""
    return isinstance(values, np.ndarray) and values.dtype.kind in "OUS" or isinstance(values, list)


def column_batches(columns: dict, batch_size: int, device: torch.device) -> Iterator[dict]:
    """Rows held as columns (name -> array, a row per index) in batches of `batch_size`, on `device`."""
    count = len(next(iter(columns.values())))
    for start in range(0, count, batch_size):
        yield to_device({k: v[start:start + batch_size] for k, v in columns.items()}, device)


def to_device(batch: dict, device: torch.device) -> dict:
    """The model's inputs on `device`; the bookkeeping columns (each row's real tokens and records per
    source) stay on the host, and text columns as they are."""
    return {k: v if is_text(v) else _tensor(v).to(device, non_blocking=True) if k.endswith(MODEL_INPUTS)
            else _tensor(v) for k, v in batch.items()}


def _tensor(values) -> torch.Tensor:
    """A tensor of a batch column; a read-only array (a view of Ray's object store) is copied, which torch
    would otherwise wrap with a warning in every worker's log."""
    if isinstance(values, np.ndarray) and not values.flags.writeable:
        values = values.copy()
    return torch.as_tensor(values)
