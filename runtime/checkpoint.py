"""Checkpoints with orbax: asynchronous sharded saves, restore straight into any mesh's shardings.

workdir/checkpoints/<step>/ holds `state` (TrainState: step, params, optimizer state, bad-step
count; each process writes only its shards), `data` (the data pipeline's JSON state: which
documents each row has read, hence also where the shuffle is), `config` (the resolved config,
JSON; with the step it fixes every other random choice, as the model has no dropout),
`checksums` (one per array of the state, see `checksums`) and, for a run with optimizer state on
a host or NVMe tier, `pieces` (those arrays, None in `state`, written and read a chunk at a time:
runtime/pieces.py).

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

import contextlib
import dataclasses
import json
import logging
import pathlib
import re
import time
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from configs import base, effects
from runtime import faults, pieces as pieces_lib


class CheckpointWarning(UserWarning):
  """A checkpoint that could not be restored and was skipped for an older one."""


class CheckpointMismatch(ValueError):
  """A checkpoint of another model (or optimizer) than the config builds."""

  def __init__(self, message: str, saved_model: dict):
    super().__init__(message)
    self.saved_model = saved_model  # the checkpoint's config.model, {} if unreadable


def _quiet(record) -> bool:
  # orbax warns on every read-only open (sampling and init_from open checkpoints that way), and
  # logs a failed background save from each of its threads: Checkpointer reports it, once.
  message = record.getMessage()
  return not (message.startswith('Given directory is read only') or
              re.search(r'raised an exception|background save thread|thread \(\w+\) failed',
                        message))


logging.getLogger('absl').addFilter(_quiet)
logging.getLogger('asyncio').addFilter(lambda record: record.levelno < logging.ERROR or not (
    'exception was never retrieved' in record.getMessage()))  # the same failed save, from asyncio


class _PendingChecksums(ocp.JsonCheckpointHandler):
  """The checksums item, saved from device arrays still being computed (`checksum_arrays`): they
  are read in orbax's background commit, so the loop does not wait for the pass over the state."""

  async def _save_fn(self, x, directory):
    await super()._save_fn({name: int(value) for name, value in jax.device_get(x).items()},
                           directory)


@ocp.args.register_with_handler(_PendingChecksums, for_save=True)
@dataclasses.dataclass
class _ChecksumsSave(ocp.args.JsonSave):
  pass


@ocp.args.register_with_handler(_PendingChecksums, for_restore=True)
@dataclasses.dataclass
class _ChecksumsRestore(ocp.args.JsonRestore):
  pass


def _manager(directory: pathlib.Path, **options) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(
      directory.absolute(), options=ocp.CheckpointManagerOptions(**options),
      item_handlers={'state': ocp.PyTreeCheckpointHandler(use_compression=False),
                     'data': ocp.JsonCheckpointHandler(), 'config': ocp.JsonCheckpointHandler(),
                     'checksums': _PendingChecksums(), pieces_lib.ITEM: pieces_lib.PiecesHandler()})


def name_of(path) -> str:
  """An array's name in a checkpoint, from its path in the state: 'opt_state.0.mu.embed.value'."""
  return jax.tree_util.keystr(path, simple=True, separator='.')


