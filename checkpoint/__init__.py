"""PyRecover's checkpoint package: state (what), backends (how bytes land), policy (when), and one door for a training
loop, ``Session`` (session.py). A training script needs only the names below."""

from . import knobs, logs  # test-only knobs, one module (a crash at a step, a wrong load): train.py installs its hooks
from .backends import RankInfo, capabilities, make_backend
from .errors import CheckpointError
from .lease import Fenced
from .logs import EVERY_RANK, setup as setup_logging
from .manager import CheckpointManager
from .policy import FINISHED, REQUEUE_FAILED, REQUEUED, STOPPED, SignalWatcher, When, install_signal_handlers
from .session import FENCED, FINAL_SAVE_FAILED, Session, Settings
from .state import (CheckpointState, ModelState, OptimizerState, RNGState, RunInfo, Stateful, TrainState,
                    unwrap_model)

logs.quiet_dcp_save_process()

__all__ = [
    # the facade
    "Session", "Settings", "When", "FENCED", "FINAL_SAVE_FAILED",
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
