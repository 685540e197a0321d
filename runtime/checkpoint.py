"""Checkpoints with orbax: asynchronous sharded saves, restore straight into any mesh's shardings.

workdir/checkpoints/<step>/ holds `state` (TrainState: step, params, optimizer state, bad-step
count; each process writes only its shards), `data` (the data pipeline's JSON state: which
documents each row has read, hence also where the shuffle is), `config` (the resolved config,
JSON; with the step it fixes every other random choice, as the model has no dropout) and
`checksums` (one per array of the state, see `checksums`).

Nothing saved is lost or trusted blindly. orbax writes a step into a temporary directory and
renames it when complete, so a process killed mid-save leaves nothing that `all_steps` would list.
A restored state whose checksums differ from the saved ones, or a checkpoint that does not restore
(truncated, zeroed, its metadata unreadable), is damaged: it is moved aside to
workdir/checkpoints-damaged/<step> (renamed, never deleted), the warning names it, and the one
before it is used; the run can then save that step afresh.

Before restoring anything, the checkpoint's metadata (names, shapes and dtypes of every array) is
compared with the state this config builds, so another model's checkpoint is a clear error
naming what differs, not an orbax traceback after allocating memory.
"""

import logging
import pathlib
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils


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


def _manager(directory: pathlib.Path, **options) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(
      directory.absolute(), options=ocp.CheckpointManagerOptions(**options),
      item_handlers={'state': ocp.PyTreeCheckpointHandler(use_compression=False),
                     'data': ocp.JsonCheckpointHandler(), 'config': ocp.JsonCheckpointHandler(),
                     'checksums': ocp.JsonCheckpointHandler()})


def _names(tree) -> list[str]:
  return [jax.tree_util.keystr(path, simple=True, separator='.')
          for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


@jax.jit
def _checksum_arrays(leaves):
  def checksum(x):
    # Each element's bits, weighted by 2i + 1 (i its index in the whole array) and summed mod
    # 2^32: integer sums do not depend on order, so any sharding gives the same value.
    words = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[
        x.dtype.itemsize]).astype(jnp.uint32)
    index, stride = jnp.zeros(x.shape, jnp.uint32), 1
    for dim in reversed(range(x.ndim)):
      index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, dim) * jnp.uint32(stride)
      stride *= x.shape[dim]
    return jnp.sum(words * (2 * index + 1), dtype=jnp.uint32)
  return [checksum(x) for x in leaves]


def checksums(tree) -> dict[str, int]:
  """{array name: checksum of its bits}, computed where the arrays are (one read of each on the
  devices; XLA:CPU manages about 3 GB/s, as it copies the bits before summing them), the same
  for any sharding of the same values."""
  leaves = [x if x.sharding.memory_kind in (None, 'device')
            else jax.device_put(x, x.sharding.with_memory_kind('device'))  # offloaded to host
            for x in jax.tree.leaves(tree)]
  return dict(zip(_names(tree), (int(c) for c in jax.device_get(_checksum_arrays(leaves)))))


def _agree(ok: bool) -> bool:
  """True only if every process found it so (a process reads only its own shards)."""
  if jax.process_count() == 1:
    return ok
  return bool(np.all(multihost_utils.process_allgather(np.array(ok))))


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
    self.directory, self.read_only = pathlib.Path(directory), read_only
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
        config=ocp.args.JsonSave(config_json), checksums=ocp.args.JsonSave(checksums(state))),
        force=True)

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
    if not (self.directory / str(step) / 'state' / '_METADATA').is_file():
      return False  # without it orbax guesses a partial tree, which would look like another model
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
    """(step, state, data_state) of the newest checkpoint that restores intact, into the
    shardings of `abstract_state`; None when there is none. Damaged ones on the way are moved
    aside (module docstring). A checkpoint of another model is an error (starting afresh would
    in time delete it); so is having checkpoints of which none restores."""
    steps = self.steps()
    for step in steps:
      restored, error = None, None
      try:
        if self.check(abstract_state, step, setting='config.workdir', model_config=model_config):
          restored = self._restore(step, abstract_state)
          error = self._verify(step, restored.state)
        else:
          error = 'its metadata does not read'
      except CheckpointMismatch:
        raise
      except Exception as e:  # orbax raises many types for truncated or corrupted files
        error = f'{type(e).__name__}: {str(e)[:200]}'
      if _agree(error is None):
        return step, restored.state, restored.data
      where = ('left in place (read only)' if self.read_only else
               f'moved to {self._set_aside(step)}')
      warnings.warn(f'checkpoint {self.directory / str(step)} is damaged '
                    f'({error or "on another process"}); {where}; trying the one before it',
                    CheckpointWarning, stacklevel=2)
    if steps:
      raise ValueError(f'config.workdir holds checkpoints {steps} in {self.directory} but none '
                       'restores; move them away (or use a new --config.workdir) to start afresh')
    return None

  def _restore(self, step: int, abstract_state):
    return self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(
            abstract_state, ocp.checkpoint_utils.construct_restore_args(abstract_state)),
        data=ocp.args.JsonRestore()))

  def _verify(self, step: int, tree) -> str | None:
    """None if `tree` (a state, or a part of one such as {'params': ...}) has the checksums saved
    with it, else what differs. (A checkpoint from before checksums were saved cannot be
    verified, and is accepted.)"""
    if not (self.directory / str(step) / 'checksums').exists():
      return None
    saved = self.manager.restore(step, args=ocp.args.Composite(
        checksums=ocp.args.JsonRestore())).checksums
    restored = checksums(tree)
    changed = [name for name, value in restored.items() if saved.get(name) != value]
    if changed:
      return (f'{len(changed)} of {len(restored)} arrays differ from their checksums: '
              f'{", ".join(changed[:3])}{", …" if len(changed) > 3 else ""}')
    return None

  def _set_aside(self, step: int) -> pathlib.Path:
    """Moves checkpoint `step` to checkpoints-damaged/ (process 0; the others wait), so that
    this step can be saved again; returns where it went."""
    aside = self.directory.parent / f'{self.directory.name}-damaged'
    where = aside / str(step)
    if jax.process_index() == 0:
      aside.mkdir(exist_ok=True)
      if where.exists():  # damaged before, at the same step
        where = aside / f'{step}-{time.strftime("%Y%m%d-%H%M%S")}'
      (self.directory / str(step)).rename(where)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f'meshlm: checkpoint {step} set aside')
    self.manager.reload()
    return where

  def close(self) -> None:
    """Wait for the save in flight, then release orbax's threads."""
    self.manager.wait_until_finished()
    self.manager.close()


