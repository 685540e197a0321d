"""Bytes each device sends per train step, by collective kind, against the ideal: the step compiled
deviceless for --target GPUs (planning/gpu_compiler.py), so the collectives are the GPU
compiler's (bf16 where the program says bf16; reduce-scatters), not the CPU backend's.

  python -m benchmarks.collectives --config=configs/llama.py:125m --config.model.n_layers=4 \
      --config.seq_len=256 --config.batch_size=8
  python -m benchmarks.collectives --config=configs/llama.py:8b --meshes=fsdp=8

Each mesh (`;`-separated, `axis=size,…`; unnamed axes 1) is compiled once for --devices GPUs.
Sent bytes count every execution of each collective (sharding/collectives.py: a layer's collectives
run once per layer), under the ring model; the ideal is planning/communication.py's formulas (in
its docstring), with the config's remat policy, microbatches and gradient reduction dtype.
"""

import sys

import jax
from absl import flags
from ml_collections import config_flags

from benchmarks import report
from planning import communication, gpu_compiler, gpus
from runtime import cli
import sharding
from training import settings
from training.programs import compile_and_plan
from training.state import build

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/llama.py:125m', 'Config file.',
                                          lock_config=True)
_MESHES = flags.DEFINE_string('meshes', 'fsdp=8;tensor=4,fsdp=2;data=2,fsdp=2,tensor=2;'
                              'fsdp=4,sequence=2', 'Meshes to compile, `;`-separated.')
_TARGET = flags.DEFINE_string('target', 'H100', f'GPU to compile for: {sorted(gpus.GPUS)}.')
_DEVICES = flags.DEFINE_integer('devices', 8, 'How many GPUs each mesh spans.')
_OUT = flags.DEFINE_string('out', None, 'Also write the JSON figures to this file.')


def measure(config, mesh: dict) -> dict:
  config = config.copy_and_resolve_references()
  config.mesh.update(mesh)
  config = settings.resolve(config)
  setup = build(config)
  plan = compile_and_plan(setup)[1]  # its collectives: sharding/collectives.py
  ideal = communication.ideal_bytes(
      setup.model_cfg, mesh, config.batch_size, config.seq_len, config.microbatches,
      config.model.remat_policy, setup.model_cfg.reduce_dtype.itemsize)
  total, ideal_total = plan.collective_bytes, sum(ideal.values())
  return {'mesh': mesh, 'collectives': plan.collectives, 'sent_bytes': total, 'ideal': ideal,
          'ideal_bytes': ideal_total, 'ratio': total / ideal_total if ideal_total else None}


def main(argv):
  del argv
  gpu_compiler.run_as_compiler_process(['-m', 'benchmarks.collectives', *sys.argv[1:]])
  config = _CONFIG.value.copy_and_resolve_references()
  config.plan.target, config.plan.devices = _TARGET.value, _DEVICES.value
  config.dry_run = True  # plans: for GPUs that are not here
  meshes = [report.parse_mesh(m) for m in _MESHES.value.split(';') if m.strip()]
  kind = gpus.get(_TARGET.value).device_kind
  m = config.model
  print(f'{_DEVICES.value} × {kind} (deviceless); d_model {m.d_model}, '
        f'{m.n_layers} layers, batch {config.batch_size} × {config.seq_len}, attention '
        f'{m.attention}, remat {m.remat_policy}, microbatches {config.microbatches}; MiB each '
        'device sends per step')
  print(f'{"mesh":<52}{"all-gather":>11}{"reduce-sc.":>11}{"all-reduce":>11}{"other":>9}'
        f'{"total":>9}{"ideal":>9}{"ratio":>7}')
  results = []
  for mesh in meshes:
    r = measure(config, mesh)
    results.append(r)
    mib = lambda op: r['collectives'].get(op, {}).get('bytes', 0) / 2**20
    other = r['sent_bytes'] / 2**20 - mib('all-gather') - mib('reduce-scatter') - mib('all-reduce')
    print(f'{sharding.describe(mesh):<52}{mib("all-gather"):>11.1f}{mib("reduce-scatter"):>11.1f}'
          f'{mib("all-reduce"):>11.1f}{other:>9.1f}{r["sent_bytes"] / 2**20:>9.1f}'
          f'{r["ideal_bytes"] / 2**20:>9.1f}{r["ratio"]:>7.2f}', flush=True)
  report.emit({'benchmark': 'collectives', 'compiled_for': kind,
               'deviceless': True, 'n_devices': _DEVICES.value, 'jax': jax.__version__,
               'config': config_flags.get_config_filename(flags.FLAGS['config']),
               'model': m.to_dict(), 'batch_size': config.batch_size, 'seq_len': config.seq_len,
               'microbatches': config.microbatches, 'results': results,
               'command': report.command()}, _OUT.value)


if __name__ == '__main__':
  cli.run(main)
