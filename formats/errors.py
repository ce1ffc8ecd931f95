"""Errors a user can act on.

Every exception here carries a one-line message that names the problem and the fix; the CLI's
``main()`` prints it to stderr and exits 1. Anything else is a bug and keeps its traceback.
"""


class DeltazipError(Exception):
    """Base class of the errors that the CLI reports as one line (exit code 1)."""


class InputError(DeltazipError):
    """A path, checkpoint, calibration file or option that cannot be used as given."""


class ArtifactError(DeltazipError):
    """An artifact that is missing, corrupt, of an unknown version or inconsistent."""


class CompressionError(DeltazipError):
    """The solver could not compress a tensor (e.g. the Hessian stays singular)."""


class DeltazipWarning(UserWarning):
    """Something the user should know that does not stop the command (the CLI prints it as one
    ``deltazip: warning: ...`` line on stderr)."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first non-blank line of ``e``'s message (some libraries start theirs with a newline), cut
    to ``limit`` characters: what a one-line error quotes of an exception it wraps."""
    return next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")[:limit]
