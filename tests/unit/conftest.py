"""Fixtures the unit tests of several packages share."""

from __future__ import annotations

import pytest

from tests.unit.serve.reference import random_adapter


@pytest.fixture(scope="session")
def adapters(embedded, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: str(random_adapter(embedded["model"], root / name, seed))
            for name, seed in (("noisy", 3), ("other", 4))}
