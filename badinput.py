"""The one exception for a user's mistake found before training (flags, config files, trackers): one line, exit code 2.
Its own module, so that what raises it needs none of the flags' world."""


class BadInput(Exception):
    """A user mistake detected before training: one line, exit code 2."""


def parse_first(parse, refused: tuple[type[BaseException], ...]):
    """A program's command line, parsed before its heavy imports: what `parse` raises of `refused` is one line and
    exit 2, never a traceback (argparse's own usage errors exit 2 inside it)."""
    import sys

    try:
        return parse()
    except refused as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
