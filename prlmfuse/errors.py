"""The one exception type that reaches the user as a single line and exit status 2."""


class UserError(Exception):
    """Bad input from the user: what is wrong, where, and how to fix it, in one line.

    The CLI prints `error: <message>` to stderr and exits 2, with no traceback.
    Library callers can catch it like any other exception.
    """

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class SettingError(UserError):
    """A setting that breaks a rule of a run or of its model.

    `key` names the setting as pipeline.yaml spells it (a tuple for a nested one, e.g.
    ("prlms", 0, "layer")), so that the pipeline reader can point at its line and column;
    `detail` is the complaint without the name. A rule between two settings names the other in
    `also`: the reader points at whichever of them the file writes.
    """

    def __init__(self, key: str | tuple, detail: str, also: tuple[str, ...] = ()):
        self.key = key if isinstance(key, tuple) else (key,)
        self.also = also
        self.detail = " ".join(str(detail).split())
        super().__init__(f"{'.'.join(map(str, self.key))}: {self.detail}")
