"""The step, precision and checkpoint benchmarks run end to end (on the tiny base config) and end with one
JSON line of figures that add up."""

import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def figures(script, *flags):
  result = subprocess.run([sys.executable, '-m', f'benchmarks.{script}', '--config=configs/base.py',
                           *flags], cwd=REPO, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


def test_train_step_benchmark():
  f = figures('train_step', '--steps=2', '--warmup=1')
  assert f['step_time_s_min'] <= f['step_time_s'] <= f['step_time_s_max']
  assert f['tokens_per_sec'] == f['batch_size'] * f['seq_len'] / f['step_time_s']
  assert f['mfu'] is None  # no peak is known for a CPU
  assert (f['compute_dtype'], f['matmul_precision']) == ('bfloat16', 'default')


def test_precision_benchmark():
  f = figures('precision', '--config.train_steps=4', '--config.eval_every=4',
              '--config.eval_batches=1')
  assert f['steps'] == 4 and sorted(f['loss_fp8']) == sorted(f['loss_default']) == ['1', '2', '4']
  last = abs(f['loss_fp8']['4'] - f['loss_default']['4']) / f['loss_default']['4']
  assert f['max_relative_gap_second_half'] >= last > 0  # fp8 is not the same computation
  assert f['eval_loss_fp8'] > 0 and f['eval_loss_default'] > 0


def test_checkpoint_benchmark():
  f = figures('checkpoint', '--steps=1', '--saves=1')
  assert 0 < f['blocked_s'] < f['save_s'] and 0 < f['restore_s']
  assert f['blocked_fraction_of_step'] == f['blocked_s'] / f['step_time_s']
  assert f['checkpoint_bytes'] > 3 * 4 * f['params']  # parameters and two Adam moments in fp32