# What a resumed run must keep, checked against the config saved with its checkpoint: the data
# stream (the iterator's saved state counts batch rows and offsets into documents) and the
# model's function (its shapes are checked from the checkpoint's metadata). Everything else may
# change on resume: steps, cadences, mesh, remat, attention implementation, compute and gradient
# reduction dtypes, microbatches, workers, and the optimizer's settings, which apply from the
# resumed step on.
KEPT_ON_RESUME = ('seed', 'batch_size', 'seq_len', 'data.paths', 'data.name', 'data.text_key',
                  'data.train_split', 'data.validation_fraction', 'data.tokenizer',
                  'data.tokenizer_model', 'model.rope_theta', 'model.rope_type',
                  'model.rope_factor', 'model.rope_low_freq_factor', 'model.rope_high_freq_factor',
                  'model.rope_original_length', 'model.norm_eps')


def check_resume(saved_config: dict, config, checkpoint: pathlib.Path) -> None:
  """ValueError naming the first setting of KEPT_ON_RESUME that differs from the saved config."""
  for field in KEPT_ON_RESUME:
    saved, here = saved_config, config
    for key in field.split('.'):
      saved = saved.get(key) if isinstance(saved, dict) else None
      here = here[key]
    if saved is not None and saved != here:
      raise ValueError(
          f'config.{field}={here!r}, but checkpoint {checkpoint} was trained with {saved!r}; a '
          'resumed run keeps its data stream and model (runtime/checkpoint.py: KEPT_ON_RESUME). '
          f'Set it back, or start another run with another --config.workdir (and '
          f'--config.init_from={checkpoint.parent.parent} to start from its parameters)')


def step_directory(path: str, setting: str = 'config.init_from') -> tuple[pathlib.Path, int]:
  """(checkpoints dir, step) for `setting`: a run's workdir (its newest checkpoint), its
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
  raise ValueError(f'{setting}={str(path)!r} holds no checkpoint; give a run\'s workdir, its '
                   'checkpoints/ dir, or one checkpoints/<step> dir')


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


def restore_params(path: str, abstract_params, model_config, setting: str = 'config.init_from'):
  """The parameters alone of the checkpoint at `path` (see step_directory), into the shardings
  of `abstract_params`, and the step directory they came from: a new run's starting point, with
  a fresh optimizer and step 0, or what sample.py and export.py read. Parameters that differ from
  the checksums saved with them are refused, `setting` named, the checkpoint left as it is."""
  checkpointer, step, wanted = _init_from(path, abstract_params, model_config)
  try:
    try:
      restored = checkpointer.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(wanted, ocp.checkpoint_utils.construct_restore_args(wanted),
                                       partial_restore=True)))
      error = checkpointer._verify(step, {'params': restored.state['params']})
    except Exception as e:  # orbax raises many types for truncated or corrupted files
      error = f'{type(e).__name__}: {str(e).splitlines()[0][:200]}'
    if error:
      others = [s for s in checkpointer.steps() if s != step]
      raise ValueError(
          f'{setting}: checkpoint {checkpointer.directory / str(step)} is damaged ({error}); it is '
          'left as it is. ' + (f'The run has checkpoints {others} too: give one of them '
                               f'({checkpointer.directory}/STEP)' if others else
                               'The run has no other checkpoint'))
    return restored.state['params'], checkpointer.directory / str(step)
  finally:
    checkpointer.close()