def _names(tree) -> list[str]:
  return [name_of(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


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


def checksum_arrays(tree) -> dict[str, jax.Array]:
  """{array name: checksum of its bits}, dispatched where the arrays are and not waited for (one
  read of each on the devices; XLA:CPU manages about 3 GB/s, as it copies the bits before summing
  them), the same for any sharding of the same values. Arrays in host memory (offloaded, or the
  optimizer state of training/tiers.py, which may not fit the devices whole) are brought to the
  devices one at a time, each summed before the next comes."""
  names, leaves = _names(tree), jax.tree.leaves(tree)
  on_devices = [i for i, x in enumerate(leaves) if x.sharding.memory_kind in (None, 'device')]
  sums = dict(zip(on_devices, _checksum_arrays([leaves[i] for i in on_devices])))
  for i, x in enumerate(leaves):
    if i not in sums:
      sums[i] = _checksum_arrays([jax.device_put(x, x.sharding.with_memory_kind('device'))])[0]
      sums[i].block_until_ready()
  return {names[i]: sums[i] for i in range(len(leaves))}


def checksums(tree) -> dict[str, int]:
  """checksum_arrays(tree), as numbers."""
  return {name: int(value) for name, value in jax.device_get(checksum_arrays(tree)).items()}


def _summed(shares: dict[str, int]) -> dict[str, int]:
  """Each array's checksum from every process's share of it."""
  if jax.process_count() == 1 or not shares:
    return shares
  names = sorted(shares)
  every = multihost_utils.process_allgather(np.array([shares[n] for n in names], np.uint64))
  return dict(zip(names, (int(v) % pieces_lib.MOD for v in np.sum(every, axis=0))))


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
  """What differs, parameters first (the optimizer state mirrors them). Values are (shape,
  dtype), or (shape,) where dtypes are not compared."""
  wanted = dict(sorted(wanted.items(), key=lambda item: not item[0].startswith('params.')))
  lines = [f'{name} is {" ".join(map(str, saved[name]))} there but {" ".join(map(str, want))} '
           'here' for name, want in wanted.items() if name in saved and saved[name] != want]
  lines += [f'{name} is missing there' for name in wanted if name not in saved]
  lines += [f'{name} is there but not here' for name in saved if name not in wanted]
  return lines


def _model_differences(saved_model: dict, model_config) -> str:
  if dataclasses.is_dataclass(model_config):  # a run's ModelConfig
    model_config = dataclasses.asdict(model_config)
  changed = [f'{k} {v!r} → {model_config[k]!r}' for k, v in sorted(saved_model.items())
             if k in model_config and model_config[k] != v]
  return f'; config.model differs: {", ".join(changed)}' if changed else ''


class Checkpointer:
  """The checkpoints of one run, in `directory` (workdir/checkpoints)."""

  def __init__(self, directory: pathlib.Path, *, keep: int = 1, read_only: bool = False):
    self.directory, self.read_only = pathlib.Path(directory), read_only
    self.saving = None  # the step of the last save started
    self._own_reader = None  # see _reader
    _OPEN.add(self)
    self.manager = _manager(self.directory, max_to_keep=None if read_only else keep,
                            save_interval_steps=0 if read_only else 1, create=not read_only,
                            read_only=read_only, enable_async_checkpointing=not read_only,
                            cleanup_tmp_directories=not read_only)

  def steps(self) -> list[int]:
    """Complete checkpoints, newest first."""
    return sorted(self.manager.all_steps(), reverse=True)

  def save(self, step: int, state, data_state: dict, config_json: dict, pieces=None,
           read_out=lambda: None) -> None:
    """Start an asynchronous save; returns once the arrays are copied off the devices. A failed
    save (the last one, or this) is a Fault: the run stops rather than train on unsaved.
    `pieces`: {name: runtime.pieces.Pieces} of arrays this process never holds whole, None in
    `state` where they are; they are read in the background, and `read_out()` is called once
    they all have been (their owner may change them from then on)."""
    with self._failing_save(self.saving):  # orbax waits for the last save before the next
      self.manager.wait_until_finished()
    items = {pieces_lib.ITEM: pieces_lib.PiecesSave(pieces, read_out)} if pieces else {}
    with self._failing_save(step):
      try:
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(config_json),
            checksums=_ChecksumsSave(checksum_arrays(state)), **items),
            force=True)
      except BaseException:
        read_out()  # nothing more will read them
        raise
    self.saving = step

  def check_saved(self) -> None:
    """A Fault if the last save has failed (a full disk): called every step, cheaply (no wait,
    no collective: a save still in flight is checked at a later call)."""
    if self.saving is not None and not self.manager.is_saving_in_progress():
      with self._failing_save(self.saving):
        self.manager.wait_until_finished()  # done: returns at once, or raises its error
      self.saving = None

  @contextlib.contextmanager
  def _failing_save(self, step):
    try:
      yield
    except faults.Fault:  # the run's own (a tier's file damaged): it says what to do
      self.saving = None
      raise
    except Exception as e:
      # read from the disk: orbax's list may already leave out the one this save would replace
      whole = sorted((int(p.name) for p in self.directory.iterdir()
                      if p.name.isdigit() and int(p.name) != step), reverse=True)
      kept = (f'checkpoint {whole[0]} is whole, and the same command resumes from it once that '
              'is fixed' if whole else 'no checkpoint is whole yet')
      fault = faults.on_disk(e, where=f'config.workdir: saving checkpoint {step} to '
                                      f'{self.directory}')
      message = str(fault) if fault else (f'config.workdir: saving checkpoint {step} to '
                                          f'{self.directory} failed ({type(e).__name__}: '
                                          f'{str(e).splitlines()[0][:300]})')
      self.saving = None
      raise faults.Fault(f'{message}. The run stopped; {kept}') from None

  def saved_config(self, step: int) -> dict:
    """The config a checkpoint was written with; {} if it does not read."""
    try:
      return self.manager.restore(step, args=ocp.args.Composite(
          config=ocp.args.JsonRestore())).config or {}
    except Exception:  # a corrupted checkpoint: restore_latest reports it
      return {}

  def reads_as(self, abstract_tree, step: int, *, setting: str, model_config,
            any_dtype: bool = True, unwanted=lambda name: False) -> bool:
    """Whether checkpoint `step` reads; CheckpointMismatch if it holds other arrays than
    `abstract_tree` (a TrainState, or a subtree such as {'params': ...}): other shapes, or with
    `any_dtype` False other dtypes (restoring casts them otherwise). Saved arrays that
    `unwanted(name)` says this run leaves out (a run's adapters or draft heads, for another run
    started from its base) are not compared."""
    if not (self.directory / str(step) / 'state' / '_METADATA').is_file():
      return False  # without it orbax guesses a partial tree, which would look like another model
    try:
      saved = self._saved_arrays(step)
    except Exception:  # unreadable metadata: a corrupted or truncated checkpoint
      return False
    wanted = _arrays(abstract_tree)
    if isinstance(abstract_tree, dict):  # a subtree: the rest of the checkpoint is not wanted
      saved = {k: v for k, v in saved.items() if k.split('.')[0] in abstract_tree}
    saved = {k: v for k, v in saved.items() if k in wanted or not unwanted(k)}
    if any_dtype:
      saved, wanted = ({k: v[:1] for k, v in arrays.items()} for arrays in (saved, wanted))
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

  def restore_latest(self, abstract_state, model_config, pieces=None):
    """(step, state, data_state) of the newest checkpoint that restores intact, into the
    shardings of `abstract_state`; None when there is none. Damaged ones on the way are moved
    aside (module docstring). A checkpoint of another model is an error (starting afresh would
    in time delete it); so is having checkpoints of which none restores (check_fresh_start).
    `pieces`: {name: runtime.pieces.Pieces} this process takes a piece at a time (their fns
    put each); the state holds None there."""
    steps = self.steps()
    for step in steps:
      restored, error = None, None
      try:
        if self.reads_as(abstract_state, step, setting='config.workdir',
                         model_config=model_config):
          restored = self._restore(step, abstract_state, pieces)
        else:
          error = 'its metadata does not read'
      except CheckpointMismatch:
        raise
      except Exception as e:  # orbax raises many types for truncated or corrupted files
        error = f'{type(e).__name__}: {str(e)[:200]}'
      # Each process read its own shards. Only if all did are the checksums computed: a
      # collective, which every process must run or none.
      if _agree(error is None) and not (error := self._verify(step, restored[0], restored[2])):
        # the checksums are global, so all agree; then the dtypes this run computes in (a
        # resumed run may change model.param_dtype, or under LoRA compute_dtype, the base's)
        return step, _cast(restored[0], abstract_state), restored[1]
      where = ('left in place (read only)' if self.read_only else
               f'moved to {self._set_aside(step)}')
      warnings.warn(f'checkpoint {self.directory / str(step)} is damaged '
                    f'({error or "on another process"}); {where}; trying the one before it',
                    CheckpointWarning, stacklevel=2)
    self.check_fresh_start()
    return None

  @property
  def aside(self) -> pathlib.Path:
    """Where damaged checkpoints are moved."""
    return self.directory.parent / f'{self.directory.name}-damaged'

  def check_fresh_start(self) -> None:
    """A Fault if no checkpoint is left but damaged ones were set aside: a run from step 0 here
    would replace the metrics of the steps they reached."""
    if self.steps() or not self.aside.is_dir():
      return
    if damaged := sorted(p.name for p in self.aside.iterdir()):
      raise faults.Fault(
          f'config.workdir: every checkpoint of this run is damaged and was moved to '
          f'{self.aside} ({", ".join(damaged)}); nothing restores, so nothing was trained. Use '
          f'a new --config.workdir (with --config.init_from to start from other parameters), or '
          f'move {self.aside} away to train this one again from step 0')

  def _reader(self) -> ocp.CheckpointManager:
    """The manager that reads arrays. On a multi-process job, one for this process alone: each
    reads its own shards, without orbax's barrier after the read, which a process whose read
    fails would skip, leaving the others' next collective unmatched (restore_latest agrees
    instead)."""
    if jax.process_count() == 1:
      return self.manager
    if self._own_reader is None:
      me = jax.process_index()
      self._own_reader = _manager(
          self.directory, read_only=True, create=False, enable_async_checkpointing=False,
          cleanup_tmp_directories=False, save_interval_steps=0, max_to_keep=None,
          multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=me,
                                                                     active_processes={me}))
    return self._own_reader

  def _saved_arrays(self, step: int) -> dict[str, tuple]:
    """{name: (shape, dtype)} of every array checkpoint `step` holds, in its state item or its
    pieces (runtime/pieces.py)."""
    return {**_arrays(self.manager.item_metadata(step)['state']),
            **pieces_lib.saved(self.directory / str(step) / pieces_lib.ITEM)}

  def _restore(self, step: int, abstract_tree, pieces=None, data: bool = True):
    """(the tree as saved (its checksums are of those arrays) in `abstract_tree`'s shardings,
    the data state, this process's checksum shares of `pieces`). Arrays saved in pieces are read
    a shard at a time; `pieces` ({name: Pieces}) a chunk at a time into their fns, None in the
    tree."""
    where, pieces = self.directory / str(step), pieces or {}
    in_pieces = pieces_lib.saved(where / pieces_lib.ITEM)
    as_saved = self.as_saved(step, abstract_tree)
    orbax_part = jax.tree_util.tree_map_with_path(
        lambda path, a: None if name_of(path) in in_pieces or name_of(path) in pieces else a,
        as_saved)
    restored = self._reader().restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(
            orbax_part, ocp.checkpoint_utils.construct_restore_args(orbax_part),
            partial_restore=True), **({'data': ocp.args.JsonRestore()} if data else {})))
    got = {name_of(path): x for path, x in jax.tree_util.tree_leaves_with_path(restored.state)}

    def leaf(path, a):
      name = name_of(path)
      if name in pieces:
        return None
      return pieces_lib.fill(where, name, a) if name in in_pieces else got[name]
    tree = jax.tree_util.tree_map_with_path(leaf, as_saved)
    return tree, restored.data if data else None, pieces_lib.restore(where, pieces)

  def as_saved(self, step: int, abstract_tree):
    """`abstract_tree` with the dtypes checkpoint `step` saved its arrays in."""
    saved = self._saved_arrays(step)
    return jax.tree_util.tree_map_with_path(
        lambda path, a: jax.ShapeDtypeStruct(a.shape, saved[name_of(path)][1],
                                             sharding=a.sharding), abstract_tree)

  def _verify(self, step: int, tree, piece_sums: dict | None = None) -> str | None:
    """None if `tree` (a state, or a part of one such as {'params': ...}; None where its arrays
    were read in pieces, whose checksum shares are `piece_sums`) has the checksums saved with it,
    else what differs. (A checkpoint from before checksums were saved cannot be verified, and is
    accepted.)"""
    where = self.directory / str(step)
    if not (where / 'checksums').exists():
      return None
    saved = {**self.manager.restore(step, args=ocp.args.Composite(
        checksums=_ChecksumsRestore())).checksums,
             **pieces_lib.saved_checksums(where / pieces_lib.ITEM)}
    restored = {**checksums(tree), **_summed(piece_sums or {})}
    changed = [name for name, value in restored.items() if saved.get(name) != value]
    if changed:
      return (f'{len(changed)} of {len(restored)} arrays differ from their checksums: '
              f'{", ".join(changed[:3])}{", …" if len(changed) > 3 else ""}')
    return None

  def _set_aside(self, step: int) -> pathlib.Path:
    """Moves checkpoint `step` to checkpoints-damaged/ (process 0; the others wait), so that
    this step can be saved again; returns where it went."""
    aside = self.aside
    where = aside / str(step)
    if jax.process_index() == 0:
      aside.mkdir(exist_ok=True)
      if where.exists():  # damaged before, at the same step
        where = aside / f'{step}-{time.strftime("%Y%m%d-%H%M%S")}'
      (self.directory / str(step)).rename(where)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f'meshlm: checkpoint {step} set aside')
    self.manager.reload()
    if self._own_reader is not None:
      self._own_reader.reload()
    return where

  def close(self) -> None:
    """Wait for the save in flight, then release orbax's threads."""
    _OPEN.discard(self)
    try:
      with self._failing_save(self.saving):
        self.manager.wait_until_finished()
    finally:
      self.manager.close()
      if self._own_reader is not None:
        self._own_reader.close()


