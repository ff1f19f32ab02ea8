"""Just-in-time checkpointing (``--jit-checkpoint``; JITC, Gupta et al., EuroSys'24).

When one data-parallel rank fails during a step, the survivors still hold identical, consistent copies of the state of
the last *completed* step: parameters and optimizer state change only inside ``optimizer.step()``. So instead of losing
everything since the last periodic checkpoint, one healthy replica saves that state and exits for a requeue; the rerun
replays at most one step.

How a failure is noticed
    The failed rank either raises (it then does not save: a rank that failed itself is not trusted) or dies; the others
    get an error from the next collective -- gloo reports a closed/reset connection within milliseconds of a peer's death,
    a *hung* peer is noticed after the process-group timeout (``--pg-timeout-seconds``, applied to the training loop).
    torchrun's agent SIGTERMs the surviving workers ~0.1 s after one dies and SIGKILLs them 30 s later: the stop
    policy only records that SIGTERM (signals.py), and the survivor's next collective fails within milliseconds, so it
    saves inside that window.

What is saved, and how exactly
    The step is the last one completed (``train_state.step``). A failure noticed during forward/backward/clipping means
    the state is that of the previous step; the data-loader position and RNG are taken from a snapshot at the start of
    the step (cheap: a few integers and ~5 KB); train.py all-reduces the logged loss there too, before the optimizer
    step. A failure noticed between steps (the stop-policy vote, a periodic save) means the step just completed. A rank
    caught *inside* the optimizer step (its parameters may be half-updated) never saves.

    The loss CSV is written by rank 0 only, but every rank's metrics know the row of each completed step: before the
    checkpoint becomes visible the survivor has them append the row if rank 0 died before writing it
    (``ensure_logged``), so the CSV keeps every step once.

    Exact: model, optimizer, LR scheduler, grad scaler, step/token counters (identical on every replica), and the
    data-loader position (global: every rank's loader holds the same epoch/position, so the survivor's serves all ranks).
    Per-rank RNG: the saver's own stream is exact; a dead rank's stream cannot be read. It is *derived* as the state the
    run seeded that rank with (``--seed + rank``), which is exact when the run has consumed no randomness since seeding
    -- checked at save time on the saver's own stream (true for this model: no dropout; the loader has its own
    generator). If the check fails, the dead ranks' RNG is omitted (they resume from a fresh seed) and the manifest says
    ``"rng_exact": false``.

How it is written
    Without the (broken) process group, through ``CheckpointManager.save_alone``: the saver writes the full replicated
    state plus one per-rank file for every rank of the run, as a vanilla-format checkpoint committed like any other,
    with ``meta.jit = true`` and the run's world size, so it loads on the same world size exactly like a periodic one.
    It is staged in the incarnation's staging folder and published by the layout's one step-folder replacement; a valid
    periodic save of the same step committed meanwhile is kept.

Who saves
    The lowest surviving rank: every survivor drops a claim file (in ``manager.jit_folder``); rank 0 proceeds at once,
    rank r > 0 waits a short grace period for a lower claim; the writer additionally takes an exclusive lock (O_EXCL),
    so there is never more than one. Survivors exit with the requeue exit code (train.py ``EXIT_REQUEUE``).

Not covered: sharded state (FSDP; no survivor holds a full copy) -- refused at startup (backends.check_combination);
NCCL's watchdog aborts the process on a collective error unless ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is relaxed
(untested here: CPU/gloo only). The crash used to test it is ``PYRECOVER_CRASH_AT_STEP`` (knobs.py).
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import layout
from .errors import CheckpointError, first_line
from .lease import Fenced
from .fsio import atomic_write_bytes, make_dirs
from .logs import EVERY_RANK
from .manager import CheckpointManager
from .naming import setting
from .state import CheckpointState

_log = logging.getLogger(__name__)


def _tell(msg: str) -> None:
    """A survivor's account of the failure: every rank prints its own."""
    _log.info(msg, extra=EVERY_RANK)

FORWARD_BACKWARD, OPTIMIZER, BETWEEN_STEPS = "forward/backward", "optimizer step", "between steps"
CLAIM_GRACE_S = 2.0

_PEER_FAILURE_MARKERS = ("gloo", "nccl", "connection closed by peer", "connection reset by peer", "broken pipe",
                         "timed out", "timeout", "socket")


def is_peer_failure(exc: BaseException) -> bool:
    """True when ``exc`` says another rank (or the launcher) failed, not this one: this rank is a healthy replica."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    if isinstance(exc, RuntimeError):
        msg = str(exc).lower()
        return any(m in msg for m in _PEER_FAILURE_MARKERS)
    return False


def one_line(exc: BaseException) -> str:
    """First line of an error, without gloo's source-location prefix and advice tail."""
    text = first_line(exc, 1000) if str(exc).strip() else ""
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", text).split(". This is typically")[0]
    return f"{type(exc).__name__}: {text[:160]}"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


class NoJIT:
    """``--jit-checkpoint`` off: the same hooks, doing nothing, so the loop has no branches for it."""

    def begin_step(self) -> None: ...

    def begin_optimizer(self) -> None: ...

    def end_step(self) -> None: ...

    def save_if_survivor(self, exc: BaseException) -> bool:  # noqa: ARG002
        return False


