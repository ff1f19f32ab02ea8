"""Just-in-time checkpointing (``--jit-checkpoint``; JITC, Gupta et al., EuroSys'24).

When one data-parallel rank fails during a step, the survivors still hold identical, consistent copies of the state of
the last *completed* step: parameters and optimizer state change only inside ``optimizer.step()``. So instead of losing
everything since the last periodic checkpoint, one healthy replica saves that state and exits for a requeue; the rerun
replays at most one step.

How a failure is noticed
    The failed rank either raises (it then does not save: a rank that failed itself is not trusted) or dies; the others
    get an error from the next collective -- gloo reports a closed/reset connection within milliseconds of a peer's death,
    a *hung* peer is noticed after the process-group timeout (``--pg-timeout-seconds``, applied to the training loop).
    SIGTERM is treated like a peer failure when nobody else handles it: torchrun's agent SIGTERMs the surviving workers
    ~0.1 s after one dies and SIGKILLs them 30 s later, so the survivor must save inside that window.

What is saved, and how exactly
    The step is the last one completed (``train_state.step``). A failure noticed during forward/backward/clipping means
    the state is that of the previous step; the data-loader position and RNG are taken from a snapshot at the start of
    the step (cheap: a few integers and ~5 KB); train.py all-reduces the logged loss there too, before the optimizer
    step. A failure noticed between steps (the stop-policy vote, a periodic save) means the step just completed. A rank
    caught *inside* the optimizer step (its parameters may be half-updated) never saves; a SIGTERM arriving there is
    deferred to the end of the step.

    The loss CSV is written by rank 0 only. Every rank notes the row of each completed step (``note_row``); if rank 0
    died before writing the row of the step being saved, the survivor appends it, so the CSV keeps every step once.

    Exact: model, optimizer, LR scheduler, grad scaler, step/token counters (identical on every replica), and the
    data-loader position (global: every rank's loader holds the same epoch/position, so the survivor's serves all ranks).
    Per-rank RNG: the saver's own stream is exact; a dead rank's stream cannot be read. It is *derived* as the state the
    run seeded that rank with (``--seed + rank``), which is exact when the run has consumed no randomness since seeding
    -- checked at save time on the saver's own stream (true for this model: no dropout; the loader has its own
    generator). If the check fails, the dead ranks' RNG is omitted (they resume from a fresh seed) and the manifest says
    ``"rng_exact": false``.

How it is written
    Without the (broken) process group: the saver writes the full replicated state plus one per-rank file for every
    rank of the run, as a vanilla-format checkpoint committed by ``layout.commit`` like any other, with
    ``meta.jit = true`` and the run's world size, so it loads on the same world size exactly like a periodic one. It is
    staged in ``<root>/.jit-<run_id>/`` and renamed into ``step-N/`` only once committed; an uncommitted periodic save
    of the same step is moved aside first, a committed one is kept (nothing to do).

Who saves
    The lowest surviving rank: every survivor drops a claim file; rank 0 proceeds at once, rank r > 0 waits a short
    grace period for a lower claim; the writer additionally takes an exclusive lock (O_EXCL), so there is never more than
    one. Survivors exit with the requeue exit code (train.py ``EXIT_REQUEUE``).

Not covered: sharded state (FSDP; no survivor holds a full copy) -- refused at startup; NCCL's watchdog aborts the
process on a collective error unless ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is relaxed (untested here: CPU/gloo only).

Test-only knob: ``PYRECOVER_CRASH_AT_STEP=k:rank[:kill|raise|hang]`` makes ``rank`` die (SIGKILL, default), raise, or
hang right after the forward pass of step k (before backward and its all-reduce). Never set it in normal use.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import layout
from .backends.base import RankInfo
from .backends.vanilla import rank_file, save_pieces
from .errors import CheckpointError
from .fsio import atomic_write_bytes
from .state import CheckpointState, _is_fsdp, unwrap_model

SETUP, FORWARD_BACKWARD, OPTIMIZER, BETWEEN_STEPS = "setup", "forward/backward", "optimizer step", "between steps"
CLAIM_GRACE_S = 2.0
JIT_DIR_PREFIX = ".jit-"

#: the active checkpointer of this process (train.py's cli() hands it the exception that ended the loop)
ACTIVE: "JustInTime | None" = None


class JITInterrupt(Exception):
    """Raised by the SIGTERM handler so the loop unwinds to ``recover`` at a point where the state is consistent."""


_PEER_FAILURE_MARKERS = ("gloo", "nccl", "connection closed by peer", "connection reset by peer", "broken pipe",
                         "timed out", "timeout", "socket")


def is_peer_failure(exc: BaseException) -> bool:
    """True when ``exc`` says another rank (or the launcher) failed, not this one: this rank is a healthy replica."""
    if isinstance(exc, JITInterrupt):
        return True
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    if isinstance(exc, RuntimeError):
        msg = str(exc).lower()
        return any(m in msg for m in _PEER_FAILURE_MARKERS)
    return False


def one_line(exc: BaseException) -> str:
    """First line of an error, without gloo's source-location prefix and advice tail."""
    text = (str(exc).strip().splitlines() or [""])[0]
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


