"""Checkpoints and fault tolerance: a run killed with SIGKILL (or stopped by SIGTERM) and restarted
matches an uninterrupted one exactly (a second signal, a stop on an evaluation step or at the
last step: tests/test_faults.py's cases, their one home); checkpoints restore under other meshes; a corrupted newest checkpoint falls back to the previous;
another model's checkpoint is a clear error before training; non-finite steps are skipped and
counted, and too many in a row stop the run with its last good checkpoint intact."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime import checkpoint, pieces
from runtime.checkpoint import (Checkpointer, CheckpointMismatch, CheckpointWarning,
                                checksums, restore_params)
from tests.conftest import SMALL_CORPUS, tiny_config, with_file_size_limit
from training import loop
from training import settings
from training.state import build, initial_state

REPO = pathlib.Path(__file__).resolve().parents[1]
STEPS = 20  # 4 checkpoints; a signal at step 12 or 13 lands between two


def command(workdir):
  return [sys.executable, 'train.py', '--config=configs/base.py', f'--config.workdir={workdir}',
          f'--config.train_steps={STEPS}', '--config.checkpoint_every=5', '--config.log_every=1',
          '--config.eval_every=0', f'--config.data.paths={SMALL_CORPUS}',
          '--config.data.validation_fraction=0.1', '--config.seed=4']


ENV = {**os.environ, 'PYTHONUNBUFFERED': '1'}


def run_to_end(workdir):
  result = subprocess.run(command(workdir), cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=ENV)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


def start(workdir):
  """train.py in a subprocess, its stdout and stderr as one stream of lines."""
  return subprocess.Popen(command(workdir), cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=ENV)


def read_until(process, prefix):
  seen = []
  for line in process.stdout:
    if line.startswith(prefix):
      return line
    seen.append(line)
  raise AssertionError(f'the run ended before printing {prefix!r}:\n{"".join(seen[-80:])}')


def metrics(workdir):
  records = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  return {r['step']: (r['loss'], r['grad_norm'], r['learning_rate']) for r in records}


def base_config():
  from configs import base
  config = base.get_config()  # as the runs built it: 8 devices, fsdp=-1
  config.model.vocab_size = 384
  return config


def latest(workdir, config=None):
  config = config or base_config()
  return Checkpointer(workdir / 'checkpoints').restore_latest(build(settings.resolve(config)).abstract_state,
                                                             config.model)


def final_params(workdir):
  step, state, _ = latest(workdir)
  assert step == STEPS
  return state.params


def assert_same_as_uninterrupted(workdir, straight):
  ours, reference = metrics(workdir), metrics(straight)
  assert sorted(ours) == list(range(1, STEPS + 1))  # steps after the checkpoint are logged once
  assert ours == reference  # bit for bit
  for a, b in zip(jax.tree.leaves(final_params(workdir)), jax.tree.leaves(final_params(straight))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture(scope='module')
def straight(tmp_path_factory):
  """The reference: STEPS steps without interruption."""
  workdir = tmp_path_factory.mktemp('straight')
  run_to_end(workdir)
  return workdir


@pytest.mark.integration
def test_sigkill_then_restart_continues_exactly_as_an_uninterrupted_run(tmp_path, straight):
  process = start(tmp_path)
  read_until(process, 'step 13/')  # checkpoints 5 and 10 were started by now
  process.send_signal(signal.SIGKILL)
  process.wait(timeout=60)
  assert process.returncode == -signal.SIGKILL
  resumed = run_to_end(tmp_path)
  assert 'resuming from step ' in resumed
  assert_same_as_uninterrupted(tmp_path, straight)


@pytest.mark.integration
def test_sigterm_saves_at_the_step_reached_and_exits_0_then_resumes_exactly(tmp_path, straight):
  process = start(tmp_path)
  read_until(process, 'step 12/')
  process.send_signal(signal.SIGTERM)
  stopped = read_until(process, 'stopped by SIGTERM after step ')
  assert process.wait(timeout=60) == 0
  step = int(stopped.split('after step ')[1].split(';')[0])
  assert 12 <= step < STEPS and step % 5  # not a regular checkpoint step: saved for the signal
  assert latest(tmp_path)[0] == step
  assert f'resuming from step {step} ' in run_to_end(tmp_path)
  assert_same_as_uninterrupted(tmp_path, straight)


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


@pytest.mark.integration
def test_sample_export_and_init_from_refuse_parameters_that_fail_their_checksums(tmp_path):
  """Bytes changed inside the array files restore without an error from orbax. sample.py,
  export.py and config.init_from read only the parameters, and verify them as a resume does:
  each stops with one line naming the checkpoint and the steps left, before it writes anything
  (an export) or trains a step (init_from)."""
  run = tmp_path / 'run'
  loop.run(tiny_run(run, train_steps=4))
  noise = np.random.default_rng(0)
  for f in array_files(run / 'checkpoints' / '4'):
    if f.stat().st_size > 100_000:  # array chunks, not the index's nodes: 64 bytes every 8 KiB
      data = bytearray(f.read_bytes())
      for at in range(4096, len(data) - 64, 8192):
        data[at:at + 64] = noise.bytes(64)
      f.write_bytes(bytes(data))
  setup = build(settings.resolve(tiny_run(run)))
  restored = Checkpointer(run / 'checkpoints', read_only=True)
  assert 'arrays differ from their checksums' in restored._verify(
      4, restored._restore(4, setup.abstract_state)[0])
  restored.close()
  commands = {
      'sample': [sys.executable, 'sample.py', f'--workdir={run}', '--prompt=x',
                 '--max_new_tokens=4'],
      'export': [sys.executable, 'export.py', f'--workdir={run}', f'--output={tmp_path / "hf"}'],
      'train': [sys.executable, 'train.py', '--config=configs/base.py', f'--config.init_from={run}',
                f'--config.workdir={tmp_path / "new"}', '--config.model.d_ff=128',
                '--config.model.compute_dtype=float32',  # tiny_config's model and data
                f'--config.data.paths={SMALL_CORPUS}', '--config.data.validation_fraction=0.1'],
  }
  processes = {name: subprocess.Popen(args, cwd=REPO, text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE) for name, args in commands.items()}
  for name, process in processes.items():
    _, err = process.communicate(timeout=300)
    lines = [line for line in err.splitlines() if line.strip()]
    assert process.returncode == 2 and len(lines) == 1, (name, err[-3000:])
    assert re.match(rf'error: (--workdir|config.init_from): checkpoint {run}/checkpoints/4 is '
                    r'damaged \(\d+ of \d+ arrays differ from their checksums: params\.', lines[0])
    assert 'The run has checkpoints [2] too' in lines[0], lines[0]
  assert not (tmp_path / 'hf').exists()
  new = tmp_path / 'new'  # read after compiling: the new run stops before its first step
  assert not (new / 'metrics.jsonl').exists() and not list((new / 'checkpoints').glob('*'))
  assert (run / 'checkpoints' / '4').is_dir()  # left as it is
  for f in array_files(run / 'checkpoints' / '4'):  # the index too: its metadata does not read
    f.write_bytes(f.read_bytes()[:f.stat().st_size // 3])
  with pytest.raises(ValueError, match=r'--workdir: checkpoint .*/checkpoints/4 is damaged \(its '
                                       r'metadata does not read\); it is left as it is. The run '
                                       r'has checkpoints \[2\] too'):
    restore_params(str(run), setup.abstract_state.params, tiny_run(run).model, setting='--workdir')


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


def stderr_lines(result) -> list[str]:
  return [line for line in result.stderr.splitlines() if line.strip()]


@pytest.mark.integration
def test_the_non_finite_stop_of_train_py_is_its_warnings_and_one_line(tmp_path):
  """A learning rate of 1e30 is finite, so it is accepted; from step 2 on every step is skipped,
  and the stop reads as the steps' warnings and one error line (exit 2), no traceback."""
  result = subprocess.run(command(tmp_path) + [
      '--config.optimizer.learning_rate=1e30', '--config.optimizer.warmup_steps=0',
      '--config.max_bad_steps=2'], cwd=REPO, capture_output=True, text=True, timeout=600, env=ENV)
  lines = stderr_lines(result)
  assert result.returncode == 2, result.stderr[-3000:]
  assert lines == ['warning: step 2: the loss or gradient is not finite; the step was skipped',
                   'warning: step 3: the loss or gradient is not finite; the step was skipped',
                   lines[-1]], result.stderr[-3000:]
  assert lines[-1].startswith('error: steps 2..3: 2 steps in a row had a non-finite loss or '
                              'gradient (config.max_bad_steps=2); no checkpoint was saved.')


