"""Errors the checkpoint package raises. Their message is one line: what, where, and what to do."""


class CheckpointError(Exception):
    """A checkpoint cannot be written, found, verified or loaded."""


class GroupDown(RuntimeError):
    """A peer of this process group failed (in-process recovery, launcher.py): a save waiting on its part stops now,
    as a collective with it would, instead of waiting for its commit timeout. Not a CheckpointError: the caller
    recovers from it as from a collective's error, not as from bad input."""


def first_line(error: BaseException, limit: int = 160, *, typed: bool = False) -> str:
    """The first line of ``error``'s message, at most ``limit`` characters (library errors are often many lines);
    ``typed``: prefixed with its type's name. An empty message gives the type's name."""
    lines = str(error).strip().splitlines()
    if not lines:
        return type(error).__name__
    return f"{type(error).__name__}: {lines[0][:limit]}" if typed else lines[0][:limit]
