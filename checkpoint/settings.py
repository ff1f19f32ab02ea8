"""What a run's checkpointing is set to: where its steps go, which backend writes them, how many are kept, when a save
or a stop comes. A front end (train.py) builds one from its own flags; every other module of the package reads it, so
it sits apart from the Session that uses it (places/ needs it without the Session's world)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from . import naming
from .policy import When

#: the run folder's record of where its steps live, by setting name, and how its front end spells those settings:
#: rewritten by rank 0 at every load (Session.load); ``python -m checkpoint`` reads it to find the run's mirror and
#: node-local tier and to name them as the run's user typed them, without importing the front end
PLACES_RECORD = "places.json"
#: the settings it records (paths made absolute as the run resolved them)
RECORDED = ("checkpoint_dir", "experiment", "mirror_dir", "local_dir")


@dataclass(frozen=True)
class Settings:
    """How and where a run checkpoints (train.py builds it from its flags)."""

    checkpoint_dir: str  # a local folder or s3://bucket/prefix
    experiment: str = "default"  # the run folder under checkpoint_dir
    resume: str | None = None  # what the load restores: `latest`, a step, a step folder or manifest; None: fresh
    backend: str = "vanilla"
    backend_options: dict = field(default_factory=dict)
    sharded: bool = False  # the model is sharded over ranks (FSDP)
    async_save: bool | str = False
    jit: bool = False  # a surviving rank saves the last completed step when a peer fails
    keep: int = 0  # newest committed checkpoints kept (0: all)
    keep_every: int = 0  # milestones kept besides
    keep_best: int = 0  # lowest held-out losses kept besides
    keep_files: tuple[str, ...] = ()  # run-folder files retired with an abandoned line (its loss rows, its flags)
    mirror_dir: str | None = None  # a second location every committed checkpoint is copied to (rank 0)
    mirror_every: int = 1
    mirror_keep: int | None = None  # None: as keep
    mirror_timeout_s: float = 600.0  # how long the end waits for the final copy
    force_takeover: bool = False  # fence a live holder of the run directory
    on_save_error: str = "stop"  # "continue": warn, train on, retry at the next save
    when: When = field(default_factory=When)
    # the node-local tier (tier.py): every save lands in local_dir first; every when.every_steps-th step (and every
    # stop or final save) is drained from there to checkpoint_dir, the shared tier
    local_dir: str | None = None
    local_every: int = 0  # a local save every N steps (when.every_steps must be a multiple)
    local_keep: int = 2  # newest local steps kept per rank
    peer: bool = False  # every local step also kept on the next node (peer.py)
    peer_timeout_s: float = 600.0  # how long a peer transfer may wait for its other end

    def places_record(self) -> bytes:
        """PLACES_RECORD's content for these settings (JSON)."""
        def where(value):
            return value if not isinstance(value, str) or "://" in value else os.path.abspath(value)

        places = {name: (getattr(self, name) if name == "experiment" else where(getattr(self, name)))
                  for name in RECORDED}
        spelled = {name: naming.setting(name) for name in RECORDED}
        return (json.dumps({"places": places, "spelled": spelled}, indent=1) + "\n").encode()
