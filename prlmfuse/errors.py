"""The one exception type that reaches the user as a single line and exit status 2."""


class UserError(Exception):
    """Bad input from the user: what is wrong, where, and how to fix it, in one line.

    The CLI prints `error: <message>` to stderr and exits 2, with no traceback.
    Library callers can catch it like any other exception.
    """

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))
