"""Times the compiled train step of any config: tokens/s, TFLOP/s per device and MFU.

  python -m benchmarks.train_step --config=configs/default.py
  python -m benchmarks.train_step --config=configs/llama.py:1b \
      --out=benchmarks/results/train_step-h100.json

Method: build the state and the AOT-compiled step exactly as train.py does, feed random tokens
(timing does not depend on their values), one document a row as in the peers' figures (no
segment ids, so cuDNN runs its plain causal kernel; --packed adds them), run --warmup steps, then time --steps steps one by one
(each waited for) and report the median.

FLOPs (planning/flops.py, MaxText's convention): per token 6·(n_layers·matmul params per layer +
d_model·vocab) for the matmuls, plus 12·n_layers·n_heads·head_dim·seq_len for attention, counted
half because it is causal; recomputation from rematerialisation is not credited.
MFU = achieved FLOP/s per device / the device's dense bf16 peak (planning/gpus.py), also with
--config.model.matmul_precision=fp8 (whose projections may run at up to twice that peak). No MFU
is reported for devices not in that table (CPU).
"""

import statistics
import time

import jax
from absl import flags
from ml_collections import config_flags

from benchmarks import inputs, report
from planning import flops
from reporting.metrics import print_table
from runtime import cli
import sharding
from training.state import param_count

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/default.py', 'Config file.',
                                          lock_config=True)
_STEPS = flags.DEFINE_integer('steps', 10, 'Timed steps.')
_WARMUP = flags.DEFINE_integer('warmup', 2, 'Untimed steps after compiling.')
_PACKED = flags.DEFINE_bool('packed', False, 'Feed segment ids (packed rows).')
_OUT = flags.DEFINE_string('out', None, 'Also write the JSON figures to this file.')


def main(argv):
  del argv
  prepared = inputs.prepare(_CONFIG.value, packed=_PACKED.value)
  config, setup, state, step = prepared.run, prepared.setup, prepared.state, prepared.train_step
  batch, compile_s = prepared.batch, prepared.compile_s
  metrics = None  # --warmup=0 runs none
  for _ in range(_WARMUP.value):
    state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  times = []
  for _ in range(_STEPS.value):
    start = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)

  device = jax.devices()[0]
  n = setup.mesh.size
  step_s = statistics.median(times)
  tokens = config.batch_size * config.seq_len
  speed = flops.throughput(setup.model_cfg, config.seq_len, tokens / step_s, n, device.device_kind)
  tflops, peak = speed['tflops_per_device'], flops.peak_tflops(device.device_kind)
  figures = {
      'benchmark': 'train_step',
      'config': config_flags.get_config_filename(flags.FLAGS['config']),
      'device': device.device_kind, 'platform': device.platform, 'n_devices': n,
      'mesh': dict(setup.mesh.shape), 'jax': jax.__version__,
      'params': param_count(setup.abstract_state.params),
      'attention': config.model.attention, 'remat_policy': config.model.remat_policy,
      'compute_dtype': config.model.compute_dtype,
      'matmul_precision': config.model.matmul_precision, 'packed': _PACKED.value,
      'batch_size': config.batch_size, 'seq_len': config.seq_len,
      'compile_s': round(compile_s, 2), 'step_time_s': step_s,
      'step_time_s_min': min(times), 'step_time_s_max': max(times),
      'tokens_per_sec': tokens / step_s, 'tflops_per_device': tflops,
      'peak_tflops_per_device': peak, 'mfu': speed.get('mfu'),
      'loss_after': float(metrics['loss']),
      'command': report.command(),
  }
  rows = [('device', f'{n} × {device.device_kind}'),
          ('mesh', sharding.describe(setup.mesh.shape)),
          ('parameters', f'{figures["params"] / 1e6:,.1f}M'),
          ('tokens / step', f'{tokens:,} ({config.batch_size} × {config.seq_len})'),
          ('attention, remat', f'{config.model.attention}, {config.model.remat_policy}'),
          ('precision', f'{config.model.compute_dtype} compute, projections on '
                        f'{config.model.matmul_precision} operands'),
          ('compile', f'{compile_s:.1f} s'),
          ('step time (median of %d)' % len(times), f'{step_s * 1e3:,.1f} ms'),
          ('tokens / s', f'{tokens / step_s:,.0f}'),
          ('TFLOP/s per device', f'{tflops:,.3g}'),
          ('MFU', f'{figures["mfu"]:.1%} of {peak:g}' if peak else 'n/a (no known peak)')]
  print_table(rows)
  report.emit(figures, _OUT.value)


if __name__ == '__main__':
  cli.run(main)
