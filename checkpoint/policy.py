"""WHEN to save and when to stop. Pure decisions over a clock and counters, so they are testable without SLURM.

The training loop asks one question at every step boundary, ``decision = boundary(step)``, and every rank gets the
same answer for the same step:

* **step interval** (``--checkpoint-frequency``) and the final step: deterministic, the same on every rank;
* **wall-clock interval** (``--checkpoint-interval-minutes``): rank 0's clock;
* **walltime** (``--timeaware-checkpointing``): rank 0 knows the job's deadline (``SLURM_JOB_END_TIME``, else
  ``squeue``/``scontrol``, re-read every few minutes in the background, else ``--walltime``; the earliest wins) and
  stops when the time left is below the longest save so far + k x the moving step time + a margin;
* **signals**: the handler only records the signal; ``--signal`` (default SIGUSR1, SLURM's usual warning) means "save,
  stop, requeue", SIGTERM always means "save and stop" (no requeue: SLURM is ending the job - time limit, preemption,
  scancel), and so does the first SIGINT (Ctrl-C; torchrun forwards it to every rank); a second SIGINT exits at once
  with 130, no save.

Each rank votes a code (0 nothing, 1 interval save, 2 walltime stop, 3 signal stop, 4 SIGTERM/INT stop); one all-reduce MAX
per step makes them agree, so a signal that reached only one rank still stops all of them, at the same step, after
the same save. Once a stop is decided the loop ends; later signals (a second USR1, SIGTERM after USR1, the SIGTERM
SLURM sends after a requeue) are only recorded: they never start a second save nor interrupt the one in progress
(Python restarts interrupted system calls; a handler that only appends to a list cannot break anything).

There are no data-loader worker processes (the loader is in-process), so no child can die of the signal before the
save commits; the SLURM commands we start run with the signals blocked (checkpoint/slurm.py). A SIGTERM that arrives
before the loop starts (nothing to save yet) exits at once with 143, as without a handler, and a SIGINT with 130: each
with one line (instead of nothing, or a KeyboardInterrupt traceback).

After the loop, ``finish`` decides the exit: finished, stopped-and-requeued (rank 0 runs ``scontrol requeue`` once the
checkpoint has committed; array-aware; bounded by ``--max-restarts`` vs ``SLURM_RESTART_COUNT``; never when training is
complete), stopped-no-requeue, or stopped-but-requeue-failed (e.g. ``scontrol`` missing).

Tests pace the loop with ``PYRECOVER_STEP_SLEEP`` (a sleep at every step boundary; see knobs.py).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from . import knobs, slurm
from .logs import EVERY_RANK
from .naming import setting
from .signals import SignalOwner
from .walltime import DeadlineReader, WalltimePolicy

_log = logging.getLogger(__name__)


def _tell(msg: str) -> None:
    """Every rank's own view (its signals, its stop): printed by every rank."""
    _log.info(msg, extra=EVERY_RANK)

# Votes, ordered by urgency: agreement is an all-reduce MAX.
# FENCED: this incarnation no longer holds the run directory's lease (taken over, or its record deleted or replaced;
# checkpoint/lease.py): stop WITHOUT saving.
NONE, INTERVAL, WALLTIME, SIGNAL, TERM, FENCED = 0, 1, 2, 3, 4, 5
REASONS = {NONE: "", INTERVAL: "interval", WALLTIME: "walltime", SIGNAL: "signal", TERM: "SIGTERM", FENCED: "fenced"}
#: what train.py blocks before its (slow) imports, before it can import this module; released by SignalWatcher.install
HELD_SIGNALS = {signal.SIGUSR1, signal.SIGUSR2}

# Outcomes of a run (train.py maps them to exit codes).
FINISHED, REQUEUED, STOPPED, REQUEUE_FAILED = "finished", "requeued", "stopped", "requeue-failed"
_OUTCOME_CODES = {REQUEUED: 1, STOPPED: 2, REQUEUE_FAILED: 3}  # rank 0's outcome wins the MAX (others send 0)


