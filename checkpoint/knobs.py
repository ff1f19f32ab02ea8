"""Every knob and fault point that only tests (and one operator escape hatch) use: the ONE place that reads them.

The library's behaviour is set by train.py's flags; the environment variables below exist so the test suite and the
fault-injection harness (tests/faults/) can pace a run, slow a disk, or kill a process at a named moment, from a
subprocess's environment. Nothing else in ``checkpoint/`` reads a ``PYRECOVER_*`` variable; modules call the accessors
here. Importing this module is cheap (standard library only, no torch).

Knob (environment variable)                    Read by                              Kind         Accessor
  What it does
---------------------------------------------  -----------------------------------  -----------  -------------------
PYRECOVER_DIRECT_IO=off                        fsio.py                              user-facing  direct_io_disabled()
  buffered checkpoint writes even where O_DIRECT works (also 0/false/no; default ``auto``). Read at every call.
PYRECOVER_READ_AHEAD=off                       session.py (Session.read_ahead)      user-facing  read_ahead_disabled()
  a restart does not read its checkpoint ahead while it sets up (also 0/false/no; default on). Read per call.
PYRECOVER_FAULT=<point>[:<n>[:error]]          fsio.py, layout.py, backends/dcp.py, test-only    fault_point()
                                               backends/concurrent.py, retention.py
  SIGKILL this process the n-th time (default 1st) it reaches fault point <point> (``FAULT_POINTS``); with
  ``:error`` raise OSError(EIO) there instead. Read once at import (the fault-injection harness, tests/faults/).
PYRECOVER_STEP_SLEEP=SECONDS                   policy.py (StepBoundary)             test-only    step_sleep_s()
  sleep that long at every step boundary, so SLURM and signal tests can land a signal or a deadline mid-run with a
  tiny model. Changes timing only, never the numbers.
PYRECOVER_SAVE_STRETCH=N                       policy.py (step_boundary)            bench-only   save_stretch()
  interval saves happen only in every other N-step stretch (steps 1..N save, N+1..2N do not, ...): one failure-free
  run then measures what a save costs against stretches of the same process without saves (benchmarks/goodput.py's
  calibration). The final save is unaffected.
PYRECOVER_TEST_PERSIST_DELAY_S=SECONDS         backends/concurrent.py               test-only    persist_delay_s()
  each payload file takes that much longer to persist (a slow disk: the CLI tests watch several saves in flight).
PYRECOVER_MIRROR_DELAY_S=SECONDS               mirror.py                            test-only    mirror_delay_s()
  the mirror's copier sleeps that long before each file (a slow mirror: a test kills the run mid-copy).
PYRECOVER_DRAIN_DELAY_S=SECONDS                tier.py (Drainer)                    test-only    drain_delay_s()
  the local tier's drainer sleeps that long after each file it copies to the shared tier (a test kills mid-drain).
PYRECOVER_PEER_DELAY_S=SECONDS                 peer.py (Link.swap)                  test-only    peer_delay_s()
  each peer copy pauses that long between its headers and its data, on both ends (a test kills a rank mid-copy).
PYRECOVER_LEASE_HEARTBEAT_S=SECONDS            lease.py (HEARTBEAT_S, at import)    test-only    lease_heartbeat_s()
  how often the lease holder touches its record (default 10).
PYRECOVER_LEASE_TIMEOUT_S=SECONDS              lease.py (TIMEOUT_S, at import)      test-only    lease_timeout_s()
  a holder whose heartbeat is older than this counts as dead (default 120).
PYRECOVER_TOKENIZE_DELAY_S=SECONDS             dataset.py (_build_cache)            test-only    tokenize_delay_s()
  each token cache stays that much longer under its temporary name before its rename (a slow tokenizer: a test
  kills the ranks mid-tokenization).
PYRECOVER_TEST_EVAL_SLEEP=SECONDS              evaluation.py (evaluate)             test-only    eval_sleep()
  every evaluation sleeps that long after its first batch, spread over its later rounds of batches (a test kills the
  run, or sends a stop signal, in the middle of an evaluation).
PYRECOVER_CRASH_AT_STEP=k[:rank[:MODE[:PHASE]]] train.py                            test-only    crash_at_step(),
                                                                                                 install_crash_hook()
  ``rank`` (default 0) dies in step k: MODE ``kill`` (SIGKILL, default), ``raise``, ``hang`` or ``lose`` (its node
  lost: every folder matching the glob PYRECOVER_CRASH_LOSE is removed, then SIGKILL); PHASE ``forward``
  (default: right after the forward pass, before backward and its all-reduce), ``backward`` (as the first
  parameter's gradient is made: DDP's all-reduce of the later buckets is under way), ``optimizer`` (as the optimizer
  step begins, after the all-reduce) or ``eval`` (in the evaluation after step k).
PYRECOVER_CRASH_IN_RECOVERY=g:rank             train.py (rejoin)                    test-only    crash_in_recovery()
  ``rank`` is SIGKILLed while it recovers into generation g: after it joined the generation's group, before the load
  (a second failure during a recovery, launcher.py only).
PYRECOVER_TEST_RANKS_PER_NODE=N               checkpoint/session.py                test-only    node_name()
  ranks r and r' count as one node when r // N == r' // N (torchrun on one host emulating several nodes, each with
  its own node-local checkpoint tier). Unset: the host name decides. With --peer-checkpoint each emulated node holds
  only what its own ranks wrote in the shared local folder (emulated_nodes()).
PYRECOVER_PROGRESS=1                           train.py                             test-only    force_progress()
  plain progress lines even when stderr is not a terminal.
PYRECOVER_SWAP_AFTER_LOAD=NAME,NAME            train.py                             test-only    swap_after_load()
  after a resume's load, swap two parameters of the same shape (e.g. ``layers.0.attention.wq.weight,
  layers.0.attention.wo.weight``): a wrong load that every checksum passes, for --validate-on-resume to catch.

Never set the test-only ones in normal use. The accessors take an optional ``environ`` mapping (default
``os.environ``) so a test can pass its own.
"""

