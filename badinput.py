"""The one exception for a user's mistake found before training (flags, config files, trackers): one line, exit code 2.
Its own module, so that what raises it needs none of the flags' world."""


class BadInput(Exception):
    """A user mistake detected before training: one line, exit code 2."""
