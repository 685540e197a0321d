"""Checkpoints with orbax: asynchronous sharded saves, restore straight into any mesh's shardings.

workdir/checkpoints/<step>/ holds `state` (TrainState: step, params, optimizer state, bad-step
count; each process writes only its shards), `data` (the data pipeline's JSON state: which
documents each row has read, hence also where the shuffle is) and `config` (the resolved config,
JSON; with the step it fixes every other random choice, as the model has no dropout). orbax writes
a step into a temporary directory and renames it when complete, so a process killed mid-save
leaves nothing that `all_steps` would list; a step that still fails to restore (truncated,
corrupted) is reported with its path and the one before it is used.

Before restoring anything, the checkpoint's metadata (names, shapes and dtypes of every array) is
compared with the state this config builds, so another model's checkpoint is a clear error
naming what differs, not an orbax traceback after allocating memory.
"""

import logging
import pathlib
import warnings

from absl import flags
from absl import logging as absl_logging
import jax
import orbax.checkpoint as ocp


class CheckpointWarning(UserWarning):
  """A checkpoint that could not be restored and was skipped for an older one."""


class CheckpointMismatch(ValueError):
  """A checkpoint of another model (or optimizer) than the config builds."""

  def __init__(self, message: str, saved_model: dict):
    super().__init__(message)
    self.saved_model = saved_model  # the checkpoint's config.model, {} if unreadable


def _quiet_read_only(record) -> bool:
  # orbax warns on every read-only open (sampling and init_from open checkpoints that way).
  return not str(record.msg).startswith('Given directory is read only')


logging.getLogger('absl').addFilter(_quiet_read_only)


def quiet_orbax_logs() -> None:
  """For the entry points: orbax logs every save and restore at INFO; keep WARNING and up unless
  the user asked for --verbosity."""
  if not flags.FLAGS['verbosity'].present:
    absl_logging.set_verbosity(absl_logging.WARNING)


def _manager(directory: pathlib.Path, **options) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(
      directory.absolute(), options=ocp.CheckpointManagerOptions(**options),
      item_handlers={'state': ocp.PyTreeCheckpointHandler(use_compression=False), 'data': ocp.JsonCheckpointHandler(),
                     'config': ocp.JsonCheckpointHandler()})