_OPEN = weakref.WeakSet()  # Checkpointers not closed yet


def close_all() -> None:
  """Closes every Checkpointer still open: an entry point's last act, so that no orbax thread is
  left to fail at interpreter shutdown after the program's own last line."""
  for checkpointer in list(_OPEN):
    try:
      checkpointer.close()
    except Exception:  # the program is already ending with its own error
      pass


TRAINED_ON = {  # what a run trains with beyond its settings: what it was, where it comes from
    'tokenizer': ('tokenizer', 'config.data.tokenizer_model'),
    'chat_template': ('chat template', 'config.data.chat_template'),
    'corpus': ('corpus (a hash of its documents)', 'config.data.paths'),
}


def check_resume(saved_config: dict, settings: dict, checkpoint: pathlib.Path,
                 trained_on: dict | None = None) -> None:
  """ValueError naming the settings a resumed run keeps (configs/effects.py: KEPT_ON_RESUME, the
  kinds configs/base.py declares them) that differ, in the run's `settings` (Run.as_dict), from
  the config `checkpoint` was saved with (their mesh as laid out, where both hold its
  'mesh_shape'); or, of `trained_on` (TRAINED_ON's: what the run reads now), what differs from
  what it read."""
  if 'mesh_shape' in saved_config and 'mesh_shape' in settings:  # the sizes -1 stood for
    saved_config, settings = (
        {**c, 'mesh': {**c['mesh'], **c['mesh_shape']}} for c in (saved_config, settings))
  changed = effects.changed(saved_config, settings, effects.KEPT_ON_RESUME)
  if changed:  # a setting first: the change the user made, named
    _refuse_changed(changed, checkpoint, saved_config)
  saved_files = saved_config.get('trained_on') or {}
  for key, now in (trained_on or {}).items():
    if saved_files.get(key) and now != saved_files[key]:  # '': not known then
      what, setting = TRAINED_ON[key]
      raise ValueError(
          f'{setting}: the {what} is {now or "unknown"} now, but checkpoint {checkpoint} was '
          f'trained on {saved_files[key]}; a resumed run reads on where its data stream stopped, '
          'which only the same continues. Put the files back as they were, or start another run '
          f'with another --config.workdir (and --config.init_from={checkpoint.parent.parent})')