class JustInTime:
    """Phase tracking around the training step plus the recovery path. Disabled instances cost nothing."""

    def __init__(self, enabled: bool, *, root: Path, state: CheckpointState, rank: RankInfo, run_id: str,
                 reseed: Callable[[int], None] | None = None, log: Callable[[str], None] = print,
                 csv_path: Path | None = None):
        self.enabled = enabled
        self.csv_path = Path(csv_path) if csv_path else None
        self._row: dict[str, Any] | None = None  # the loss-CSV row of the last completed step
        self.root = Path(root)
        self.guard: Callable[[str], None] = lambda what: None  # fencing (checkpoint/lease.py), set by setup()
        self.state = state
        self.rank = rank
        self.run_id = run_id
        self.reseed = reseed
        self.log = log
        self.phase = SETUP
        self._snapshot: dict[str, Any] = {}
        self._pending_signal: int | None = None
        self._recovering = False

    # --- hooks around the step (train.py) ------------------------------------------------------------------------
    def begin_step(self) -> None:
        if not self.enabled:
            return
        self._raise_pending()
        # What the per-rank pieces were when the last completed step ended (the step about to run changes them).
        self._snapshot = {key: piece.state_dict() for key, piece in self.state.per_rank().items()}
        self.phase = FORWARD_BACKWARD

    def begin_optimizer(self) -> None:
        if self.enabled:
            self.phase = OPTIMIZER

    def end_step(self) -> None:
        if not self.enabled:
            return
        self.phase = BETWEEN_STEPS
        self._snapshot = {}

    def note_row(self, **row: Any) -> None:
        """The loss-CSV row of the step just completed, on every rank (train.py all-reduces the loss *before* the
        optimizer step, so every rank knows it). Only rank 0 writes the CSV; if it dies before writing this row and a
        survivor saves this step, the survivor appends the row, so the CSV still has every step exactly once."""
        if not self.enabled:
            return
        self._row = row
        self._raise_pending()

    def _raise_pending(self) -> None:
        if self._pending_signal is not None:
            signum, self._pending_signal = self._pending_signal, None
            raise JITInterrupt(f"received {signal.Signals(signum).name} during the optimizer step")

    # --- SIGTERM ---------------------------------------------------------------------------------------------------
    def install_signal_handler(self) -> bool:
        """Handle SIGTERM as "save now" unless someone else (e.g. the SLURM policy) already handles it."""
        if threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
            return False
        signal.signal(signal.SIGTERM, self._on_signal)
        return True

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
        if self._recovering:
            return
        if self.phase == OPTIMIZER:
            self._pending_signal = signum  # parameters are being updated: finish the step first
            return
        if self.phase == SETUP:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise JITInterrupt(f"received {signal.Signals(signum).name}")

    # --- recovery --------------------------------------------------------------------------------------------------
    def recover(self, exc: BaseException) -> bool:
        """Called with the exception that ended the loop. True: this rank is a healthy survivor and is done (it saved
        the last completed step, or another rank did, or there was nothing new to save) -> exit for a requeue.
        False: not handled (JIT off, this rank failed itself, or it was inside the optimizer step) -> re-raise."""
        if not self.enabled:
            return False
        self._recovering = True
        r = self.rank.rank
        if threading.current_thread() is threading.main_thread():
            # torchrun SIGTERMs survivors ~0.1 s after a worker dies: whoever handles SIGTERM, it must not end the save.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if not is_peer_failure(exc):
            self.log(f"jit: rank {r} failed itself ({one_line(exc)}); it does not save, a healthy replica will")
            return False
        if self.phase == OPTIMIZER:
            self.log(f"jit: rank {r} noticed the failure inside the optimizer step; its parameters may be half-updated, "
                     "so it does not save")
            return False
        if self.phase == SETUP:
            self.log(f"jit: rank {r} noticed a failure before training started ({one_line(exc)}); nothing to save")
            return True
        t0 = time.perf_counter()
        train = self.state["train_state"]
        step = int(train.step)
        self.log(f"jit: rank {r} noticed a failure during the {self.phase} of step {step + 1} ({one_line(exc)}); "
                 f"the state of step {step} is intact")
        if step == 0:
            self.log("jit: no step completed yet; nothing to save")
            return True
        try:
            existing = layout.resolve(self.root, str(step), warn=lambda m: None)
        except CheckpointError:
            existing = None
        if existing is not None:
            self.log(f"jit: step {step} is already committed ({existing.path}); nothing to save")
            return True
        work = self.root / f"{JIT_DIR_PREFIX}{self.run_id}"
        if not self._elect(work):
            return True
        try:
            self._complete_csv(step)
            path, meta = self._save(work, step)
        except (OSError, CheckpointError) as e:
            self.log(f"jit: rank {r} could not save step {step}: {one_line(e)}; resume falls back to the last "
                     "periodic checkpoint")
            return True
        self.log(f"jit: rank {r} saved step {step} to {path} in {time.perf_counter() - t0:.2f}s "
                 f"(RNG of ranks {meta['rng_derived_ranks']} "
                 f"{'derived from their seed: exact' if meta['rng_exact'] else 'NOT recoverable: fresh seed on resume'}); "
                 "resume with --resume-from-checkpoint latest")
        return True

    def _elect(self, work: Path) -> bool:
        """Claim on the filesystem; True if this rank is the one that writes."""
        r = self.rank.rank
        work.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(work / f"claim-rank-{r:05d}", str(os.getpid()).encode())
        if r > 0:
            deadline = time.monotonic() + CLAIM_GRACE_S
            while time.monotonic() < deadline:
                lower = [p.name for p in work.glob("claim-rank-*") if int(p.name.rsplit("-", 1)[1]) < r]
                if lower:
                    self.log(f"jit: rank {r} leaves the save to a lower surviving rank ({sorted(lower)[0]})")
                    return False
                time.sleep(0.05)
        try:
            fd = os.open(work / "writer.lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            self.log(f"jit: rank {r}: another survivor is already saving")
            return False
        os.write(fd, str(r).encode())
        os.close(fd)
        return True

    def _complete_csv(self, step: int) -> None:
        """Make sure the loss CSV has the row of ``step`` before a checkpoint of it becomes visible."""
        if self.csv_path is None or not self.csv_path.exists():
            return
        if self._row is None or int(self._row["step"]) != step:
            self.log(f"jit: the loss of step {step} is unknown here; the loss CSV may lack that row")
            return
        with open(self.csv_path, newline="") as f:
            reader = csv.DictReader(f)
            fields = reader.fieldnames or list(self._row)
            steps = [int(r["step"]) for r in reader if (r.get("step") or "").isdigit()]
        if steps and max(steps) >= step:
            return
        with open(self.csv_path, "a", newline="") as f:
            csv.DictWriter(f, fields, extrasaction="ignore").writerow({**self._row, "wall_time": f"{time.time():.3f}"})
            f.flush()
            os.fsync(f.fileno())
        self.log(f"jit: appended the loss of step {step} to {self.csv_path} (rank 0 did not live to write it)")

    def _per_rank_payloads(self) -> tuple[dict[int, dict], bool]:
        """Per-rank files for every rank of the run: own pieces exact; others derived (see module docstring)."""
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
        payloads = {q: own if q == self.rank.rank else ({**others, "rng": seeded[q]} if rng_exact else dict(others))
                    for q in range(self.rank.world_size)}
        return payloads, rng_exact

    def _save(self, work: Path, step: int) -> tuple[Path, dict]:
        staging = work / layout.step_dir_name(step)
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        pieces = {f"{key}.pt": piece.state_dict() for key, piece in self.state.shared().items()}
        per_rank, rng_exact = self._per_rank_payloads()
        for q, payload in per_rank.items():
            pieces[rank_file(q)] = payload
        files = save_pieces(staging, pieces, self.rank.rank)
        layout.write_part_record(staging, self.rank.rank, files, run_id=self.run_id)
        others = [q for q in range(self.rank.world_size) if q != self.rank.rank]
        # rng_exact: the other ranks' RNG was derived from their seed and is exact; else they resume with a fresh seed.
        meta = {"jit": True, "saved_by_rank": self.rank.rank, "failure_phase": self.phase, "rng_exact": rng_exact,
                "rng_derived_ranks": others}
        layout.commit(staging, step, self.rank.world_size, "vanilla", [{"files": files}], meta=meta)
        target = self.root / layout.step_dir_name(step)
        if target.exists():
            try:
                layout.verify(target)
                shutil.rmtree(staging, ignore_errors=True)  # a periodic save of this step committed meanwhile
                return target, meta
            except CheckpointError:
                pass  # replaced below: the broken copy stays in place until the new one is committed
        return layout.publish(staging, self.root, step, guard=self.guard, tag=f"{self.run_id}-jit"), meta


def cleanup_stale(root: Path, run_id: str) -> None:
    """Remove JIT work folders of earlier runs (claims, locks, unfinished staging). Rank 0, at startup."""
    root = Path(root)
    if not root.is_dir():
        return
    for p in root.iterdir():
        if p.name.startswith(JIT_DIR_PREFIX) and p.name != f"{JIT_DIR_PREFIX}{run_id}" and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def install_crash_knob(model: torch.nn.Module, rank: int, current_step: Callable[[], int]) -> None:
    """Test-only: PYRECOVER_CRASH_AT_STEP=k:rank[:kill|raise|hang] (see module docstring)."""
    spec = os.environ.get("PYRECOVER_CRASH_AT_STEP", "")
    if not spec:
        return
    parts = spec.split(":")
    at_step, who, mode = int(parts[0]), int(parts[1]) if len(parts) > 1 else 0, (parts[2] if len(parts) > 2 else "kill")
    if who != rank:
        return

    def hook(module, inputs, output):  # noqa: ARG001
        if current_step() + 1 != at_step:
            return
        print(f"[crash] rank {rank}: {mode} after the forward pass of step {at_step}", flush=True)
        if mode == "raise":
            raise RuntimeError(f"injected crash of rank {rank} at step {at_step}")
        if mode == "hang":
            while True:
                time.sleep(3600)
        os.kill(os.getpid(), signal.SIGKILL)

    unwrap_model(model).register_forward_hook(hook)


def setup(enabled: bool, *, root: Path, state: CheckpointState, rank: RankInfo, run_id: str, model: torch.nn.Module,
          current_step: Callable[[], int], reseed: Callable[[int], None] | None = None,
          log: Callable[[str], None] = print, csv_path: Path | None = None,
          guard: Callable[[str], None] | None = None) -> JustInTime:
    """Create the checkpointer train.py calls around each step (a no-op one when ``enabled`` is False). ``guard(what)``
    raises if this incarnation has been fenced (checkpoint/lease.py)."""
    global ACTIVE
    install_crash_knob(model, rank.rank, current_step)
    jit = JustInTime(enabled, root=root, state=state, rank=rank, run_id=run_id, reseed=reseed, log=log,
                     csv_path=csv_path)
    if guard is not None:
        jit.guard = guard
    if not enabled:
        return jit
    if _is_fsdp(model):
        raise CheckpointError("--jit-checkpoint needs every rank to hold the full state (DDP); with sharded (FSDP) "
                              "state no survivor can save it: drop --jit-checkpoint")
    if rank.is_main:
        cleanup_stale(root, run_id)
    handled = jit.install_signal_handler()
    jit.phase = BETWEEN_STEPS
    ACTIVE = jit
    log(f"jit: just-in-time checkpointing on (rank {rank.rank}; SIGTERM "
        f"{'saves the last completed step' if handled else 'left to the existing handler'})")
    return jit


def recover(exc: BaseException) -> bool:
    """Module-level entry for train.py's cli(): False when JIT is off or does not handle ``exc``."""
    return ACTIVE is not None and ACTIVE.recover(exc)
