"""One exception for every user-facing failure: the CLI prints its message as one line, no traceback."""


class SpecdistillError(Exception):
    """Bad input or an unmet precondition. The message names the file, row or key at fault."""
