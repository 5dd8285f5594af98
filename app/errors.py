"""The one exception type for mistakes a user can fix (config, data, model path, cluster size)."""


class UserInputError(ValueError):
    """A problem with what the user gave us. The message is one line: what is wrong, where, and the fix."""
