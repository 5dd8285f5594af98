"""What a user sees when something is wrong: the one exception type for mistakes a user can fix (config, data,
model path, cluster size), how a command line reports one, and how every module words a warning."""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable


class UserInputError(ValueError):
    """A problem with what the user gave us. The message is one line: what is wrong, where, and the fix."""


def exit_code(command: Callable[[], int]) -> int:
    """Run a command line's work: a UserInputError becomes one line `error: ...` on stderr and exit code 2;
    any other exception is a bug and keeps its traceback."""
    try:
        return command()
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


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
