"""The one exception type for mistakes a user can fix by changing a setting or a file."""


class UserError(Exception):
    """A bad setting or input: printed as one paragraph (no traceback) and the process exits non-zero."""


class AgreedStop(UserError):
    """A UserError every rank raises at the same point of a loop, having agreed on it through a collective (a step's
    reward failures, gradients that turned NaN): on its way out the loop may still run collectives, and publishes the
    checkpoint save in flight (`ckpt.checkpoint.Checkpointer.kept_on_agreed_stop`) instead of leaving it unpublished."""