def _arrays(tree) -> dict[str, tuple]:
  """'params.embed.value' → (shape, dtype) for every array of a state or its metadata."""
  return {jax.tree_util.keystr(path, simple=True, separator='.'): (tuple(x.shape), str(x.dtype))
          for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def _differences(saved: dict, wanted: dict) -> list[str]:
  """What differs, parameters first (the optimizer state mirrors them)."""
  wanted = dict(sorted(wanted.items(), key=lambda item: not item[0].startswith('params.')))
  lines = [f'{name} is {saved[name][0]} {saved[name][1]} there but {want[0]} {want[1]} here'
           for name, want in wanted.items() if name in saved and saved[name] != want]
  lines += [f'{name} is missing there' for name in wanted if name not in saved]
  lines += [f'{name} is there but not here' for name in saved if name not in wanted]
  return lines


def _model_differences(saved_model: dict, model_config) -> str:
  changed = [f'{k} {v!r} → {model_config[k]!r}' for k, v in sorted(saved_model.items())
             if k in model_config and model_config[k] != v]
  return f'; config.model differs: {", ".join(changed)}' if changed else ''


class Checkpointer:
  """The checkpoints of one run, in `directory` (workdir/checkpoints)."""

  def __init__(self, directory: pathlib.Path, *, keep: int = 1, read_only: bool = False):
    self.directory = pathlib.Path(directory)
    self.manager = _manager(self.directory, max_to_keep=None if read_only else keep,
                            save_interval_steps=0 if read_only else 1, create=not read_only,
                            read_only=read_only, enable_async_checkpointing=not read_only,
                            cleanup_tmp_directories=not read_only)

  def steps(self) -> list[int]:
    """Complete checkpoints, newest first."""
    return sorted(self.manager.all_steps(), reverse=True)

  def save(self, step: int, state, data_state: dict, config_json: dict) -> None:
    """Start an asynchronous save; returns once the arrays are copied off the devices."""
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(data_state),
        config=ocp.args.JsonSave(config_json)), force=True)

  def saved_config(self, step: int) -> dict:
    """The config a checkpoint was written with; {} if it does not read."""
    try:
      return self.manager.restore(step, args=ocp.args.Composite(
          config=ocp.args.JsonRestore())).config or {}
    except Exception:  # a corrupted checkpoint: restore_latest reports it
      return {}

  def check(self, abstract_tree, step: int, *, setting: str, model_config) -> bool:
    """Whether checkpoint `step` reads; CheckpointMismatch if it holds other arrays than
    `abstract_tree` (a TrainState, or a subtree such as {'params': ...})."""
    try:
      saved = _arrays(self.manager.item_metadata(step)['state'])
    except Exception:  # unreadable metadata: a corrupted or truncated checkpoint
      return False
    wanted = _arrays(abstract_tree)
    if isinstance(abstract_tree, dict):  # a subtree: the rest of the checkpoint is not wanted
      saved = {k: v for k, v in saved.items() if k.split('.')[0] in abstract_tree}
    differences = _differences(saved, wanted)
    if differences:
      saved_model = self.saved_config(step).get('model', {})
      raise CheckpointMismatch(
          f'{setting}: checkpoint {self.directory / str(step)} holds another model or optimizer '
          f'than this config builds ({"; ".join(differences[:3])}'
          f'{f"; {len(differences) - 3} more" if len(differences) > 3 else ""})'
          f'{_model_differences(saved_model, model_config)}.'
          ' Use the config that wrote it, or another workdir', saved_model)
    return True

  def restore_latest(self, abstract_state, model_config):
    """(step, state, data_state) of the newest checkpoint that restores, into the shardings of
    `abstract_state`; None when there is none. A checkpoint of another model is an error
    (starting afresh would in time delete it); so is having checkpoints of which none restores."""
    steps = self.steps()
    for step in steps:
      try:
        if self.check(abstract_state, step, setting='config.workdir', model_config=model_config):
          restored = self.manager.restore(step, args=ocp.args.Composite(
              state=ocp.args.PyTreeRestore(
                  abstract_state, ocp.checkpoint_utils.construct_restore_args(abstract_state)),
              data=ocp.args.JsonRestore()))
          return step, restored.state, restored.data
        error = 'its metadata does not read'
      except CheckpointMismatch:
        raise
      except Exception as e:  # orbax raises many types for truncated or corrupted files
        error = f'{type(e).__name__}: {str(e)[:200]}'
      warnings.warn(f'checkpoint {self.directory / str(step)} does not restore ({error}); '
                    'trying the one before it', CheckpointWarning, stacklevel=2)
    if steps:
      raise ValueError(f'config.workdir holds checkpoints {steps} in {self.directory} but none '
                       'restores; move them away (or use a new --config.workdir) to start afresh')
    return None

  def close(self) -> None:
    """Wait for the save in flight, then release orbax's threads."""
    self.manager.wait_until_finished()
    self.manager.close()


def step_directory(path: str) -> tuple[pathlib.Path, int]:
  """(checkpoints dir, step) for `config.init_from`: a run's workdir (its newest checkpoint), its
  checkpoints/ dir, or one checkpoints/<step> dir."""
  path = pathlib.Path(path).expanduser()
  if path.name.isdigit() and (path / 'state').is_dir():
    return path.parent, int(path.name)
  for directory in (path / 'checkpoints', path):
    if directory.is_dir():
      checkpointer = Checkpointer(directory, read_only=True)
      steps = checkpointer.steps()
      checkpointer.close()
      if steps:
        return directory, steps[0]
  raise ValueError(f'config.init_from={str(path)!r} holds no checkpoint; give a run\'s workdir, '
                   'its checkpoints/ dir, or one checkpoints/<step> dir')


def _init_from(path: str, abstract_params, model_config):
  """The read-only Checkpointer, step and wanted tree of `config.init_from`, checked."""
  directory, step = step_directory(path)
  checkpointer, wanted = Checkpointer(directory, read_only=True), {'params': abstract_params}
  if not checkpointer.check(wanted, step, setting='config.init_from', model_config=model_config):
    checkpointer.close()
    raise ValueError(f'config.init_from: checkpoint {directory / str(step)} does not read '
                     '(truncated or corrupted?); point it at another step')
  return checkpointer, step, wanted


def check_init_from(path: str, abstract_params, model_config) -> None:
  """CheckpointMismatch (or ValueError) unless `path` holds parameters of this model."""
  _init_from(path, abstract_params, model_config)[0].close()


def restore_params(path: str, abstract_params, model_config):
  """The parameters alone of the checkpoint at `path` (see step_directory), into the shardings
  of `abstract_params`, and the step directory they came from: a new run's starting point, with
  a fresh optimizer and step 0."""
  checkpointer, step, wanted = _init_from(path, abstract_params, model_config)
  try:
    restored = checkpointer.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(wanted, ocp.checkpoint_utils.construct_restore_args(wanted),
                                     partial_restore=True)))
    return restored.state['params'], checkpointer.directory / str(step)
  finally:
    checkpointer.close()
