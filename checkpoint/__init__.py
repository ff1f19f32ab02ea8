"""PyRecover's checkpoint package: state (what), backends (how bytes land), policy (when)."""

import logging

from .backends import RankInfo, make_backend
from .errors import CheckpointError
from .manager import CheckpointManager
from .state import CheckpointState, ModelState, OptimizerState, RNGState, RunInfo, Stateful, TrainState


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
    "CheckpointError",
    "CheckpointManager",
    "CheckpointState",
    "ModelState",
    "OptimizerState",
    "RNGState",
    "RankInfo",
    "RunInfo",
    "Stateful",
    "TrainState",
    "make_backend",
]
