"""What the command-line tests share: the one-line error check and a closed local port."""

from __future__ import annotations

import pytest

from tests.helpers import free_port


@pytest.fixture
def one_line_error(capsys):
    """Run a CLI's `main(argv)` in-process; it must exit 2 with one line `error: ...` on stderr and print
    nothing on stdout. Returns that line."""
    def run(main, argv: list[str]) -> str:
        code = main([str(arg) for arg in argv])
        out, err = capsys.readouterr()
        assert code == 2, out + err
        assert err.startswith("error: ") and err.count("\n") == 1, err
        assert out == ""
        return err.strip()
    return run


@pytest.fixture
def closed_address() -> str:
    """A Jobs API address nothing listens on: connecting fails at once."""
    return f"http://127.0.0.1:{free_port()}"
