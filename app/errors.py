"""The one exception type for mistakes a user can fix (config, data, model path, cluster size), and how a
command line reports one."""

from __future__ import annotations

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


def first_line(error: BaseException) -> str:
    """An exception's message cut to one line, without URL credentials or query strings, for the `(...)` of a
    UserInputError; its type if it has none."""
    text = str(error).strip()
    return _URL_SECRETS.sub("", text.splitlines()[0]) if text else type(error).__name__
