"""The one exception type for bad input: the CLI prints it as one line and exits with 2."""


class UserError(Exception):
    """Bad input from the user (a file, a key, a value). The message says what to do."""

    exit_code = 2