@dataclass
class IntervalPolicy:
    """Save every ``every_steps`` steps (0 = never on a schedule) and always at the final step. With a node-local tier
    (``local_every`` > 0) a save every ``local_every`` steps lands there, and only every ``every_steps``-th goes on to
    the shared tier (``shared``). ``stretch`` > 0 (knobs.save_stretch, benchmarks only): interval saves only within the
    odd-numbered stretches of that many steps."""

    every_steps: int
    final_step: int
    stretch: int = 0
    local_every: int = 0

    def due(self, step: int) -> bool:
        if step == self.final_step:
            return True
        if self.stretch and (step - 1) // self.stretch % 2:
            return False
        every = self.local_every or self.every_steps
        return every > 0 and step % every == 0

    def shared(self, step: int) -> bool:
        """Whether an interval save of ``step`` also goes to the shared tier (always, without a local tier)."""
        return (not self.local_every or step == self.final_step
                or (self.every_steps > 0 and step % self.every_steps == 0))


# ----------------------------------------------------------------------------------------------------------------------
# Parsing flags
# ----------------------------------------------------------------------------------------------------------------------


#: Signals that cannot mean "save at the next step boundary and stop", by name, with why (``--signal`` refuses them
#: by name or number alike).
UNUSABLE_SIGNALS = {
    **dict.fromkeys(("SIGKILL", "SIGSTOP"), "cannot be caught"),
    **dict.fromkeys(("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGTRAP", "SIGSYS"),
                    "reports a crash of the process itself"),
    "SIGCHLD": "arrives whenever a child process exits", "SIGCONT": "arrives whenever a stopped process is continued",
    "SIGWINCH": "arrives whenever the terminal is resized", "SIGURG": "arrives with a socket's urgent data",
    "SIGPIPE": "arrives at a write to a closed pipe",
    **dict.fromkeys(("SIGTSTP", "SIGTTIN", "SIGTTOU"), "is job control (Ctrl-Z, terminal access)"),
}


def parse_signal(text: str) -> int | None:
    """``USR1`` / ``SIGUSR1`` / ``10`` -> signal number; ``none`` -> None (only SIGTERM is handled). ValueError (one
    line) for an unknown signal or one in UNUSABLE_SIGNALS."""
    t = str(text).strip().upper()
    if t in ("", "NONE", "OFF", "0"):
        return None
    try:
        sig = signal.Signals(int(t)) if t.isdigit() else signal.Signals[t if t.startswith("SIG") else "SIG" + t]
    except (ValueError, KeyError):
        raise ValueError(f"unknown signal {text!r} (e.g. USR1, SIGUSR2, 12, none)") from None
    if sig.name in UNUSABLE_SIGNALS:
        raise ValueError(f"{sig.name} ({int(sig)}) {UNUSABLE_SIGNALS[sig.name]}, so it cannot be the stop signal; use "
                         f"SIGUSR1 or SIGUSR2 (or none)")
    return int(sig)


# ----------------------------------------------------------------------------------------------------------------------
# Signals
# ----------------------------------------------------------------------------------------------------------------------


#: how a line says which signal ended the process (train.py's start-up handlers say the same)
_ENDED_BY = {signal.SIGINT: "interrupted (SIGINT)", signal.SIGTERM: "terminated (SIGTERM)"}
NOTHING_TO_SAVE = "before training started: nothing to save yet"


def _say_now(signum: int, what: str) -> None:
    """One line from a handler: os.write is safe where print is not (the handler may have interrupted a print)."""
    os.write(2, f"{_ENDED_BY[signum]} {what}\n".encode())


def _exit_now(signum: int, what: str) -> None:
    """A signal that cannot wait for a save: one line, exit 128 + signum at once, no KeyboardInterrupt traceback.
    os._exit: nothing left to unwind or join."""
    _say_now(signum, what)
    os._exit(128 + signum)


