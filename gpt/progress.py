"""A one-line progress bar on stderr with rate and ETA, redrawn at most a few times a second.

    with Progress("encode", total=nbytes, unit="MB", scale=1e-6) as bar:
        bar.update(n)   # after each piece of work
    # leaving the block: the final state, then a newline; or, when an error leaves it, the bar erased
    # (so the error's line starts a line of its own)

On a stream that is not a terminal (a log file, CI) it prints nothing: the caller's summary line says
what happened.
"""

from __future__ import annotations

import sys
import time


def format_duration(seconds: float) -> str:
    """1h02m03s, 4m05s or 6s: elapsed times and ETAs on the console."""
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Progress:
    def __init__(self, label: str, total: float, unit: str = "MB", scale: float = 1e-6, stream=None, enabled=None):
        self.label, self.total, self.unit, self.scale = label, total, unit, scale
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.done = 0.0
        self.start = self._last = time.perf_counter()

    def update(self, n: float = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if self.enabled and now - self._last >= 0.2:
            self._last = now
            self._draw(now)

    def line(self, now: float | None = None) -> str:
        now = time.perf_counter() if now is None else now
        elapsed = max(now - self.start, 1e-9)
        frac = min(self.done / self.total, 1.0) if self.total else 1.0
        rate = self.done * self.scale / elapsed
        eta = (self.total - self.done) / (self.done / elapsed) if 0 < self.done < self.total else 0.0
        bar = "#" * int(frac * 24)
        n = 0 if self.scale == 1 else 1  # decimals: counted things are whole
        return (
            f"{self.label} [{bar:<24}] {frac:4.0%} {self.done * self.scale:,.{n}f}/{self.total * self.scale:,.{n}f} "
            f"{self.unit} {rate:,.1f} {self.unit}/s elapsed {format_duration(elapsed)} ETA {format_duration(eta)}"
        )

    def _draw(self, now: float) -> None:
        self.stream.write("\r" + self.line(now) + "\x1b[K")
        self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(keep=exc_type is None)

    def close(self, keep: bool = True) -> None:
        """The final state on its own line, or (keep=False) the bar erased, if it was ever drawn."""
        if not self.enabled:
            return
        if keep:
            self._draw(time.perf_counter())
            self.stream.write("\n")
        elif self._last > self.start:
            self.stream.write("\r\x1b[K")
        self.stream.flush()
