"""The one owner of this process's signal handlers (Lightning's signal connector is the model).

Whoever wants a signal registers a listener here instead of calling ``signal.signal``; the owner installs one handler
per signal that calls the listeners in order, and ``restore()`` puts back the handlers that were there before. So two
parts of the program can never silently replace each other's handler (the stop policy's SIGTERM and another part's
SIGTERM), and a run that ends returns the process to the state it found.

Listeners run in the main thread between two bytecodes: they must only record (no I/O, no locks). A listener may raise
SystemExit to end the process the way the default action would.
"""

from __future__ import annotations

import signal
import threading
from typing import Callable

Listener = Callable[[int], None]


class SignalOwner:
    def __init__(self) -> None:
        self._listeners: dict[int, list[Listener]] = {}
        self._previous: dict[int, object] = {}

    def listen(self, signum: int, listener: Listener) -> None:
        """Call ``listener(signum)`` when ``signum`` arrives (after the listeners registered before it)."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("signal listeners can only be registered from the main thread")
        if signum not in self._listeners:
            self._previous[signum] = signal.getsignal(signum)
            self._listeners[signum] = []
            signal.signal(signum, self._dispatch)
        self._listeners[signum].append(listener)

    def _dispatch(self, signum: int, frame) -> None:  # noqa: ARG002
        for listener in list(self._listeners.get(signum, ())):
            listener(signum)

    def owns(self, signum: int) -> bool:
        return signal.getsignal(signum) == self._dispatch

    def restore(self, signum: int | None = None) -> None:
        """Put back the handler(s) found before the first ``listen`` (all signals, or just ``signum``)."""
        for s in [signum] if signum is not None else list(self._listeners):
            if s in self._listeners:
                previous = self._previous.pop(s)
                del self._listeners[s]
                signal.signal(s, previous if previous is not None else signal.SIG_DFL)