class SignalWatcher:
    """Records signals; the loop reads them at step boundaries. The handler does nothing else (no I/O, no locks), except
    that SIGTERM before ``arm()`` (setup: nothing to save yet) says so in one line and exits with 143, as the default
    action would, through ``exit_process``: raising SystemExit by default; a program passes os._exit, since an exception
    raised from a handler can be swallowed or converted by the code it interrupts (an extension module's import turns
    it into ImportError). It is one listener of the process's signal owner (signals.py), which restores the previous
    handlers at the end.

    SIGINT (Ctrl-C; torchrun forwards it to every rank) is SIGTERM's "save and stop, no requeue" in the loop. Before
    ``arm()``, a second SIGINT, or one after the last save: exit at once with 130 and one line (``_exit_now``)."""

    def __init__(self, stop_signal: int | None, owner: SignalOwner | None = None,
                 exit_process: Callable[[int], None] | None = None):
        self.stop_signal = stop_signal
        self.owner = owner or SignalOwner()
        self.exit_process = exit_process or _raise_exit
        self.received: list[int] = []
        self.armed = False
        self._reported = 0

    @property
    def signals(self) -> set[int]:
        return {signal.SIGTERM, signal.SIGINT} | ({self.stop_signal} if self.stop_signal is not None else set())

    def install(self) -> "SignalWatcher":
        for sig in sorted(self.signals):
            self.owner.listen(sig, self._handle)
        # train.py holds USR1/USR2 during its imports; one that arrived meanwhile is delivered now (to our handler if
        # it is the stop signal; the other one keeps its default action, as without the hold)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS)
        return self

    def arm(self) -> None:
        self.armed = True

    def _handle(self, signum: int) -> None:
        if signum == signal.SIGINT and not self.armed:
            _exit_now(signum, NOTHING_TO_SAVE)
        if signum == signal.SIGINT and signal.SIGINT in self.received:
            _exit_now(signum, f"again: exiting now without saving; {setting('resume', 'latest')} continues from the "
                              "last committed checkpoint")
        self.received.append(signum)
        if signum == signal.SIGTERM and not self.armed:
            _say_now(signum, NOTHING_TO_SAVE)
            self.exit_process(128 + signal.SIGTERM)

    def release_term(self) -> None:
        """After the last save: the handlers found at install come back, and SIGINT and SIGTERM exit at once with one
        line (a process stuck in teardown must not outlive them)."""
        self.owner.restore()
        for sig in _ENDED_BY:
            self.owner.listen(sig, lambda s: _exit_now(s, "after the last save: exiting now"))

    def restore(self) -> None:
        """The end of the run: every handler as it was before ``install``."""
        self.owner.restore()

    def vote(self) -> int:
        if not self.received:
            return NONE
        return TERM if {signal.SIGTERM, signal.SIGINT} & set(self.received) else SIGNAL

    def new(self) -> list[str]:
        """Names of the signals received since the last call (for the log)."""
        names = [signal.Signals(s).name for s in self.received[self._reported:]]
        self._reported += len(names)
        return names


def _raise_exit(code: int) -> None:
    raise SystemExit(code)


def install_signal_handlers(signal_spec: str | int | None, owner: SignalOwner | None = None,
                            exit_process: Callable[[int], None] | None = None) -> SignalWatcher:
    """Install the handlers as early as possible (a warning signal before this kills the process by default)."""
    stop = signal_spec if isinstance(signal_spec, int) or signal_spec is None else parse_signal(signal_spec)
    return SignalWatcher(stop, owner, exit_process).install()


class WallClockInterval:
    """Save every ``minutes`` of wall-clock time (counted from the last save of any kind)."""

    def __init__(self, minutes: float, clock: Callable[[], float] = time.monotonic):
        self.seconds = minutes * 60.0
        self.clock = clock
        self.last = clock()

    def due(self) -> bool:
        return self.seconds > 0 and self.clock() - self.last >= self.seconds

    def reset(self) -> None:
        self.last = self.clock()


# ----------------------------------------------------------------------------------------------------------------------
# The step boundary
# ----------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    save: bool = False
    stop: bool = False
    vote: int = NONE
    shared: bool = False  # the save goes to the shared tier too (with a local tier, not every one does)
    peer: bool = False  # with a peer copy, the save is also kept on the next node: not the one a run stops or ends
    # with, which the shared tier receives (a transfer then would only hold up the end)

    @property
    def reason(self) -> str:
        return REASONS[self.vote]


