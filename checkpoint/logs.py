"""Log lines go through stdlib logging: one logger per module under ``checkpoint`` (and ``pyrecover`` for train.py),
configured once by the program that runs (``setup``), never handed around as callables.

In a job of many ranks most lines are rank 0's to say (a checkpoint committed, retention); a line that every rank must
print because it is that rank's own view (a signal it received, a just-in-time save) is logged with
``extra=EVERY_RANK``. The rank filter on the handler decides, in one place.
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
from typing import TextIO

#: ``logger.info(msg, extra=EVERY_RANK)``: printed by every rank, not only rank 0
EVERY_RANK = {"every_rank": True}
ROOTS = ("checkpoint", "pyrecover")


class RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or getattr(record, "every_rank", False)


class BarAwareHandler(logging.StreamHandler):
    """While a tqdm progress bar is on the terminal (metrics.py), a line goes through ``tqdm.write``: it clears the
    bar, prints the line, redraws the bar -- the bar never breaks mid-line. Without a bar: a plain stream write."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm = sys.modules.get("tqdm")  # not imported: no bar can be showing
        bars = getattr(getattr(tqdm, "tqdm", None), "_instances", None) if tqdm else None
        if not bars or all(getattr(b, "disable", True) for b in list(bars)):
            return super().emit(record)
        try:
            tqdm.tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


def setup(rank: int = 0, stream: TextIO | None = None) -> None:
    """INFO and up, the bare message, one write per line to ``stream`` (stdout), filtered by ``rank``."""
    handler = BarAwareHandler(stream or sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(RankFilter(rank))
    for name in ROOTS:
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(logging.INFO)
        logger.propagate = False


class _QuietDCPSaveProcess(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.module != "_async_process_executor"


def quiet_dcp_save_process() -> None:
    """DCP's save process (dcp ``--async-checkpoint process``) logs every request to stderr through the root logger at
    INFO, and a failed save as a multi-line traceback; the training process reports every outcome itself, in one
    line. That process is a spawned child that re-imports the main program, and so this package, before it logs:
    the package's import is the only hook early enough. Only a child process gets the filter (multiprocessing names
    it before the re-import; ``parent_process()`` is set only after): a program importing the package keeps its root
    logger as it was."""
    if multiprocessing.current_process().name != "MainProcess":
        logging.getLogger().addFilter(_QuietDCPSaveProcess())
