"""HOW bytes land: the protocol every backend implements.

A backend writes this rank's *payload* files into a step folder and reports their size/checksum records. It never
writes the manifest or the commit marker: `layout.commit` does that, identically for every backend.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..state import CheckpointState


@dataclass(frozen=True)
class RankInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class PayloadHandle(ABC):
    """What `Backend.save` returns. ``wait_staged`` returns once the state has been captured (the model and optimizer may
    change again); ``wait`` returns this rank's file records once they are durable, re-raising any background error."""

    @abstractmethod
    def wait_staged(self) -> None: ...

    @abstractmethod
    def wait(self) -> dict[str, dict]: ...

    @abstractmethod
    def done(self) -> bool: ...


class CompletedPayload(PayloadHandle):
    """A synchronous save: everything already happened."""

    def __init__(self, files: dict[str, dict]):
        self._files = files

    def wait_staged(self) -> None:
        pass

    def wait(self) -> dict[str, dict]:
        return self._files

    def done(self) -> bool:
        return True


class BackgroundTask:
    """Run ``fn`` in a daemon thread; ``wait()`` returns its result or re-raises its exception in the caller."""

    def __init__(self, fn: Callable[[], object], name: str):
        self._result: object = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            self._result = fn()
        except BaseException as e:  # re-raised by wait() in the training thread
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> object:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


class Backend(ABC):
    name: str = "?"
    #: how many saves may be in flight at once (1 = the next save waits for the previous one)
    max_in_flight: int = 1

    def __init__(self, rank: RankInfo):
        self.rank = rank

    @abstractmethod
    def save(self, step_dir: Path, state: CheckpointState) -> PayloadHandle:
        """Write this rank's share of ``state`` under ``step_dir`` (already created)."""

    @abstractmethod
    def load(self, step_dir: Path, manifest: dict, state: CheckpointState) -> None:
        """Restore ``state`` in place from a verified checkpoint folder."""


    def close(self) -> None:
        """Release background resources; in-flight saves have been waited for by the manager."""