@dataclass
class RequeueSettings:
    enabled: bool | None = None  # None = auto: on in a SLURM job that is not an array task
    max_restarts: int = 100
    timeout_s: float = 30.0


class StepBoundary:
    """Everything the loop decides at a step boundary, agreed across ranks; then ``finish`` after the loop.

    ``agree(x)`` must return the maximum of ``x`` over all ranks (an all-reduce; identity for one process)."""

    def __init__(self, interval: IntervalPolicy, *, agree: Callable[[float], float], rank: int = 0,
                 signals: SignalWatcher | None = None, walltime: WalltimePolicy | None = None,
                 every_minutes: WallClockInterval | None = None, requeue: RequeueSettings | None = None,
                 environ: Mapping[str, str] = os.environ,
                 mono: Callable[[], float] = time.monotonic, step_sleep: float = 0.0,
                 save_history: Sequence | None = None, fenced: Callable[[], bool] | None = None):
        self.interval = interval
        self.agree = agree
        self.rank = rank
        self.signals = signals
        self.walltime = walltime
        self.every_minutes = every_minutes
        self.requeue = requeue or RequeueSettings()
        self.environ = environ
        self.mono = mono
        self.step_sleep = step_sleep
        self.save_history = save_history  # CheckpointManager.history: SaveRecord(blocking_s, durable_s)
        self.fenced = fenced  # rank 0: True once this incarnation no longer holds the lease
        self.stopped: Decision | None = None
        self.stop_step: int | None = None
        self._last = mono()
        self._saved_last = False
        self._walltime_note = ""
        self._my_signals: list[str] = []
        self._pending = NONE  # a stop agreed between an evaluation's batches (interrupt): the next decision's
        self._eval_s = 0.0  # evaluations since the last boundary: not step time

    # --- per step ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Right before the loop: from now on a SIGTERM is 'save and stop' (before it, exit at once)."""
        if self.signals is not None:
            self.signals.arm()
        self._last = self.mono()

    def local_vote(self, before_eval: bool = False) -> int:
        """``before_eval``: an evaluation is about to start, so the walltime rule also counts its measured duration."""
        vote = NONE
        if self.signals is not None:
            for name in self.signals.new():
                _tell(f"rank {self.rank}: received {name}")
            vote = max(vote, self.signals.vote())
            self._my_signals = sorted({signal.Signals(s).name for s in self.signals.received})
        if self.walltime is not None:
            self._feed_saves()
            extra = self.walltime.eval_s if before_eval else 0.0
            if self.walltime.due(extra):
                vote = max(vote, WALLTIME)
                self._walltime_note = self.walltime.explain(extra)
        if self.every_minutes is not None and self.every_minutes.due():
            vote = max(vote, INTERVAL)
        if self.fenced is not None and self.fenced():
            vote = FENCED
        return vote

    def resolve(self, agreed: int, step: int) -> Decision:
        stop = agreed >= WALLTIME
        save = (self.interval.due(step) or agreed >= INTERVAL) and agreed != FENCED
        # a save a vote asked for (a stop, the wall-clock interval) goes everywhere: it may be the last one
        shared = save and (agreed >= INTERVAL or self.interval.shared(step))
        peer = save and not stop and step != self.interval.final_step
        decision = Decision(save=save, stop=stop, vote=agreed, shared=shared, peer=peer)
        if save and self.every_minutes is not None:
            self.every_minutes.reset()
        if stop and self.stopped is None:
            self.stopped, self.stop_step = decision, step
            what = "stopping" if agreed == FENCED else "saving and stopping"
            _tell(f"rank {self.rank}: {what} at step {step}: {self._why(agreed)}")
        return decision

    def __call__(self, step: int) -> Decision:
        if self.step_sleep > 0:
            time.sleep(self.step_sleep)  # test-only pacing (knobs.step_sleep_s)
        now = self.mono()
        if self.walltime is not None and not self._saved_last:
            # a step that included a save would inflate the estimate; an evaluation is counted on its own
            self.walltime.observe_step(max(0.0, now - self._last - self._eval_s))
        self._last, self._eval_s = now, 0.0
        agreed = max(int(self.agree(float(self.local_vote()))), self._pending)
        self._pending = NONE
        decision = self.resolve(agreed, step)
        self._saved_last = decision.save
        return decision

    # --- between an evaluation's batches ---------------------------------------------------------------------------
    def interrupt(self, before_eval: bool = False) -> bool:
        """Whether an evaluation must give way to a stop (a signal, the walltime -- ``before_eval``: counting the
        evaluation's measured duration, so none starts that would overrun --, fenced): the same vote and all-reduce as
        a step boundary, so every rank gets the same answer; every rank calls it as often. A stop is kept for the
        next decision (``__call__``, or ``stop_now`` at a save whose card was evaluating)."""
        agreed = int(self.agree(float(self.local_vote(before_eval))))
        if agreed < WALLTIME:
            return False
        self._pending = max(self._pending, agreed)
        return True

    def observe_eval(self, seconds: float) -> None:
        """A whole evaluation took ``seconds``: the walltime rule counts it before the next one starts."""
        self._eval_s += seconds
        if self.walltime is not None:
            self.walltime.observe_eval(seconds)

    def stop_now(self, step: int) -> Decision | None:
        """The decision a stop agreed during this step's save (its card's evaluation gave way) makes of it: that save
        becomes the stop's (shared, no peer copy). None: no stop came."""
        if self._pending == NONE:
            return None
        agreed, self._pending = self._pending, NONE
        return self.resolve(agreed, step)

    def _feed_saves(self) -> None:
        if self.save_history:
            for r in self.save_history[-8:]:  # the newest ones; async saves fill durable_s (and mirror_s) later
                # a clean exit also waits for the final checkpoint to reach the mirror (--mirror-dir)
                self.walltime.observe_save(max(r.blocking_s, r.durable_s, r.shared_s) + r.mirror_s)

    def _why(self, agreed: int) -> str:
        if agreed == FENCED:
            return "this incarnation no longer holds the run directory's lease (taken over, or its record deleted); it is fenced and saves nothing"
        if agreed in (SIGNAL, TERM):
            if self._my_signals:  # as of this rank's vote (one arriving during the all-reduce is logged later)
                return f"received {', '.join(self._my_signals)}"
            return "another rank received a stop signal"
        if agreed == WALLTIME:
            return self._walltime_note or "walltime (decided on rank 0)"
        return REASONS[agreed]

    # --- after the loop ------------------------------------------------------------------------------------------
    def finish(self, step: int, final_step: int) -> str:
        """Call on every rank after the last checkpoint has committed (``manager.close()``). Rank 0 requeues the job if
        it should; every rank returns the same outcome (FINISHED, REQUEUED, STOPPED or REQUEUE_FAILED)."""
        if self.stopped is None or step >= final_step:
            if self.stopped is not None:
                _tell(f"rank {self.rank}: stop requested at the final step {step}: training is complete, no requeue")
            outcome = FINISHED
        else:
            code = _OUTCOME_CODES[self._requeue(step, final_step)] if self.rank == 0 else 0
            code = int(self.agree(float(code)))
            outcome = {v: k for k, v in _OUTCOME_CODES.items()}[code]
        if self.signals is not None:
            late = self.signals.new()
            if late:
                _tell(f"rank {self.rank}: also received {', '.join(late)} while stopping: ignored (the save had "
                         f"started; one save per stop)")
            if self.signals.armed and threading.current_thread() is threading.main_thread():
                self.signals.release_term()
        return outcome

    def _interrupted(self) -> bool:
        """Stopped by Ctrl-C (SIGINT: the user asked, not SLURM's SIGTERM), as this rank saw it."""
        return (self.stopped is not None and self.stopped.vote == TERM and "SIGINT" in self._my_signals
                and "SIGTERM" not in self._my_signals)

    def want_requeue(self) -> tuple[bool, str]:
        """Whether to requeue after this stop, and why (not)."""
        r = self.requeue
        if self._interrupted():
            return False, "interrupted (SIGINT)"
        if self.stopped is not None and self.stopped.vote == TERM:
            return False, "stopped by SIGTERM (SLURM is ending the job: time limit, preemption or scancel)"
        if r.enabled is False:
            return False, setting("when.requeue", False)
        if not slurm.in_job(self.environ):
            return False, "not running in a SLURM job"
        if r.enabled is None and slurm.in_array(self.environ):
            return False, ("job array task: the next array task resumes from `latest` (pass "
                           f"{setting('when.requeue', True)} to requeue this task instead)")
        restarts = slurm.restart_count(self.environ)
        if restarts >= r.max_restarts:
            return False, f"already restarted {restarts} times ({setting('when.max_restarts', r.max_restarts)})"
        return True, f"restart {restarts + 1} of at most {r.max_restarts}"

    def _requeue(self, step: int, final_step: int) -> str:
        want, why = self.want_requeue()
        if not want:
            _tell(f"interrupted (SIGINT) at step {step}: checkpoint step {step} committed; resume with "
                     f"{setting('resume', 'latest')} (make train does)" if self._interrupted() else
                     f"stopped at step {step} of {final_step}, checkpoint committed; not requeueing: {why}")
            return STOPPED
        target = slurm.requeue_target(self.environ)
        ok, message = slurm.requeue(target, timeout=self.requeue.timeout_s)
        if not ok:
            _tell(f"error: stopped at step {step} of {final_step} with the checkpoint committed, but cannot requeue "
                     f"job {target}: {message}; resubmit with {setting('resume', 'latest')} (or `sbatch "
                     f"submit-training-simple.sh --continue`)")
            return REQUEUE_FAILED
        _tell(f"stopped at step {step} of {final_step}, checkpoint committed; requeued job {target} ({why}): "
                 f"{message}")
        return REQUEUED


