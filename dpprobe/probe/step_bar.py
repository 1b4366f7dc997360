"""The probe's progress bar over steps, which never stays silent through a long wait.

A sweep's steps run in a few compiled calls, and the first call of each program compiles it
(36 s was measured for the default sweep on 60,000 x 3,969 features, 2 cores at load 10); a
streamed step reads the whole store. The bar itself only moves when a call returns, so a timer
thread says what the job waits for and for how long ("compiling the steps, 12 s") whenever the
bar has not moved for `HEARTBEAT_SECONDS`. It adds nothing of another kind to what the bar
shows: the wait's name (public: which phase of the code runs) and seconds of wall time, as
the bar's own elapsed time and rate already show.
"""

from __future__ import annotations

import sys
import threading
import time

from tqdm.auto import tqdm

__all__ = ["HEARTBEAT_SECONDS", "StepBar", "step_bar"]

# Longest silence of a shown bar: the timer refreshes it after this many seconds without a
# step, so that stderr moves at least every few seconds through any wait.
HEARTBEAT_SECONDS = 3.0


class StepBar(tqdm):
    """A tqdm bar over steps with a heartbeat: while no step lands for `heartbeat` seconds,
    a daemon thread shows "WAITING_FOR, N s" after the bar (N: seconds since the bar last
    moved). `wait_for(text)` names the next wait; `update` clears the note.
    Disabled bars start no thread."""

    def __init__(self, *args, heartbeat: float | None = None, **kwargs):
        self._waiting, self._since = "computing", time.monotonic()
        self._stop, self._beat = threading.Event(), None
        # The check-and-set of the note and a step's clearing of it exclude each other, so a
        # note computed just before a step lands never outlives that step.
        self._note_lock = threading.Lock()
        super().__init__(*args, **kwargs)
        if not self.disable:
            every = HEARTBEAT_SECONDS if heartbeat is None else heartbeat
            self._beat = threading.Thread(target=self._heartbeat, args=(every,),
                                          name="dpprobe-step-bar", daemon=True)
            self._beat.start()

    def wait_for(self, what: str) -> None:
        """Name what the job waits for next (shown once the bar has been still a while).

        Args:
          what: a public description, e.g. "compiling the steps".
        """
        self._waiting = what

    def update(self, n=1):
        """Advance by `n` steps and clear the waiting note.

        Args:
          n: steps completed.

        Returns:
          what tqdm's `update` returns.
        """
        if self.disable:
            return super().update(n)
        with self._note_lock:
            self._since = time.monotonic()
            if self.postfix:
                self.set_postfix_str("", refresh=False)
        return super().update(n)

    def _heartbeat(self, every: float) -> None:
        while not self._stop.wait(every / 3):
            self.note_if_still(every)

    def note_if_still(self, every: float) -> None:
        """Show the waiting note if the bar has not moved for `every` seconds (the heartbeat
        thread's tick).

        Args:
          every: the silence, in seconds, after which the note is shown.
        """
        with self._note_lock:
            waited = time.monotonic() - self._since
            if waited >= every:
                self.set_postfix_str(f"{self._waiting}, {waited:.0f} s")

    def close(self) -> None:
        """Stop the heartbeat, then close the bar."""
        self._stop.set()
        if self._beat is not None and self._beat is not threading.current_thread():
            self._beat.join()
        super().close()


def step_bar(total: int, progress: bool, desc: str) -> StepBar:
    """A progress bar over steps on stderr (off unless `progress`), with a heartbeat.

    Args:
      total: the number of steps.
      progress: show the bar (False: a disabled bar, no thread).
      desc: the bar's label.

    Returns:
      a `StepBar` (a context manager).
    """
    return StepBar(total=total, unit="step", desc=desc, disable=not progress, file=sys.stderr,
                   dynamic_ncols=True, leave=False)