class JustInTime(NoJIT):
    """Phase tracking around the training step, and the save of the last completed step when a peer fails."""

    def __init__(self, manager: CheckpointManager, state: CheckpointState, *,
                 reseed: Callable[[int], None] | None = None,
                 ensure_logged: Callable[[int], None] = lambda step: None,
                 describe: Callable[[int], dict] = lambda step: {}):
        self.manager = manager
        self.state = state
        self.rank = manager.rank
        self.reseed = reseed
        self.ensure_logged = ensure_logged  # the metrics' row repair (train.py): the CSV gets the saved step's row
        self.describe = describe  # the card's manifest meta without evaluation (no forward in a failure path)
        self.phase = BETWEEN_STEPS
        self._snapshot: dict[str, Any] = {}

    # --- hooks around the step (train.py) ------------------------------------------------------------------------
    def begin_step(self) -> None:
        # What the per-rank pieces were when the last completed step ended (the step about to run changes them).
        self._snapshot = {key: piece.state_dict() for key, piece in self.state.per_rank().items()}
        self.phase = FORWARD_BACKWARD

    def begin_optimizer(self) -> None:
        self.phase = OPTIMIZER

    def end_step(self) -> None:
        self.phase = BETWEEN_STEPS
        self._snapshot = {}

    # --- recovery --------------------------------------------------------------------------------------------------
    def save_if_survivor(self, exc: BaseException) -> bool:
        """Called with the exception that ended the loop. True: this rank is a healthy survivor and is done (it saved
        the last completed step, or another rank did, or there was nothing new to save) -> exit for a requeue.
        False: not handled (this rank failed itself, or it was inside the optimizer step) -> re-raise."""
        r = self.rank.rank
        if not is_peer_failure(exc):
            _tell(f"jit: rank {r} failed itself ({one_line(exc)}); it does not save, a healthy replica will")
            return False
        if self.phase == OPTIMIZER:
            _tell(f"jit: rank {r} noticed the failure inside the optimizer step; its parameters may be half-updated, "
                     "so it does not save")
            return False
        if self.manager.lease is not None:
            # A partitioned rank of a stale incarnation must not even claim the save: the run directory is the new
            # owner's (raises Fenced: exit 6, nothing written).
            self.manager.lease.check("just-in-time save")
        t0 = time.perf_counter()
        step = int(self.state["train_state"].step)
        _tell(f"jit: rank {r} noticed a failure during the {self.phase} of step {step + 1} ({one_line(exc)}); "
                 f"the state of step {step} is intact")
        if step == 0:
            _tell("jit: no step completed yet; nothing to save")
            return True
        try:
            existing = layout.resolve(self.manager.root, str(step), quiet=True)
        except CheckpointError:
            existing = None
        if existing is not None:
            _tell(f"jit: step {step} is already committed ({existing.path}); nothing to save")
            return True
        if not self._elect():
            return True
        try:
            self.ensure_logged(step)
            pieces, meta = self._pieces()
            path = self.manager.save_alone(step, pieces, meta=meta | self.describe(step))
        except Fenced:
            raise
        except (OSError, CheckpointError) as e:
            _tell(f"jit: rank {r} could not save step {step}: {one_line(e)}; resume falls back to the last "
                     "periodic checkpoint")
            return True
        _tell(f"jit: rank {r} saved step {step} to {path} in {time.perf_counter() - t0:.2f}s "
                 f"(RNG of ranks {meta['rng_derived_ranks']} "
                 f"{'derived from their seed: exact' if meta['rng_exact'] else 'NOT recoverable: fresh seed on resume'}); "
                 f"resume with {setting('resume', 'latest')}")
        return True

    def _elect(self) -> bool:
        """Claim on the filesystem; True if this rank is the one that writes."""
        r, work = self.rank.rank, self.manager.jit_folder
        make_dirs(work)
        atomic_write_bytes(work / f"claim-rank-{r:05d}", str(os.getpid()).encode())
        if r > 0:
            deadline = time.monotonic() + CLAIM_GRACE_S
            while time.monotonic() < deadline:
                lower = [p.name for p in work.glob("claim-rank-*") if int(p.name.rsplit("-", 1)[1]) < r]
                if lower:
                    _tell(f"jit: rank {r} leaves the save to a lower surviving rank ({sorted(lower)[0]})")
                    return False
                time.sleep(0.05)
        try:
            fd = os.open(work / "writer.lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            _tell(f"jit: rank {r}: another survivor is already saving")
            return False
        os.write(fd, str(r).encode())
        os.close(fd)
        return True

    def _pieces(self) -> tuple[dict[str, dict], dict]:
        """The files of the checkpoint: the shared pieces, and per-rank files for every rank of the run -- this rank's
        exact, the others' derived (see the module docstring)."""
        from .backends.torchfile import rank_file

        pieces = {f"{key}.pt": piece.state_dict() for key, piece in self.state.shared().items()}
        if self.phase == FORWARD_BACKWARD and self._snapshot:
            own = self._snapshot
        else:
            own = {key: piece.state_dict() for key, piece in self.state.per_rank().items()}
        others = {key: value for key, value in own.items() if key != "rng"}
        seeded: dict[int, dict] = {}
        if "rng" in own and self.reseed is not None:
            current = self.state["rng"].state_dict()
            try:
                for q in range(self.rank.world_size):
                    self.reseed(q)
                    seeded[q] = self.state["rng"].state_dict()
            finally:
                self.state["rng"].load_state_dict(current)
        rng_exact = bool(seeded) and _same(seeded[self.rank.rank], own["rng"])
        for q in range(self.rank.world_size):
            pieces[rank_file(q)] = own if q == self.rank.rank else (
                {**others, "rng": seeded[q]} if rng_exact else dict(others))
        # rng_exact: the other ranks' RNG was derived from their seed and is exact; else they resume with a fresh seed.
        meta = {"jit": True, "saved_by_rank": self.rank.rank, "failure_phase": self.phase, "rng_exact": rng_exact,
                "rng_derived_ranks": [q for q in range(self.rank.world_size) if q != self.rank.rank]}
        return pieces, meta
