"""When a training run stops early: signals (finish the step, save, exit; a second Ctrl-C waits for a
checkpoint write; SIGHUP too, so closing the terminal loses no work) and `--max-minutes` (stop early
enough that the final evaluation fits).

    with StopSignal() as stop:
        ... if stop.signum is not None: save and stop
        with stop.deferred(): write a checkpoint
    limit = TimeLimit(minutes, t_start, eval_tokens); limit.out_of_time(now, step_seconds, tok_s, eval_due)
    limit.ahead(now, step_seconds, steps_left)   # (seconds, steps) to the limit, if it ends the run first
"""

from __future__ import annotations

import signal
from contextlib import contextmanager


class StopSignal:
    """SIGINT/SIGTERM/SIGHUP set a flag; the loop finishes its step, saves and exits. A second SIGINT
    aborts, except while a checkpoint is being written (`deferred()`): then it aborts right after the write."""

    SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))

    def __init__(self):
        self.signum = None
        self._old = {}
        self._deferring = False
        self._abort = False

    def __enter__(self):
        for sig in self.SIGNALS:
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            if self._deferring:
                self._abort = True
                return
            raise KeyboardInterrupt
        self.signum = signum

    @contextmanager
    def deferred(self):
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        if self._abort:
            raise KeyboardInterrupt

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


class TimeLimit:
    """--max-minutes, evaluation included: the run stops (evaluates, saves) early enough that the final
    evaluation ends before the limit. The evaluation's cost is the last one measured or, before the
    first, estimated from the training throughput (a forward pass costs about a third of a step)."""

    def __init__(self, minutes: float, t_start: float, eval_tokens: int):
        self.minutes = minutes
        self.end = t_start + 60 * minutes if minutes else None
        self.eval_seconds = None
        self.eval_tokens = eval_tokens

    def out_of_time(
        self, now: float, step_seconds: float, tokens_per_s: float, eval_due: bool = False, warming_up: bool = False
    ) -> bool:
        """Whether to stop now: another step, the evaluation due now (if any) and the final one would not fit.
        While `warming_up` (the first step: allocation, compiling) nothing is estimated from its time: the
        run stops only once the limit itself has passed."""
        if self.end is None:
            return False
        if warming_up:
            return now >= self.end
        evaluation = self.eval_seconds if self.eval_seconds is not None else self.eval_tokens / max(tokens_per_s, 1) / 2
        return now + step_seconds + evaluation * (2 if eval_due else 1) >= self.end

    def ahead(self, now: float, step_seconds: float, steps_left: int) -> tuple[float, int] | None:
        """(seconds, steps) until the limit stops the run, when it comes before the last of `steps_left`
        steps (what an ETA must then count to); None when the steps end first or there is no limit."""
        if self.end is None or step_seconds * steps_left <= self.end - now:
            return None
        seconds = max(self.end - now, 0.0)
        return seconds, int(seconds / step_seconds) if step_seconds > 0 else steps_left
