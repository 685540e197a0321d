"""Checkpoints and fault tolerance: checkpoints restore under other meshes; a corrupted newest
checkpoint falls back to the previous; another model's checkpoint is a clear error before
training; non-finite steps are skipped and counted, and too many in a row stop the run with its
last good checkpoint intact. A run stopped by a signal, killed, or refused a save by a full disk,
then resumed, trains as an uninterrupted one bit for bit; damaged checkpoints are refused by
every reader: tests/test_faults.py's cases, their one home."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime import checkpoint, pieces
from runtime.checkpoint import (Checkpointer, CheckpointMismatch, CheckpointWarning,
                                checksums)
from tests.conftest import tiny_config
from training import loop
from training import settings
from training.state import build, initial_state


@pytest.mark.integration
def test_restore_under_other_meshes_and_fall_back_past_a_corrupted_checkpoint(tmp_path):
  config = tiny_config(fsdp=8)
  saved_setup = build(settings.resolve(config))
  state = saved_setup.init_state()
  checkpointer = Checkpointer(tmp_path, keep=3)
  for step in (1, 2):
    checkpointer.save(step, state, {'rows': [step]}, {})
  checkpointer.close()
  expected = jax.tree.leaves(state.params)

  for mesh, devices in ((dict(fsdp=4, tensor=2), jax.devices()), ({}, jax.devices()[:1])):
    target = build(settings.resolve(tiny_config(**mesh), devices))
    step, restored, data = Checkpointer(tmp_path).restore_latest(target.abstract_state,
                                                                 config.model)
    assert step == 2 and data == {'rows': [2]}
    for a, b, want in zip(jax.tree.leaves(restored.params), expected,
                          jax.tree.leaves(target.state_shardings.params)):
      assert a.sharding == want  # straight into the target shardings
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  for f in (tmp_path / '2' / 'state').rglob('*'):
    if f.is_file() and f.stat().st_size > 0:
      f.write_bytes(b'\0' * 7)  # truncated and corrupted
  with pytest.warns(CheckpointWarning, match=f'{tmp_path.name}/2 is damaged'):
    step, _, data = Checkpointer(tmp_path).restore_latest(saved_setup.abstract_state,
                                                          config.model)
  assert step == 1 and data == {'rows': [1]}




def array_files(checkpoint):
  """The files holding a checkpoint's array data, largest first."""
  files = [f for f in (checkpoint / 'state').rglob('*') if f.is_file() and '/d/' in str(f)]
  return sorted(files, key=lambda f: f.stat().st_size, reverse=True)