@pytest.mark.integration
def test_a_save_the_disk_refuses_stops_the_run_with_one_line_and_the_next_run_is_whole(tmp_path,
                                                                                       straight):
  """The first save's array files are past the limit (the prepared data, the compiled programs
  in the cache and the run's other files are not): the save fails in orbax's background thread,
  and the run stops at once, one line, exit 2, rather than train on with nothing saved. The next
  run, with room, clears the unfinished save and trains exactly as an uninterrupted run."""
  # The state is some 1.8 MB, which a save writes in as many files as its writers' timing makes
  # (1.1 MB, 640 kB and 35 kB here): with a limit of 300 kB, one save under load fitted whole and
  # the second failed instead. The largest other file is the cache's train step, some 230 kB,
  # compiled by `straight` with the same command, so this run only reads it.
  result = subprocess.run(with_file_size_limit(100_000, command(tmp_path)), cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=ENV)
  lines = stderr_lines(result)
  assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
  assert lines[0] == (f'error: config.workdir: saving checkpoint 5 to {tmp_path}/checkpoints: '
                      'File too large; raise the file size limit (ulimit -f), or write somewhere '
                      'else. The run stopped; no checkpoint is whole yet')
  logged = [json.loads(line)['step'] for line in (tmp_path / 'metrics.jsonl').open()]
  assert 5 <= logged[-1] <= 7  # stopped within the save's time, not at the end
  assert Checkpointer(tmp_path / 'checkpoints').steps() == []
  assert 'resuming' not in run_to_end(tmp_path)
  assert_same_as_uninterrupted(tmp_path, straight)


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
