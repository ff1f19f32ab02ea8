"""PyRecover's checkpoint package: state (what), backends (how bytes land), policy (when), and one door for a training
loop, ``Session`` (session.py). A training script needs only the names below."""

import logging

from . import knobs  # test-only knobs, one module (a crash at a step, a wrong load): train.py installs its hooks
from .backends import RankInfo, capabilities, make_backend
from .errors import CheckpointError
from .lease import Fenced
from .logs import EVERY_RANK, setup as setup_logging
from .manager import CheckpointManager
from .policy import FINISHED, REQUEUE_FAILED, REQUEUED, STOPPED, SignalWatcher, When, install_signal_handlers
from .session import FENCED, FINAL_SAVE_FAILED, Session, Settings
from .state import (CheckpointState, ModelState, OptimizerState, RNGState, RunInfo, Stateful, TrainState,
                    unwrap_model)


class _QuietDCPSaveProcess(logging.Filter):
    """DCP's save process (dcp ``--async-checkpoint process``) logs every request to stderr through the root logger at
    INFO, and a failed save as a multi-line traceback; the training process reports every outcome itself (a failure
    in one line). Installed here, at the package's import: that process re-imports the main program (spawn) before it
    starts logging, and every program driving a backend imports this package -- the dcp module itself is imported
    lazily, too late."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.module != "_async_process_executor"


logging.getLogger().addFilter(_QuietDCPSaveProcess())

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
