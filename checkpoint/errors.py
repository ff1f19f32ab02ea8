"""Errors the checkpoint package raises. Their message is one line: what, where, and what to do."""


class CheckpointError(Exception):
    """A checkpoint cannot be written, found, verified or loaded."""


def first_line(error: BaseException, limit: int = 160, *, typed: bool = False) -> str:
    """The first line of ``error``'s message, at most ``limit`` characters (library errors are often many lines);
    ``typed``: prefixed with its type's name. An empty message gives the type's name."""
    lines = str(error).strip().splitlines()
    if not lines:
        return type(error).__name__
    return f"{type(error).__name__}: {lines[0][:limit]}" if typed else lines[0][:limit]
