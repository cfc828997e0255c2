"""Errors the tools raise for bad input or a bad environment: the CLI prints them as one line, not a traceback."""


class ToolError(Exception):
    """A problem with the user's input or environment."""


class VerifyError(ToolError):
    """Bytes read back differ from the pattern written; `.offset` is the first bad byte's file offset."""

    def __init__(self, path, offset):
        super().__init__(f"verify failed: {path} holds unexpected data at offset {offset}")
        self.path, self.offset = path, offset
