"""PyRecover's checkpoint package: state (what), backends (how bytes land), policy (when), and one door for a training
loop, ``Session`` (session.py). A training script needs only the names below.

The names are loaded when first used (module ``__getattr__``): most of the package needs torch, and a command line
reads its pure modules (naming, walltime, policy's signal names, backend_table) to check its flags before torch is
imported. ``from checkpoint import Session`` works as before."""

from __future__ import annotations

import importlib

from . import knobs, logs  # test-only knobs, one module (a crash at a step, a wrong load): train.py installs its hooks
from .logs import EVERY_RANK, setup as setup_logging

logs.quiet_dcp_save_process()

#: public name -> the submodule that defines it
_LAZY = {
    **dict.fromkeys(("RankInfo", "capabilities", "make_backend"), "backends"),
    "CheckpointError": "errors", "Fenced": "lease", "CheckpointManager": "manager",
    **dict.fromkeys(("FINISHED", "REQUEUE_FAILED", "REQUEUED", "STOPPED", "SignalWatcher", "When",
                     "install_signal_handlers"), "policy"),
    **dict.fromkeys(("FENCED", "FINAL_SAVE_FAILED", "Session", "Outcome", "Preview", "Found", "Loaded", "Loop",
                     "Ending"), "session"), "Settings": "settings",
    **dict.fromkeys(("CheckpointState", "ModelState", "OptimizerState", "RNGState", "RunInfo", "Stateful",
                     "TrainState", "unwrap_model"), "state"),
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    else:  # a submodule not imported yet (``checkpoint.manager``), as an eager package would have it
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    # the facade: its calls' results, and how a run ends
    "Session", "Settings", "When", "Preview", "Found", "Loaded", "Loop", "Ending", "Outcome", "FENCED",
    "FINAL_SAVE_FAILED",
    # what is saved
    "CheckpointState", "ModelState", "OptimizerState", "RNGState", "RunInfo", "Stateful", "TrainState", "unwrap_model",
    # how a run ends
    "CheckpointError", "Fenced", "FINISHED", "REQUEUED", "STOPPED", "REQUEUE_FAILED",
    "SignalWatcher", "install_signal_handlers",
    # logging, test knobs
    "EVERY_RANK", "setup_logging", "knobs",
    # the lower layers, for tools and benchmarks
    "CheckpointManager", "RankInfo", "capabilities", "make_backend",
]
