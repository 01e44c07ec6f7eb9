"""Errors a user can act on.

Every error that reaches a user is a ``ColiError``: its message is one line that
names the thing at fault (a file, a field, a value) and, where possible, what to
do next. Front ends print ``str(err)`` and exit 2 (CLI) or map it to an
API-shaped error (HTTP); they never show a traceback for these.
"""


class ColiError(Exception):
    """Base class of user-facing errors; ``str(err)`` is the whole message."""


class ModelLoadError(ColiError):
    """A model directory or one of its files cannot be used."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's architecture is not one colibri implements."""


class InvalidRequestError(ColiError):
    """A request (prompt, sampling parameters, messages) is malformed."""
