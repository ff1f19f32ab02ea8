"""The promoter: the one background thread that moves committed steps from one place to the next (places/). Each
arrow of the places' diagram (docs/ARCHITECTURE.md) is a Promoter with its own ``copy``; what differs between them is
only which steps they take and what a failure means:

    ordered   every submitted step, in order, none skipped (node-local -> shared: the shared tier must receive each
              step the policy sent there). A failure is re-raised in the training thread at the next ``poll`` or
              ``wait``; until then later steps are not copied. A step not copied stays protected: its source place
              still holds it.
    newest    a step still waiting is replaced by a newer one (shared -> mirror: a mirror follows the newest and never
              falls behind). ``copy`` handles its own failures (retries, one warning); the promoter goes on.

``copy(step, job)`` runs on the promoter's thread (a newest promoter's ``copy`` must not raise); whatever it copies it
copies by the commit protocol of its destination (files checked against the source's manifest, part records,
manifest, COMMITTED last). The promoter only
decides what runs when, so the protected set that a place's retention must spare is always the promoter's own.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable

ORDERED, NEWEST = "ordered", "newest"


class Promoter:
    def __init__(self, name: str, copy: Callable[[int, Any], None], *, mode: str):
        assert mode in (ORDERED, NEWEST), mode
        self.name, self.mode, self._copy = name, mode, copy
        self._cv = threading.Condition()
        self._waiting: deque[tuple[int, Any]] = deque()
        self._current: int | None = None
        self._failed: set[int] = set()  # ordered: not copied after a failure; their source keeps them
        self._error: BaseException | None = None
        self._closing = False
        self.skipped = 0  # newest: waiting steps a newer one replaced
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # --- the training thread -------------------------------------------------------------------------------------
    def submit(self, step: int, job: Any = None) -> None:
        with self._cv:
            if self.mode == NEWEST and self._waiting:
                self.skipped += len(self._waiting)
                self._waiting.clear()
            self._waiting.append((step, job))
            self._cv.notify_all()

    def protected(self) -> set[int]:
        """The steps waiting, being copied, or (ordered) left uncopied by a failure: the source must keep them."""
        with self._cv:
            return {s for s, _ in self._waiting} | self._failed | ({self._current} if self._current is not None
                                                                   else set())

    def holds(self, step: int) -> bool:
        """``step`` is waiting or being copied now."""
        with self._cv:
            return step == self._current or any(s == step for s, _ in self._waiting)

    @property
    def current(self) -> int | None:
        return self._current

    def poll(self) -> None:
        """Re-raise the failure of an ordered copy, once."""
        with self._cv:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def wait(self) -> None:
        """Until nothing waits or runs; then ``poll``."""
        with self._cv:
            self._cv.wait_for(lambda: not self._waiting and self._current is None)
        self.poll()

    def drop_waiting(self) -> None:
        """Forget the steps not started (e.g. the run was fenced: nothing more may change the destination)."""
        with self._cv:
            self._waiting.clear()
            self._cv.notify_all()

    def newer_waiting(self, timeout_s: float) -> bool:
        """On the promoter's thread, between a failed attempt and its retry: wait ``timeout_s`` unless a newer step
        arrives first (True: it did; the retry gives way to it)."""
        with self._cv:
            return self._cv.wait_for(lambda: bool(self._waiting), timeout_s)

    def close(self, timeout_s: float | None = None) -> bool:
        """Copy what waits, then end the thread; at most ``timeout_s``. True: it ended."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # --- the promoter's thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._waiting or self._closing)
                if not self._waiting:
                    return
                step, job = self._waiting.popleft()
                if self.mode == ORDERED and self._error is not None:
                    self._failed.add(step)  # nothing is copied until the failure is reported; the source keeps it
                    self._cv.notify_all()
                    continue
                self._current = step
            try:
                self._copy(step, job)
            except BaseException as e:  # noqa: BLE001 - re-raised in the training thread (poll/wait)
                with self._cv:
                    if self.mode == ORDERED:
                        self._failed.add(step)
                    self._error = self._error or e
            finally:
                with self._cv:
                    self._current = None
                    self._cv.notify_all()