@dataclass(frozen=True)
class When:
    """When to save and stop, as the run asked for it."""

    every_steps: int = 0  # a save every N steps (0: none); the final step always saves
    final_step: int = 0
    every_minutes: float = 0.0  # also a save every N minutes of wall time (0: none)
    walltime_aware: bool = False  # save and stop before the job's time limit
    walltime_s: float | None = None  # the limit when not under SLURM (or to override it)
    walltime_margin_s: float = 0.0  # how long before the limit at the latest
    requeue: bool | None = None  # None = auto: on in a SLURM job that is not an array task
    max_restarts: int = 100


def step_boundary(when: When, *, rank: int, agree: Callable[[float], float], signals: SignalWatcher | None,
                  save_history: Sequence | None = None, start: float | None = None,
                  environ: Mapping[str, str] = os.environ, fenced: Callable[[], bool] | None = None,
                  local_every: int = 0) -> StepBoundary:
    """The step-boundary policy for ``when`` (``local_every``: the node-local tier's interval, see IntervalPolicy).
    Walltime and the wall-clock interval are decided on rank 0 (one
    ``squeue`` per job, not per rank); the all-reduce carries the decision to the others."""
    walltime = None
    if when.walltime_aware and rank == 0:
        reader = DeadlineReader(environ, walltime_s=when.walltime_s, start=start)
        walltime = WalltimePolicy(reader, margin_s=when.walltime_margin_s)
        walltime.start()
    every = WallClockInterval(when.every_minutes) if when.every_minutes and rank == 0 else None
    interval = IntervalPolicy(when.every_steps, when.final_step, knobs.save_stretch(environ), local_every)
    return StepBoundary(interval, agree=agree, rank=rank,
                        signals=signals, walltime=walltime, every_minutes=every,
                        requeue=RequeueSettings(when.requeue, when.max_restarts), environ=environ,
                        step_sleep=knobs.step_sleep_s(environ), save_history=save_history, fenced=fenced)
