"""`config.profile_steps` > 0: a jax.profiler trace of that many steps, starting `profile_start`
steps into the run (after compilation and warm-up), into WORKDIR/profile. View it with
`tensorboard --logdir=WORKDIR/profile` (Profile tab) or open the perfetto_trace.json.gz it also
writes at https://ui.perfetto.dev. Every process traces its own devices."""

import pathlib

import jax


class StepTrace:

  def __init__(self, directory: pathlib.Path, first_step: int, n_steps: int):
    self.directory, self.first, self.last = directory, first_step, first_step + n_steps
    self.enabled, self.active = n_steps > 0, False

  def before_step(self, step: int) -> None:
    """Call before dispatching step `step` (0-based)."""
    if self.enabled and step == self.first:
      jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
      self.active = True

  def after_step(self, done: int, outputs) -> None:
    """Call after dispatching, with the steps done and what the step returned."""
    if self.active and done >= self.last:
      self.stop(outputs)

  def stop(self, outputs=None) -> None:
    if self.active:
      # the traced steps run to the end inside the trace (a tiered step that failed in its
      # update has freed the devices' old copy: nothing to wait for there)
      jax.block_until_ready([x for x in jax.tree.leaves(outputs)
                             if not (isinstance(x, jax.Array) and x.is_deleted())])
      jax.profiler.stop_trace()
      self.active = False
