"""Ctrl-C during a run: finish the step in hand, stop, and report the steps so far.

While :class:`InterruptGuard` is active, the first Ctrl-C (SIGINT) only sets a flag, which the
step loop reads between steps (``run_simulation(should_stop=guard)``), so the run stops on a
step boundary and its figures stay consistent. A second Ctrl-C raises ``KeyboardInterrupt`` at
once, for a run that does not stop. Outside the guard Ctrl-C behaves as usual.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any


class InterruptGuard:
    """A context manager that turns the first SIGINT into a flag; call it to read the flag.

    Signal handlers can only be installed from the main thread; elsewhere the guard installs
    nothing and never reports an interrupt.
    """

    def __init__(self) -> None:
        self.interrupted = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> InterruptGuard:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._installed:
            # None: the previous handler was not set from Python; the default is the best guess
            previous = self._previous if self._previous is not None else signal.SIG_DFL
            signal.signal(signal.SIGINT, previous)
            self._installed = False

    def __call__(self) -> bool:
        """Whether Ctrl-C was pressed while the guard was active."""
        return self.interrupted

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        if self.interrupted:
            raise KeyboardInterrupt
        self.interrupted = True