def _refuse_changed(changed, checkpoint: pathlib.Path, saved_config: dict):
  kinds = sorted({effects.kind_of(field, saved_config) for field, _, _ in changed})
  named = '; '.join(f'config.{field}={now!r}, but checkpoint {checkpoint} was trained with '
                    f'{before!r}' if i == 0 else f'config.{field}={now!r} (was {before!r})'
                    for i, (field, before, now) in enumerate(changed[:3]))
  more = f' (and {len(changed) - 3} more)' if len(changed) > 3 else ''
  why = sorted({base.DEPENDS[field][2] for field, _, _ in changed
                if effects.kind_of(field, saved_config) != base.EFFECTS[field]})
  raise ValueError(
      f'{named}{more}; a resumed run keeps its {" and ".join(kinds)} settings (configs/base.py: '
      f'EFFECTS{"; DEPENDS: " + ", ".join(why) if why else ""}). Set it back, or start another '
      f'run with another --config.workdir (and --config.init_from={checkpoint.parent.parent} to '
      'start from its parameters)')


def saved_steps(workdir: str) -> list[int]:
  """The steps a workdir's checkpoints/ holds, read without orbax (nothing is created)."""
  directory = pathlib.Path(workdir).expanduser() / 'checkpoints'
  return sorted(int(p.name) for p in directory.glob('*') if p.name.isdigit() and p.is_dir())


