"""What one pass over the training data holds: how many rows each source gives it, and its seeds.

Plain arithmetic, no Ray: app/data.py builds each pass from this plan with Ray Data. A pass draws
`rows_per_pass()[i]` rows from source i (with repetition where a source is smaller than its share),
shuffles them all together with a seed for that pass, and splits them into equal shards, one per rank.
The same seed, pass and worker count give the same shards, so a resumed run continues exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PassPlan:
    names: tuple[str, ...]  # one per source, for logging
    rows: tuple[int, ...]  # rows each source holds (after dropping rows with no target token)
    weights: tuple[float, ...] | None  # shares of every pass; None: in proportion to the sizes
    seed: int

    def rows_per_pass(self) -> list[int]:
        """Rows drawn from each source per pass: as many in all as the sources hold together."""
        if self.weights is None:
            return list(self.rows)
        total, weight = sum(self.rows), sum(self.weights)
        return [max(1, round(total * w / weight)) for w in self.weights]

    def copies_needed(self, source: int) -> int:
        """How many times source `source` is repeated to fill its share of a pass."""
        return max(1, math.ceil(self.rows_per_pass()[source] / self.rows[source]))

    def source_seed(self, epoch: int, source: int) -> int:
        return _mix(self.seed, epoch, source + 1)

    def pass_seed(self, epoch: int) -> int:
        return _mix(self.seed, epoch, 0)


def _mix(*values: int) -> int:
    """A 32-bit seed from several integers (Ray Data takes seeds below 2**32)."""
    h = 0x9E3779B9
    for v in values:
        h = (h * 0x01000193 ^ (v & 0xFFFFFFFF)) & 0xFFFFFFFF
    return h


def source_names(paths: list[str]) -> tuple[str, ...]:
    """Short, distinct names for the sources: the file or directory name, numbered where they repeat."""
    stems = [Path(p.rstrip("/")).stem or p for p in paths]
    return tuple(s if stems.count(s) == 1 else f"{s}-{i}" for i, s in enumerate(stems))