from __future__ import annotations

import errno
import os
from typing import Mapping

_OFF = ("off", "0", "false", "no")

#: Every fault point the save path reaches, by module (the names PYRECOVER_FAULT takes).
FAULT_POINTS = {
    "after_write_before_fsync": "fsio.py: a file's bytes are written, not yet fsynced",
    "after_fsync_before_rename": "fsio.py: a file is durable under its temporary name",
    "after_manifest_before_commit": "layout.py: manifest.json written, COMMITTED not yet",
    "during_retention_delete": "retention.py: retention is deleting an old checkpoint",
    "between_replace_renames": "layout.py: the old step folder moved to trash, the new one not yet in place",
    "dcp_write_file": "backends/dcp.py: inside a DCP save, before a file's bytes",
    "concurrent_persist_begin": "backends/concurrent.py: once per save, as its writer starts",
    "concurrent_write_chunk": "backends/concurrent.py: before every data chunk",
    "concurrent_persist_half": "backends/concurrent.py: once per save, halfway through its tensor bytes",
}


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def _seconds(name: str, default: float, environ: Mapping[str, str] | None) -> float:
    raw = _env(environ).get(name, "")
    try:
        return float(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None


# --- user-facing ------------------------------------------------------------------------------------------------------
def direct_io_disabled(environ: Mapping[str, str] | None = None) -> bool:
    """PYRECOVER_DIRECT_IO=off (or 0/false/no): buffered checkpoint writes even where O_DIRECT works. Read per call."""
    return _env(environ).get("PYRECOVER_DIRECT_IO", "auto").lower() in _OFF


def read_ahead_disabled(environ: Mapping[str, str] | None = None) -> bool:
    """PYRECOVER_READ_AHEAD=off (or 0/false/no): a restart reads its checkpoint only when it loads it. Read per call."""
    return _env(environ).get("PYRECOVER_READ_AHEAD", "on").lower() in _OFF


# --- test-only: pacing and slow disks ---------------------------------------------------------------------------------
def step_sleep_s(environ: Mapping[str, str] | None = None) -> float:
    """PYRECOVER_STEP_SLEEP: seconds to sleep at every step boundary (0 when unset or not a number)."""
    try:
        return _seconds("PYRECOVER_STEP_SLEEP", 0.0, environ)
    except ValueError:
        return 0.0


def save_stretch(environ: Mapping[str, str] | None = None) -> int:
    """PYRECOVER_SAVE_STRETCH: the length of the alternating save / no-save stretches (0: off, or not a number)."""
    raw = _env(environ).get("PYRECOVER_SAVE_STRETCH", "")
    return int(raw) if raw.isdigit() else 0


def persist_delay_s(environ: Mapping[str, str] | None = None) -> float:
    """PYRECOVER_TEST_PERSIST_DELAY_S: extra seconds per payload file of the concurrent backend (0 when unset)."""
    return _seconds("PYRECOVER_TEST_PERSIST_DELAY_S", 0.0, environ)


def mirror_delay_s(environ: Mapping[str, str] | None = None) -> float:
    """PYRECOVER_MIRROR_DELAY_S: seconds the mirror's copier sleeps before each file (0 when unset)."""
    return _seconds("PYRECOVER_MIRROR_DELAY_S", 0.0, environ)


def drain_delay_s(environ: Mapping[str, str] | None = None) -> float:
    """PYRECOVER_DRAIN_DELAY_S: seconds the local tier's drainer sleeps after each file (0 when unset)."""
    return _seconds("PYRECOVER_DRAIN_DELAY_S", 0.0, environ)


def peer_delay_s(environ: Mapping[str, str] | None = None) -> float:
    """PYRECOVER_PEER_DELAY_S: seconds each peer copy pauses between its headers and its data (0 when unset)."""
    return _seconds("PYRECOVER_PEER_DELAY_S", 0.0, environ)


def lease_heartbeat_s(environ: Mapping[str, str] | None = None) -> float:
    """PYRECOVER_LEASE_HEARTBEAT_S: how often the lease holder touches its record (default 10 s)."""
    return _seconds("PYRECOVER_LEASE_HEARTBEAT_S", 10.0, environ)


def lease_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """PYRECOVER_LEASE_TIMEOUT_S: a holder whose heartbeat is older than this counts as dead (default 120 s)."""
    return _seconds("PYRECOVER_LEASE_TIMEOUT_S", 120.0, environ)


def tokenize_delay_s(environ: Mapping[str, str] | None = None) -> float:
    """PYRECOVER_TOKENIZE_DELAY_S: extra seconds per token cache written by dataset.py (0 when unset)."""
    return _seconds("PYRECOVER_TOKENIZE_DELAY_S", 0.0, environ)


def eval_sleep(environ: Mapping[str, str] | None = None) -> float | None:
    """PYRECOVER_TEST_EVAL_SLEEP: seconds each evaluation sleeps after its first batch, spread over its later rounds
    of batches (a slow evaluation, as a stop signal meets it between two batches; None when unset)."""
    seconds = _seconds("PYRECOVER_TEST_EVAL_SLEEP", 0.0, environ)
    return seconds or None


CRASH_PHASES = ("forward", "backward", "optimizer", "eval")


def crash_at_step(environ: Mapping[str, str] | None = None) -> list[tuple[int, int, str, str]]:
    """PYRECOVER_CRASH_AT_STEP=k[:rank[:kill|raise|hang[:phase]]][,...] as [(step, rank, mode, phase), ...]; rank
    defaults to 0, mode to "kill", phase to "forward". Several crashes, comma-separated, share one run (each happens
    once with PYRECOVER_CRASH_ONCE). Empty when unset."""
    crashes = []
    for spec in filter(None, _env(environ).get("PYRECOVER_CRASH_AT_STEP", "").split(",")):
        parts = spec.split(":") + ["", "", ""]
        mode = parts[2] or "kill"  # anything but raise/hang kills
        phase = parts[3] or "forward"
        if phase not in CRASH_PHASES:
            raise ValueError(f"PYRECOVER_CRASH_AT_STEP: {spec}: phase {phase!r} is not one of {', '.join(CRASH_PHASES)}")
        crashes.append((int(parts[0]), int(parts[1]) if parts[1] else 0, mode, phase))
    return crashes


def crash_in_recovery(generation: int, rank: int, environ: Mapping[str, str] | None = None) -> None:
    """PYRECOVER_CRASH_IN_RECOVERY=g:rank (test-only): SIGKILL this process if it is ``rank`` recovering into
    generation ``g`` (called by train.py once the generation's group is built, before the load)."""
    spec = _env(environ).get("PYRECOVER_CRASH_IN_RECOVERY", "")
    if not spec or [int(x) for x in spec.split(":")] != [generation, rank]:
        return
    import signal

    print(f"[crash] rank {rank}: kill while recovering into generation {generation}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def node_name(rank: int, environ: Mapping[str, str] | None = None) -> str:
    """The node this rank runs on, as the node-local tier groups ranks: the host name, or with
    PYRECOVER_TEST_RANKS_PER_NODE=N (test-only) node ``rank // N`` of this host."""
    import socket

    per_node = _env(environ).get("PYRECOVER_TEST_RANKS_PER_NODE", "")
    host = socket.gethostname()
    return f"{host}/node-{rank // int(per_node)}" if per_node else host


def emulated_nodes(environ: Mapping[str, str] | None = None) -> bool:
    """PYRECOVER_TEST_RANKS_PER_NODE is set: the nodes are emulated on one host and share its local folder."""
    return bool(_env(environ).get("PYRECOVER_TEST_RANKS_PER_NODE", ""))


#: the knobs read once, when their module is imported: a warm standby's child would keep the standby's values, so the
#: standby declines a rank whose values differ (warm.py)
IMPORT_TIME = ("PYRECOVER_FAULT", "PYRECOVER_LEASE_HEARTBEAT_S", "PYRECOVER_LEASE_TIMEOUT_S")


def force_progress(environ: Mapping[str, str] | None = None) -> bool:
    """PYRECOVER_PROGRESS=1: train.py prints plain progress lines even when stderr is not a terminal."""
    return _env(environ).get("PYRECOVER_PROGRESS") == "1"


# --- test-only: fault points ------------------------------------------------------------------------------------------
# Read once, so that a fault point costs one comparison when PYRECOVER_FAULT is unset (it sits in the write loops).
_FAULT = os.environ.get("PYRECOVER_FAULT", "")
_FAULT_RANK = os.environ.get("PYRECOVER_FAULT_RANK", "")  # a rank started with RANK=r (a spare has none)
_FAULT_POINT, _, _FAULT_REST = _FAULT.partition(":")
_fault_hits: dict[str, int] = {}


def fault_point(name: str, where: object = "") -> None:
    """A named moment of the save path (``FAULT_POINTS``). Does nothing unless PYRECOVER_FAULT names it; then, on its
    n-th hit, SIGKILLs this process, or raises OSError(EIO) with ``:error``."""
    if not _FAULT or name != _FAULT_POINT:
        return
    if _FAULT_RANK and os.environ.get("RANK") != _FAULT_RANK:  # PYRECOVER_FAULT_RANK: one rank's process only
        return
    nth_str, _, action = _FAULT_REST.partition(":")
    nth = int(nth_str or 1)
    _fault_hits[name] = _fault_hits.get(name, 0) + 1
    if _fault_hits[name] != nth:
        return
    if action == "error":
        raise OSError(errno.EIO, f"injected I/O error at {name}", str(where))
    import signal

    print(f"[fault] SIGKILL at {name} ({where})", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def install_crash_hook(model, rank: int, current_step) -> None:
    """PYRECOVER_CRASH_AT_STEP (test-only): make ``rank`` die (SIGKILL), raise or hang in the step given, in the phase
    given (``crash_at_step``) -- a peer failure for --jit-checkpoint or an in-process recovery to survive. ``model``:
    the unwrapped module; ``current_step()``: the last completed step."""
    crashes = [(i, *c) for i, c in enumerate(crash_at_step()) if c[1] == rank]
    if not crashes or getattr(model, "_pyrecover_crash_hook", False):
        return  # one set of hooks per module: a recovered rank loads again into the same module
    model._pyrecover_crash_hook = True
    once = os.environ.get("PYRECOVER_CRASH_ONCE")  # a file: each crash happens once in the job, not again after the
    import signal                                  # in-process recovery that replays the step (or in the spare)
    import time

    def hook(index: int, at_step: int, mode: str, phase: str):
        def crash(*_args) -> None:
            # the step's own phases run in training mode before the step counts; the evaluation after step k does not
            training = phase != "eval"
            if training != model.training or current_step() + (1 if training else 0) != at_step:
                return
            if once:
                try:
                    os.close(os.open(f"{once}.{index}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    return
            where = "after the forward pass" if phase == "forward" else f"in the {phase} phase"
            print(f"[crash] rank {rank}: {mode} {where} of step {at_step}", flush=True)
            if mode == "raise":
                raise RuntimeError(f"injected crash of rank {rank} at step {at_step}"
                                   + ("" if phase == "forward" else f" ({phase})"))
            if mode == "hang":
                while True:
                    time.sleep(3600)
            if mode == "lose":  # the node's disk goes with it (an emulated node's folder in the tier)
                import glob
                import shutil

                for folder in glob.glob(os.environ.get("PYRECOVER_CRASH_LOSE", "")):
                    shutil.rmtree(folder, ignore_errors=True)
            os.kill(os.getpid(), signal.SIGKILL)

        return crash

    for index, at_step, _, mode, phase in crashes:
        crash = hook(index, at_step, mode, phase)
        if phase in ("forward", "eval"):
            model.register_forward_hook(crash)
        elif phase == "backward":  # the first parameter (the embedding) gets its gradient late in backward
            next(model.parameters()).register_hook(crash)
        else:  # every optimizer's step (the run has one), after the gradients' all-reduce
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            register_optimizer_step_pre_hook(crash)


def swap_after_load(model, environ: Mapping[str, str] | None = None) -> None:
    """PYRECOVER_SWAP_AFTER_LOAD (test-only): swap two same-shape parameters of ``model`` in place."""
    spec = _env(environ).get("PYRECOVER_SWAP_AFTER_LOAD", "")
    if not spec:
        return
    import torch

    a, b = (dict(model.named_parameters())[name] for name in spec.split(","))
    with torch.no_grad():
        tmp = a.detach().clone()
        a.copy_(b)
        b.copy_(tmp)
    print(f"[knob] swapped {spec} after the load", flush=True)
