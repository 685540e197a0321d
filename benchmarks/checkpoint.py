"""Times checkpointing as the training loop does it: the save's total time, how long the loop is
blocked by an asynchronous save (as a fraction of a step), how much the save running in the
background slows the steps it overlaps, and the restore.

  python -m benchmarks.checkpoint --config=configs/llama.py:125m \
      --config.batch_size=4 --config.seq_len=256

Goal: the loop is blocked for at most 5% of a step. (On this 2-core CPU a 125M step of 4 × 256
tokens takes seconds; the preset's own 32 × 1024 batch on a GPU takes about as long, so the
fraction is comparable for the copy off the devices. The checksums a save computes are not in
the blocked time: orbax's background commit waits for them, while the loop goes on.)

Method: build the state and compiled step as train.py does, on random tokens; time --steps
steps one by one (median: the step time). Then --saves times: (1) save and wait with nothing else
running (save time, and bytes on disk); (2) save right after a step, as the loop does, timing the
call (blocked time; orbax returns once the arrays are copied off the devices) and the steps that
run while the save finishes in the background; (3) restore the newest checkpoint into the state's
shardings with a fresh Checkpointer, as a resumed run does (restore time). Medians are reported.
"""

import os
import shutil
import statistics
import tempfile
import time

import jax
from absl import flags, logging
from ml_collections import config_flags

from benchmarks import inputs, report
from reporting.metrics import print_table
from runtime import cli
from runtime.checkpoint import Checkpointer
from training.state import param_count

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/llama.py:125m', 'Config file.',
                                          lock_config=True)
_STEPS = flags.DEFINE_integer('steps', 3, 'Timed steps without a save (the step time).')
_SAVES = flags.DEFINE_integer('saves', 3, 'Repetitions of each save and restore measurement.')
_DIR = flags.DEFINE_string('dir', None, 'Where to write checkpoints (default: a temporary dir).')
_OUT = flags.DEFINE_string('out', None, 'Also write the JSON figures to this file.')


def timed(fn):
  start = time.perf_counter()
  result = fn()
  return time.perf_counter() - start, result


def disk_bytes(path) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main(argv):
  del argv
  prepared = inputs.prepare(_CONFIG.value)
  config, setup, state, batch = prepared.run, prepared.setup, prepared.state, prepared.batch

  def step(state):
    state, metrics = prepared.train_step(state, batch)
    jax.block_until_ready(metrics)
    return state

  state = step(state)  # warm up
  step_times = []
  for _ in range(_STEPS.value):
    t, state = timed(lambda: step(state))
    step_times.append(t)
  step_s = statistics.median(step_times)

  directory = _DIR.value or tempfile.mkdtemp(prefix='meshlm-checkpoint-bench-')
  checkpointer = Checkpointer(os.path.join(directory, 'checkpoints'), keep=2)
  data_state, config_json = {'rows': list(range(config.batch_size))}, config.as_dict()
  save_s, blocked_s, overlap_s, restore_s = [], [], [], []
  number = 0
  for _ in range(_SAVES.value):
    number += 1
    save_s.append(timed(lambda: (checkpointer.save(number, state, data_state, config_json),
                                 checkpointer.manager.wait_until_finished()))[0])
  size = disk_bytes(os.path.join(directory, 'checkpoints', str(number)))
  for _ in range(_SAVES.value):
    number += 1
    state = step(state)
    blocked_s.append(timed(lambda: checkpointer.save(number, state, data_state, config_json))[0])
    while checkpointer.manager.is_saving_in_progress():  # steps overlapping the background save
      t, state = timed(lambda: step(state))
      overlap_s.append(t)
    checkpointer.manager.wait_until_finished()
  checkpointer.close()
  for _ in range(_SAVES.value):
    fresh = Checkpointer(os.path.join(directory, 'checkpoints'))
    t, (restored_step, restored, _) = timed(lambda: jax.block_until_ready(
        fresh.restore_latest(setup.abstract_state, config.model)))
    fresh.close()
    assert restored_step == number
    restore_s.append(t)
    del restored
  if not _DIR.value:
    shutil.rmtree(directory)

  device = jax.devices()[0]
  blocked = statistics.median(blocked_s)
  slowdown = statistics.median(overlap_s) - step_s if overlap_s else 0.0
  figures = {
      'benchmark': 'checkpoint',
      'config': config_flags.get_config_filename(flags.FLAGS['config']),
      'device': device.device_kind, 'platform': device.platform, 'n_devices': setup.mesh.size,
      'mesh': dict(setup.mesh.shape), 'jax': jax.__version__,
      'params': param_count(setup.abstract_state.params),
      'checkpoint_bytes': size, 'batch_size': config.batch_size, 'seq_len': config.seq_len,
      'step_time_s': step_s, 'save_s': statistics.median(save_s),
      'blocked_s': blocked, 'blocked_fraction_of_step': blocked / step_s,
      'overlapped_steps': len(overlap_s), 'overlapped_step_slowdown_s': slowdown,
      'restore_s': statistics.median(restore_s),
      'command': report.command(),
  }
  rows = [('device', f'{setup.mesh.size} × {device.device_kind}'),
          ('parameters', f'{figures["params"] / 1e6:,.1f}M'),
          ('checkpoint on disk', f'{size / 2**30:,.2f} GiB'),
          ('step time', f'{step_s:,.3f} s ({config.batch_size} × {config.seq_len} tokens)'),
          ('save (nothing else running)', f'{figures["save_s"]:,.3f} s'),
          ('loop blocked by a save', f'{blocked:,.3f} s = {blocked / step_s:.1%} of a step'
           f' (goal ≤ 5%)'),
          ('steps overlapping the save', f'{len(overlap_s)} in {_SAVES.value} saves, each '
           f'{slowdown:+,.3f} s vs. the step time'),
          ('restore', f'{figures["restore_s"]:,.3f} s')]
  print_table(rows)
  report.emit(figures, _OUT.value)


if __name__ == '__main__':
  # orbax warns about the waits this benchmark makes on purpose
  cli.run(main, log_level=logging.ERROR)
