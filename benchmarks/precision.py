"""Trains a config twice, its projections on compute-dtype and on fp8 operands
(config.model.matmul_precision), and compares the loss curves: does fp8 track the default?

  python -m benchmarks.precision --config=configs/default.py \
      --out=benchmarks/results/precision-cpu.json

Both runs see the same batches from the same initial parameters (same seed, fresh workdirs);
every step's training loss is logged. Reported: the losses at a few steps, the largest and the
mean relative gap |fp8 − default| / default over the last half of the run (the first steps, far
from any minimum, move fast in both), and each run's final eval loss. On CPU, fp8 is emulated
(XLA converts to float8 and back), so the numbers are fp8's, the speed is not.
"""

import tempfile

import jax
import numpy as np
from absl import flags
from ml_collections import config_flags

from benchmarks import report
from reporting.metrics import print_table
from runtime import cli
from training import loop

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/default.py', 'Config file.')
_OUT = flags.DEFINE_string('out', None, 'Also write the JSON figures to this file.')


def curve(config, precision: str) -> tuple[np.ndarray, float | None]:
  """Every step's training loss, and the last eval loss, of `config` at `precision`."""
  config = config.copy_and_resolve_references()
  config.model.matmul_precision, config.log_every, config.checkpoint_every = precision, 1, 0
  with tempfile.TemporaryDirectory(prefix=f'meshlm-precision-{precision}-') as workdir:
    config.workdir = workdir
    records = loop.run(config)
  losses = np.array([r['loss'] for r in records if 'loss' in r])
  evals = [r['eval_loss'] for r in records if 'eval_loss' in r]
  return losses, evals[-1] if evals else None


def main(argv):
  del argv
  config = _CONFIG.value
  (default, default_eval), (fp8, fp8_eval) = (curve(config, p) for p in ('default', 'fp8'))
  half = len(default) // 2
  gap = np.abs(fp8 - default) / default
  steps = sorted({1, len(default) // 4, half, len(default)})
  figures = {
      'benchmark': 'precision',
      'config': config_flags.get_config_filename(flags.FLAGS['config']),
      'device': jax.devices()[0].device_kind, 'jax': jax.__version__,
      'compute_dtype': config.model.compute_dtype, 'steps': len(default),
      'loss_default': {s: float(default[s - 1]) for s in steps},
      'loss_fp8': {s: float(fp8[s - 1]) for s in steps},
      'max_relative_gap_second_half': float(gap[half:].max()),
      'mean_relative_gap_second_half': float(gap[half:].mean()),
      'eval_loss_default': default_eval, 'eval_loss_fp8': fp8_eval,
      'command': report.command(),
  }
  rows = [(f'loss at step {s}', f'{default[s - 1]:.4f} default, {fp8[s - 1]:.4f} fp8')
          for s in steps]
  rows += [('relative gap, 2nd half', f'max {gap[half:].max():.2%}, mean {gap[half:].mean():.2%}'),
           ('eval loss', f'{default_eval:.4f} default, {fp8_eval:.4f} fp8' if default_eval
            else 'n/a (config.eval_every=0)')]
  print_table(rows)
  report.emit(figures, _OUT.value)


if __name__ == '__main__':
  cli.run(main)
