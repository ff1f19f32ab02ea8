"""WHEN the job's time runs out: the deadline (SLURM or --walltime) and the time-aware stop rule, for policy.py.

``DeadlineReader`` finds the deadline: ``SLURM_JOB_END_TIME`` first, then ``squeue``/``scontrol`` (admins extend
limits; the variable never changes), and ``--walltime`` counted from the start of train.py; the earliest wins.
``WalltimePolicy`` says stop when ``deadline - now < longest save + k x moving step time + margin``; it re-reads the
deadline in a background thread so a slow slurmctld never stalls a step. Both take their clock and query as
arguments, so tests/test_policy.py drives them with a fake clock.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Mapping

from . import slurm
from .naming import setting

_log = logging.getLogger(__name__)


def parse_walltime(text: str) -> float:
    """A SLURM time (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``) -> seconds."""
    t = str(text).strip()
    try:
        days = 0
        if "-" in t:
            d, t = t.split("-", 1)
            days = int(d)
            parts = [int(x) for x in t.split(":")]
            if not 1 <= len(parts) <= 3:
                raise ValueError
            h, m, s = (parts + [0, 0])[:3]
        else:
            parts = [int(x) for x in t.split(":")]
            if len(parts) == 1:
                h, m, s = 0, parts[0], 0
            elif len(parts) == 2:
                h, m, s = 0, parts[0], parts[1]
            elif len(parts) == 3:
                h, m, s = parts
            else:
                raise ValueError
        if min(days, h, m, s) < 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"walltime {text!r} is not a SLURM time (MM, MM:SS, HH:MM:SS, D-HH:MM:SS)") from None
    total = float(((days * 24 + h) * 60 + m) * 60 + s)
    if total <= 0:
        raise ValueError(f"walltime {text!r} must be positive")
    return total


Deadline = tuple  # (epoch seconds | None, source description)


class DeadlineReader:
    """The job's deadline (epoch seconds) and its source. SLURM's deadline: ``SLURM_JOB_END_TIME`` (SLURM 23.02+) at
    first, then ``squeue``/``scontrol`` (admins extend limits; the variable never changes). ``--walltime`` counts from
    ``start`` (when train.py started). The earliest known deadline wins."""

    def __init__(self, environ: Mapping[str, str] = os.environ, walltime_s: float | None = None,
                 start: float | None = None, query: Callable[[str], Deadline] = slurm.end_time):
        self.environ = environ
        self.walltime_s = walltime_s
        self.start = time.time() if start is None else start
        self.query = query
        self.reads = 0

    def __call__(self) -> Deadline:
        candidates: list[tuple[float, str]] = []
        notes = []
        job = slurm.job_id(self.environ)
        env_end = self.environ.get("SLURM_JOB_END_TIME", "").strip()
        if env_end and self.reads == 0:
            try:
                candidates.append((float(env_end), "SLURM_JOB_END_TIME"))
            except ValueError:
                notes.append(f"SLURM_JOB_END_TIME={env_end!r} is not a number")
        elif job:
            when, source = self.query(job)
            if when is not None:
                candidates.append((when, f"{source} (job {job})"))
            else:
                notes.append(source)
        if self.walltime_s:
            candidates.append((self.start + self.walltime_s, setting("when.walltime_s", f"{self.walltime_s:.0f}s")))
        self.reads += 1
        if not candidates:
            why = "; ".join(notes) if notes else f"not in a SLURM job and no {setting('when.walltime_s')}"
            return None, why
        return min(candidates)


class WalltimePolicy:
    """Stop when ``deadline - now < max save time + k x step time + margin``.

    ``observe_step`` feeds a moving (exponential) average of the step time, ``observe_save`` the longest save so far
    (blocking and until durable, plus until mirrored with --mirror-dir). The deadline is re-read every ``refresh_s``
    (in a background thread unless ``background=False``, so a slow slurmctld never stalls a step)."""

    def __init__(self, read: Callable[[], Deadline], *, margin_s: float = 60.0, step_factor: float = 3.0,
                 refresh_s: float = 300.0, clock: Callable[[], float] = time.time, background: bool = True,
                 ema: float = 0.2):
        self.read = read
        self.margin_s = margin_s
        self.step_factor = step_factor
        self.refresh_s = refresh_s
        self.clock = clock
        self.background = background
        self.ema = ema
        self.step_s: float | None = None
        self.save_s = 0.0
        self.eval_s = 0.0  # the longest whole evaluation so far (counted before the next one starts)
        self.deadline: float | None = None
        self.source = ""
        self._last_read = float("-inf")
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """First read, synchronous, logged."""
        self._apply(self.read(), first=True)

    def _apply(self, result: Deadline, first: bool = False) -> None:
        when, source = result
        self._last_read = self.clock()
        if when is None:
            if first:
                _log.info(f"walltime: no deadline known ({source}); time-aware stopping is off until one is")
            return
        if first or self.deadline is None or abs(when - self.deadline) >= 1.0:
            left = when - self.clock()
            verb = "deadline" if first else "deadline changed:"
            _log.info(f"walltime: {verb} {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(when))} "
                     f"({left:.0f}s from now) from {source}")
        self.deadline, self.source = when, source

    def _maybe_refresh(self, now: float) -> None:
        if now - self._last_read < self.refresh_s or (self._thread is not None and self._thread.is_alive()):
            return
        if not self.background:
            self._apply(self.read())
            return
        self._last_read = now

        def work() -> None:
            try:
                self._apply(self.read())
            except Exception as e:  # noqa: BLE001 - a failed refresh keeps the last deadline
                _log.info(f"walltime: re-reading the deadline failed: {e}")

        self._thread = threading.Thread(target=work, name="walltime-refresh", daemon=True)
        self._thread.start()

    def observe_step(self, seconds: float) -> None:
        self.step_s = seconds if self.step_s is None else (1 - self.ema) * self.step_s + self.ema * seconds

    def observe_save(self, seconds: float) -> None:
        self.save_s = max(self.save_s, seconds)

    def observe_eval(self, seconds: float) -> None:
        self.eval_s = max(self.eval_s, seconds)

    def needed(self, extra_s: float = 0.0) -> float:
        return self.save_s + self.step_factor * (self.step_s or 0.0) + self.margin_s + extra_s

    def remaining(self, now: float | None = None) -> float | None:
        return None if self.deadline is None else self.deadline - (self.clock() if now is None else now)

    def due(self, extra_s: float = 0.0) -> bool:
        """``extra_s``: the time something about to start takes first (an evaluation: ``eval_s``)."""
        now = self.clock()
        self._maybe_refresh(now)
        left = self.remaining(now)
        return left is not None and left < self.needed(extra_s)

    def explain(self, extra_s: float = 0.0) -> str:
        left = self.remaining()
        evaluation = f" + the evaluation due now {extra_s:.2f}s" if extra_s else ""
        return (f"walltime: {left:.1f}s left before the deadline from {self.source}, < {self.needed(extra_s):.1f}s "
                f"needed (longest save {self.save_s:.2f}s + {self.step_factor:g} x step {self.step_s or 0.0:.2f}s"
                f"{evaluation} + margin {self.margin_s:g}s)")