def recorded_trained_on(workdir: str) -> dict:
  """What the newest checkpoint of the run in `workdir` records it trained with (TRAINED_ON's
  fingerprints); {} where it has none that reads. Read as the JSON file orbax writes the config
  item to, without orbax: settings are resolved before the job's processes join, and nothing may
  touch a device before then (runtime/distributed.py)."""
  if not (steps := saved_steps(workdir)):
    return {}
  newest = pathlib.Path(workdir).expanduser() / 'checkpoints' / str(steps[-1])
  item = newest / 'config' / 'metadata'
  try:
    return json.loads(item.read_text()).get('trained_on') or {}
  except (OSError, ValueError, AttributeError):  # damaged, or written otherwise: not known
    return {}


def step_directory(path: str, setting: str = 'config.init_from',
                   step: int | None = None) -> tuple[pathlib.Path, int]:
  """(checkpoints dir, step) for `setting`: a run's workdir (its newest checkpoint, or `step`), its
  checkpoints/ dir, or one checkpoints/<step> dir."""
  path = pathlib.Path(path).expanduser()
  if path.name.isdigit() and (path / 'state').is_dir() and step is None:
    return path.parent, int(path.name)
  for directory in (path / 'checkpoints', path):
    if directory.is_dir():
      checkpointer = Checkpointer(directory, read_only=True)
      steps = checkpointer.steps()
      checkpointer.close()
      if steps and step is None:
        return directory, steps[0]
      if steps and step in steps:
        return directory, step
      if steps:
        raise ValueError(f'--step={step}: {directory} holds checkpoints of steps '
                         f'{sorted(steps)}; give one of them')
  raise ValueError(f'{setting}={str(path)!r} holds no checkpoint; give a run\'s workdir, its '
                   'checkpoints/ dir, or one checkpoints/<step> dir')


