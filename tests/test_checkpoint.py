"""Checkpoints: a run killed with SIGKILL and restarted matches an uninterrupted one exactly;
checkpoints restore under other meshes; a corrupted newest checkpoint falls back to the previous."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.conftest import SMALL_CORPUS, tiny_config
from training.checkpoint import Checkpointer, CheckpointWarning
from training.state import build

REPO = pathlib.Path(__file__).resolve().parents[1]
STEPS = 40


def command(workdir):
  return [sys.executable, 'train.py', '--config=configs/base.py', f'--config.workdir={workdir}',
          f'--config.train_steps={STEPS}', '--config.checkpoint_every=5', '--config.log_every=1',
          '--config.eval_every=0', f'--config.data.paths={SMALL_CORPUS}',
          '--config.data.validation_fraction=0.1', '--config.seed=4']


def run_to_end(workdir):
  result = subprocess.run(command(workdir), cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, 'PYTHONUNBUFFERED': '1'})
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


def metrics(workdir):
  records = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  return {r['step']: (r['loss'], r['grad_norm'], r['learning_rate']) for r in records}


def final_params(workdir):
  from configs import base
  config = base.get_config()  # as the runs built it: 8 devices, fsdp=-1
  config.model.vocab_size = 384
  step, state, _ = Checkpointer(workdir, keep=3).restore_latest(build(config).abstract_state)
  assert step == STEPS
  return state.params


def test_sigkill_then_restart_continues_exactly_as_an_uninterrupted_run(tmp_path):
  straight = tmp_path / 'straight'
  run_to_end(straight)

  killed = tmp_path / 'killed'
  process = subprocess.Popen(command(killed), cwd=REPO, stdout=subprocess.PIPE, text=True,
                             stderr=subprocess.DEVNULL, env={**os.environ, 'PYTHONUNBUFFERED': '1'})
  for line in process.stdout:
    if line.startswith('step 25/'):  # checkpoints 5, 10, 15, 20 were started by now
      process.send_signal(signal.SIGKILL)
      break
  process.wait(timeout=60)
  assert process.returncode == -signal.SIGKILL
  resumed = run_to_end(killed)
  assert 'resuming from step ' in resumed

  ours, reference = metrics(killed), metrics(straight)
  assert sorted(ours) == list(range(1, STEPS + 1))  # steps after the checkpoint are logged once
  assert ours == reference  # bit for bit
  for a, b in zip(jax.tree.leaves(final_params(killed)), jax.tree.leaves(final_params(straight))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_restore_under_other_meshes_and_fall_back_past_a_corrupted_checkpoint(tmp_path):
  saved_setup = build(tiny_config(fsdp=8))
  state = saved_setup.init_state()
  checkpointer = Checkpointer(tmp_path, keep=3)
  for step in (1, 2):
    checkpointer.save(step, state, {'rows': [step]}, {})
  checkpointer.close()
  expected = jax.tree.leaves(state.params)

  for mesh, devices in ((dict(fsdp=4, tensor=2), jax.devices()), ({}, jax.devices()[:1])):
    target = build(tiny_config(**mesh), devices)
    step, restored, data = Checkpointer(tmp_path, keep=3).restore_latest(target.abstract_state)
    assert step == 2 and data == {'rows': [2]}
    for a, b, want in zip(jax.tree.leaves(restored.params), expected,
                          jax.tree.leaves(target.state_shardings.params)):
      assert a.sharding == want  # straight into the target shardings
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  for f in (tmp_path / 'checkpoints' / '2' / 'state').rglob('*'):
    if f.is_file() and f.stat().st_size > 0:
      f.write_bytes(b'\0' * 7)  # truncated and corrupted
  with pytest.warns(CheckpointWarning, match='checkpoints/2'):
    step, _, data = Checkpointer(tmp_path, keep=3).restore_latest(saved_setup.abstract_state)
  assert step == 1 and data == {'rows': [1]}


def test_checkpoints_of_another_model_shape_are_an_error_not_a_fresh_start(tmp_path):
  setup = build(tiny_config(fsdp=8))
  checkpointer = Checkpointer(tmp_path, keep=3)
  checkpointer.save(1, setup.init_state(), {}, {})
  checkpointer.close()
  other = tiny_config(fsdp=8)
  other.model.d_model = 32
  with pytest.raises(ValueError, match='config.workdir'), pytest.warns(CheckpointWarning):
    Checkpointer(tmp_path, keep=3).restore_latest(build(other).abstract_state)
  assert (tmp_path / 'checkpoints' / '1').is_dir()  # nothing deleted
