"""Stopping safely: Ctrl-C and SIGTERM wait for the end of an update or a save.

The engine's loop runs inside `_catch_signals()`; every update and every save runs inside
`_critical()`. A signal that arrives there is held and raised as `TrainingInterrupted` when the
block ends, so a checkpoint never holds a half-applied update and a save is never cut short.
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


class Signals:
    """Mixin of the engine's `Trainer`: the signal handlers and the critical sections."""

    _critical_depth = 0  # > 0 inside an update or a save: Ctrl-C / SIGTERM wait for its end
    _pending_signal = None

    def _catch_signals(self):
        """Ctrl-C (and SIGTERM in a single process: what schedulers and `timeout` send) raise
        TrainingInterrupted, but not inside an update or a save: there the signal is held until it ends.
        Returns the function that restores the previous handlers (main thread only; a no-op elsewhere)."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        wanted = [signal.SIGINT] + ([signal.SIGTERM] if self.world_size == 1 else [])
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
        if self._critical_depth > 0:
            self._pending_signal = signum
            return
        raise TrainingInterrupted(signum)

    @contextlib.contextmanager
    def _critical(self, raise_pending: bool = True):
        """Hold Ctrl-C / SIGTERM until the block ends; then (raise_pending) raise TrainingInterrupted."""
        self._critical_depth += 1
        try:
            yield
        finally:
            self._critical_depth -= 1
        if raise_pending and self._critical_depth == 0 and self._pending_signal is not None:
            signum, self._pending_signal = self._pending_signal, None
            raise TrainingInterrupted(signum)

    @staticmethod
    def _stop_words(failure) -> str:
        if isinstance(failure, TrainingInterrupted) and failure.signum == signal.SIGTERM:
            return "terminated (SIGTERM)"
        if isinstance(failure, KeyboardInterrupt):
            return "interrupted"
        return f"stopped by an error at step {{step}} ({type(failure).__name__})"