def saved_run(path: str, setting: str = 'config.init_from') -> tuple[dict, pathlib.Path]:
  """(the config the checkpoint at `path` (step_directory's) was saved with, {} if it does not
  read; its run's workdir)."""
  directory, step = step_directory(path, setting)
  checkpointer = Checkpointer(directory, read_only=True)
  try:
    return checkpointer.saved_config(step), directory.parent
  finally:
    checkpointer.close()


def _init_from(path: str, abstract_params, model_config, setting: str = 'config.init_from',
               unwanted=lambda name: False):
  """The read-only Checkpointer, step and wanted tree of `setting` (config.init_from), checked
  (`unwanted`: Checkpointer.reads_as's)."""
  directory, step = step_directory(path, setting)
  checkpointer, wanted = Checkpointer(directory, read_only=True), {'params': abstract_params}
  if not checkpointer.reads_as(wanted, step, setting=setting, model_config=model_config,
                            unwanted=unwanted):
    checkpointer.close()
    raise ValueError(f'{setting}: checkpoint {directory / str(step)} is damaged (its metadata '
                     f'does not read); it is left as it is. {_others(checkpointer, step)}')
  # Read as saved (the checksums are of those arrays), cast after: a run may start from
  # another's parameters in another dtype (LoRA's base is frozen in the compute dtype).
  return checkpointer, step, checkpointer.as_saved(step, wanted)


def _cast(tree, abstract_tree):
  """`tree`'s arrays in `abstract_tree`'s dtypes (in place where they already are; None where
  they were read in pieces)."""
  return jax.tree.map(lambda a, x: x if x is None or x.dtype == a.dtype else x.astype(a.dtype),
                      abstract_tree, tree)


def _others(checkpointer: Checkpointer, step: int) -> str:
  others = [s for s in checkpointer.steps() if s != step]
  return (f'The run has checkpoints {others} too: give one of them ({checkpointer.directory}/STEP)'
          if others else 'The run has no other checkpoint')


def check_init_from(path: str, abstract_params, model_config, unwanted=lambda name: False) -> None:
  """CheckpointMismatch (or ValueError) unless `path` holds parameters of this model."""
  _init_from(path, abstract_params, model_config, unwanted=unwanted)[0].close()


def restore_params(path: str, abstract_params, model_config, setting: str = 'config.init_from',
                   unwanted=lambda name: False):
  """The parameters alone of the checkpoint at `path` (see step_directory), into the shardings
  of `abstract_params`, and the step directory they came from: a new run's starting point, with
  a fresh optimizer and step 0, or what sample.py and export.py read. Parameters that differ from
  the checksums saved with them are refused, `setting` named, the checkpoint left as it is."""
  checkpointer, step, wanted = _init_from(path, abstract_params, model_config, setting, unwanted)
  try:
    try:
      restored = checkpointer._restore(step, wanted, data=False)[0]
      error = None
    except Exception as e:  # orbax raises many types for truncated or corrupted files
      error = f'{type(e).__name__}: {str(e).splitlines()[0][:200]}'
    if not _agree(error is None):  # as restore_latest: all processes verify, or none
      error = error or 'on another process'
    else:
      error = checkpointer._verify(step, {'params': restored['params']})
    if error:
      raise ValueError(f'{setting}: checkpoint {checkpointer.directory / str(step)} is damaged '
                       f'({error}); it is left as it is. {_others(checkpointer, step)}')
    params = _cast(restored['params'], abstract_params)
    return params, checkpointer.directory / str(step)
  finally:
    checkpointer.close()
