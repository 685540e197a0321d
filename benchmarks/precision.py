"""Trains a config twice, its projections on compute-dtype and on fp8 operands
(config.model.matmul_precision), and compares the loss curves: does fp8 track the default?

  python -m benchmarks.precision --config=configs/default.py \
      --out=benchmarks/results/precision-cpu.json

With --compare=grad_reduce it trains the config on the devices here (fsdp over all of them) with
its gradients reduced in float32 and in bfloat16 (config.model.grad_reduce_dtype), and keeps both
curves whole:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.precision \
      --compare=grad_reduce --config=configs/default.py \
      --out=benchmarks/results/precision_grad_reduce-cpu.json

With --compare=partition it trains the config on the devices here (8 simulated CPU devices, or
GPUs) under each partition of config.partition against plain FSDP over all of them: data=2
replicas, hierarchical, then with int8 weights, then int8 gradients too (sharding/hierarchical.py):

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.precision \
      --compare=partition --config=configs/default.py \
      --out=benchmarks/results/precision_partition-cpu.json

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
_COMPARE = flags.DEFINE_enum('compare', 'fp8', ['fp8', 'partition', 'grad_reduce'],
                             'fp8 projections, the partitions over data, or bf16 gradient '
                             'reduction, against the default.')

PARTITIONS = {  # name: (config.mesh.data, config.partition)
    'flat': (1, {}), 'hierarchical': (2, dict(hierarchical=True)),
    '+int8 weights': (2, dict(hierarchical=True, weights='int8')),
    '+int8 grads': (2, dict(hierarchical=True, weights='int8', gradients='int8'))}


def curve(config, precision: str, partition: str = 'flat',
          grad_reduce: str | None = None) -> tuple[np.ndarray, float | None]:
  """Every step's training loss, and the last eval loss, of `config` at `precision` under
  `partition` (PARTITIONS: data replicas, the rest of the devices fsdp), its gradients reduced in
  `grad_reduce` (default: the config's)."""
  config = config.copy_and_resolve_references()
  config.model.matmul_precision, config.log_every, config.checkpoint_every = precision, 1, 0
  if grad_reduce:
    config.model.grad_reduce_dtype = grad_reduce
  data, fields = PARTITIONS[partition]
  config.mesh.data, config.mesh.fsdp = data, -1
  config.partition.update(fields)
  with tempfile.TemporaryDirectory(prefix=f'meshlm-precision-{precision}-') as workdir:
    config.workdir = workdir
    records = loop.run(config)
  losses = np.array([r['loss'] for r in records if 'loss' in r])
  evals = [r['eval_loss'] for r in records if 'eval_loss' in r]
  return losses, evals[-1] if evals else None


def partitions(config) -> None:
  """--compare=partition: each of PARTITIONS against flat, as main compares fp8."""
  if jax.device_count() % 2:
    raise ValueError(f'--compare=partition splits the {jax.device_count()} devices here into 2 '
                     'data replicas; run on an even count (on CPU: XLA_FLAGS='
                     '--xla_force_host_platform_device_count=8)')
  runs = {name: curve(config, 'default', name) for name in PARTITIONS}
  flat, _ = runs['flat']
  half = len(flat) // 2
  steps = sorted({1, len(flat) // 4, half, len(flat)})
  gaps = {name: np.abs(losses - flat) / flat for name, (losses, _) in runs.items()}
  rows = [(f'loss at step {s}', ', '.join(f'{losses[s - 1]:.4f} {name}'
                                          for name, (losses, _) in runs.items())) for s in steps]
  rows += [(f'{name}: gap, 2nd half', f'max {gaps[name][half:].max():.2%}, mean '
            f'{gaps[name][half:].mean():.2%}; eval loss {runs[name][1]}') for name in runs]
  print_table(rows)
  report.emit({
      'benchmark': 'precision_partition',
      'config': config_flags.get_config_filename(flags.FLAGS['config']),
      'device': jax.devices()[0].device_kind, 'devices': jax.device_count(),
      'jax': jax.__version__, 'steps': len(flat),
      'loss': {name: {s: float(losses[s - 1]) for s in steps}
               for name, (losses, _) in runs.items()},
      'max_relative_gap_second_half': {name: float(g[half:].max()) for name, g in gaps.items()},
      'mean_relative_gap_second_half': {name: float(g[half:].mean()) for name, g in gaps.items()},
      'eval_loss': {name: e for name, (_, e) in runs.items()}, 'command': report.command()},
      _OUT.value)


def grad_reduce(config) -> None:
  """--compare=grad_reduce: bf16 against fp32 gradient reduction, both curves whole."""
  runs = {dtype: curve(config, 'default', grad_reduce=dtype) for dtype in ('float32', 'bfloat16')}
  (fp32, fp32_eval), (bf16, bf16_eval) = runs['float32'], runs['bfloat16']
  half = len(fp32) // 2
  gap = np.abs(bf16 - fp32) / fp32
  steps = sorted({1, len(fp32) // 4, half, len(fp32)})
  rows = [(f'loss at step {s}', f'{fp32[s - 1]:.4f} fp32, {bf16[s - 1]:.4f} bf16') for s in steps]
  rows += [('relative gap, 2nd half', f'max {gap[half:].max():.2%}, mean {gap[half:].mean():.2%}'),
           ('largest step gap', f'{np.abs(bf16 - fp32).max():.4f} (step '
            f'{int(np.abs(bf16 - fp32).argmax()) + 1})'),
           ('eval loss', f'{fp32_eval} fp32, {bf16_eval} bf16')]
  print_table(rows)
  report.emit({
      'benchmark': 'precision_grad_reduce',
      'config': config_flags.get_config_filename(flags.FLAGS['config']),
      'device': jax.devices()[0].device_kind, 'devices': jax.device_count(),
      'jax': jax.__version__, 'compute_dtype': config.model.compute_dtype, 'steps': len(fp32),
      'max_relative_gap_second_half': float(gap[half:].max()),
      'mean_relative_gap_second_half': float(gap[half:].mean()),
      'max_abs_gap': float(np.abs(bf16 - fp32).max()),
      'eval_loss': {'float32': fp32_eval, 'bfloat16': bf16_eval},
      'loss': {'float32': [float(x) for x in fp32], 'bfloat16': [float(x) for x in bf16]},
      'command': report.command()}, _OUT.value)


def main(argv):
  del argv
  config = _CONFIG.value
  if _COMPARE.value == 'partition':
    return partitions(config)
  if _COMPARE.value == 'grad_reduce':
    return grad_reduce(config)
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
