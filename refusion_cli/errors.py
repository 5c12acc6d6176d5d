"""Errors a user can cause. The CLI turns these into one line and a non-zero exit."""


class UserError(Exception):
    """A mistake in the user's input (a path, an option, a checkpoint): shown as one line, no traceback."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint
