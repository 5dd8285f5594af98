"""A rank's endless stream of training micro-batches, with a position that checkpoints can record."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

PassOverShard = Callable[[int], Iterable[dict]]  # epoch -> one pass over this rank's shard


class ShardStream:
    """Pass after pass over this rank's shard, so every rank can take exactly max_steps steps.

    `epoch` and `rows_into_epoch` say where the stream stands; a resumed stream skips the rows the
    checkpointed run had already trained on in that pass (read and dropped: a stream cannot seek).
    """

    def __init__(self, one_pass: PassOverShard, device: torch.device, epoch: int = 0, skip_rows: int = 0):
        self.one_pass, self.device = one_pass, device
        self.epoch, self.rows_into_epoch, self._skip = epoch, 0, skip_rows
        self._batches = self._generate()

    def __next__(self) -> dict:
        return next(self._batches)

    def __iter__(self) -> Iterator[dict]:
        return self

    def _generate(self) -> Iterator[dict]:
        while True:
            empty = True
            for batch in self.one_pass(self.epoch):
                empty = False
                rows = len(batch["input_ids"])
                if self._skip >= rows:
                    self._skip -= rows
                    self.rows_into_epoch += rows
                    continue
                if self._skip:  # the checkpoint fell inside this batch (another batch size): its rest only
                    batch = {k: v[self._skip:] for k, v in batch.items()}
                    self.rows_into_epoch, rows, self._skip = self.rows_into_epoch + self._skip, rows - self._skip, 0
                self.rows_into_epoch += rows
                yield to_device(batch, self.device)
            if empty:
                raise RuntimeError(f"this worker's training shard is empty (pass {self.epoch}); "
                                   "the dataset has fewer rows than workers")
            self.epoch, self.rows_into_epoch, self._skip = self.epoch + 1, 0, 0


def to_device(batch: dict, device: torch.device) -> dict:
    """The model's inputs on `device`; the bookkeeping columns (each row's real tokens and records per
    source) stay on the host."""
    model_inputs = {"input_ids", "labels", "position_ids"}
    return {k: torch.as_tensor(v).to(device, non_blocking=True) if k in model_inputs else torch.as_tensor(v)
            for k, v in batch.items()}