@pytest.mark.integration
def test_a_damaged_newest_checkpoint_is_set_aside_and_its_step_saved_again(tmp_path):
  """Truncated array files: the run resumes from the checkpoint before, keeps the damaged one in
  checkpoints-damaged/, and saves that step afresh (before, its save failed on every run)."""
  loop.run(tiny_run(tmp_path, train_steps=4))
  for f in array_files(tmp_path / 'checkpoints' / '4'):
    f.write_bytes(f.read_bytes()[:len(f.read_bytes()) // 3])
  with pytest.warns(CheckpointWarning, match=r'checkpoints/4 is damaged .*moved to .*'
                                             r'checkpoints-damaged/4'):
    records = loop.run(tiny_run(tmp_path, train_steps=6))
  assert [r['step'] for r in records if 'loss' in r] == [3, 4, 5, 6]
  assert Checkpointer(tmp_path / 'checkpoints').steps() == [6, 4, 2]
  assert array_files(tmp_path / 'checkpoints-damaged' / '4')  # kept for a person to look at


def test_checksums_do_not_depend_on_the_sharding():
  state = build(settings.resolve(tiny_config(fsdp=8))).init_state()
  other = jax.device_put(state, build(settings.resolve(tiny_config(fsdp=4, tensor=2))).state_shardings)
  from runtime.checkpoint import checksums
  assert checksums(state) == checksums(other)
  flipped = state.replace(params=jax.tree.map(lambda x: x.at[(0,) * x.ndim].add(1.0),
                                              state.params))
  assert all(checksums(flipped)[k] != v for k, v in checksums(state).items()
             if k.startswith('params.'))


@pytest.mark.integration
def test_a_checkpoint_whose_metadata_is_missing_is_damage_not_another_model(tmp_path):
  loop.run(tiny_run(tmp_path, train_steps=4))
  (tmp_path / 'checkpoints' / '4' / 'state' / '_METADATA').unlink()
  with pytest.warns(CheckpointWarning, match=r'checkpoints/4 is damaged'):
    records = loop.run(tiny_run(tmp_path, train_steps=6))
  assert records[0]['step'] == 3


def tiny_run(workdir, **changes):
  c = tiny_config(fsdp=8)
  c.workdir, c.eval_every, c.log_every, c.checkpoint_every = str(workdir), 0, 1, 2
  c.update(changes)
  return c


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """A tiny run's workdir, 4 steps, checkpoints at 2 and 4."""
  workdir = tmp_path_factory.mktemp('trained')
  loop.run(tiny_run(workdir, train_steps=4))
  return workdir


def test_another_models_checkpoint_is_a_clear_error_before_training(trained):
  before = (trained / 'metrics.jsonl').read_text()
  other = tiny_run(trained, train_steps=6)
  other.model.d_model = 32
  with pytest.raises(ValueError, match=r'config.model.d_model=32, but checkpoint .*/4 was trained '
                                       r'with 64; a resumed run keeps its shape settings'):
    loop.run(other)  # the setting named, before the arrays are compared
  other = tiny_run(trained, train_steps=6)
  other.model.vocab_size = 512
  with pytest.raises(ValueError, match='config.model.vocab_size=512, but .* trained with 384'):
    loop.run(other)
  with pytest.raises(CheckpointMismatch, match=r'params.embed.value is \(384, 64\) there but '
                                               r'\(512, 64\) here'):  # the arrays, as named
    Checkpointer(trained / 'checkpoints').reads_as(build(settings.resolve(other)).abstract_state, 4,
                                                setting='config.workdir', model_config=other.model)
  assert (trained / 'metrics.jsonl').read_text() == before  # nothing trained, nothing written
  assert Checkpointer(trained / 'checkpoints').steps() == [4, 2]


@pytest.mark.parametrize('field,value', [('seed', 5), ('batch_size', 16), ('data.paths', 'stdlib'),
                                         ('model.rope_theta', 5e5)])
def test_a_resumed_run_that_changes_its_data_or_model_is_refused_before_compiling(
    trained, monkeypatch, field, value):
  def compile_and_plan(*args):
    raise AssertionError('compiled before the settings were checked')
  monkeypatch.setattr(loop, 'compile_and_plan', compile_and_plan)
  before = (trained / 'metrics.jsonl').read_text()
  changed = tiny_run(trained, train_steps=6)
  section, _, name = field.rpartition('.')
  (changed[section] if section else changed)[name] = value
  with pytest.raises(ValueError, match=rf'config.{field}={value!r}, but checkpoint .*/4 was '
                                       r'trained with .*; a resumed run keeps'):
    loop.run(changed)
  assert (trained / 'metrics.jsonl').read_text() == before


def test_init_from_takes_the_parameters_only(trained, tmp_path):
  config = tiny_run(tmp_path, init_from=str(trained))
  setup = build(settings.resolve(config))
  step, state, data = initial_state(setup, None, log=lambda *_: None)
  _, saved, _ = Checkpointer(trained / 'checkpoints').restore_latest(setup.abstract_state,
                                                                   config.model)
  assert step == 0 and data is None and int(state.step) == 0 and int(saved.step) == 4
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(saved.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  fresh = setup.init_state()
  for a, b in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(fresh.opt_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # a fresh optimizer
  with pytest.raises(ValueError, match='config.init_from=.* holds no checkpoint'):
    loop.run(tiny_run(tmp_path / 'b', init_from=str(tmp_path / 'nowhere')))


def poison(steps):
  """Wraps the loop's training batches: the batches of `steps` (1-based) get NaN weights."""
  real = loop.pipeline.train_batches

  def train_batches(*args, **kwargs):
    batches = real(*args, **kwargs)
    step = 0

    class Poisoned:
      state, close = batches.state, batches.close

      def __next__(self):
        nonlocal step
        step += 1
        batch = next(batches)
        if step in steps:
          batch['weights'] = batch['weights'] * jnp.float32('nan')
        return batch
    return Poisoned()
  return train_batches


@pytest.mark.integration
def test_a_non_finite_step_is_skipped_and_counted_and_the_run_goes_on(tmp_path, monkeypatch):
  monkeypatch.setattr(loop.pipeline, 'train_batches', poison({3}))
  with pytest.warns(RuntimeWarning, match='step 3: the loss or gradient is not finite'):
    records = loop.run(tiny_run(tmp_path, train_steps=6, max_bad_steps=2))
  assert [r['bad_steps'] for r in records] == [0, 0, 1, 1, 1, 1]
  assert np.isnan(records[2]['loss']) and np.isfinite(records[-1]['loss'])


@pytest.mark.integration
@pytest.mark.parametrize('precision', ['default', 'fp8'])
def test_skipped_step_leaves_parameters_and_optimizer_state_as_they_were(small_corpus,
                                                                          precision):
  from training import programs
  config = tiny_config(fsdp=8)
  config.model.matmul_precision = precision  # fp8: a NaN gradient's scale is NaN, never inf
  setup = build(settings.resolve(config))
  state = setup.init_state()
  train_step = programs.compile_train_step(setup, config.batch_size, config.seq_len, 0.0)
  batch = {k: jnp.zeros(x.shape, x.dtype, device=x.sharding)
           for k, x in programs.abstract_batch(setup.mesh, config.batch_size,
                                               config.seq_len).items()}
  batch['weights'] = jnp.full_like(batch['weights'], jnp.nan)
  before = jax.tree.map(np.asarray, (state.params, state.opt_state))
  after, metrics = train_step(state, batch)
  assert bool(metrics['skipped']) and int(after.bad_steps) == 1 and int(after.step) == 1
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves((after.params, after.opt_state))):
    np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.integration
def test_max_bad_steps_in_a_row_stop_the_run_keeping_the_last_good_checkpoint(tmp_path,
                                                                                monkeypatch):
  monkeypatch.setattr(loop.pipeline, 'train_batches', poison({3, 4}))
  with pytest.raises(FloatingPointError, match=r'steps 3..4: 2 steps in a row .*'
                     r'config.max_bad_steps=2.*last good checkpoint, step 2'), \
       pytest.warns(RuntimeWarning):
    loop.run(tiny_run(tmp_path, train_steps=8, max_bad_steps=2))
  assert Checkpointer(tmp_path / 'checkpoints').steps() == [2]  # nothing saved after step 2


@pytest.mark.integration
def test_no_checkpoint_is_saved_from_a_bad_streak_and_the_good_one_is_kept(tmp_path,
                                                                          monkeypatch):
  """Steps 3–5 not finite, a checkpoint due every 2 steps and only one kept: step 4's is not
  saved (it would follow skipped steps, and rotation would delete step 2's), and the error
  names step 2's."""
  monkeypatch.setattr(loop.pipeline, 'train_batches', poison({3, 4, 5}))
  with pytest.raises(FloatingPointError, match=r'steps 3..5: 3 steps in a row .*last good '
                                               r'checkpoint, step 2'), \
       pytest.warns(RuntimeWarning):
    loop.run(tiny_run(tmp_path, train_steps=8, max_bad_steps=3, keep_checkpoints=1))
  assert Checkpointer(tmp_path / 'checkpoints').steps() == [2]


@pytest.mark.integration
def test_a_save_due_in_a_bad_streak_waits_for_the_next_finite_step(tmp_path, monkeypatch):
  monkeypatch.setattr(loop.pipeline, 'train_batches', poison({3, 4}))
  with pytest.warns(RuntimeWarning):
    loop.run(tiny_run(tmp_path, train_steps=6, max_bad_steps=3, keep_checkpoints=5))
  assert Checkpointer(tmp_path / 'checkpoints').steps() == [6, 5, 2]


@pytest.mark.integration
def test_a_crash_before_the_first_checkpoint_leaves_no_duplicate_metrics(tmp_path, monkeypatch):
  """The first run dies at step 4 with nothing saved; the next starts from step 0 and must not
  keep the dead run's records beside its own: not in metrics.jsonl, nor in what TensorBoard
  shows of the event files both runs wrote."""
  from tensorboard.backend.event_processing import event_accumulator
  real = loop.pipeline.train_batches

  def crashing(*args, **kwargs):
    batches, served = real(*args, **kwargs), [0]

    class Crashing:
      state, close = batches.state, batches.close

      def __next__(self):
        served[0] += 1
        if served[0] == 4:
          raise RuntimeError('the machine went away')
        return next(batches)
    return Crashing()

  monkeypatch.setattr(loop.pipeline, 'train_batches', crashing)
  with pytest.raises(RuntimeError, match='went away'):
    loop.run(tiny_run(tmp_path, train_steps=6, checkpoint_every=5))
  assert Checkpointer(tmp_path / 'checkpoints').steps() == []
  monkeypatch.setattr(loop.pipeline, 'train_batches', real)
  loop.run(tiny_run(tmp_path, train_steps=6, checkpoint_every=5))
  logged = [json.loads(l) for l in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  assert [r['step'] for r in logged] == [1, 2, 3, 4, 5, 6]
  events = event_accumulator.EventAccumulator(str(tmp_path), size_guidance={'scalars': 0})
  events.Reload()
  shown = [(e.step, e.value) for e in events.Scalars('learning_rate')]
  assert [step for step, _ in shown] == [1, 2, 3, 4, 5, 6]
  assert [value for _, value in shown] == pytest.approx([r['learning_rate'] for r in logged])


@pytest.mark.integration
def test_a_resumed_run_names_each_schedule_setting_it_changed(tmp_path, capsys):
  config = tiny_config(fsdp=-1)
  config.workdir, config.train_steps, config.checkpoint_every, config.eval_every = (
      str(tmp_path), 2, 2, 0)
  loop.run(config)
  # What settings.resolve reads before the job's processes join: the newest checkpoint's record.
  assert checkpoint.recorded_trained_on(str(tmp_path))['tokenizer'] == 'byte-1'
  config.train_steps, config.optimizer.learning_rate, config.loss.z_loss = 3, 1e-3, 0.0
  capsys.readouterr()
  loop.run(config)
  assert ("from step 2 on, the schedule differs from its checkpoint's: config.train_steps 2 → 3, "
          "config.optimizer.learning_rate 0.003 → 0.001, config.loss.z_loss 0.0001 → 0.0\n"
          ) in capsys.readouterr().out


@pytest.mark.parametrize('shape, dtype, cut', [((6, 10, 12), np.float32, (2, 5, 6)),
                                               ((16, 24), jnp.bfloat16, (4, 24)),
                                               ((), np.int32, ())])
def test_the_checksum_shares_of_an_arrays_pieces_add_up_to_its_checksum(shape, dtype, cut):
  """runtime/pieces.py sums each piece's share of an array's checksum on the host, a chunk of rows
  at a time, without the whole array: the shares add up to the devices' checksum of it."""
  x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
  total = 0
  for corner in np.ndindex(*(n // c for n, c in zip(shape, cut))):
    index = tuple(slice(i * c, (i + 1) * c) for i, c in zip(corner, cut))
    piece = x[index]
    for start in range(0, max(1, piece.shape[0] if shape else 1), 3):  # chunks of up to 3 rows
      rows = piece[start:start + 3] if shape else piece
      total += pieces.checksum_rows(rows, index, shape, start)
  assert total % 2**32 == checksums({'x': jnp.asarray(x)})['x']
