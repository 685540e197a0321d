"""SIGTERM (a scheduler's preemption notice) or SIGINT (Ctrl-C) stops training cleanly: the loop
finishes its step, saves a checkpoint and returns. A second signal stops at once, as it would
have without us (SIGINT raises KeyboardInterrupt, so a notebook's kernel survives; SIGTERM
kills); the last complete checkpoint is untouched (orbax renames a save into place only when it
is whole).

On a multi-process job every process must save at the same step, or the collectives of the save
and of the next step hang. JAX's preemption service (started by `jax.distributed.initialize`)
owns SIGTERM there: it tells the coordinator, which picks one step for all, and
`reached_preemption_sync_point(step)` is true on every process at that step. SIGINT is turned
into a SIGTERM to the same process so that it takes the same path.
"""

import os
import signal
import sys
import threading

import jax
from jax.experimental import multihost_utils


class StopSignals:
  """A context manager; `requested(step)` after each step says whether to save and stop."""

  def __init__(self):
    self.received = None  # the first signal's name
    self.multi_process = jax.process_count() > 1
    self.sync_service = self.multi_process  # until JAX says its preemption service is off
    self._previous = {}

  def _handle(self, signum, frame):
    name = signal.Signals(signum).name
    if self.received:  # the second signal: what it would have done without us
      print(f'meshlm: second {name}, stopping now; the last complete checkpoint is kept',
            file=sys.stderr, flush=True)
      previous = self._previous.get(signum)
      if callable(previous):  # Python's SIGINT handler: KeyboardInterrupt (a notebook survives)
        previous(signum, frame)
      signal.signal(signum, signal.SIG_DFL)
      os.kill(os.getpid(), signum)
      return
    self.received = name
    print(f'meshlm: {name} received, saving a checkpoint after this step (send it again to '
          'exit at once)', file=sys.stderr, flush=True)
    if self.sync_service and signum == signal.SIGINT:
      os.kill(os.getpid(), signal.SIGTERM)  # to JAX's preemption service, like a scheduler's

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():  # signals reach only that thread
      # JAX's preemption service handles SIGTERM itself on a multi-process job.
      signums = [signal.SIGINT] if self.multi_process else [signal.SIGINT, signal.SIGTERM]
      for signum in signums:
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous.clear()

  def requested(self, step: int) -> bool:
    """Call after every step, on every process, with the number of steps done."""
    if self.sync_service:
      try:
        return multihost_utils.reached_preemption_sync_point(step)
      except RuntimeError:  # the preemption service is off (jax_enable_preemption_service)
        self.sync_service = False
    return self.received is not None
