"""Errors the tools raise for bad input or a bad environment: the CLI prints them as one line, not a traceback.

Exit status: a UsageError (the command line asks for something that cannot be done as given: a value out of
range, options that do not mix, a path that is missing or of the wrong kind) exits 2; any other ToolError (a
failure of the disk, the environment or fio) exits 1. docs/cli.md lists them."""


class ToolError(Exception):
    """A problem with the user's input or environment."""


class UsageError(ToolError):
    """Bad usage: the run cannot start as the command line asks; changing the command line fixes it. `prog`
    names the (sub)command when the error comes from its argument parser."""

    def __init__(self, message, prog=None):
        super().__init__(message)
        self.prog = prog


class PathError(UsageError):
    """A path named on the command line is missing, of the wrong kind or not writable. The CLI exits with 2 for it,
    as for any other bad usage (`swapio info`, `bench`, `tune`, `plan` and `demo` alike)."""


class VerifyError(ToolError):
    """Bytes read back differ from the pattern written; `.offset` is the first bad byte's file offset."""

    def __init__(self, path, offset):
        super().__init__(f"verify failed: {path} holds unexpected data at offset {offset}")
        self.path, self.offset = path, offset
