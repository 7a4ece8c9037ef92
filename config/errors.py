"""The one exception type for mistakes a user can fix by changing a setting or a file."""


class UserError(Exception):
    """A bad setting or input: printed as one paragraph (no traceback) and the process exits non-zero."""
