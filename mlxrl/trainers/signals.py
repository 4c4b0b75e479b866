"""Stopping safely: Ctrl-C and SIGTERM wait for the end of an update or a save.

The engine's loop runs inside `StopSignals.catch()`; every update and every save runs inside
`StopSignals.critical()`. A signal that arrives there is held and raised as `TrainingInterrupted` when
the block ends, so a checkpoint never holds a half-applied update and a save is never cut short.
"""

from __future__ import annotations

import contextlib
import signal
import threading


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT), or SIGTERM in a single process: raised by `train()` once a resumable
    checkpoint of the finished steps is saved (a KeyboardInterrupt, so callers treat both alike)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """The engine's signal handlers and critical sections (one per trainer). `pending`: a signal held
    inside a critical section, not yet raised."""

    def __init__(self):
        self.depth = 0  # > 0 inside an update or a save: Ctrl-C / SIGTERM wait for its end
        self.pending = None

    def catch(self, world_size: int = 1):
        """Ctrl-C (and SIGTERM in a single process: what schedulers and `timeout` send) raise
        TrainingInterrupted, but not inside an update or a save: there the signal is held until it ends.
        Returns the function that restores the previous handlers (main thread only; a no-op elsewhere)."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        wanted = [signal.SIGINT] + ([signal.SIGTERM] if world_size == 1 else [])
        saved = {}
        for sig in wanted:
            previous = signal.getsignal(sig)
            if previous is signal.SIG_IGN:  # e.g. a background job: the user chose to ignore it
                continue
            saved[sig] = signal.SIG_DFL if previous is None else previous
            signal.signal(sig, self._on_signal)

        def restore():
            for sig, handler in saved.items():
                signal.signal(sig, handler)

        return restore

    def _on_signal(self, signum, frame):
        if self.depth > 0:
            self.pending = signum
            return
        raise TrainingInterrupted(signum)

    @contextlib.contextmanager
    def critical(self, raise_pending: bool = True):
        """Hold Ctrl-C / SIGTERM until the block ends; then (raise_pending) raise TrainingInterrupted."""
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if raise_pending and self.depth == 0 and self.pending is not None:
            signum, self.pending = self.pending, None
            raise TrainingInterrupted(signum)


def stop_words(failure) -> str:
    """How a run stopped, for its last line ({step}: the step it stopped in)."""
    if isinstance(failure, TrainingInterrupted) and failure.signum == signal.SIGTERM:
        return "terminated (SIGTERM)"
    if isinstance(failure, KeyboardInterrupt):
        return "interrupted"
    return f"stopped by an error at step {{step}} ({type(failure).__name__})"
