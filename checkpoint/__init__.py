"""PyRecover's checkpoint package: state (what), backends (how bytes land), policy (when)."""

from .backends import RankInfo, make_backend
from .errors import CheckpointError
from .manager import CheckpointManager
from .state import CheckpointState, ModelState, OptimizerState, RNGState, RunInfo, Stateful, TrainState

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
