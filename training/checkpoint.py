"""Checkpoints with orbax: asynchronous sharded saves, restore straight into any mesh's shardings.

workdir/checkpoints/<step>/ holds `state` (TrainState: step, params, optimizer state; each process
writes only its shards), `data` (the data pipeline's JSON state) and `config` (the resolved config,
JSON). orbax writes a step into a temporary directory and renames it when complete, so a process
killed mid-save leaves nothing that `latest_step` would pick; a step that still fails to restore
(truncated, corrupted) is reported with its path and the one before it is used.
"""

import pathlib
import warnings

import orbax.checkpoint as ocp


class CheckpointWarning(UserWarning):
  """A checkpoint that could not be restored and was skipped for an older one."""


class Checkpointer:

  def __init__(self, workdir: pathlib.Path, *, keep: int):
    self.directory = pathlib.Path(workdir) / 'checkpoints'
    self.manager = ocp.CheckpointManager(
        self.directory.absolute(), options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=True, create=True))

  def save(self, step: int, state, data_state: dict, config_json: dict) -> None:
    """Start an asynchronous save; returns once the arrays are copied off the devices."""
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
        config=ocp.args.JsonSave(config_json)), force=True)

  def restore_latest(self, abstract_state):
    """(step, state, data_state) of the newest checkpoint that restores, into the shardings of
    `abstract_state`; None when there is none. When checkpoints exist but none restores (another
    model's, say), it is an error: starting afresh would in time delete them."""
    steps = sorted(self.manager.all_steps(), reverse=True)
    for step in steps:
      try:
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
      except Exception as e:  # orbax raises many types for truncated or corrupted files
        warnings.warn(f'checkpoint {self.directory / str(step)} does not restore '
                      f'({type(e).__name__}: {str(e)[:200]}); trying the one before it',
                      CheckpointWarning, stacklevel=2)
        continue
      return step, restored.state, restored.data
    if steps:
      raise ValueError(f'config.workdir holds checkpoints {steps} in {self.directory} but none '
                       'restores into this config (a different model shape or vocabulary?); '
                       'use a new --config.workdir, or the config that wrote them')
    return None

  def close(self) -> None:
    """Wait for the save in flight, then release orbax's threads."""
    self.manager.wait_until_finished()
    self.manager.close()
