"""Errors the checkpoint package raises. Their message is one line: what, where, and what to do."""


class CheckpointError(Exception):
    """A checkpoint cannot be written, found, verified or loaded."""
