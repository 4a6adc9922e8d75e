"""One exception for every user-facing failure: the CLI prints its message as one line, no traceback."""


class SpecdistillError(Exception):
    """Bad input or an unmet precondition. The message names the file, row or key at fault."""


class Preempted(SpecdistillError):
    """Training stopped on request (SIGTERM) after saving a checkpoint: not a failure. The CLI exits with
    EXIT_CODE (EX_TEMPFAIL, "try again"), so a scheduler or a script can tell it from success and from an error."""

    EXIT_CODE = 75
