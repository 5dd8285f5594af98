"""What a user sees when something is wrong: the one exception type for mistakes a user can fix (config, data,
model path, cluster size), how a command line reports one, and how every module words a warning."""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import Callable


class UserInputError(ValueError):
    """A problem with what the user gave us. The message is one line: what is wrong, where, and the fix. What
    it quotes of the user's input stays on that line: line breaks and other control characters are escaped."""

    def __init__(self, message: str):
        super().__init__(on_one_line(message))


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")  # what str.splitlines() splits at, and the rest of C0/C1


def on_one_line(text: str) -> str:
    """The text with line breaks and other control characters escaped (`\\n`, `\\r`, `\\x00`)."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def exit_code(command: Callable[[], int]) -> int:
    """Run a command line's work: a UserInputError becomes one line `error: ...` on stderr and exit code 2;
    any other exception is a bug and keeps its traceback."""
    try:
        return command()
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


class CommandParser(argparse.ArgumentParser):
    """argparse as every command line here uses it: a wrong argument is one line and exit code 2, like a
    UserInputError, not argparse's usage block."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {on_one_line(message)} (see {self.prog} --help)\n")


# what a URL in an error message may carry that must not reach a log: `user:password@`, and a query string
# (a presigned URL's signature and session token)
_URL_SECRETS = re.compile(r"(?<=://)[^/\s@]+@|(?<=[\w/])\?[^\s'\"=]*=[^\s'\"]*")


def first_line(error: BaseException, limit: int | None = None) -> str:
    """An exception's message cut to one line (and to `limit` characters), without URL credentials or query
    strings, for the `(...)` of a UserInputError or a warning; its type if it has none."""
    text = str(error).strip()
    line = _URL_SECRETS.sub("", text.splitlines()[0]) if text else type(error).__name__
    return line[:limit] if limit else line


def warn(message: str) -> None:
    """A warning the user should read: one line `warning: ...` on stderr, in the driver's output or, from a
    worker, in the job's log with Ray's prefix naming the worker."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


@functools.cache
def warn_once(message: str) -> None:
    """`warn`, once per process for the same message (what every step or evaluation would repeat)."""
    warn(message)
