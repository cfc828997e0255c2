"""Errors the tools raise for bad input or a bad environment: the CLI prints them as one line, not a traceback."""


class ToolError(Exception):
    """A problem with the user's input or environment."""


class PathError(ToolError):
    """A path named on the command line is missing, of the wrong kind or not writable. The CLI exits with 2 for it,
    as for any other bad usage (`swapio info`, `bench`, `tune`, `plan` and `demo` alike)."""


class VerifyError(ToolError):
    """Bytes read back differ from the pattern written; `.offset` is the first bad byte's file offset."""

    def __init__(self, path, offset):
        super().__init__(f"verify failed: {path} holds unexpected data at offset {offset}")
        self.path, self.offset = path, offset
