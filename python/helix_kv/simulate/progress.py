"""A one-line progress indicator on stderr, with no dependency.

It redraws itself in place (carriage return) at most a few times a second and is meant
for terminals: :func:`progress_wanted` says whether to show it.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 24
MIN_REDRAW_SECONDS = 0.1


def progress_wanted(json_output: bool, forced: bool | None, stream: TextIO) -> bool:
    """Show progress when forced on, never when forced off, else only on a terminal
    and not with ``--json``."""
    if forced is not None:
        return forced
    if json_output:
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class ProgressLine:
    """``[#####-----] 40/96 requests  step 812``, redrawn in place; :meth:`close` ends it."""

    def __init__(self, label: str = "", stream: TextIO | None = None) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self._last_draw = -float("inf")
        self._drawn = False
        self._last_text = ""

    def render(self, finished: int, total: int, steps: int) -> str:
        """The text of the line for these figures."""
        filled = BAR_WIDTH * finished // total if total else BAR_WIDTH
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        prefix = f"{self.label} " if self.label else ""
        return f"{prefix}[{bar}] {finished}/{total} requests  step {steps}"

    def __call__(self, clock: int, finished: int, total: int, steps: int) -> None:
        """Progress callback for :func:`helix_kv.simulate.step_loop.run_simulation`."""
        now = time.monotonic()
        if now - self._last_draw < MIN_REDRAW_SECONDS and finished < total:
            return
        self._last_draw = now
        text = self.render(finished, total, steps)
        padding = " " * max(0, len(self._last_text) - len(text))
        self.stream.write("\r" + text + padding)
        self.stream.flush()
        self._last_text = text
        self._drawn = True

    def close(self) -> None:
        """End the line so later output starts on a fresh one."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
